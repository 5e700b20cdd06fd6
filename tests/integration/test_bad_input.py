"""Every input a user can get wrong, and the one line each one gets.

Each CLI case runs `python -m launch.cluster tiny ...` in its own session with a timeout: it
must exit 2 with exactly one line `error: ...` naming the key or file (the traceback, if any,
goes to the run's logs/launcher.jsonl), never hang, and leave no process of its session behind
(redis-server, raylet, Ray workers). The table is docs/reliability/security.md's bad-input table.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A launch that hangs would wait forever; this only turns a hang into a failure. The slowest case
# ("every prompt longer than the context") builds the synthetic task, the tokenizer and the tiny model
# before its check (~15 s idle) and ran past 90 s at load 30+ on 2 cores.
HANG_GUARD_S = 300


def _bird(tmp: Path, mutate) -> Path:
    """A small synthetic BIRD directory, then `mutate(dir)` breaks one thing."""
    from tasks.synthetic import write_dataset

    d = tmp / "bird"
    write_dataset(d, 2, 40, seed=0)
    mutate(d)
    return d


def _drop_databases(d: Path) -> None:
    for sub in ("train_databases", "dev_databases", "databases"):
        shutil.rmtree(d / sub, ignore_errors=True)


def _not_sqlite(d: Path) -> None:
    for db in d.rglob("*.sqlite"):
        db.write_text("this is not a database\n" * 100)


def _dev_missing_fields(d: Path) -> None:
    rows = json.loads((d / "dev.json").read_text())
    for r in rows:
        r.pop("question", None)
    (d / "dev.json").write_text(json.dumps(rows))


# (case, overrides, extra env, builder(tmp) -> dict of format values, text the one line must contain)
CLI_CASES = [
    ("unknown config key", ["coordinator.stepz=3"], {}, None, "coordinator.stepz"),
    ("unknown section", ["trainr.lr=1e-6"], {}, None, "trainr"),
    ("mistyped value", ["coordinator.steps=three"], {}, None, "coordinator.steps"),
    ("simulated engine in a training run", ["generator.engine=simulated"], {}, None, "generator.engine"),
    ("bad enum value", ["coordinator.mode=sync"], {}, None, "coordinator.mode"),
    ("missing model path", ["model.source=path", "model.path={tmp}/no-such-model"], {}, None, "model.path"),
    ("BIRD dir missing", ["data.synthetic=false", "data.bird_dir={tmp}/nowhere"], {}, None, "nowhere"),
    ("BIRD dir without databases", ["data.synthetic=false", "data.bird_dir={bird}"], {}, _drop_databases,
     "database file not found"),
    ("database is not SQLite", ["data.synthetic=false", "data.bird_dir={bird}"], {}, _not_sqlite, "SQLite"),
    ("dev.json with missing fields", ["data.synthetic=false", "data.bird_dir={bird}"], {}, _dev_missing_fields,
     "'question'"),
    ("every prompt longer than the context", ["data.max_prompt_tokens=4"], {}, None, "data.max_prompt_tokens"),
    ("unreachable REDIS_URL", [], {"REDIS_URL": "redis://127.0.0.1:1/0"}, None, "cannot reach Redis"),
    ("malformed REDIS_URL", [], {"REDIS_URL": "http://nope"}, None, "REDIS_URL"),
    ("wrong Redis password", [], {"REDIS_URL": "redis://:not-the-password@127.0.0.1:{port}/0"}, None,
     "refused the credentials"),
    ("Ray address that does not answer", [], {"RAY_ADDRESS": "127.0.0.1:1"}, None, "RAY_ADDRESS"),
]


def _session_procs(sid: int) -> list[str]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == sid:
            continue
        try:
            stat = open(f"/proc/{d}/stat").read()
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] != "Z" and int(fields[3]) == sid:
                out.append(open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:80])
        except (OSError, ValueError):
            continue
    return out


@pytest.fixture(scope="module")
def password_redis(tmp_path_factory):
    from queues.redis_server import EmbeddedRedis

    with EmbeddedRedis(tmp_path_factory.mktemp("pw"), tcp_port=0, password="the-password") as r:
        yield r


@pytest.mark.parametrize("case,overrides,env,mutate,expect", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input_is_one_line_and_exit_2(case, overrides, env, mutate, expect, tmp_path, password_redis):
    fmt = {"tmp": tmp_path, "port": password_redis.tcp_port}
    if mutate is not None:
        fmt["bird"] = _bird(tmp_path, mutate)
    args = [a.format(**fmt) for a in overrides]
    full_env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "RAY_ADDRESS")}
    full_env.update({k: v.format(**fmt) for k, v in env.items()})
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "launch.cluster", "tiny", f"run_root={tmp_path}/runs",
                             "coordinator.steps=1", "model.tiny_sft_steps=0", "logging.console=false", *args],
                            cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, text=True)
    try:
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        pytest.fail(f"{case}: hung for {HANG_GUARD_S} s")
    seconds = time.monotonic() - start
    lines = [ln for ln in (out + err).splitlines() if ln.strip()]
    assert proc.returncode == 2, f"{case}: exit {proc.returncode}\n{out}\n{err}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{case}: expected one error line, got:\n{out}{err}"
    assert expect in lines[0], f"{case}: {lines[0]!r} does not mention {expect!r}"
    if "REDIS_URL" in env:  # a Redis that cannot be used names the setting to fix
        assert lines[0].startswith("error: REDIS_URL: "), lines[0]
    assert "not-the-password" not in out + err
    left = [p.name for p in (tmp_path / "runs").glob("tiny-*")] if (tmp_path / "runs").exists() else []
    assert left == [], f"{case}: a failed launch left {left} behind"
    deadline = time.monotonic() + 30  # processes still exiting as the launcher returned (a loaded machine)
    while _session_procs(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _session_procs(proc.pid) == [], f"{case}: processes left behind"
    print(f"\n| {case} | `{' '.join(args) or ' '.join(f'{k}=...' for k in env)}` | {lines[0]} | {seconds:.1f} s |")


def test_megabytes_of_model_output_are_scored_not_hung(tmp_path):
    """A 'model output' of 4 MB (and one of pure garbage bytes) gets a verdict, quickly."""
    from actors.scorer import Scorer
    from config import ScorerConfig
    from queues.messages import PromptTask, RolloutGroup, Sample, pack_floats, pack_ids
    from tasks.synthetic import write_dataset

    d = write_dataset(tmp_path / "bird", 1, 10, seed=0)
    q = json.loads((Path(d) / "train.json").read_text())[0]
    db = next(Path(d).rglob(f"{q['db_id']}.sqlite"))
    huge = "SELECT " + "1+" * 2_000_000 + "1"
    task = PromptTask(task_id="0:0:0", prompt_id="p", step=0, policy_version=0, prompt_tokens=pack_ids([1]), n=2,
                      db_path=str(db), gold_sql=q["SQL"])
    group = RolloutGroup(task=task, policy_version=0, samples=[
        Sample(tokens=pack_ids([1]), logprobs=pack_floats([0.0]), finish_reason="length", text=huge),
        Sample(tokens=pack_ids([1]), logprobs=pack_floats([0.0]), finish_reason="length", text="\x00\xff" * 500_000)])
    scorer = Scorer(ScorerConfig(workers=1, timeout_s=5.0, memory_mb=512))
    try:
        # Scored within the sandbox's bounds (timeout_s=5 per query); 120 s only turns a hang into a failure
        # on a loaded machine (the verdicts below show the queries were answered, not waited out).
        scored = asyncio.run(asyncio.wait_for(scorer.score(group), 120))
        assert len(scored.verdicts) == 2 and all(v != "match" for v in scored.verdicts)
        assert scored.rewards == [0.0, 0.0]
    finally:
        scorer.close()


def test_prompt_longer_than_the_context_is_an_error_group_fake_engine():
    """One prompt over the engine's context: that task's group carries a one-line error."""
    pytest.importorskip("transformers")
    from actors.engines.base import prompt_ids
    from actors.generator.generator import Generator
    from config import GeneratorConfig
    from queues.messages import PromptTask, pack_ids

    class Engine:  # a fake engine with the real length check every engine runs first
        version = 0

        async def generate(self, task):
            prompt_ids(task, max_model_len=2048)
            raise AssertionError("not reached")

        def stats(self):
            return {}

    gen = Generator(Engine(), GeneratorConfig(max_inflight_prompts=1))
    task = PromptTask(task_id="0:0:0", prompt_id="p", step=0, policy_version=0, prompt_tokens=pack_ids([1] * 100_000),
                      n=2)
    group = asyncio.run(gen.generate_one(task))
    assert group.samples == [] and "the model's limit is 2048" in group.error and "\n" not in group.error
