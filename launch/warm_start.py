"""The tiny recipe's supervised warm start: a few steps of cross-entropy on the training split's SQL
before RL, so a randomly initialised model writes SQL often enough for GRPO to have a signal.

Invariants: it runs only for `model.source == "tiny"` with `model.tiny_sft_steps > 0` (anything else
returns {} and changes nothing); every step goes through the learner group's `sft_step` (all ranks);
the pairs are (prompt ids, " " + target SQL ids + eos), drawn with `seed`, so a rerun is the same.
With `model.tiny_sft_slip` = p > 0, each drawn pair's target is its template's slip
(tasks.synthetic.SLIPS: SQL that runs but answers another question) with probability p, drawn anew at
every draw, so the warm policy learns a mixture (the gold answer about 1 - p of the time) rather than
which prompt had which label; prompts of no template keep their gold SQL. Only training prompts are
used: the held-out split is never seen here. In a colocated run the launcher puts the engines to sleep
before it (launch/place.py), so the warm start never shares the device with a resident engine.
"""
from __future__ import annotations

import time

from config import RunConfig


def sft_pairs(cfg: RunConfig, items: list, model_path: str) -> list[tuple[list[int], list[int], list[int] | None]]:
    """(prompt ids, gold SQL ids + eos, slipped SQL ids + eos or None) for the tiny recipe's warm start."""
    from transformers import AutoTokenizer

    from queues.messages import unpack_ids
    from tasks.synthetic import slipped

    tok = AutoTokenizer.from_pretrained(model_path)

    def target(sql: str) -> list[int]:
        return tok.encode(" " + sql, add_special_tokens=False) + [tok.eos_token_id]

    pairs = []
    for it in items:
        slip = slipped(it.gold_sql) if cfg.model.tiny_sft_slip > 0 else None
        pairs.append((unpack_ids(it.prompt_tokens).tolist(), target(it.gold_sql), target(slip) if slip else None))
    return pairs


def will_warm_start(cfg: RunConfig) -> bool:
    return cfg.model.source == "tiny" and cfg.model.tiny_sft_steps > 0


def warm_start(cfg: RunConfig, learner, items: list, model_path: str, log) -> dict[str, float]:
    """The tiny recipe's supervised warm-start on (partly slipped) SQL, so RL starts with some signal."""
    import asyncio
    import random

    steps = cfg.model.tiny_sft_steps
    if not will_warm_start(cfg):
        return {}
    pairs = sft_pairs(cfg, items, model_path)
    rng = random.Random(cfg.seed)
    batch, p_slip = cfg.model.tiny_sft_batch, cfg.model.tiny_sft_slip
    losses, slips, drawn = [], 0, 0
    start = time.perf_counter()
    for i in range(steps):
        chunk = []
        for prompt, gold, slip in rng.sample(pairs, min(batch, len(pairs))):
            use_slip = slip is not None and rng.random() < p_slip
            slips += use_slip
            drawn += 1
            chunk.append((prompt, slip if use_slip else gold))
        losses.append(asyncio.run(learner.sft_step(chunk, cfg.model.tiny_sft_lr)))
        if (i + 1) % max(1, steps // 5) == 0:
            log.info("warm-start", step=i + 1, of=steps, loss=round(sum(losses[-20:]) / len(losses[-20:]), 4))
    return {"sft_loss_first": losses[0], "sft_loss_last": sum(losses[-10:]) / len(losses[-10:]),
            "sft_slipped_share": slips / max(drawn, 1), "time_sft": time.perf_counter() - start}
