"""bench/peers' process-tree sampler on real processes: it sums the whole tree, sees every process, and ends the
whole tree at its timeout."""
import sys
import textwrap
import time

from bench.peers.tree import run_tree


def test_run_tree_sums_the_whole_tree_and_sees_every_process(tmp_path):
    child = textwrap.dedent("""
        import subprocess, sys, time
        hold = bytearray(80 * 1024 * 1024)  # 80 MB resident in the grandchild
        for i in range(0, len(hold), 4096):
            hold[i] = 1
        time.sleep(2.0)
    """)
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    res = run_tree([sys.executable, "-c", parent], log_path=tmp_path / "log", interval_s=0.1, timeout_s=120)
    assert res.rc == 0 and not res.timed_out
    assert res.peak_rss_bytes > 80 * 1024 * 1024 and res.peak_processes == 2
    assert 80 * 1024 * 1024 < res.peak_pss_bytes <= res.peak_rss_bytes  # shared pages split, private ones whole
    assert len({pid for _, pid, _ in res.spawned}) == 2
    assert len(res.peak_breakdown) == 2 and res.peak_breakdown[0][1] > 80 * 1024 * 1024  # the grandchild, largest first


def test_run_tree_ends_the_whole_tree_at_its_timeout(tmp_path):
    # The parent (a shell) starts its child and prints its pid before the timeout: no interpreter starts
    # (two Python ones took more than 15 s at load 30+ on 2 cores), so 10 s (the test waits it out whole).
    parent = "sleep 600 & echo $!; sleep 600"
    res = run_tree(["sh", "-c", parent], log_path=tmp_path / "log", interval_s=0.1, timeout_s=10)
    assert res.timed_out and res.rc != 0
    printed = (tmp_path / "log").read_text().split()
    assert printed, "the parent did not start its child within the timeout: nothing to check"
    grandchild = int(printed[0])
    import psutil

    def ended() -> bool:
        try:
            return psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    # SIGKILLed: it ends once the kernel runs it again, which takes a while on a loaded machine; one
    # that run_tree missed would still run after the 30 s.
    deadline = time.monotonic() + 30
    while not ended() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended(), f"the grandchild {grandchild} outlived run_tree's timeout"

