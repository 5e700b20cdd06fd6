"""The unit lane's isolation, enforced: every test under tests/unit runs its setup, call and teardown inside
tests/isolation.py's guard, and every module here is imported inside it, so a test (or the code it calls) that
opens a socket, starts a process, imports Ray or DeepSpeed, or calls ray.init / deepspeed.initialize /
torch.distributed.init_process_group fails, naming what it tried and where. Such a test belongs in
tests/integration.

Invariant: the guard is active only around tests/unit's own items and modules (pytest hands these hooks the
items of this directory alone); the other lanes never see it. The one process a library starts for itself once
per machine, matplotlib's font list (`fc-list`, cached in its config dir), is built before the guard, at
configure time; a fresh machine's first run would otherwise fail the report's test.
"""
import pytest

from tests.isolation import isolated


def pytest_configure(config):
    """matplotlib lists the system's fonts with a subprocess the first time it runs on a machine: do it here,
    before any test is guarded (a no-op once its cache exists)."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.font_manager  # noqa: F401  (builds or loads the font cache)


def _guarded(where: str, phase: str):
    with isolated(f"{where} ({phase})") as tried:
        result = yield
    if tried:
        raise pytest.fail(f"{where} ({phase}): {', '.join(sorted(set(tried)))} in the unit lane (no Ray, Redis, "
                          f"subprocess or sockets); move the test to tests/integration", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guarded(item.nodeid, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item.nodeid, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _guarded(item.nodeid, "teardown"))


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A module whose import reaches for them is a collection error naming what it tried."""
    if not isinstance(collector, pytest.Module):
        return (yield)
    with isolated(f"{collector.nodeid} (import)") as tried:
        report = yield
    if tried and report.outcome != "failed":
        report.outcome, report.result = "failed", []
        report.longrepr = (f"{collector.nodeid}: importing it tried {', '.join(sorted(set(tried)))} in the unit lane "
                           f"(no Ray, Redis, subprocess or sockets); move it to tests/integration")
    return report
