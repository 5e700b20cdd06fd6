"""One GPU: the colocated weight update INTO vLLM's worker, cycle after cycle, measured edge by edge.

    python -m bench.gpu.vllm_sync                       # H200: VLLMEngine + Learner (ZeRO-0, bf16, use_liger)
    ENGINE=transformers MODEL=smoke python -m bench.gpu.vllm_sync   # CPU: the same script's plumbing

A random-init Qwen3-0.6B-shaped model (built locally with bench.gpu.learner_kit's builder, nothing downloaded), a
VLLMEngine (its engine core and worker in their own process) and the project's Learner in this process,
on one GPU. Per cycle, the colocated step's edges in order: engine sleep(2) -> learner wake -> the
learner's log-probs of the engine's last samples (mismatch KL at that version) -> one train step ->
learner sleep -> engine wake(weights) -> CUDA-IPC weight sync into the vLLM worker through the worker
extension (the learner's bucket, merged as the learner group would, handles opened inside the worker)
-> wake(kv_cache) -> finish (allocator caches emptied, prefix cache reset, version) -> generate.
Each edge's seconds and the device memory after it (the whole device, the learner's allocator, the
vLLM worker's allocator). After cycle 1 the engine's new samples are also scored by the initial
weights (a transformers model of the checkpoint): the KL to the old weights must be far above the
KL to the learner's new weights.

The transport is the one factory's (weights.strategy): CUDA IPC on a GPU, the object store on CPU.
vLLM's own weight transfer (vllm.distributed.weight_transfer) was measured against it here (SYNC=compare,
issue 23: 3.1x slower per sync at equal memory on the H200, docs/perf/weight_sync.md) and removed.

Env: ENGINE (vllm|transformers), MODEL (0.6B|smoke), CYCLES (5), SYNC (ipc|bytes: the plain-bytes path), LR (1e-3:
one Adam step visibly moves a random model), BUCKET_MB (512), GPU_UTIL (0.3), OUT (results dir; $OUT on the device).
Results: $OUT/gpu_vllm_sync.json and a table on stdout.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

ENGINE = os.environ.get("ENGINE", "vllm")
MODEL = os.environ.get("MODEL", "0.6B")
CYCLES = int(os.environ.get("CYCLES", "5"))
LR = float(os.environ.get("LR", "1e-3"))
BUCKET_MB = float(os.environ.get("BUCKET_MB", "512"))
GPU_UTIL = float(os.environ.get("GPU_UTIL", "0.3"))
SYNC = os.environ.get("SYNC", "ipc")  # ipc: the colocated transport (weights.ipc); bytes: engine.load_weights
SYNCS = ("ipc", "bytes")
OUT = os.environ.get("OUT") or "/tmp/arl_gpu_vllm_sync"
PROMPT_LEN, MAX_TOKENS, N = (200, 64, 8) if MODEL != "smoke" else (20, 8, 4)


def log(*a):
    print(*a, flush=True)


def kl_stats(engine_lps, ref_lps) -> dict:
    """Over the engine's sampled tokens: mean/max |diff| and KL(engine || ref) estimates (k1, k3)."""
    import torch

    e = torch.cat([torch.as_tensor(x, dtype=torch.float64) for x in engine_lps])
    r = torch.cat([torch.as_tensor(x, dtype=torch.float64) for x in ref_lps])
    d = e - r
    return dict(tokens=int(e.numel()), mean_abs=round(float(d.abs().mean()), 5), max_abs=round(float(d.abs().max()), 4),
                kl_k1=round(float(d.mean()), 6), kl_k3=round(float((torch.exp(-d) - 1 + d).mean()), 6))


def make_batch(prompt, comps, lps, step: int, mb_tokens: int):
    import numpy as np

    from policies.packing import plan_micro_batches
    from queues.messages import TrainBatch, TrainGroup, pack_floats, pack_ids

    rewards = np.array([float(i % 2) for i in range(len(comps))])
    adv = ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).tolist()
    tg = TrainGroup(prompt_id="q0", prompt_tokens=pack_ids(prompt), completions=[pack_ids(c) for c in comps],
                    gen_logprobs=[pack_floats(np.array(x, dtype="float32")) for x in lps], advantages=adv,
                    rewards=rewards.tolist(), policy_version=step)
    lengths = [len(prompt) + len(c) for c in comps]
    plan = plan_micro_batches(lengths, mb_tokens)
    return TrainBatch(step=step, policy_version=step, groups=[tg], micro_batches=[[(0, i) for i in mb] for mb in plan],
                      minibatches=[list(range(len(plan)))], num_tokens=sum(lengths))


def teacher_logprobs(model, prompt, comps, device) -> list:
    """Per-token log-probs of each completion under a plain transformers model (temperature 1)."""
    import torch

    out = []
    with torch.no_grad():
        for c in comps:
            ids = torch.tensor([list(prompt) + list(c)], device=device)
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
            lp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
            out.append(lp.cpu())
    return out


class Probe:
    """Seconds and memory at every edge, in order."""

    def __init__(self, engine, cuda: bool):
        self.engine, self.cuda, self.rows = engine, cuda, []

    async def memory(self) -> dict:
        import torch

        if not self.cuda:
            return {}
        free, total = torch.cuda.mem_get_info()
        m = dict(device_used_gib=round((total - free) / 2**30, 3),
                 learner_alloc_gib=round(torch.cuda.memory_allocated() / 2**30, 3),
                 learner_reserved_gib=round(torch.cuda.memory_reserved() / 2**30, 3))
        llm = getattr(self.engine, "llm", None)
        if llm is not None:
            w = (await llm.collective_rpc(method="arl_memory", timeout=60, args=()))[0]
            m.update(worker_alloc_gib=round(w.get("allocated_gib", 0), 3), worker_reserved_gib=round(w.get("reserved_gib", 0), 3))
        return m

    async def edge(self, cycle: int, name: str, started: float, **extra) -> dict:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        row = dict(cycle=cycle, edge=name, s=round(time.perf_counter() - started, 4), **extra, **(await self.memory()))
        self.rows.append(row)
        log(json.dumps(row))
        return row


async def generate(engine, prompt, version: int):
    from queues.messages import PromptTask, pack_ids, unpack_floats, unpack_ids

    sampled = PromptTask(task_id=f"{version}:0", prompt_id="q0", step=version, policy_version=version,
                         prompt_tokens=pack_ids(prompt), n=N, sampling=dict(max_tokens=MAX_TOKENS, temperature=1.0))
    greedy = PromptTask(task_id=f"{version}:1", prompt_id="q1", step=version, policy_version=version,
                        prompt_tokens=pack_ids(prompt), n=1, sampling=dict(max_tokens=32 if MODEL != "smoke" else 6,
                                                                           temperature=0.0))
    gs, gg = await asyncio.gather(engine.generate(sampled), engine.generate(greedy))
    comps = [unpack_ids(s.tokens).tolist() for s in gs.samples]
    lps = [unpack_floats(s.logprobs).tolist() for s in gs.samples]
    assert gs.policy_version == version and not gs.error, (gs.policy_version, gs.error)
    return comps, lps, unpack_ids(gg.samples[0].tokens).tolist()


async def sync(engine, learner, version: int, cuda: bool) -> dict:
    """The colocated transport from the one factory: CUDA IPC on a GPU, the object store's plain path on CPU
    (SYNC=bytes: the tensors through engine.load_weights)."""
    from weights import SyncSummary
    from weights.strategy import get_transport

    in_workers = engine if engine.loads_in_workers else None
    if SYNC == "bytes":  # what VLLM.md's 2.6 GiB came from: bytes through the RPC, staged on the worker's GPU
        n = nbytes = buckets = 0
        for bucket in learner.export_weights(BUCKET_MB, device="cpu"):
            await engine.load_weights(bucket, version)
            n, buckets = n + len(bucket), buckets + 1
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        return dict(buckets=buckets, tensors=n, gib=round(nbytes / 2**30, 3), path="bytes")
    transport = get_transport("cuda_ipc" if cuda else "object_store")
    if cuda:
        sender = transport.make_sender(learner.export_weights, BUCKET_MB, device="cuda")
    else:
        from weights import ObjectStoreSender

        sender = ObjectStoreSender(lambda mb: learner.export_weights(mb, device="cpu"), BUCKET_MB, put=lambda p: p)
    receiver = transport.make_receiver(engine.load_weights, in_workers)
    sender.start(version)
    while True:
        message = transport.merge_messages([sender.next_bucket()])  # what the learner group sends, one rank here
        got = await receiver.receive(message)
        if isinstance(message, SyncSummary):
            sender.abort()
            assert got == version, (got, version)
            return dict(buckets=message.num_buckets, tensors=message.num_tensors, gib=round(message.nbytes / 2**30, 3))


async def main() -> dict:
    import torch

    from bench.gpu.learner_kit import build_model_dir, make_learner
    from config import GeneratorConfig, ModelConfig

    if SYNC not in SYNCS:
        raise SystemExit(f"SYNC={SYNC!r}: one of {list(SYNCS)}")
    if ENGINE == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise SystemExit(f"bench.gpu.vllm_sync: vLLM is not importable here ({e}); SYNC={SYNC} needs it "
                             "(the H200 with shared/gpu/vllm-site.sh)") from None
    cuda = torch.cuda.is_available()
    # This process also trains (CUDA in use here): vLLM's engine-core process must be spawned, not forked.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.makedirs(OUT, exist_ok=True)
    res = dict(engine=ENGINE, model=MODEL, sync=SYNC, cycles=CYCLES, lr=LR, bucket_mb=BUCKET_MB, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    mdir = build_model_dir(MODEL)  # on a GPU run it first in its own process: vLLM wants CUDA untouched here
    gcfg = GeneratorConfig(engine=ENGINE, gpu_memory_utilization=GPU_UTIL, max_tokens=MAX_TOKENS, enforce_eager=True,
                           n_samples=N, temperature=1.0, device="cuda" if cuda else "cpu")
    mcfg = ModelConfig(path=mdir, dtype="bfloat16" if cuda else "float32")
    t = time.perf_counter()
    from actors.engines.registry import make_engine

    engine = make_engine(gcfg, mcfg, mdir)
    probe = Probe(engine, cuda)
    if ENGINE == "vllm":
        import vllm

        res["vllm"] = vllm.__version__
        res["flashinfer_sampler"] = os.environ.get("VLLM_USE_FLASHINFER_SAMPLER")
    await probe.edge(0, "engine_start", t)
    if cuda:
        res["card"] = torch.cuda.get_device_name()
        res["torch"] = torch.__version__
    t = time.perf_counter()
    learner, info = make_learner(MODEL, 0, "sdpa", "lk" if cuda else "plain", 16384, lr=LR, gc=True,
                                 offload_optimizer=True)
    learner.sleep()
    await probe.edge(0, "learner_init_and_sleep", t, attn=info.get("attn_implementation"),
                     liger=info.get("liger_kernels_applied"))

    import numpy as np

    vocab = int(getattr(engine, "vocab_size", None) or 512)
    prompt = np.random.default_rng(5).integers(1, vocab, PROMPT_LEN).tolist()
    t = time.perf_counter()
    comps, lps, greedy = await generate(engine, prompt, 0)
    first = await probe.edge(0, "generate", t, tokens=sum(map(len, comps)))
    res["greedy_v0"] = greedy[:16]
    kls = []
    for cycle in range(1, CYCLES + 1):
        t = time.perf_counter()
        await engine.sleep(2)
        await probe.edge(cycle, "engine_sleep2", t)
        t = time.perf_counter()
        learner.wake()
        await probe.edge(cycle, "learner_wake", t)
        t = time.perf_counter()
        learner_lps = learner.logprobs([(prompt, c) for c in comps])
        kl = kl_stats(lps, learner_lps)
        kls.append(dict(version=cycle - 1, **kl))
        await probe.edge(cycle, "learner_logprobs", t, mismatch=kl)
        t = time.perf_counter()
        metrics = learner.train_step(make_batch(prompt, comps, lps, cycle - 1, 16384))
        peak = round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None
        await probe.edge(cycle, "train_step", t, loss=round(float(metrics.get("loss", 0)), 5), learner_peak_gib=peak)
        t = time.perf_counter()
        learner.sleep()
        await probe.edge(cycle, "learner_sleep", t)
        t = time.perf_counter()
        await engine.wake(["weights"])
        await probe.edge(cycle, "engine_wake_weights", t)
        t = time.perf_counter()
        summary = await sync(engine, learner, cycle, cuda)
        await probe.edge(cycle, "weight_sync", t, **summary)
        t = time.perf_counter()
        await engine.wake(["kv_cache"])
        await probe.edge(cycle, "engine_wake_kv", t)
        t = time.perf_counter()
        await engine.finish_weight_update(cycle)
        await probe.edge(cycle, "finish_update", t)
        old_greedy = greedy
        t = time.perf_counter()
        comps, lps, greedy = await generate(engine, prompt, cycle)
        await probe.edge(cycle, "generate", t, tokens=sum(map(len, comps)), greedy_changed=greedy != old_greedy)
        if cycle == 1:  # the new samples under the initial weights: far from them, close to the learner's
            from transformers import AutoModelForCausalLM

            ref = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.bfloat16 if cuda else torch.float32).to(
                "cuda" if cuda else "cpu")
            res["v1_samples_vs_initial_weights"] = kl_stats(lps, teacher_logprobs(ref, prompt, comps, ref.device))
            del ref
            if cuda:
                torch.cuda.empty_cache()
    learner.wake()
    kls.append(dict(version=CYCLES, **kl_stats(lps, learner.logprobs([(prompt, c) for c in comps]))))
    res["mismatch_by_version"] = kls
    res["edges"] = probe.rows
    used = [r["device_used_gib"] for r in probe.rows if r["edge"] == "generate" and "device_used_gib" in r]
    if used:
        res["device_used_after_generate_gib"] = used
        res["growth_vs_first_cycle_gib"] = round(max(used[1:]) - used[1], 3) if len(used) > 1 else 0.0
        res["growth_vs_startup_gib"] = round(max(used) - first["device_used_gib"], 3)
    await engine.close()
    with open(os.path.join(OUT, f"gpu_vllm_sync_{SYNC}.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


def table(res: dict) -> str:
    lines = ["| cycle | edge | s | device GiB | learner alloc/reserved | worker alloc/reserved | note |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["edges"]:
        note = {k: v for k, v in r.items() if k in ("mismatch", "gib", "buckets", "loss", "tokens", "greedy_changed",
                                                    "learner_peak_gib")}
        lines.append(f"| {r['cycle']} | {r['edge']} | {r['s']} | {r.get('device_used_gib', '')} | "
                     f"{r.get('learner_alloc_gib', '')}/{r.get('learner_reserved_gib', '')} | "
                     f"{r.get('worker_alloc_gib', '')}/{r.get('worker_reserved_gib', '')} | {note or ''} |")
    return "\n".join(lines)


if __name__ == "__main__":
    result = asyncio.run(main())
    log(table(result))
    log(json.dumps({k: v for k, v in result.items() if k != "edges"}, indent=1))
