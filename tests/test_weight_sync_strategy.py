"""The one factory (weights.strategy) for every placement, and vLLM's own weight transfer driven from our
halves against a fake vLLM client (vLLM and CUDA cannot run here: the tests that use it say `fake`)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from config import ConfigError, apply_overrides
from config.recipes import get_recipe
from weights import SyncSummary, WeightSyncError, drive_bucketed_sync
from weights.strategy import REGISTRY, get_transport, transport_for
from weights.vllm_native import VllmIpcChunk, VllmIpcSender, VllmNativeReceiver, merge_vllm_chunks


def _cfg(*overrides, recipe="tiny"):
    return apply_overrides(get_recipe(recipe), list(overrides))


@pytest.mark.parametrize("recipe, overrides, kind", [
    ("tiny", [], "object_store"),                                      # CPU
    ("gpu1_0p6b", [], "cuda_ipc"),                                     # colocated, one GPU
    ("bird_1p7b", [], "cuda_ipc"),                                     # colocated, 8 GPUs
    ("bird_1p7b", ["coordinator.mode=async", "generator.num_engines=4"], "nccl"),  # disaggregated
])
def test_factory_picks_the_placements_transport(recipe, overrides, kind):
    cfg = _cfg(*overrides, recipe=recipe)
    transport = transport_for(cfg.coordinator, cfg.generator.engine)
    assert cfg.coordinator.weight_sync == kind and transport.key.kind == kind and transport.key.impl == "ours"
    assert transport.per_bucket == (kind != "nccl")


def test_every_registered_transport_imports_and_carries_its_key():
    for key in REGISTRY:
        assert get_transport(key.kind, key.impl).key == key


def test_vllm_impl_validated_in_one_line():
    cfg = _cfg("coordinator.weight_sync_impl=vllm", recipe="gpu1_0p6b")
    assert transport_for(cfg.coordinator, "vllm").key.impl == "vllm"
    assert cfg.generator.engine_kwargs["weight_transfer_config"] == {"backend": "ipc"}
    for recipe, bad in [("tiny", ["coordinator.weight_sync_impl=theirs"]),
                        ("tiny", ["coordinator.weight_sync_impl=vllm"]),  # the transformers engine
                        ("bird_1p7b", ["coordinator.weight_sync_impl=vllm", "coordinator.mode=async",
                                       "generator.num_engines=4"])]:  # nccl: not wired natively
        with pytest.raises(ConfigError, match="weight_sync_impl") as e:
            _cfg(*bad, recipe=recipe)
        assert "\n" not in str(e.value)
    with pytest.raises(WeightSyncError, match="generator.engine=vllm"):
        get_transport("cuda_ipc", "vllm", engine="transformers")
    with pytest.raises(WeightSyncError, match="no transport object_store/vllm"):
        get_transport("object_store", "vllm")


class FakeVllmClient:
    """Stands in for vLLM's engine client: records the protocol and loads what the 'handles' hold."""

    def __init__(self, fail_at: int | None = None):
        self.calls: list[str] = []
        self.loaded: dict[str, torch.Tensor] = {}
        self.fail_at = fail_at

    async def start_weight_update(self):
        self.calls.append("start")

    async def update_weights(self, info):
        self.calls.append("update")
        if self.fail_at is not None and self.calls.count("update") == self.fail_at:
            raise RuntimeError("worker died")
        assert len(info["names"]) == len(info["dtype_names"]) == len(info["shapes"]) == len(info["ipc_handles"])
        for name, shape, handle in zip(info["names"], info["shapes"], info["ipc_handles"]):
            (tensor,) = handle.values()  # one GPU: the fake 'handle' is the tensor itself
            assert list(tensor.shape) == shape
            self.loaded[name] = tensor.clone()

    def finish_weight_update(self):
        self.calls.append("finish")


def _export(params):
    def export(bucket_mb, device=None):
        yield list(params.items())[:2]
        yield list(params.items())[2:]
    return export


def test_fake_vllm_ipc_sync_drives_start_update_finish_and_bumps_the_version():
    params = {f"w{i}": torch.randn(3, 4) for i in range(4)}
    sender = VllmIpcSender(_export(params), 1.0, share=lambda t: t, uuid="GPU-0")
    client = FakeVllmClient()
    receiver = VllmNativeReceiver(None, client)
    sender.start(3)
    got = asyncio.run(drive_bucketed_sync(sender.next_bucket, [receiver.receive]))
    assert got == 3 and receiver.version == 3
    assert client.calls == ["start", "update", "update", "finish"]
    assert all(torch.equal(client.loaded[n], t) for n, t in params.items())


def test_fake_vllm_failure_finishes_the_update_and_keeps_the_version():
    params = {f"w{i}": torch.randn(2) for i in range(4)}
    client = FakeVllmClient(fail_at=2)
    receiver = VllmNativeReceiver(None, client)
    aborted = []
    sender = VllmIpcSender(_export(params), 1.0, share=lambda t: t, uuid="GPU-0")
    sender.start(1)
    with pytest.raises(RuntimeError, match="worker died"):
        asyncio.run(drive_bucketed_sync(sender.next_bucket, [receiver.receive], abort=lambda: (aborted.append(1), sender.abort())))
    assert receiver.version is None and aborted and client.calls[-1] == "finish"
    client.fail_at = None  # the redo from chunk 0 completes
    sender.start(1)
    assert asyncio.run(drive_bucketed_sync(sender.next_bucket, [receiver.receive])) == 1


def test_fake_vllm_chunks_merge_handles_per_tensor_and_refuse_a_shared_gpu():
    params = {"a": torch.ones(2), "b": torch.zeros(3)}
    chunks = []
    for uuid in ("GPU-0", "GPU-1"):
        s = VllmIpcSender(lambda mb, device=None: iter([list(params.items())]), 1.0, share=lambda t: "h", uuid=uuid)
        s.start(0)
        chunks.append(s.next_bucket())
    merged = merge_vllm_chunks(chunks)
    assert isinstance(merged, VllmIpcChunk) and merged.update_info()["ipc_handles"] == [
        {"GPU-0": "h", "GPU-1": "h"}, {"GPU-0": "h", "GPU-1": "h"}]
    with pytest.raises(WeightSyncError, match="same GPU"):
        merge_vllm_chunks([chunks[0], chunks[0]])
    assert isinstance(get_transport("cuda_ipc", "vllm").merge_messages([SyncSummary(version=0, num_buckets=1, num_tensors=2,
                                                                           nbytes=20)] * 2), SyncSummary)


def test_fake_vllm_ipc_handles_are_rebuild_arguments_as_vllm_0_26_indexes_them(monkeypatch):
    """vLLM 0.26's IPCWeightTransferEngine sets index 6 (the device) of each handle and calls
    rebuild_cuda_tensor(*handle): a handle is reduce_tensor's arguments, not the (function, arguments)
    pair (a pair made the worker fail with "list assignment index out of range" on the H200)."""
    import torch.multiprocessing.reductions as reductions

    def rebuild(*args):
        raise AssertionError("a function must not travel")

    def fake_reduce_tensor(tensor):  # no GPU here: the shape of torch's answer for a CUDA tensor, 15 arguments
        return rebuild, (type(tensor), tensor.shape, tensor.stride(), 0, "storage", tensor.dtype, 3, b"handle",
                         tensor.numel() * tensor.element_size(), 0, False, b"ref", 0, b"event", True)

    monkeypatch.setattr(reductions, "reduce_tensor", fake_reduce_tensor)
    params = {"a": torch.ones(2, 3), "b": torch.zeros(4)}
    sender = VllmIpcSender(_export(params), 1.0, uuid="GPU-0")
    sender.start(1)
    chunk = sender.next_bucket()
    handles = chunk.update_info()["ipc_handles"]
    for (name, tensor), handle in zip(list(params.items())[:2], handles):
        args = list(handle["GPU-0"])  # what vLLM 0.26's receive_weights does with it
        assert not any(callable(a) and not isinstance(a, type) for a in args)
        assert args[6] == 3 and tuple(args[1]) == tuple(tensor.shape)
        args[6] = 0  # the worker's own device index: fits, as it did not with a (function, args) pair


def test_fan_out_names_the_ranks_of_each_step_and_a_missing_step_is_one_line():
    store, ipc, nccl = (get_transport(k) for k in ("object_store", "cuda_ipc", "nccl"))
    ranks = lambda t, op, zero=0: [(r, c.op) for r, c in t.fan_out(t.call(op), 4, zero)]  # noqa: E731
    assert ranks(store, "next") == [(0, "next")]                           # rank 0 alone sends
    assert ranks(store, "next", 3) == [(r, "next") for r in range(4)]      # ZeRO-3: every rank gathers
    assert ranks(store, "abort") == [(r, "abort") for r in range(4)]       # an abort reaches every rank
    assert ranks(ipc, "next") == [(r, "next") for r in range(4)]           # each rank its own GPU
    assert ranks(nccl, "send") == [(0, "send")]
    assert ranks(nccl, "send", 3) == [(0, "send")] + [(r, "export") for r in (1, 2, 3)]
    assert ranks(nccl, "listen", 3) == [(0, "listen")]
    for where, run in [("sender", lambda t: t.on_sender(None, t.call("fly"))),
                       ("worker", lambda t: t.on_worker(None, "fly"))]:
        for t in (store, ipc, nccl):
            with pytest.raises(WeightSyncError, match=f"no {where} step 'fly'") as e:
                run(t)
            assert "\n" not in str(e.value)


def test_fake_vllm_engine_gets_the_native_receiver_whose_client_inits_vllms_transfer_once(monkeypatch):
    """The receiver half the generator's end builds for a vLLM engine (`engine.llm` stands in for vLLM's
    AsyncLLM, a DeferredEngine's built engine too): init once, then start / update per chunk / finish."""
    from weights.vllm_native import VllmTransferClient

    monkeypatch.setattr(VllmTransferClient, "_request", staticmethod(lambda name, **fields: (name, fields)))

    class FakeAsyncLLM:
        def __init__(self):
            self.calls, self.loaded = [], {}

        async def init_weight_transfer_engine(self, request):
            self.calls.append(request[0])

        async def start_weight_update(self):
            self.calls.append("start")

        async def update_weights(self, request):
            self.calls.append(request[0])
            info = request[1]["update_info"]
            for name, handle in zip(info["names"], info["ipc_handles"]):
                self.loaded[name] = handle["GPU-0"].clone()

        async def finish_weight_update(self):
            self.calls.append("finish")

    llm = FakeAsyncLLM()
    deferred = type("Deferred", (), {"engine": type("VLLMEngine", (), {"llm": llm})()})()
    transport = get_transport("cuda_ipc", "vllm", engine="vllm")
    receiver = transport.make_receiver(None, deferred)
    params = {f"w{i}": torch.randn(3) for i in range(4)}
    for version in (1, 2):
        sender = VllmIpcSender(_export(params), 1.0, share=lambda t: t, uuid="GPU-0")
        sender.start(version)
        assert asyncio.run(drive_bucketed_sync(sender.next_bucket, [receiver.receive])) == version
    assert llm.calls == ["WeightTransferInitRequest"] + ["start", "WeightTransferUpdateRequest",
                                                         "WeightTransferUpdateRequest", "finish"] * 2
    assert all(torch.equal(llm.loaded[n], t) for n, t in params.items())
    with pytest.raises(WeightSyncError, match="needs the vLLM engine"):
        transport.make_receiver(None, object())
