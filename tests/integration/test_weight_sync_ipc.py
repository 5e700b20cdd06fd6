"""Weight updates into vLLM's workers, CPU-checkable parts: merging the learner ranks' CUDA-IPC buckets,
each receiver opening only its own GPU's handle, the worker extension's three loaders and the real
VLLMEngine's calls into it.

What stands in for what cannot run here, and is named so: `fake_rebuild` replaces torch's
rebuild_cuda_tensor (no GPU: a "handle" carries its bytes), `FakeWorker` is a vLLM worker (device,
rank, model_runner.model.load_weights) with the real WeightLoaderExtension mixed in, and `FakeAsyncLLM`
is vLLM's AsyncLLM: its collective_rpc msgpack-encodes the arguments as vLLM does for its engine-core
process (so a tensor could not cross) and runs the method on every fake worker.
"""
from __future__ import annotations

import asyncio
import pickle

import msgspec
import pytest
import torch

from actors.engines.vllm_engine import VLLMEngine
from actors.engines.vllm_worker import WeightLoaderExtension
from weights import make_receiver
from weights.broadcast import BroadcastSender
from weights.bucketed import Receive
from weights.endpoint import ReceiveEnd
from weights.ipc import (
    CudaIpcBucket,
    ipc_message_from_bytes,
    ipc_message_to_bytes,
    merge_ipc_buckets,
    select_ipc_handles,
)
from weights.nccl import Join, Ranks, ReceiveAll, WorkerJoin
from weights.protocol import to_worker
from weights.store import ObjectStoreReceiver
from weights.strategy import get_transport
from weights.wire import (
    SyncAbort,
    SyncSummary,
    WeightSyncError,
    encode_message,
    flatten_bucket,
    iter_buckets,
)

OPENED: list[tuple[str, int]] = []  # (gpu the handle belongs to, CUDA index it was opened on)


def fake_rebuild(gpu: str, data: bytes, _a, _b, _c, _d, device: int, _e) -> torch.Tensor:
    """Stands in for rebuild_cuda_tensor: args[6] is the storage device, as in torch's handles."""
    OPENED.append((gpu, device))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(50, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.randn(16, generator=g),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(32, 16, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(16, generator=g),
    }


def fake_rank_messages(w: dict[str, torch.Tensor], version: int, uuid: str, sender_index: int, bucket_mb: float):
    """What one learner rank's CudaIpcSender.next_bucket() returns, bucket by bucket, with fake handles."""
    out, tensors, nbytes = [], 0, 0
    for index, named in enumerate(iter_buckets(w.items(), bucket_mb)):
        plan, buffers = flatten_bucket(named, version, index)
        handles = {d: (fake_rebuild, (uuid, b.numpy().tobytes(), 0, 0, 0, 0, sender_index, 0)) for d, b in buffers.items()}
        out.append(CudaIpcBucket(plan=encode_message(plan), handles={uuid: handles}))
        tensors, nbytes = tensors + len(plan.tensors), nbytes + plan.nbytes
    out.append(SyncSummary(version=version, num_buckets=len(out), num_tensors=tensors, nbytes=nbytes))
    return out


BUCKET_MB = 2000 / (1 << 20)  # several buckets for `weights`
NCCL, IPC = get_transport("nccl"), get_transport("cuda_ipc")


class FakeModel:
    def __init__(self):
        self.loaded: dict[str, torch.Tensor] = {}
        self.order: list[str] = []

    def load_weights(self, weights):
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()  # vLLM copies into its (sharded) parameters
            self.order.append(name)
        return set(self.loaded)


class FakeWorker(WeightLoaderExtension):
    """A vLLM worker stand-in: tensor-parallel rank `rank` on `device`, with the real extension."""

    def __init__(self, rank: int, uuid: str):
        self.rank, self.uuid = rank, uuid
        self.device = torch.device("cpu", rank)  # the index plays the worker's CUDA index
        self.model_runner = type("Runner", (), {"model": FakeModel()})()
        self.arl_uuid = uuid  # on a GPU the uuid is read from self.device


class FakeAsyncLLM:
    """vLLM's AsyncLLM as far as the engine's weight path uses it."""

    def __init__(self, workers: list[FakeWorker]):
        self.workers, self.prefix_resets = workers, 0
        self._enc, self._dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        wire = self._dec.decode(self._enc.encode(list(args)))  # what vLLM's utility-call encoding carries
        return list(await asyncio.gather(*(asyncio.to_thread(getattr(w, method), *wire) for w in self.workers)))

    async def reset_prefix_cache(self):
        self.prefix_resets += 1
        return True


def fake_vllm_engine(workers: list[FakeWorker]) -> VLLMEngine:
    engine = VLLMEngine.__new__(VLLMEngine)  # the real class; no vLLM to build
    engine.cfg = type("Cfg", (), {"tensor_parallel_size": len(workers)})()
    engine.llm, engine.version, engine._load_s, engine.worker_memory = FakeAsyncLLM(workers), 0, 0.0, []
    return engine


def assert_loaded(model: FakeModel, w: dict[str, torch.Tensor]) -> None:
    assert model.order == list(w)  # every name, in the learner's export order
    for name, t in w.items():
        assert model.loaded[name].dtype == t.dtype and torch.equal(model.loaded[name].view(-1).view(torch.uint8),
                                                                    t.contiguous().view(-1).view(torch.uint8)), name


async def gloo_sync(workers, w, version: int, join, receive) -> int:
    """The learner's side (a real BroadcastSender over gloo) against `join(rdv, 1)` / `receive(version)`
    of the fake workers' engine; checks every worker loaded `w`; returns what `receive` returned."""
    sender = BroadcastSender(lambda mb: iter_buckets(w.items(), mb), BUCKET_MB, backend="gloo", device="cpu",
                             timeout_s=30)
    rdv = sender.listen(world_size=1 + len(workers), host="127.0.0.1")
    try:
        await asyncio.wait_for(asyncio.gather(asyncio.to_thread(sender.init), join(rdv, 1)), 60)
        assert [wk._arl_receiver.rank for wk in workers] == list(range(1, 1 + len(workers)))
        summary, got = await asyncio.wait_for(asyncio.gather(asyncio.to_thread(sender.send, version), receive(version)), 60)
        assert summary.num_tensors == len(w)
        for worker in workers:
            assert_loaded(worker.model_runner.model, w)
        return got
    finally:
        sender.close()
        for worker in workers:
            worker._arl_receiver.close()


# ----------------------------------------------------------------------------- merge and selection


def test_merge_ipc_buckets_carries_the_plan_once_and_each_ranks_handles_by_gpu_uuid():
    w = weights(0)
    ranks = [fake_rank_messages(w, 3, f"GPU-{r}", r, BUCKET_MB) for r in range(2)]
    assert len(ranks[0]) >= 3
    for step in zip(*ranks):
        merged = merge_ipc_buckets(list(step))
        if isinstance(step[0], SyncSummary):
            assert merged == step[0]
            continue
        assert merged.plan == step[0].plan and merged.device_uuids == ["GPU-0", "GPU-1"]
        assert merged.handles["GPU-1"] is step[1].handles["GPU-1"]
        assert ipc_message_from_bytes(ipc_message_to_bytes(merged)).handles.keys() == merged.handles.keys()
    assert merge_ipc_buckets([ranks[0][0]]) is not None  # one rank: its own message


def test_merge_refuses_ranks_out_of_step_or_disagreeing_and_passes_an_abort_on():
    a = fake_rank_messages(weights(0), 3, "GPU-0", 0, BUCKET_MB)
    b = fake_rank_messages(weights(0), 3, "GPU-1", 1, BUCKET_MB)
    other = fake_rank_messages(weights(1) | {"extra": torch.zeros(3)}, 3, "GPU-1", 1, 1.0)
    with pytest.raises(WeightSyncError, match="rank 1's plan differs from rank 0's"):
        merge_ipc_buckets([a[0], other[0]])
    with pytest.raises(WeightSyncError, match="ranks 0 and 1 both export on GPU GPU-0"):
        merge_ipc_buckets([a[0], a[0]])
    with pytest.raises(WeightSyncError, match=r"out of step \(rank 0: bucket 1 of v3, rank 1: summary of v3\)"):
        merge_ipc_buckets([a[1], b[-1]])
    with pytest.raises(WeightSyncError, match="summary.num_tensors is 6 on rank 1, 5 on rank 0"):
        merge_ipc_buckets([a[-1], msgspec.structs.replace(a[-1], num_tensors=6)])
    abort = SyncAbort(version=3, reason="rank 1 failed")
    assert merge_ipc_buckets([a[0], abort]) is abort
    with pytest.raises(WeightSyncError, match="no messages"):
        merge_ipc_buckets([])


def test_a_receiver_opens_its_own_gpus_handle_and_names_both_sides_when_it_has_none():
    merged = merge_ipc_buckets([fake_rank_messages(weights(0), 1, f"GPU-{r}", r, 1.0)[0] for r in range(3)])
    assert select_ipc_handles(merged, {"GPU-2": 0})[0] == 0
    index, handles = select_ipc_handles(merged, {"GPU-0": 0, "GPU-1": 1}, prefer=1)
    assert index == 1 and handles is merged.handles["GPU-1"]
    assert select_ipc_handles(merged, {"GPU-0": 0, "GPU-1": 1})[1] is merged.handles["GPU-0"]
    with pytest.raises(WeightSyncError, match=r"handles for GPU\(s\) \['GPU-0', 'GPU-1', 'GPU-2'\], this process sees "
                                              r"\['GPU-9'\]"):
        select_ipc_handles(merged, {"GPU-9": 0})


# ----------------------------------------------------------------------------- into (fake) vLLM workers


async def test_cuda_ipc_into_fake_tp2_vllm_workers_each_opens_only_its_gpu_with_the_real_engine_and_receiver():
    OPENED.clear()
    w = weights(2)
    workers = [FakeWorker(0, "GPU-a"), FakeWorker(1, "GPU-b")]
    engine = fake_vllm_engine(workers)
    receiver = make_receiver("cuda_ipc", None, engine)  # what the generator builds for a vLLM engine
    ranks = [fake_rank_messages(w, 4, uuid, sender_index=5 + r, bucket_mb=BUCKET_MB)
             for r, uuid in enumerate(["GPU-a", "GPU-b"])]
    results = [await receiver.receive(merge_ipc_buckets(list(step))) for step in zip(*ranks)]
    assert results[-1] == 4 and receiver.version == 4 and all(r is None for r in results[:-1])
    for worker in workers:
        assert_loaded(worker.model_runner.model, w)
        opened = [o for o in OPENED if o[0] == worker.uuid]
        assert opened and all(index == worker.rank for _, index in opened)  # its own GPU, at its own index
    assert len(OPENED) == sum(len(m.handles[u]) for m in ranks[0][:-1] for u in m.handles) * 2
    await engine.finish_weight_update(4)
    assert engine.version == 4 and engine.llm.prefix_resets == 1


async def test_object_store_and_load_weights_reach_fake_vllm_workers_as_plain_bytes():
    from weights.store import ObjectStoreSender

    w = weights(3)
    workers = [FakeWorker(0, "GPU-a"), FakeWorker(1, "GPU-b")]
    engine = fake_vllm_engine(workers)
    sender = ObjectStoreSender(lambda mb: iter_buckets(w.items(), mb), BUCKET_MB, put=lambda payload: payload)
    receiver = make_receiver("object_store", None, engine)
    assert isinstance(receiver, ObjectStoreReceiver)
    sender.start(7)
    while (got := await receiver.receive(sender.next_bucket())) is None:
        pass
    assert got == 7
    for worker in workers:
        assert_loaded(worker.model_runner.model, w)

    fresh = [FakeWorker(0, "GPU-a")]
    await fake_vllm_engine(fresh).load_weights(list(w.items()), 8)  # the engine interface's own path
    assert_loaded(fresh[0].model_runner.model, w)
    with pytest.raises(TypeError):
        msgspec.msgpack.encode([torch.zeros(1)])  # why tensors never go through the RPC


async def test_broadcast_group_joined_by_fake_vllm_workers_over_gloo_one_rank_each():
    workers = [FakeWorker(0, "GPU-a"), FakeWorker(1, "GPU-b")]
    engine = fake_vllm_engine(workers)
    end = ReceiveEnd(None, lambda: engine)  # a generator's end of the transport, over the engine
    assert (await end.handle(NCCL.call(Ranks())))[0] == engine.num_workers() == 2

    async def join(rdv, first):
        return await end.handle(NCCL.call(Join(rdv, first)))

    async def receive(version):
        reply, completed = await end.handle(NCCL.call(ReceiveAll(version)))
        assert reply == completed
        return reply

    assert await gloo_sync(workers, weights(4), 9, join, receive) == 9


def test_a_worker_whose_rank_does_not_fit_the_group_says_so_before_joining():
    from weights.broadcast import Rendezvous

    rdv = Rendezvous(host="127.0.0.1", port=1, world_size=3, backend="gloo", timeout_s=1)
    with pytest.raises(WeightSyncError, match="needs rank 3 but the group's world_size is 3"):
        FakeWorker(1, "GPU-b").arl_weights("nccl", to_worker(WorkerJoin(rdv, 2)))


def test_the_merged_ipc_message_crosses_msgpack_as_pickled_bytes():
    merged = merge_ipc_buckets([fake_rank_messages(weights(0), 1, f"GPU-{r}", r, 1.0)[0] for r in range(2)])
    blob = ipc_message_to_bytes(merged)
    back = ipc_message_from_bytes(msgspec.msgpack.decode(msgspec.msgpack.encode(blob)))
    assert back.plan == merged.plan and back.handles.keys() == merged.handles.keys()
    assert pickle.loads(blob)[1]["GPU-0"]["float32"][0] is fake_rebuild  # the rebuild function, by reference


def _generator_shell_over(engine: VLLMEngine):
    """The real GeneratorActor class body (not started through Ray) over a fake-vLLM engine."""
    from actors.generator.generator import Generator
    from actors.generator.shell import GeneratorShell

    shell = object.__new__(GeneratorShell)
    shell.gen = Generator(engine, type("Cfg", (), {"max_inflight_prompts": 4})())
    shell.needs_weights, shell._weights_ready = True, asyncio.Event()
    shell._weights_in = ReceiveEnd(shell.gen.load_weights, lambda: shell.gen.engine)
    return shell


async def test_generator_shell_hands_fake_vllm_engines_the_messages_for_both_transports():
    w = weights(5)
    workers = [FakeWorker(0, "GPU-a"), FakeWorker(1, "GPU-b")]
    shell = _generator_shell_over(fake_vllm_engine(workers))
    assert await shell.receive_weights(NCCL.call(Ranks())) == 2
    # nccl (gloo here): each worker joins as its own rank, the shell ends the update and sets the version
    assert await gloo_sync(workers, w, 3, lambda rdv, first: shell.receive_weights(NCCL.call(Join(rdv, first))),
                           lambda version: shell.receive_weights(NCCL.call(ReceiveAll(version)))) == 3
    assert shell._weights_in.halves[NCCL.key] == "engine" and shell.gen.version == 3 and not shell.needs_weights
    # cuda_ipc: the merged message goes to the engine as it came
    for worker in workers:
        worker.model_runner.model = FakeModel()
    ranks = [fake_rank_messages(w, 4, uuid, r, BUCKET_MB) for r, uuid in enumerate(["GPU-a", "GPU-b"])]
    results = [await shell.receive_weights(IPC.call(Receive(merge_ipc_buckets(list(step))))) for step in zip(*ranks)]
    assert results[-1] == 4 and shell.gen.version == 4
    for worker in workers:
        assert_loaded(worker.model_runner.model, w)
