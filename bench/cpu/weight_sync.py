"""Times a full weight sync (flatten, transport, load into the receiver's parameters) per transport.

    .venv/bin/python -m bench.cpu.weight_sync                       # ~100M params, fp32 and bf16, CPU
    .venv/bin/python -m bench.cpu.weight_sync --layers 28 --vocab 151936 --out docs/perf/weight_sync.md

The state dict is Qwen3-0.6B-shaped (hidden 1024, 16 q / 8 kv heads of 128, MLP 3072, tied head);
--layers and --vocab scale it. Each transport runs a warm-up sync, then --repeats timed syncs;
the table reports the median. Real Ray actors and real gloo processes, nothing simulated.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import weights as ws  # noqa: E402


def qwen3_like(layers: int, vocab: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    hidden, heads, kv_heads, head_dim, mlp = 1024, 16, 8, 128, 3072
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (mlp, hidden),
            p + "mlp.up_proj.weight": (mlp, hidden),
            p + "mlp.down_proj.weight": (hidden, mlp),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        })
    shapes["model.norm.weight"] = (hidden,)
    # torch.empty + a cheap fill: the bytes' values do not change the transport's speed
    return {n: torch.empty(s, dtype=dtype).fill_(0.5) for n, s in shapes.items()}


class Params:
    def __init__(self, like):
        self.params = {n: torch.zeros_like(t) for n, t in like.items()}

    def load_weights(self, named, version):
        for name, tensor in named:
            self.params[name].copy_(tensor)


def bench_object_store(args, dtype) -> list[float]:
    import ray

    @ray.remote
    class Learner:
        def __init__(self):
            self.weights = qwen3_like(args.layers, args.vocab, dtype)
            self.sender = ws.ObjectStoreSender(lambda mb: ws.iter_buckets(self.weights.items(), mb), args.bucket_mb)

        def start(self, version):
            self.sender.start(version)

        def next(self):
            return self.sender.next_bucket()

    @ray.remote
    class Generator:
        def __init__(self):
            self.model = Params(qwen3_like(args.layers, args.vocab, dtype))
            self.receiver = ws.ObjectStoreReceiver(self.model.load_weights)

        async def receive(self, message):
            return await self.receiver.receive(message)

    learner, generator = Learner.remote(), Generator.remote()
    times = []
    for version in range(args.repeats + 1):
        async def one():
            await learner.start.remote(version)
            t0 = time.perf_counter()
            await ws.drive_bucketed_sync(learner.next.remote, [generator.receive.remote])
            return time.perf_counter() - t0
        elapsed = asyncio.run(one())
        if version:
            times.append(elapsed)
    ray.kill(learner)
    ray.kill(generator)
    return times


def _gloo_sender(args, dtype, rdv_queue, results):
    torch.set_num_threads(1)
    weights = qwen3_like(args.layers, args.vocab, dtype)
    sender = ws.BroadcastSender(lambda mb: ws.iter_buckets(weights.items(), mb), args.bucket_mb,
                                backend="gloo", timeout_s=300)
    rdv_queue.put(sender.listen(2, host="127.0.0.1"))
    sender.init()
    times = []
    for version in range(args.repeats + 1):
        t0 = time.perf_counter()
        sender.send(version)
        if version:
            times.append(time.perf_counter() - t0)
    sender.close()
    results.put(times)


def _gloo_receiver(args, dtype, rdv_queue):
    torch.set_num_threads(1)
    model = Params(qwen3_like(args.layers, args.vocab, dtype))
    receiver = ws.BroadcastReceiver(model.load_weights)
    receiver.init(rdv_queue.get(), rank=1)
    for version in range(args.repeats + 1):
        asyncio.run(receiver.receive_all(version))
    receiver.close()


def bench_gloo(args, dtype) -> list[float]:
    ctx = mp.get_context("spawn")
    rdv_queue, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_gloo_sender, args=(args, dtype, rdv_queue, results)),
             ctx.Process(target=_gloo_receiver, args=(args, dtype, rdv_queue))]
    for p in procs:
        p.start()
    times = results.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--bucket-mb", type=float, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--transports", default="object_store,gloo")
    parser.add_argument("--out", default="", help="append the table to this markdown file")
    args = parser.parse_args()

    rows = []
    use_ray = "object_store" in args.transports.split(",")
    if use_ray:
        import ray
        temp_dir = tempfile.mkdtemp(prefix="ray-bench-", dir="/tmp")
        os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
        ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False,
                 object_store_memory=4 * 1024**3)
    try:
        for dname in args.dtypes.split(","):
            dtype = getattr(torch, dname)
            weights = qwen3_like(args.layers, args.vocab, dtype)
            nbytes = sum(t.numel() * t.element_size() for t in weights.values())
            nparams = sum(t.numel() for t in weights.values())
            buckets = sum(1 for _ in ws.iter_buckets(weights.items(), args.bucket_mb))
            del weights
            for transport in args.transports.split(","):
                times = bench_object_store(args, dtype) if transport == "object_store" else bench_gloo(args, dtype)
                med = statistics.median(times)
                rows.append((transport, dname, nparams, nbytes, buckets, med, nbytes / med / 1e9))
                print(f"{transport:12s} {dname:9s} {nparams / 1e6:7.1f}M params {nbytes / 1e9:6.3f} GB "
                      f"{buckets:3d} buckets  {med:7.3f} s  {nbytes / med / 1e9:6.3f} GB/s  (runs {times})", flush=True)
    finally:
        if use_ray:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)

    table = ["| transport | dtype | params | GB | buckets | median s | GB/s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    table += [f"| {t} | {d} | {p / 1e6:.1f}M | {b / 1e9:.3f} | {n} | {s:.3f} | {g:.3f} |" for t, d, p, b, n, s, g in rows]
    print("\n".join(table))
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\n## {datetime.date.today().isoformat()}, {os.cpu_count()}-core CPU (shared)\n\n")
            f.write(f"    .venv/bin/python -m bench.cpu.weight_sync {' '.join(sys.argv[1:])}\n\n")
            f.write(f"torch {torch.__version__}, bucket {args.bucket_mb} MiB, median of {args.repeats} "
                    f"timed syncs after one warm-up; time = flatten + transport + copy into the receiver's params.\n\n")
            f.write("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
