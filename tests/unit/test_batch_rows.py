"""The transformers engine batches by rows as well as prompts (generator.max_batch_rows): a held-out
evaluation's one-row greedy prompts and eval_samples-row sampled prompts fill a batch as a training step's
prompts x n_samples do (tiny: 128 rows), instead of max_batch_prompts prompts each."""
import pytest
import torch

from actors.engines.hf import TransformersEngine
from config import GeneratorConfig, ModelConfig, apply_overrides
from config.recipes import get_recipe
from queues.messages import PromptTask, pack_ids

torch.set_num_threads(1)


def _task(engine, k: int, n: int) -> PromptTask:
    ids = engine.tokenizer(f"SELECT name FROM singer {k}")["input_ids"]
    return PromptTask(task_id=f"t{k}", prompt_id=f"t{k}", step=0, policy_version=0, prompt_tokens=pack_ids(ids), n=n)


def _engine(tiny_dir, **kw):
    cfg = GeneratorConfig(engine="transformers", device="cpu", max_tokens=4, n_samples=8, **kw)
    return TransformersEngine(cfg, ModelConfig(source="tiny", dtype="float32"), tiny_dir)


def _batches(engine, ns: list[int]) -> list[int]:
    """The sizes of the batches the engine's loop would take from pending requests of n = ns (in order)."""
    from actors.engines.hf_rows import Request

    engine._pending = [Request(task=t, params=type("P", (), {"n": t.n})(), ids=[], future=None, submitted_at=0.0)
                       for t in (_task(engine, k, n) for k, n in enumerate(ns))]
    sizes = []
    while engine._pending:
        k = min(engine._batch_size(), len(engine._pending))  # the loop's slice
        sizes.append(k)
        del engine._pending[:k]
    return sizes


def test_a_row_cap_fills_a_batch_with_as_many_prompts_as_fit_its_rows(tiny_dir):
    engine = _engine(tiny_dir, max_batch_prompts=128, max_batch_rows=128)
    assert _batches(engine, [8] * 16) == [16]  # a training step: 16 prompts x 8 rows, one batch as before
    assert _batches(engine, [1] * 74 + [4] * 74) == [87, 32, 29]  # an evaluation: 126, 128, 116 rows
    assert _batches(engine, [200, 1]) == [1, 1]  # a prompt over the cap alone is still taken
    no_cap = _engine(tiny_dir, max_batch_prompts=16)
    assert _batches(no_cap, [1] * 74 + [4] * 74) == [16] * 9 + [4]  # before: prompts only


async def test_row_batched_greedy_answers_equal_one_at_a_time(tiny_dir):
    engine = _engine(tiny_dir, max_batch_prompts=64, max_batch_rows=64)
    tasks = [PromptTask(task_id=f"g{k}", prompt_id=f"g{k}", step=0, policy_version=0, n=1, sampling={"temperature": 0},
                        prompt_tokens=_task(engine, k, 1).prompt_tokens) for k in range(6)]
    import asyncio

    together = await asyncio.gather(*(engine.generate(t) for t in tasks))
    assert engine.stats()["engine_batches"] == 1  # the six went as one batch
    alone = [await engine.generate(t) for t in tasks]
    assert [g.samples[0].tokens for g in together] == [g.samples[0].tokens for g in alone]


def test_tiny_batches_by_rows():
    cfg = apply_overrides(get_recipe("tiny"), [])
    g = cfg.generator
    assert g.max_batch_rows == g.n_samples * cfg.coordinator.prompts_per_step  # a training step's rows
    assert g.max_batch_prompts >= 74 and g.max_inflight_prompts >= 74  # a whole greedy evaluation fits one batch


def test_a_negative_row_cap_is_refused_by_name():
    from config import ConfigError

    with pytest.raises(ConfigError, match="generator.max_batch_rows"):
        apply_overrides(get_recipe("tiny"), ["generator.max_batch_rows=-1"])
