"""launch/startup_memory.py: the start-up phases' device memory as scalars, and a mark never failing a run
(no GPU here: the learner stand-ins answer what actors/device_memory.py answers on a GPU, or fail)."""
import asyncio

from actors.device_memory import memory_stats
from launch.startup_memory import StartupMemory, startup_row


class Log:
    def __init__(self):
        self.lines = []

    def info(self, event, **fields):
        self.lines.append((event, fields))


class Learner:
    def __init__(self, stats=None, fail=False, hang=False):
        self.stats, self.fail, self.hang = stats, fail, hang

    async def memory(self):
        if self.hang:
            await asyncio.sleep(60)
        if self.fail:
            raise RuntimeError("rank died")
        return self.stats


GPU = {"allocated_gib": 1.25, "reserved_gib": 3.5, "max_allocated_gib": 8.4321, "max_reserved_gib": 9.0,
       "device_used_gib": 51.54}


def test_a_row_is_scalars_named_by_process_with_the_device_total_once():
    row = startup_row("learner built", GPU, {"reserved_gib": 42.0, "device_used_gib": 50.0})
    assert row == {"phase": "learner built", "learner_allocated_gib": 1.25, "learner_max_allocated_gib": 8.432,
                   "learner_max_reserved_gib": 9.0, "learner_reserved_gib": 3.5, "engine_reserved_gib": 42.0,
                   "device_used_gib": 51.54}  # the learner's view of the device first
    assert startup_row("x", None, {"device_used_gib": 50.0}) == {"phase": "x", "device_used_gib": 50.0}
    assert all(isinstance(v, float) for k, v in row.items() if k != "phase")


def test_marks_log_one_line_each_and_a_failing_or_silent_actor_never_fails_the_run():
    log = Log()
    mem = StartupMemory(log, enabled=True, timeout_s=0.2)
    assert mem.mark("learner built", Learner(GPU))["learner_max_allocated_gib"] == 8.432
    assert mem.mark("learner asleep", Learner(fail=True)) == {"phase": "learner asleep"}
    assert mem.mark("engines built", Learner(hang=True)) == {"phase": "engines built"}
    assert [f["phase"] for _, f in log.lines] == ["learner built", "learner asleep", "engines built"]
    assert {e for e, _ in log.lines} == {"start-up memory"}
    assert log.lines[1][1]["missing"] == "learner (RuntimeError)"
    assert log.lines[2][1]["missing"] == "learner (TimeoutError)" and len(mem.rows) == 3


def test_cpu_runs_mark_nothing_and_cpu_devices_report_nothing():
    log = Log()
    assert StartupMemory(log, enabled=False).mark("learner built", Learner(GPU)) is None and log.lines == []
    assert memory_stats("cpu") == {} and memory_stats("cpu", reset_peak=True) == {}
