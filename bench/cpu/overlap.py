"""The overlap claim: how much SQL scoring is left exposed after generation, batch vs streaming.

    .venv/bin/python -m bench.cpu.overlap [--prompts 16] [--samples 16] [--workers 2] [--scale 100] [--slow-query-s 0]

What runs (all in this process, on one asyncio loop, except the SQL workers and Redis):
  coordinator role  this script publishes one step's PromptTasks to the real "prompts" stream
  generator         actors.generator.generator.Generator over a SimulatedEngine subclass (below): the
                    latency model decides WHEN each group finishes (lognormal response lengths,
                    ~1,200 tokens mean, long tail, `tick_s + per_seq_s * live` seconds per token);
                    this script only decides WHAT the samples say: every completion carries a real
                    ```sql block, so the scorer has real queries to run
  scorer            actors.scorer.Scorer + ScorerLoop: real SqlPool worker processes, real
                    SQLite, real GoldCache, real in-group dedup of identical predictions
  assembler         actors.assembler.Assembler: waits for the step's scored groups, builds the
                    TrainBatch and publishes it
  Redis             a real embedded redis-server (queues.redis_server.EmbeddedRedis)

The SQL is a deliberately expensive self-join on a synthetic BIRD-layout database
(tasks.synthetic.write_dataset(scale=100) -> 150k fact rows per database), sized to cost
0.4-1.0 s per query like the seed's BIRD queries. Each prompt gets its own gold query (a row
limit K and a date literal D); its 16 samples are: the gold query 3 times (2 deduped), 12
variants with another date literal (distinct SQL, distinct results: "wrong_result") and one
answer without SQL. Every query the pool runs is timed (ExecResult.seconds) and reported.
With --slow-query-s S > 0, one sample of the step's first prompt is an endless query (a recursive
CTE that never ends) and the scorer's per-query timeout is S: that one query holds a pool worker for S
seconds, as a hostile or runaway model query does (the head-of-line case of issue 17).

The same step (same prompts, same engine seed, so the same response lengths) runs twice:
  batch     the seed's order: generate every prompt first (wait until every group is on the
            rollouts stream, no scorer running), then start the scorer, wait for the assembler
  stream    per-prompt streaming: the scorer runs from the start and scores each group as it lands
Each mode gets a fresh run id, engine, Scorer (so an empty gold cache) and Assembler. Measured:
  step s        prompts published -> TrainBatch published
  generation s  prompts published -> last RolloutGroup published
  exposed s     last RolloutGroup published -> the assembler holds every scored group
  exposed %     exposed / step
Generation is simulated (a latency model, no model runs); scoring is real SQLite.
"""
from __future__ import annotations

import os
import sys

# Run as a script, sys.path[0] is bench/cpu/: put the repo root there instead (see bench/cpu/scoring.py).
sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402

from actors.assembler import Assembler  # noqa: E402
from actors.engines.simulated import SimulatedEngine  # noqa: E402
from actors.generator.generator import Generator  # noqa: E402
from actors.scorer import Scorer, ScorerLoop  # noqa: E402
from config import AssemblerConfig, GeneratorConfig, RunContext, ScorerConfig  # noqa: E402
from queues.messages import PromptTask, RolloutGroup, codec, pack_ids  # noqa: E402
from queues.redis_server import EmbeddedRedis  # noqa: E402
from queues.streams import Stream, connect  # noqa: E402
from queues.topology import PROMPTS, ROLLOUTS  # noqa: E402
from tasks.bird import load_split  # noqa: E402
from tasks.synthetic import DOMAINS, write_dataset  # noqa: E402

MODES = ("batch", "stream")
MONTHS = [f"{y:04d}-{m:02d}-01" for y in range(2019, 2025) for m in range(1, 13)]
GOLD_COPIES, WRONG_VARIANTS, NO_SQL = 3, 12, 1  # per group of 16; scaled for other group sizes
ENDLESS_SQL = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"


@dataclass
class OverlapSettings:
    prompts: int = 16
    samples: int = 16
    workers: int = 2
    scale: int = 100  # write_dataset scale: 1,500 * scale fact rows per database
    databases: int = 2
    tick_s: float = 0.025  # seconds per decode tick (one token for every live sequence) ...
    per_seq_s: float = 0.00002  # ... plus this much per live sequence
    mean_response_tokens: float = 1200.0
    max_tokens: int = 8192
    seed: int = 0
    slow_query_s: float = 0.0  # > 0: one endless query in the step, cut by a scorer timeout of this many s


@dataclass
class BenchPrompt:
    prompt_id: str
    db_id: str
    db_path: str
    gold_sql: str
    predictions: list  # one entry per sample: SQL text, or None for an answer without SQL


@dataclass
class ModeResult:
    mode: str
    step_s: float
    generation_s: float
    exposed_scoring_s: float
    exposed_frac: float
    groups: int
    samples: int
    samples_with_sql: int
    pred_queries_run: int
    gold_queries_run: int
    deduped_frac: float
    query_seconds: list = field(default_factory=list)
    verdicts: dict = field(default_factory=dict)
    outcomes: dict = field(default_factory=dict)
    assembler_duplicates: float = 0.0
    published: bool = False
    # group published -> scored, for every group but the one holding the endless query (if any):
    # what head-of-line blocking inflates (the groups that queue behind a slow one)
    other_groups_latency_s: list = field(default_factory=list)


def expensive_query(domain: dict, row_limit: int, date_literal: str) -> str:
    """A self-join over the fact table through the item id, ~0.4-1.0 s at scale 100; the date
    literal changes the answer but not the cost (every joined pair evaluates it)."""
    d = domain
    return (f"SELECT COUNT(*), SUM(CASE WHEN b.{d['date']} >= '{date_literal}' THEN b.{d['qty']} ELSE 0 END) "
            f"FROM {d['fact']} AS a JOIN {d['fact']} AS b ON a.{d['i_id']} = b.{d['i_id']} "
            f"WHERE a.{d['qty']} <= {row_limit}")


def build_prompts(dataset_dir, settings: OverlapSettings) -> list[BenchPrompt]:
    """One step's prompts: the first training questions, each with its own expensive gold query."""
    domains = {d["domain"]: d for d in DOMAINS}
    questions = load_split(dataset_dir, "train")[: settings.prompts]
    if len(questions) < settings.prompts:
        raise ValueError(f"dataset has {len(questions)} training questions, need {settings.prompts}")
    rng = random.Random(f"{settings.seed}:predictions")
    gold_copies = max(1, round(settings.samples * GOLD_COPIES / 16))
    no_sql = round(settings.samples * NO_SQL / 16)
    wrong = max(0, settings.samples - gold_copies - no_sql)
    prompts = []
    for i, q in enumerate(questions):
        domain = domains[q.db_id]
        row_limit = 4 + i % 4
        gold_month = MONTHS[(7 * i) % len(MONTHS)]
        others = rng.sample([m for m in MONTHS if m != gold_month], wrong)
        gold = expensive_query(domain, row_limit, gold_month)
        preds = [gold] * gold_copies + [expensive_query(domain, row_limit, m) for m in others] + [None] * no_sql
        rng.shuffle(preds)
        prompts.append(BenchPrompt(str(q.question_id), q.db_id, q.db_path, gold, preds))
    if settings.slow_query_s > 0:  # one endless query in the step, in its first prompt
        first = prompts[0].predictions
        first[next(i for i, p in enumerate(first) if p is not None and p != prompts[0].gold_sql)] = ENDLESS_SQL
    return prompts


def completion_text(sql: str | None, n_tokens: int) -> str:
    if sql is None:
        return f"[simulated] <think>{n_tokens} simulated tokens</think>\nI cannot answer this from the schema."
    return f"[simulated] <think>{n_tokens} simulated tokens</think>\n```sql\n{sql}\n```"


class SqlAnsweringSimulatedEngine(SimulatedEngine):
    """SimulatedEngine whose sample texts end in the benchmark's SQL for that prompt and slot;
    timing, lengths and tokens are the parent's latency model, untouched."""

    def __init__(self, predictions_by_prompt: dict[str, list], *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.predictions_by_prompt = predictions_by_prompt

    async def generate(self, task: PromptTask) -> RolloutGroup:
        group = await super().generate(task)
        preds = self.predictions_by_prompt[task.prompt_id]
        for slot, sample in enumerate(group.samples):
            sample.text = completion_text(preds[slot % len(preds)], len(sample.tokens) // 4)
        return group


def record_query_seconds(pool, sink: list) -> None:
    """Wraps this pool instance's submit so every executed query's seconds land in `sink`."""
    original_submit = pool.submit

    def timed_submit(db_path, sql):
        fut = original_submit(db_path, sql)
        fut.add_done_callback(lambda f: sink.append(f.result().seconds) if not f.cancelled() else None)
        return fut

    pool.submit = timed_submit


async def run_mode(mode: str, redis_url: str, prompts: list[BenchPrompt], settings: OverlapSettings,
                   timeout_s: float = 3600.0) -> ModeResult:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    run_id = f"overlap-{mode}-{uuid.uuid4().hex[:8]}"
    gen_cfg = GeneratorConfig(engine="simulated", n_samples=settings.samples, max_tokens=settings.max_tokens,
                              max_inflight_prompts=max(64, settings.prompts), seed=settings.seed)
    engine = SqlAnsweringSimulatedEngine(
        {p.prompt_id: p.predictions for p in prompts}, gen_cfg, mean_response_tokens=settings.mean_response_tokens,
        tick_s=settings.tick_s, per_seq_s=settings.per_seq_s, seed=settings.seed)
    generator = Generator(engine, gen_cfg)
    scorer = Scorer(ScorerConfig(workers=settings.workers, timeout_s=settings.slow_query_s or 30.0))
    query_seconds: list[float] = []
    # Start and warm every worker (process start, imports, the database connections) before the clock.
    scorer.pool.run_many([(p.db_path, "SELECT 1") for p in prompts[: settings.workers * 4]])
    record_query_seconds(scorer.pool, query_seconds)
    scorer_loop = ScorerLoop(scorer, consumer="scorer-0")
    assembler = Assembler(AssemblerConfig(), RunContext(run_id=run_id, redis_url=redis_url))
    await assembler.start()
    redis = await connect(redis_url)
    prompts_stream = Stream(redis, run_id, PROMPTS)
    rollouts_stream = Stream(redis, run_id, ROLLOUTS)
    ids = list(range(1, 65))
    tasks = [PromptTask(task_id=f"0:{slot}:0", prompt_id=p.prompt_id, step=0, policy_version=0,
                        prompt_tokens=pack_ids(ids), n=settings.samples, db_id=p.db_id, db_path=p.db_path,
                        gold_sql=p.gold_sql) for slot, p in enumerate(prompts)]
    task_ids = [t.task_id for t in tasks]
    generator_task = scorer_task = None
    try:
        started = time.time()
        for t in tasks:
            t.published_at = started
        await prompts_stream.publish_many([codec(PromptTask).encode(t) for t in tasks])
        generator_task = asyncio.create_task(generator.run(redis_url, run_id, "generator-0"))
        if mode == "stream":
            scorer_task = asyncio.create_task(scorer_loop.run(redis_url, run_id))
        else:
            while await rollouts_stream.backlog() < len(tasks):
                if generator_task.done():
                    generator_task.result()
                    raise RuntimeError("generator stopped before the step was generated")
                await asyncio.sleep(0.02)
            scorer_task = asyncio.create_task(scorer_loop.run(redis_url, run_id))
        missing = await assembler.wait_for(task_ids, timeout_s)
        all_scored = time.time()
        if missing:
            raise RuntimeError(f"{mode}: {len(missing)} groups never scored within {timeout_s:g} s: {missing[:5]}")
        scored_groups = [assembler.buffer[t][1] for t in task_ids]
        last_published = max(g.rollout.published_at for g in scored_groups)
        report = await assembler.collect(0, task_ids, version=0)
        step_done = time.time()
    finally:
        generator.stop()
        scorer_loop.stop()
        for t in (generator_task, scorer_task):
            if t is not None:
                await asyncio.wait_for(t, 30)
        await assembler.stop()
        await redis.aclose()
        scorer.close()
    samples = sum(len(g.rollout.samples) for g in scored_groups)
    with_sql = sum(1 for g in scored_groups for s in g.rollout.samples if "```sql" in s.text)
    step_s = step_done - started
    exposed_s = all_scored - last_published
    return ModeResult(
        mode=mode, step_s=step_s, generation_s=last_published - started, exposed_scoring_s=exposed_s,
        exposed_frac=exposed_s / step_s, groups=len(scored_groups), samples=samples, samples_with_sql=with_sql,
        pred_queries_run=scorer.pred_queries, gold_queries_run=scorer.gold_cache.misses,
        deduped_frac=1 - scorer.pred_queries / with_sql if with_sql else 0.0, query_seconds=query_seconds,
        verdicts=dict(scorer.verdicts), outcomes={o: sum(v == o for v in report["outcomes"].values())
                                                  for o in set(report["outcomes"].values())},
        assembler_duplicates=report["metrics"]["duplicates_ignored"], published=report["published"],
        other_groups_latency_s=[g.scored_at - g.rollout.published_at for g in scored_groups
                                if not (settings.slow_query_s > 0 and g.rollout.task.prompt_id == prompts[0].prompt_id)])


async def run_overlap(settings: OverlapSettings, work_dir: str, modes=MODES) -> dict:
    """Builds the dataset and the step's prompts, then runs each mode in turn on one Redis."""
    t = time.monotonic()
    dataset = write_dataset(os.path.join(work_dir, "bird"), num_databases=settings.databases,
                            num_questions=max(40, 2 * settings.prompts), seed=settings.seed, scale=settings.scale)
    prompts = build_prompts(dataset, settings)
    build_s = time.monotonic() - t
    results = {}
    with EmbeddedRedis(os.path.join(work_dir, "run")) as server:
        for mode in modes:
            results[mode] = await run_mode(mode, server.url, prompts, settings)
    return {"settings": asdict(settings), "dataset_build_s": build_s, "results": results}


def format_table(out: dict) -> str:
    s = out["settings"]
    lines = [
        f"{s['prompts']} prompts x {s['samples']} samples, SqlPool workers={s['workers']}, synthetic scale={s['scale']}, "
        f"simulated decode: tick {s['tick_s'] * 1000:g} ms + {s['per_seq_s'] * 1e6:g} us/live seq, "
        f"mean {s['mean_response_tokens']:g} tokens (lognormal, sigma 0.6), max_tokens {s['max_tokens']}"
        + (f", one endless query cut at {s['slow_query_s']:g} s" if s.get("slow_query_s") else ""),
        "",
        "| mode | step s | generation s | exposed scoring s | exposed / step | queries run (gold + pred) "
        "| query s median [min-max] | deduped | other groups' scoring latency s median / max |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode, r in out["results"].items():
        q = r.query_seconds
        q_text = f"{statistics.median(q):.2f} [{min(q):.2f}-{max(q):.2f}]" if q else "-"
        w = r.other_groups_latency_s
        lat = f"{statistics.median(w):.2f} / {max(w):.2f}" if w else "-"
        lines.append(
            f"| {'batch then score' if mode == 'batch' else 'per-prompt streaming'} | {r.step_s:.1f} | "
            f"{r.generation_s:.1f} | {r.exposed_scoring_s:.2f} | {100 * r.exposed_frac:.1f} % | "
            f"{r.gold_queries_run} + {r.pred_queries_run} | {q_text} | {100 * r.deduped_frac:.0f} % | {lat} |")
    if set(MODES) <= set(out["results"]):
        b, st = out["results"]["batch"], out["results"]["stream"]
        lines += ["", f"streaming / batch step time: {st.step_s / b.step_s:.2f} "
                      f"(saves {b.step_s - st.step_s:.1f} s of {b.step_s:.1f} s); "
                      f"exposed scoring {b.exposed_scoring_s:.1f} s -> {st.exposed_scoring_s:.2f} s"]
    for mode, r in out["results"].items():
        lines.append(f"{mode}: verdicts {dict(sorted(r.verdicts.items()))}, outcomes {r.outcomes}, "
                     f"batch published {r.published}, assembler duplicates_ignored {r.assembler_duplicates:g}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = OverlapSettings()
    for name, value in asdict(defaults).items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    args = vars(ap.parse_args())
    modes = tuple(m for m in args.pop("modes").split(",") if m)
    settings = OverlapSettings(**args)
    with tempfile.TemporaryDirectory(prefix="arl-overlap-") as work_dir:
        out = asyncio.run(run_overlap(settings, work_dir, modes))
    print(f"dataset build {out['dataset_build_s']:.1f} s; generation simulated (latency model), scoring real SQLite")
    print(format_table(out))


if __name__ == "__main__":
    main()
