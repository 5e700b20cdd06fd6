"""Messages and inputs built by hand for the tests: a synthetic BIRD question, a scored group, a rollout group
of given texts, GRPO log-prob batches, and a run's metrics rows.

Invariant: pure builders (no Redis, Ray, process or socket); the same arguments give the same objects (torch
generators are seeded by the caller's seed).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from queues.messages import (
    PromptTask,
    RolloutGroup,
    Sample,
    ScoredGroup,
    pack_floats,
    pack_ids,
)


def synthetic_question(tmp_path_factory, name: str, seed: int):
    """The first dev question of a fresh synthetic BIRD directory of one database (20 questions)."""
    from tasks.bird import load_split
    from tasks.synthetic import write_dataset

    bird = write_dataset(tmp_path_factory.mktemp(name) / "syn", num_databases=1, num_questions=20, seed=seed)
    return load_split(bird, "dev")[0]


def scored(task_id, rewards, version=0, error="", gold_failed=False, completion_len=3):
    """A scored group of len(rewards) samples (or an error group), verdict match where the reward is 1."""
    task = PromptTask(task_id=task_id, prompt_id=f"q{task_id}", step=0, policy_version=version,
                      prompt_tokens=pack_ids(range(5)), n=len(rewards))
    samples = [] if error else [Sample(tokens=pack_ids(range(completion_len)), logprobs=pack_floats([-1.0] * completion_len),
                                       finish_reason="stop") for _ in rewards]
    rollout = RolloutGroup(task=task, samples=samples, policy_version=version, error=error)
    return ScoredGroup(rollout=rollout, rewards=list(rewards), verdicts=["match" if r == 1 else "wrong_result" for r in rewards],
                       gold_failed=gold_failed)


def rollout_group(q, texts, error="", prompt_id="p0", gold_sql=None):
    """A rollout group answering question `q` with one sample per text (the scorer's input)."""
    task = PromptTask(task_id=f"0:{prompt_id}:0", prompt_id=prompt_id, step=0, policy_version=0,
                      prompt_tokens=pack_ids([1, 2, 3]), n=len(texts), db_id=q.db_id, db_path=q.db_path,
                      gold_sql=q.sql if gold_sql is None else gold_sql, difficulty=q.difficulty)
    samples = [Sample(tokens=pack_ids([4]), logprobs=b"\0\0\0\0", finish_reason="stop", text=t) for t in texts]
    return RolloutGroup(task=task, samples=samples, policy_version=0, error=error)


def grpo_batch(seed=0, samples=5, max_len=9, spread=0.5):
    """[B, L] log-probs (current, old, generation, reference), advantages, mask and entropies for the loss."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (samples,), generator=g)
    mask = torch.arange(max_len)[None, :] < lengths[:, None]
    old = -torch.rand(samples, max_len, generator=g) * 3
    lp = old + torch.randn(samples, max_len, generator=g) * spread  # ratios well outside [0.8, 1.28]
    adv = torch.randn(samples, 1, generator=g).expand(samples, max_len).contiguous()
    gen = old + torch.randn(samples, max_len, generator=g) * 0.3
    ref = old + torch.randn(samples, max_len, generator=g) * 0.2
    ent = torch.rand(samples, max_len, generator=g) * 2
    # Padding positions hold garbage that must never matter.
    for t in (lp, old, gen, ref, ent):
        t[~mask] = float("nan")
    return lp, old, adv, mask, gen, ref, ent


def write_metrics(run_dir: Path, rows: list[dict]) -> None:
    """A run directory's metrics.jsonl holding `rows`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def synthetic_rows(steps: int = 12) -> list[dict]:
    """Per-step metrics rows of a run that learns (a held-out evaluation every 4 steps)."""
    rows = []
    for s in range(steps):
        row = {"step": s, "time": 1000.0 + s, "reward_mean": 0.1 + 0.05 * s, "accuracy": 0.02 * s,
               "response_len_mean": 200 - s, "time_generate": 3.0, "time_train": 1.5 + 0.1 * s}
        if s % 4 == 0:
            row["eval_accuracy"] = 0.03 * s
        rows.append(row)
    return rows


def overlong_group(lengths, rewards, truncated):
    """A scored group whose samples have these lengths; a truncated one ends with finish_reason length."""
    g = scored("t", rewards, completion_len=max(lengths))
    for s, n, t in zip(g.rollout.samples, lengths, truncated):
        s.tokens, s.logprobs = pack_ids(range(n)), s.logprobs[: 4 * n]
        s.finish_reason = "length" if t else "stop"
    return g
