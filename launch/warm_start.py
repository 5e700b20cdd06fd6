"""The tiny recipe's supervised warm start: a few steps of cross-entropy on the training split's SQL
before RL, so a randomly initialised model writes SQL often enough for GRPO to have a signal.

Invariants: it runs only for `model.source == "tiny"` with `model.tiny_sft_steps > 0` (anything else
returns {} and changes nothing); every step goes through the learner group's `sft_step` (all ranks);
with learner.lora the steps train the frozen base the adapter then trains over (the same steps as without;
actors/learner/lora_base.py), which is then saved over the run's model directory (`save_base`);
the pairs are (prompt ids, " " + target SQL ids + eos), drawn with `seed`, so a rerun is the same.
With `model.tiny_sft_slip` = p > 0, each drawn pair's target is its template's slip
(tasks.synthetic.SLIPS: SQL that runs but answers another question) with probability p, drawn anew at
every draw, so the warm policy learns a mixture (the gold answer about 1 - p of the time) rather than
which prompt had which label; prompts of no template keep their gold SQL. Only training prompts are
used: the held-out split is never seen here. Steps travel `steps_per_call` at a time in one learner call
(`sft_steps`: each rank loops over them); every step's draws are made beforehand (`draw`, in the launcher's
inputs child process: the launcher itself never loads the tokenizer) in the same order as one call a step
would make them, so the run is the same whichever the batching. A step's draws are `step_draws` (this module imports
neither config nor msgspec: bench/gpu/warm_start.py replays the draws on a device that has only torch).
In a colocated run the launcher puts the engines to sleep before it (launch/place.py), so the warm
start never shares the device with a resident engine.
With generator.max_turns > 1 and `model.tiny_sft_episodes` = q > 0, each drawn example is, with
probability q, an error-then-fix episode (tasks/synthetic_episodes.py: a misspelt query, its real
error as an observation with loss mask 0, then the same answer the one-shot draw would give), so both
warm starts end on the same answer mixture and only the chance to see an error and retry differs.
With `model.tiny_sft_value_slips` = v > 0, a share v of those episodes misspells a quoted value instead:
the first query runs and shows no rows (or a 0 / NULL aggregate) before the answer.
With `model.tiny_sft_revise` = r > 0, a share r of the episodes are look-then-fix episodes instead: the
first query is the one-shot draw (the slip with probability p, else the gold SQL), its real rows the
observation, and the answer the gold SQL; then the episode's final answer is always gold (so its answer
mixture is cleaner than a direct answer's: that, the chance to see a first guess's rows and retry, is
what these episodes teach).
With `model.tiny_sft_look` = l > 0 (data.synthetic_value_forms's task), a share l of the episodes are
look-then-answer episodes instead (taking precedence): a query that shows how the question's value is
stored in this database, its real rows, then the one-shot draw's answer (gold or slip, as a direct answer
would be); an example whose gold compares no place or category value stays a direct answer.
"""
from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:  # importable without config (msgspec), see the module docstring
    from config import RunConfig


def sft_pairs(cfg: RunConfig, items: list, model_path: str) -> list[tuple[list[int], list[int], list[int] | None]]:
    """(prompt ids, gold SQL ids + eos, slipped SQL ids + eos or None) for the tiny recipe's warm start."""
    from transformers import AutoTokenizer

    from queues.messages import unpack_ids
    from tasks.synthetic_text import slipped

    tok = AutoTokenizer.from_pretrained(model_path)

    def target(sql: str) -> list[int]:
        return tok.encode(" " + sql, add_special_tokens=False) + [tok.eos_token_id]

    pairs = []
    for it in items:
        slip = slipped(it.gold_sql) if cfg.model.tiny_sft_slip > 0 else None
        pairs.append((unpack_ids(it.prompt_tokens).tolist(), target(it.gold_sql), target(slip) if slip else None))
    return pairs


def step_draws(pairs: list, rng, batch: int, p_slip: float) -> Iterator[tuple[int, bool]]:
    """One warm-start step's draws from `rng`: (index into `pairs`, whether its target is the slip), `batch`
    distinct pairs, each slipped with probability `p_slip` where it has a slip (pairs[k][2] not None). Lazy,
    so a caller may draw more from `rng` between two draws (the episodes do) and a rerun stays the same."""
    for k in rng.sample(range(len(pairs)), min(batch, len(pairs))):
        yield k, pairs[k][2] is not None and rng.random() < p_slip


def will_warm_start(cfg: RunConfig) -> bool:
    return cfg.model.source == "tiny" and cfg.model.tiny_sft_steps > 0


STEPS_PER_CALL = 20  # warm-start steps a learner call carries (each rank loops over them)


class Draws:
    """Every warm-start step's examples, drawn in order (`draw`), kept compact (token ids as int32
    arrays; a prompt's array shared by all its draws): the launcher builds them in its inputs' child
    process (launch/inputs.py) and holds them for the run (a relaunch before the first checkpoint warm-starts
    again from the same draws). `chunk(i, n)` gives steps i..i+n-1 as the learner takes them (lists)."""

    def __init__(self, steps: list, slips: int, drawn: int, fixes: int):
        self.steps, self.slips, self.drawn, self.fixes = steps, slips, drawn, fixes

    def __len__(self) -> int:
        return len(self.steps)

    def chunk(self, start: int, n: int) -> list[list[tuple]]:
        return [[tuple(part.tolist() for part in ex) for ex in step] for step in self.steps[start:start + n]]


def draw(cfg: RunConfig, items: list, model_path: str) -> Draws:
    """The warm start's `model.tiny_sft_steps` steps of draws (module docstring): pairs tokenized here
    (`sft_pairs`), drawn with random.Random(cfg.seed) in the order one learner call a step would draw them
    (episodes draw from the same rng between two draws). Needs the tokenizer (transformers); no learner."""
    from array import array

    def ids(seq) -> array:
        return array("i", seq)

    pairs = [(ids(p), ids(g), ids(s) if s is not None else None) for p, g, s in sft_pairs(cfg, items, model_path)]
    rng = random.Random(cfg.seed)
    batch, p_slip, p_episode = cfg.model.tiny_sft_batch, cfg.model.tiny_sft_slip, cfg.model.tiny_sft_episodes
    episodes = _Episodes(cfg, model_path) if p_episode > 0 and cfg.generator.max_turns > 1 else None
    steps, slips, drawn, fixes = [], 0, 0, 0
    for _ in range(cfg.model.tiny_sft_steps):
        step = []
        for k, use_slip in step_draws(pairs, rng, batch, p_slip):
            prompt, gold, slip = pairs[k]
            slips += use_slip
            drawn += 1
            if episodes is None:
                step.append((prompt, slip if use_slip else gold))
                continue
            _, response, mask = episodes.example(items[k], prompt.tolist(), use_slip, rng.random() < p_episode, rng)
            fixes += len(mask) > 0 and 0 in mask
            step.append((prompt, ids(response), array("b", mask)))
        steps.append(step)
    return Draws(steps, slips, drawn, fixes)


def warm_start(cfg: RunConfig, learner, items: list, model_path: str, log,
               steps_per_call: int = STEPS_PER_CALL, draws: Draws | None = None) -> dict[str, float]:
    """The tiny recipe's supervised warm-start on (partly slipped) SQL, so RL starts with some signal.
    `draws`: made beforehand (launch/inputs.py, in the inputs' child process), else drawn here (`draw`:
    the tokenizer loads in this process). Returns its scalars; `time_sft` is the wall time of the learner
    calls, `time_sft_learner` rank 0's time inside the steps (the rest is the calls' round trips)."""
    import asyncio

    steps = cfg.model.tiny_sft_steps
    if not will_warm_start(cfg):
        return {}
    if draws is None:
        draws = draw(cfg, items, model_path)
    losses: list[float] = []
    learner_s, calls = 0.0, 0
    start = time.perf_counter()
    every = max(1, steps // 5)
    done = 0
    while done < steps:
        batch_steps = min(steps_per_call, steps - done)
        out = asyncio.run(learner.sft_steps(draws.chunk(done, batch_steps), cfg.model.tiny_sft_lr))
        losses += out["losses"]
        learner_s += out["seconds"]
        calls += 1
        before, done = done, done + batch_steps
        if done // every > before // every:
            log.info("warm-start", step=done, of=steps, loss=round(sum(losses[-20:]) / len(losses[-20:]), 4))
    if cfg.learner.lora.rank > 0:
        # LoRA trains over a frozen base; this warm start built it: it replaces the run's model (the engines Ray
        # restarts, a relaunched learner and every export's adapter then name the base the adapter trained over)
        asyncio.run(learner.save_base(model_path))
        log.info("warm-start base saved", path=str(model_path))
    wall = time.perf_counter() - start
    return {"sft_loss_first": losses[0], "sft_loss_last": sum(losses[-10:]) / len(losses[-10:]),
            "sft_slipped_share": draws.slips / max(draws.drawn, 1), "sft_error_fix_share": draws.fixes / max(draws.drawn, 1),
            "time_sft": wall, "time_sft_learner": learner_s, "sft_calls": float(calls),
            "sft_step_s": wall / steps}


class _Episodes:
    """Multi-turn warm-start examples (tasks/synthetic_episodes.py) for generator.max_turns > 1."""

    def __init__(self, cfg: RunConfig, model_path: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.max_obs = cfg.generator.max_observation_tokens
        self.p_value = cfg.model.tiny_sft_value_slips
        self.p_revise = cfg.model.tiny_sft_revise
        self.p_look = cfg.model.tiny_sft_look

    def example(self, item, prompt: list[int], use_slip: bool, error_first: bool, rng) -> tuple:
        """(prompt ids, response ids, loss mask): a slip-then-fix episode when `error_first` (and a
        misspelling of the answer errors, or, for a share `model.tiny_sft_value_slips`, a misspelt value
        shows other rows), else the direct answer."""
        from tasks.synthetic_episodes import episode_target, look_target, revise_target
        from tasks.synthetic_text import slipped

        answer = (slipped(item.gold_sql) if use_slip else None) or item.gold_sql
        if error_first and self.p_look > 0 and rng.random() < self.p_look:
            got = look_target(self.tok, answer, item.gold_sql, item.db_path, self.max_obs)
            ids, mask = got or episode_target(self.tok, answer, item.db_path, rng, self.max_obs, False)
            return prompt, ids, mask
        if error_first and self.p_revise > 0 and rng.random() < self.p_revise:
            return (prompt, *revise_target(self.tok, answer, item.gold_sql, item.db_path, self.max_obs))
        kind = "value" if error_first and self.p_value > 0 and rng.random() < self.p_value else "identifier"
        got = (episode_target(self.tok, answer, item.db_path, rng, self.max_obs, True, kind)
               if error_first else None)
        ids, mask = got or episode_target(self.tok, answer, item.db_path, rng, self.max_obs, False)
        return prompt, ids, mask
