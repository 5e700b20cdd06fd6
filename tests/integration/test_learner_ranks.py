"""The learner as a group of ranks (CPU: processes over gloo, real Ray, real DeepSpeed): the split of
micro-batches across ranks, 2 ranks == 1 rank for every ZeRO stage, checkpoints of one world size."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from policies.shard import split_across_ranks
from tests.clusters import ray_cluster
from tests.learners import MODEL_CFG, TEMPERATURE, make_batch

pytestmark = pytest.mark.usefixtures("learner_process_env")  # it builds Learners in this process


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_split_runs_every_micro_batch_once_with_equal_calls_balanced_by_tokens(world_size):
    rng = random.Random(world_size)
    for n in [0, 1, 2, 3, 5, 7, 8, 13]:
        tokens = [rng.randint(1, 500) for _ in range(n)]
        split = split_across_ranks(tokens, world_size)
        assert len(split) == world_size
        assert {len(s) for s in split} == {max(1, -(-n // world_size))}  # the same number of calls each
        real = [i for s in split for i in s if i is not None]
        assert sorted(real) == list(range(n))  # every micro-batch exactly once
        for s in split:  # own micro-batches in their order, empty slots last
            mine = [i for i in s if i is not None]
            assert s == mine + [None] * (len(s) - len(mine)) and mine == sorted(mine)
        loads = [sum(tokens[i] for i in s if i is not None) for s in split]
        if n >= world_size:  # balanced: no rank is more than its largest micro-batch above the lightest
            assert max(loads) - min(loads) <= max(tokens), (tokens, split)
    # Greedy by tokens, not by position: the two heavy micro-batches go to different ranks.
    assert split_across_ranks([100, 90, 10, 5], 2) == [[0, 3], [1, 2]]
    assert split_across_ranks([1, 1, 1], 2) == [[0, 2], [1, None]]


def test_split_refuses_bad_input_by_name():
    with pytest.raises(ValueError, match="world_size"):
        split_across_ranks([1, 2], 0)
    with pytest.raises(ValueError, match="token counts"):
        split_across_ranks([1, -2], 2)


# ----------------------------------------------------------------------------- 2 ranks == 1 rank

STAGES = [0, 1, 2, 3]


def _run_cfg(zero_stage: int):
    from config import LearnerConfig
    from config.recipes import tiny

    cfg = tiny()
    cfg.model = MODEL_CFG
    cfg.generator.temperature = TEMPERATURE
    cfg.assembler.micro_batch_tokens = 64
    cfg.learner = LearnerConfig(zero_stage=zero_stage, dtype="float32", lr=1e-3, update_epochs=2, device="cpu",
                                grad_clip=1.0, num_cpus=0.5, num_ranks=2)
    return cfg


def _weights(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


async def _sync_object_store(group) -> tuple[int, dict]:
    """(buckets, name -> tensor) of one object_store sync driven as the coordinator does, in 64 KiB buckets."""
    import ray

    from weights import ObjectStoreBucket, SyncSummary, payload_to_tensors
    from weights.bucketed import Next, Start
    from weights.strategy import get_transport

    store = get_transport("object_store")
    await group.send_weights(store.call(Start(1, 1 / 16)))
    got, buckets = {}, 0
    while True:
        message = await group.send_weights(store.call(Next()))
        if isinstance(message, SyncSummary):
            assert message.num_buckets == buckets
            return buckets, got
        assert isinstance(message, ObjectStoreBucket)
        buckets += 1
        _, named = payload_to_tensors(ray.get(message.refs[0]))
        got.update((n, t.clone()) for n, t in named)


@pytest.fixture(scope="module")
def ranks_vs_one(model_dir, tmp_path_factory):
    """Per ZeRO stage: one step (2 update epochs: 2 optimizer steps) of a 2-rank LearnerGroup over
    gloo, its batch read by rank 0 from a real Redis stream, and of one in-process rank on the same
    batch; their metrics and exported weights. The ZeRO-1 group also saves a checkpoint."""
    import asyncio

    from actors.learner.learner import Learner
    from config import RunContext
    from launch.create import create_learner
    from queues.messages import TrainBatch, codec
    from queues.redis_server import EmbeddedRedis
    from queues.streams import Stream, connect
    from queues.topology import BATCHES

    root = tmp_path_factory.mktemp("ranks")
    batch = make_batch(seed=11, groups=3, n=4, budget=44)  # 5 micro-batches
    async def publish(url: str, run_id: str) -> None:
        stream = Stream(await connect(url), run_id, BATCHES)
        await stream.ensure_group()
        await stream.publish(codec(TrainBatch).encode(batch))

    out = {"batch": batch, "root": root, "stages": {}}
    with EmbeddedRedis(root) as redis, ray_cluster():
        for stage in STAGES:
            cfg = _run_cfg(stage)
            one = Learner(cfg.learner, cfg.model, model_dir, total_steps=10, micro_batch_tokens=64,
                          temperature=TEMPERATURE)
            m1 = one.train_step(batch)
            one.export_hf(str(root / f"one{stage}"))
            del one
            group = create_learner(cfg, RunContext.of(cfg, f"z{stage}", root, redis.url), model_dir, 10, f"z{stage}")
            try:
                asyncio.run(group.connect())
                asyncio.run(publish(redis.url, f"z{stage}"))
                m2 = asyncio.run(group.train_from_stream(0, timeout_s=120))
                asyncio.run(group.export_hf(str(root / f"two{stage}")))
                if stage == 1:
                    asyncio.run(group.save(str(root / "ckpt2")))
                if stage == 3:  # a weight sync through the group: every rank exports, rank 0's buckets go out
                    out["synced"] = asyncio.run(_sync_object_store(group))
            finally:
                group.kill()
            out["stages"][stage] = (m1, m2, _weights(root / f"one{stage}"), _weights(root / f"two{stage}"))
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_two_ranks_train_one_step_exactly_as_one_rank(ranks_vs_one, model_dir, stage):
    """The same weights (float32, 1e-5; an Adam step here moves them by up to 1e-3), the same grad norm
    and metrics. Adam's update is blind to a uniform gradient scale, so the grad norm is what
    catches a wrong world-size scaling; the weights catch a wrong split or normaliser."""
    batch = ranks_vs_one["batch"]
    assert len(batch.micro_batches) % 2 == 1  # odd: one rank runs an empty micro-batch
    m1, m2, w1, w2 = ranks_vs_one["stages"][stage]
    start = _weights(model_dir)
    assert w1.keys() == w2.keys()
    worst = max(float((w1[k] - w2[k]).abs().max()) for k in w1)
    moved = max(float((w1[k] - start[k]).abs().max()) for k in w1)
    assert worst <= 1e-5 < 1e-4 < moved, (worst, moved)
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
    for k in ("pg_loss", "loss", "ratio_mean", "ppo_kl", "clipfrac", "epoch1/ratio_max", "epoch1/clipfrac"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-7), (k, m1[k], m2[k])
    assert m1["epoch1/clipfrac"] > 0  # the second epoch's clipping is compared, not two zeros
    assert (m2["num_loss_tokens"], m2["micro_batches"], m2["train_groups"]) == \
           (m1["num_loss_tokens"], m1["micro_batches"], float(len(batch.groups)))


def test_a_checkpoint_of_two_ranks_refuses_to_resume_in_one_naming_both_sizes(ranks_vs_one, model_dir):
    from actors.learner.learner import Learner

    cfg = _run_cfg(1)
    one = Learner(cfg.learner, cfg.model, model_dir, total_steps=10, micro_batch_tokens=64, temperature=TEMPERATURE)
    with pytest.raises(ValueError) as e:
        one.load(str(ranks_vs_one["root"] / "ckpt2"))
    msg = str(e.value)
    assert "\n" not in msg and "saved by 2 learner rank" in msg and "learner.num_ranks=1" in msg, msg


def test_zero3_weight_sync_through_two_ranks_sends_rank_0s_gathered_weights(ranks_vs_one):
    """Under ZeRO-3 each rank holds half of every parameter: the export is collective (both ranks
    iterate it in lockstep), rank 0's buckets carry the whole, updated weights, each name once."""
    buckets, synced = ranks_vs_one["synced"]
    _, _, _, exported = ranks_vs_one["stages"][3]
    assert buckets > 1
    assert set(synced) >= set(exported) - {"lm_head.weight"}
    for name, t in synced.items():
        assert torch.equal(t, exported[name]), name
