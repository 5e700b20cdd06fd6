"""Weight sync: pure flatten/plan pieces, gloo broadcast between real processes, the Ray object store."""
from __future__ import annotations

import asyncio
import datetime
import io
import os
import queue as queue_mod
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

import weights as ws
from tests.net import free_port, listening_on
from tests.weightsets import BUCKET_MB, make_weights


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def assert_same(sent: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(sent)
    for name in sent:
        assert same_bits(sent[name], got[name]), name


class Model:
    """A receiver-side model: zero parameters of the right shapes, load_weights copies in."""

    def __init__(self, like: dict[str, torch.Tensor]):
        self.params = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in like.items()}
        self.loads: list[int] = []

    async def load_weights(self, named, version):
        for name, tensor in named:
            self.params[name].copy_(tensor)
        self.loads.append(version)


# ----------------------------------------------------------------------------- pure


def test_flatten_unflatten_and_payload_round_trip_bit_exact():
    weights = make_weights(0)
    named = list(weights.items())
    plan, buffers = ws.flatten_bucket(named, version=3, index=0)
    assert set(buffers) == {"float32", "bfloat16", "float16", "int64", "bool"}  # one buffer per dtype
    assert all(b.dtype == torch.uint8 and b.is_contiguous() for b in buffers.values())
    plan = ws.decode_message(ws.encode_message(plan))  # the header survives the wire
    ws.validate_plan(plan, ws.expected_from_named(named))
    assert_same(weights, dict(ws.unflatten_bucket(plan, buffers)))

    # the object-store payload: numpy uint8 arrays + encoded plan, read back as views
    payload = ws.bucket_to_payload(named, version=3, index=0)
    back_plan, back = ws.payload_to_tensors(payload)
    assert (back_plan.version, back_plan.index) == (3, 0)
    assert_same(weights, dict(back))

    # flat buffers are copies: changing the source afterwards does not change what was sent
    weights["embed.weight"].add_(1)
    assert not same_bits(weights["embed.weight"], dict(back)["embed.weight"])


def test_iter_buckets_bounds_each_bucket_and_keeps_order():
    weights = make_weights(1)
    bucket_mb = 30_000 / ws.MB
    buckets = list(ws.iter_buckets(weights.items(), bucket_mb))
    assert len(buckets) >= 3
    assert [n for b in buckets for n, _ in b] == list(weights)
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= 30_000 or len(bucket) == 1  # an oversized tensor travels alone
    with pytest.raises(ws.WeightSyncError, match="bucket_mb"):
        list(ws.iter_buckets(weights.items(), 0))


def test_wrong_shape_or_dtype_in_header_is_a_clear_error():
    weights = make_weights(2)
    expected = ws.expected_from_named(weights.items())
    plan, buffers = ws.flatten_bucket(list(make_weights(2, odd_shape=True).items()), version=5, index=1)
    with pytest.raises(ws.WeightSyncError,
                       match=r"v5 bucket 1: tensor 'layers.1.mlp.weight' arrives as shape \[131, 63\] float32, "
                             r"the model holds shape \[131, 64\] float32"):
        ws.validate_plan(plan, expected)

    bf = dict(weights)
    bf["embed.weight"] = bf["embed.weight"].to(torch.float16)
    plan, _ = ws.flatten_bucket(list(bf.items()), version=5, index=0)
    with pytest.raises(ws.WeightSyncError, match="'embed.weight' arrives as .* float16, the model holds .* float32"):
        ws.validate_plan(plan, expected)

    plan, _ = ws.flatten_bucket([("extra", torch.zeros(2))], version=5, index=0)
    with pytest.raises(ws.WeightSyncError, match="'extra' is not a parameter"):
        ws.validate_plan(plan, expected)

    # a header whose offsets run past its buffer, or an unknown dtype, is refused before any copy
    good, _ = ws.flatten_bucket([("a", torch.zeros(4)), ("b", torch.zeros(4))], version=1, index=0)
    bad = ws.BucketPlan(version=1, index=0, tensors=[good.tensors[0], ws.TensorMeta("b", (5,), "float32", 4)],
                        buffer_nbytes=good.buffer_nbytes)
    with pytest.raises(ws.WeightSyncError, match="'b' .* runs past its 32-byte buffer"):
        ws.validate_plan(bad)
    bad = ws.BucketPlan(version=1, index=0, tensors=[ws.TensorMeta("a", (4,), "complex32", 0)],
                        buffer_nbytes={"complex32": 16})
    with pytest.raises(ws.WeightSyncError, match="unknown dtype 'complex32'"):
        ws.validate_plan(bad)
    with pytest.raises(ws.WeightSyncError, match="schema 99"):
        ws.decode_message(ws.encode_message(ws.SyncSummary(schema=99, version=1, num_buckets=0, num_tensors=0, nbytes=0)))


def test_object_store_protocol_without_ray_and_partial_sync_keeps_version():
    weights = make_weights(3)
    exported_buckets = []

    def export_weights(bucket_mb):
        for bucket in ws.iter_buckets(weights.items(), bucket_mb):
            exported_buckets.append(len(bucket))
            yield bucket

    sender = ws.ObjectStoreSender(export_weights, bucket_mb=30_000 / ws.MB, put=lambda payload: payload)
    model = Model(weights)
    receiver = ws.ObjectStoreReceiver(model.load_weights, expected=ws.expected_from_named(weights.items()),
                                      get=lambda ref: ref)
    sender.start(1)
    version = asyncio.run(ws.drive_bucketed_sync(sender.next_bucket, [receiver.receive], abort=sender.abort))
    assert version == 1 and receiver.version == 1
    assert len(exported_buckets) >= 3 and model.loads == [1] * len(exported_buckets)
    assert_same(weights, model.params)

    # v2 loses its second bucket on the way: the receiver refuses to finish and stays at v1
    sender.start(2)
    first = sender.next_bucket()
    sender.next_bucket()  # dropped
    asyncio.run(receiver.receive(first))
    rest = []
    while not isinstance(message := sender.next_bucket(), ws.SyncSummary):
        rest.append(message)
    with pytest.raises(ws.WeightSyncError, match="bucket 2 arrived, bucket 1 was expected"):
        asyncio.run(receiver.receive(rest[0]))
    with pytest.raises(ws.WeightSyncError, match="v2 incomplete"):
        asyncio.run(receiver.receive(message))
    assert receiver.version == 1

    # and a header that does not match the model fails the sync, the version still unchanged
    odd = make_weights(3, odd_shape=True)
    sender = ws.ObjectStoreSender(lambda mb: ws.iter_buckets(odd.items(), mb), 30_000 / ws.MB, put=lambda p: p)
    sender.start(3)
    with pytest.raises(ws.WeightSyncError, match="'layers.1.mlp.weight' arrives as shape"):
        asyncio.run(ws.drive_bucketed_sync(sender.next_bucket, [receiver.receive], abort=sender.abort))
    assert receiver.version == 1 and sender._buckets is None  # abort released the sender


# ----------------------------------------------------------------------------- gloo, two processes


def _to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    # plain bytes through the result queue: shared-memory tensors would die with this process
    buf = io.BytesIO()
    torch.save(tensors, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(data))


def _sender_main(rdv_queue, results):
    import torch.distributed as dist

    try:
        calls = []

        def export_weights(bucket_mb):
            version = calls[-1]
            yield from ws.iter_buckets(make_weights(version, odd_shape=(version == 2)).items(), bucket_mb)

        sender = ws.BroadcastSender(export_weights, BUCKET_MB, backend="gloo", timeout_s=20)
        rdv = sender.listen(world_size=2, host="127.0.0.1")
        rdv_queue.put(rdv)
        sender.init()
        out = {"default_initialized": dist.is_initialized()}
        for version in (1, 2, 3):
            calls.append(version)
            try:
                out[version] = sender.send(version).num_buckets
            except ws.WeightSyncError as exc:
                out[version] = f"error: {exc}"
        out["default_initialized_after"] = dist.is_initialized()
        sender.close()
        results.put(("sender", out))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put(("sender", f"crash at v{calls[-1] if calls else None}: {exc!r}"))


def _receiver_main(rdv_queue, results, default_port):
    import torch.distributed as dist

    try:
        # This process runs its own default group (as a DeepSpeed/vLLM process would) all along.
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{default_port}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        model = Model(make_weights(1))
        receiver = ws.BroadcastReceiver(model.load_weights, expected=ws.expected_from_named(model.params.items()))
        receiver.init(rdv_queue.get(timeout=60), rank=1)
        out = {}
        for version in (1, 2, 3):
            out["at"] = version
            try:
                out[version] = asyncio.run(receiver.receive_all(version))
            except ws.WeightSyncError as exc:
                out[version] = f"error: {exc}"
            out[f"version_after_{version}"] = receiver.version
            if version == 1:
                out["params_v1"] = _to_bytes(model.params)
        out["params_v3"] = _to_bytes(model.params)
        probe = torch.ones(1)
        dist.all_reduce(probe)  # the default group still works, and is still a world of one
        out["default_world"] = (dist.get_world_size(), probe.item())
        receiver.close()
        dist.destroy_process_group()
        results.put(("receiver", out))
    except BaseException as exc:  # noqa: BLE001
        results.put(("receiver", f"crash at v{locals().get('version')}: {exc!r}"))


@pytest.fixture(scope="module")
def gloo_run():
    ctx = mp.get_context("spawn")
    rdv_queue, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_sender_main, args=(rdv_queue, results)),
             ctx.Process(target=_receiver_main, args=(rdv_queue, results, free_port()))]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in procs:
            who, value = results.get(timeout=90)
            out[who] = value
    except queue_mod.Empty:
        pytest.fail(f"weight-sync processes hung; got only {list(out)}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    crashes = {who: value for who, value in out.items() if isinstance(value, str)}
    assert not crashes, crashes
    return out


def test_gloo_broadcast_is_bit_exact_over_several_buckets(gloo_run):
    sender, receiver = gloo_run["sender"], gloo_run["receiver"]
    assert sender[1] >= 3  # the bucket plan really split the weights
    assert receiver[1] == 1 and receiver["version_after_1"] == 1
    assert_same(make_weights(1), _from_bytes(receiver["params_v1"]))
    assert receiver[3] == 3 and isinstance(sender[3], int)
    assert_same(make_weights(3), _from_bytes(receiver["params_v3"]))


def test_gloo_group_leaves_the_default_group_alone(gloo_run):
    assert gloo_run["sender"]["default_initialized"] is False
    assert gloo_run["sender"]["default_initialized_after"] is False
    assert gloo_run["receiver"]["default_world"] == (1, 1.0)


def test_gloo_wrong_shape_fails_both_sides_clearly_without_bumping_the_version(gloo_run):
    sender, receiver = gloo_run["sender"], gloo_run["receiver"]
    message = "'layers.1.mlp.weight' arrives as shape [131, 63] float32, the model holds shape [131, 64] float32"
    assert receiver[2].startswith("error: ") and message in receiver[2]
    assert sender[2].startswith("error: ") and "receiver rank 1" in sender[2] and message in sender[2]
    assert receiver["version_after_2"] == 1  # the failed v2 did not count
    assert receiver["version_after_3"] == 3  # and the group was still usable for v3


# ----------------------------------------------------------------------------- Ray object store


def test_object_store_sync_between_two_ray_actors(local_ray):
    ray = local_ray

    @ray.remote
    class Learner:
        def __init__(self):
            self.weights = make_weights(4)
            self.sender = ws.ObjectStoreSender(lambda mb: ws.iter_buckets(self.weights.items(), mb), BUCKET_MB)

        def weight_sync_start(self, version):
            self.sender.start(version)

        def weight_sync_next(self):
            return self.sender.next_bucket()

        def weight_sync_abort(self):
            self.sender.abort()

    @ray.remote
    class Generator:
        def __init__(self):
            self.model = Model(make_weights(4))
            self.receiver = ws.ObjectStoreReceiver(self.model.load_weights,
                                                   expected=ws.expected_from_named(self.model.params.items()))

        async def weight_sync_receive(self, message):
            return await self.receiver.receive(message)

        def state(self):
            return self.receiver.version, len(self.model.loads), self.model.params

    learner, generator = Learner.remote(), Generator.remote()

    async def coordinate():
        await learner.weight_sync_start.remote(7)
        return await ws.drive_bucketed_sync(learner.weight_sync_next.remote, [generator.weight_sync_receive.remote],
                                            abort=learner.weight_sync_abort.remote)

    assert asyncio.run(coordinate()) == 7
    version, loads, params = ray.get(generator.state.remote())
    assert version == 7 and loads >= 3
    assert_same(make_weights(4), params)


def test_broadcast_store_listens_on_the_rendezvous_host_alone():
    """torch's TCPStore server binds every interface by itself; the sender hands it a loopback socket."""

    sender = ws.BroadcastSender(lambda mb: iter(()), 1, backend="gloo")
    rdv = sender.listen(2, host="127.0.0.1")
    try:
        mine = [a for a in listening_on({os.getpid()}) if a.endswith(f":{rdv.port}")]
        assert mine == [f"0100007F:{rdv.port}"], mine  # 127.0.0.1 as /proc/net/tcp writes it
    finally:
        sender.close()
    assert not [a for a in listening_on({os.getpid()}) if a.endswith(f":{rdv.port}")]  # closed with the sender


def _receiver_that_joins_then_waits(rdv_queue, joined):
    receiver = ws.BroadcastReceiver(lambda named, version: None)
    receiver.init(rdv_queue.get(timeout=60), rank=1)
    joined.set()
    time.sleep(600)  # killed by the test before any receive


def test_send_to_a_dead_receiver_ends_when_the_group_is_closed_not_at_its_timeout():
    """A generator killed mid-sync: the learner's send waits for its ack. The coordinator replaces
    the group (the nccl transport's `listen` step closes the old sender): that send must end within seconds, not
    hold its thread for the group timeout (600 s here, as in a run)."""
    ctx = mp.get_context("spawn")
    rdv_queue, joined = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_receiver_that_joins_then_waits, args=(rdv_queue, joined))
    proc.start()
    try:
        sender = ws.BroadcastSender(lambda mb: ws.iter_buckets(make_weights(1).items(), mb), BUCKET_MB,
                                    backend="gloo", timeout_s=600)
        rdv_queue.put(sender.listen(world_size=2, host="127.0.0.1"))
        sender.init()
        assert joined.wait(60)
        proc.kill()
        proc.join(10)
        outcome = {}

        def send():
            try:
                sender.send(1)
                outcome["result"] = "returned"
            except Exception as exc:  # noqa: BLE001 - reported to the test
                outcome["result"] = exc

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        thread.join(3)
        assert thread.is_alive(), outcome  # still waiting for the dead rank's ack
        start = time.monotonic()
        sender.close()
        thread.join(15)
        assert not thread.is_alive(), "send still blocked after close()"
        # It fails (the broadcast's own error: the peer closed its connection), and at once.
        assert isinstance(outcome["result"], RuntimeError) and time.monotonic() - start < 5, outcome
    finally:
        if proc.is_alive():
            proc.kill()


def test_group_layout_gives_a_tensor_parallel_engine_consecutive_ranks():
    """nccl: the learner is rank 0; a TP-4 vLLM engine's 4 workers take 4 consecutive ranks (the
    coordinator used to give every generator one rank, which a TP engine's workers overflow)."""
    from weights import group_layout

    assert group_layout([1, 1]) == ([1, 2], 3)
    assert group_layout([4, 4, 1]) == ([1, 5, 9], 10)
    with pytest.raises(ValueError, match="generator 1 asks for 0 ranks"):
        group_layout([2, 0])
