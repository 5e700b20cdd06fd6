"""What a turn costs the engine: samples/s and prefix-cache hits for max_turns 1 vs 3 at the same budget.

    python -m bench.gpu.episodes                    # H200: vLLM, gpu1_0p6b's model shape (random init)
    SMOKE=1 .venv/bin/python -m bench.gpu.episodes  # CPU: the transformers engine, tiny's model

Both arms sample the same number of episodes (PROMPTS x N) and the same number of model tokens per
episode (TURNS x TURN_TOKENS). max_turns 1: one request per prompt (n samples) of TURNS x TURN_TOKENS
tokens. max_turns 3: each sample an episode of TURNS turns (actors/generator/episode.py, the
generator's own runner) whose turns each sample TURN_TOKENS tokens; after every turn but the last the
model's choice is FORCED to a tool call of the prompt's gold query (a random-init model never writes
one), so the query really runs (tasks/executor.py) and its observation is appended, and the next turn
is a new request over prompt + everything so far, which vLLM's prefix cache mostly finds. The engine's
work is real; only the model's choice to call the tool is forced.

Env: SMOKE, PROMPTS (32), N (8), TURNS (3), TURN_TOKENS (64), OUT (results dir; $OUT on the device).
Results: $OUT/episodes.json and a table on stdout.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

SMOKE = os.environ.get("SMOKE", "") == "1"
PROMPTS = int(os.environ.get("PROMPTS", "4" if SMOKE else "32"))
N = int(os.environ.get("N", "2" if SMOKE else "8"))
TURNS = int(os.environ.get("TURNS", "3"))
TURN_TOKENS = int(os.environ.get("TURN_TOKENS", "8" if SMOKE else "64"))
OUT = os.environ.get("OUT", "") or tempfile.mkdtemp(prefix="arl-episodes-")


class ForcedToolCalls:
    """The engine, with the model's choice forced: every turn samples at most TURN_TOKENS real tokens,
    and a turn that is not the episode's last then ends in a tool call of `sql` (its ids appended with
    log-prob 0, as if sampled). Everything else is the wrapped engine's."""

    def __init__(self, engine, tokenizer, sql_of: dict[str, str]):
        from policies.episode import TOOL_CLOSE, TOOL_OPEN

        self.engine, self.sql_of = engine, sql_of
        self.call_ids = {pid: tokenizer(TOOL_OPEN + sql + TOOL_CLOSE, add_special_tokens=False)["input_ids"]
                         for pid, sql in sql_of.items()}

    @property
    def version(self):
        return self.engine.version

    async def generate(self, task):
        from queues.messages import pack_floats, pack_ids, unpack_floats, unpack_ids

        turn = int(task.task_id.rsplit("t", 1)[1])  # the runner's request ids end in t<turn>
        task.sampling = dict(task.sampling, max_tokens=min(TURN_TOKENS, task.sampling.get("max_tokens", TURN_TOKENS)),
                             stop=[])
        group = await self.engine.generate(task)
        if turn < TURNS - 1:
            s = group.samples[0]
            call = self.call_ids[task.prompt_id]
            s.tokens = pack_ids(unpack_ids(s.tokens).tolist() + call)
            s.logprobs = pack_floats(unpack_floats(s.logprobs).tolist() + [0.0] * len(call))
            s.versions, s.finish_reason = b"", "stop"
        return group


async def arm(engine, tokenizer, items, max_turns: int) -> dict:
    from actors.generator.episode import EpisodeRunner
    from config import GeneratorConfig
    from queues.messages import PromptTask, unpack_ids
    from tasks.executor import ToolExecutor

    cfg = GeneratorConfig(engine="transformers", n_samples=N, temperature=1.0, max_tokens=TURNS * TURN_TOKENS + 400,
                          max_turns=max_turns, max_observation_tokens=64)
    tasks = [PromptTask(task_id=f"{max_turns}:{i}:0", prompt_id=it.prompt_id, step=0, policy_version=0,
                        prompt_tokens=it.prompt_tokens, n=N, db_id=it.db_id, db_path=it.db_path, gold_sql=it.gold_sql,
                        sampling={"max_tokens": TURNS * TURN_TOKENS} if max_turns == 1 else {})
             for i, it in enumerate(items)]
    executor = ToolExecutor(workers=4, timeout_s=5.0, max_rows=1000)
    runner = (None if max_turns == 1 else
              EpisodeRunner(ForcedToolCalls(engine, tokenizer, {it.prompt_id: it.gold_sql for it in items}), cfg,
                            tokenizer, executor))
    before = dict(engine.stats())
    t0 = time.perf_counter()
    groups = await asyncio.gather(*((runner or engine).generate(t) for t in tasks))
    wall = time.perf_counter() - t0
    after = engine.stats()
    executor.close()
    samples = [s for g in groups for s in g.samples]
    tokens = sum(len(s.tokens) // 4 for s in samples)

    def delta(key):
        return float(after.get(key, 0.0)) - float(before.get(key, 0.0))

    cached, prompt = delta("engine_cached_prompt_tokens"), delta("engine_prompt_tokens")
    return {"max_turns": max_turns, "samples": len(samples), "wall_s": round(wall, 3),
            "samples_per_s": round(len(samples) / wall, 2), "response_tokens": tokens,
            "model_tokens_per_s": round(delta("engine_tokens_generated") / wall, 1),
            "turns_mean": round(sum(s.turns for s in samples) / len(samples), 2),
            "obs_tokens_mean": round(sum(int((unpack_ids(s.loss_mask) == 0).sum()) for s in samples if s.loss_mask)
                                     / len(samples), 1),
            "prefix_cache_hit_rate": round(cached / prompt, 3) if prompt else None,
            "engine_requests": delta("engine_requests")}


def main() -> int:
    from transformers import AutoTokenizer

    from actors.engines.registry import make_engine
    from config import apply_overrides
    from config.recipes import get_recipe
    from tasks.bird import build_prompts, load_split
    from tasks.synthetic import write_dataset
    from tasks.tiny_model import build_tiny

    cfg = apply_overrides(get_recipe("tiny" if SMOKE else "gpu1_0p6b"), [])
    if not SMOKE:
        try:
            import vllm  # noqa: F401
        except ImportError:
            print("bench.gpu.episodes: vLLM is not installed here (no CPU wheel); run SMOKE=1 on CPU")
            return 2
    root = tempfile.mkdtemp(prefix="arl-episodes-data-")
    bird = write_dataset(os.path.join(root, "syn"), num_databases=2, num_questions=max(60, 2 * PROMPTS), seed=0,
                         templates=tuple(cfg.data.synthetic_templates))
    model_dir = build_tiny(os.path.join(root, "model"), model_cfg=cfg.model, seed=0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    gen = cfg.generator
    if SMOKE:
        gen.engine, gen.device = "transformers", "cpu"
    else:
        gen.engine, gen.gpu_memory_utilization = "vllm", 0.5
    engine = make_engine(gen, cfg.model, model_dir)
    questions = load_split(bird, "train")[:PROMPTS]

    async def both() -> list[dict]:
        out = []
        for turns in (1, TURNS):
            items, _ = build_prompts(questions, tok, 512, style="compact", sample_values=0, max_turns=turns)
            out.append(await arm(engine, tok, items, turns))
            print(json.dumps(out[-1]), flush=True)
        await engine.close()
        return out

    rows = asyncio.run(both())
    one, multi = rows
    head = ("| max_turns | episodes | wall s | samples/s | model tok/s | turns | obs tokens / episode | "
            "prefix-cache hit rate | engine requests |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    lines = [head] + [f"| {r['max_turns']} | {r['samples']} | {r['wall_s']} | {r['samples_per_s']} | "
                      f"{r['model_tokens_per_s']} | {r['turns_mean']} | {r['obs_tokens_mean']} | "
                      f"{r['prefix_cache_hit_rate']} | {int(r['engine_requests'])} |" for r in rows]
    lines.append(f"\nmax_turns {TURNS} / 1 samples/s: {multi['samples_per_s'] / one['samples_per_s']:.2f}x "
                 f"({PROMPTS} prompts x {N}, {TURNS} x {TURN_TOKENS} model tokens an episode, engine {gen.engine})")
    print("\n".join(lines))
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "episodes.json"), "w") as f:
        json.dump({"rows": rows, "prompts": PROMPTS, "n": N, "turns": TURNS, "turn_tokens": TURN_TOKENS,
                   "engine": gen.engine, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
