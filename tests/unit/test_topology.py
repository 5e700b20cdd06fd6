"""queues.topology: the run's streams declared once, and every stage opening its streams by them (no Redis)."""
import ast
from pathlib import Path

import pytest

from queues.streams import RunStreams, Stream
from queues.topology import (
    ASSEMBLED,
    BATCHES,
    DATA_FLOW,
    EVENTS,
    PROMPTS,
    ROLLOUTS,
    SCORED,
    STREAMS,
    describe,
    main,
    redis_cli,
    run_key,
)

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ("actors", "launch", "queues", "weights", "tasks", "policies", "observe", "config")


def test_the_data_flow_in_order_each_stream_read_by_one_group():
    assert [s.name for s in DATA_FLOW] == ["prompts", "rollouts", "scored", "batches"]
    assert [s.group for s in STREAMS] == ["generators", "scorers", "assembler", "learner", "coordinator"]
    assert STREAMS[-1] is EVENTS and len({s.name for s in STREAMS} | {ASSEMBLED.name}) == 6
    assert PROMPTS.key("r1") == run_key("r1", "prompts") == "arl:r1:prompts"


def test_a_stream_opened_by_its_spec_takes_its_group_and_a_bare_name_is_refused_by_the_run():
    conn = RunStreams(redis=None, run_id="r1")
    for spec in STREAMS:
        s = conn.stream(spec)
        assert (s.key, s.group) == (spec.key("r1"), spec.group)
    assert Stream(None, "r1", ROLLOUTS, "audit").group == "audit"  # a second group, named on purpose
    assert conn.hash(ASSEMBLED).key == "arl:r1:assembled"
    with pytest.raises(TypeError, match="takes a queues.topology spec"):
        conn.stream("rollouts")


def test_the_redis_cli_lines_name_the_topology_s_keys(capsys):
    lines = redis_cli("r1", cli="redis-cli -s $S")
    assert lines[0].startswith(f"redis-cli -s $S XLEN {ROLLOUTS.key('r1')}")
    assert f"XPENDING {SCORED.key('r1')} {SCORED.group}" in lines[2] and ASSEMBLED.key("r1") in lines[3]
    guide = (ROOT / "docs" / "guide" / "operate.md").read_text().splitlines()
    assert all(f"    {line}" in guide for line in redis_cli(cli="redis-cli -s $S"))  # the guide's lines are these
    main(["r1"])  # python -m queues.topology r1
    out = capsys.readouterr().out
    assert out.splitlines() == describe("r1") and BATCHES.key("r1") in out


def test_no_stream_name_is_written_outside_the_topology():
    """A stream (or the run's hash) named by a string where the runtime opens one: `.stream("x")`,
    `.hash("x")`, `Stream(redis, run, "x")`. The topology's specs are the only names."""
    names = {s.name for s in STREAMS} | {ASSEMBLED.name}
    found = []
    for package in RUNTIME:
        for path in (ROOT / package).rglob("*.py"):
            if path.name == "topology.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call):
                    continue
                fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if fn in ("stream", "hash", "Stream", "StageHash"):
                    for arg in node.args:
                        if isinstance(arg, ast.Constant) and arg.value in names:
                            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {arg.value!r}")
    assert found == []
