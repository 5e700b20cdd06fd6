"""H200 bench, the colocated half: sleep/train/sync handshake with CUDA-IPC weight sync between two
processes on one GPU (a learner and a TransformersEngine generator), checked bit for bit.

Run through bench/gpu/learner.py (`MODE=colo python -m bench.gpu.learner`), which starts this module as its
`--colo` child (`python -m bench.gpu.learner_colo --colo <spec>`, one ROW line out): h200 never imports it.
Invariants: every wait on the generator process is bounded, and ends at once when it exits; the engine's
weights after a sync have the learner's exact bits (`fingerprint` on both sides).
"""
from __future__ import annotations

import time

from bench.gpu.learner_kit import LENS, SHAPES, SMOKE, build_model_dir, make_learner


def _engine_child(model_dir: str, cmd_q, res_q, device: str, expected_names_only: bool = False):
    """Generator process: TransformersEngine + a CUDA-IPC receiver, driven by (cmd, arg) messages."""
    import asyncio

    import torch

    from actors.engines.hf import TransformersEngine
    from config import GeneratorConfig, ModelConfig

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    gcfg = GeneratorConfig(engine="transformers", device=device, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=64,
                           stop=[], seed=0, max_batch_prompts=16)
    mcfg = ModelConfig(dtype="bfloat16", attn_implementation="sdpa")
    cuda = device.startswith("cuda")

    def mem():
        if not cuda:
            return {}
        free, total = torch.cuda.mem_get_info()
        return dict(alloc_gib=round(torch.cuda.memory_allocated() / 2**30, 3),
                    reserved_gib=round(torch.cuda.memory_reserved() / 2**30, 3),
                    device_used_gib=round((total - free) / 2**30, 3))

    t = time.perf_counter()
    engine = TransformersEngine(gcfg, mcfg, model_dir)
    from weights import CudaIpcReceiver, expected_from_named

    expected = expected_from_named(engine.model.named_parameters())
    receiver = CudaIpcReceiver(engine.load_weights, expected=expected) if cuda else None
    res_q.put(("ready", dict(init_s=round(time.perf_counter() - t, 2), mem=mem())))
    while True:
        cmd, arg = cmd_q.get()
        t = time.perf_counter()
        try:
            if cmd == "stop":
                res_q.put(("ok", {}))
                break
            if cmd == "generate":
                groups = loop.run_until_complete(asyncio.gather(*(engine.generate(task) for task in arg)))
                if cuda:
                    torch.cuda.synchronize()
                from queues.messages import unpack_floats, unpack_ids

                out = [[(unpack_ids(s.tokens).tolist(), unpack_floats(s.logprobs).tolist()) for s in g.samples]
                       for g in groups]
                val = dict(groups=out, versions=[g.policy_version for g in groups])
            elif cmd == "sleep":
                before = mem()
                loop.run_until_complete(engine.sleep(arg))
                val = dict(before=before, after=mem())
            elif cmd == "wake":
                before = mem()
                loop.run_until_complete(engine.wake(arg))
                val = dict(before=before, after=mem())
            elif cmd == "ipc":
                v = loop.run_until_complete(receiver.receive(arg))
                val = dict(version=v)
            elif cmd == "load":  # CPU smoke only: named CPU tensors through the queue
                loop.run_until_complete(engine.load_weights(arg[0], arg[1]))
                val = {}
            elif cmd == "finish":
                loop.run_until_complete(engine.finish_weight_update(arg))
                val = dict(version=engine.version, mem=mem())
            elif cmd == "fingerprint":
                val = dict(fp=fingerprint(engine.model.named_parameters()))
            elif cmd == "teacher":  # teacher-forced log-probs of (prompt, completion) with the engine's weights
                prompt, comp = arg
                ids = torch.tensor([list(prompt) + list(comp)], device=engine.device)
                with torch.no_grad():
                    logits = engine.model(input_ids=ids, use_cache=False).logits[0].float()
                lp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
                val = dict(lp=lp.tolist())
            else:
                raise ValueError(cmd)
            val["s"] = round(time.perf_counter() - t, 4)
            res_q.put(("ok", val))
        except Exception as e:  # noqa: BLE001 - reported to the parent
            import traceback

            res_q.put(("error", f"{cmd}: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


def fingerprint(named) -> dict:
    """Bitwise fingerprint of bf16 weights: per-tensor int64 sum of the raw 16-bit words, summed with
    position weights, plus the count of tensors. Equal on both sides <=> (practically) identical bits."""
    import torch

    total, n, numel = 0, 0, 0
    for i, (name, p) in enumerate(sorted(named, key=lambda x: x[0])):
        w = p.detach().contiguous().view(torch.int16).to(torch.int64)
        s = int(w.sum()) + 7 * int((w * (torch.arange(w.numel(), device=w.device).view(w.shape) % 1009)).sum())
        total = (total * 1000003 + s) % (1 << 61)
        n += 1
        numel += p.numel()
    return dict(hash=total, tensors=n, numel=numel)


def run_colo(spec: dict) -> dict:
    import torch
    import torch.multiprocessing as mp

    from policies.packing import plan_micro_batches
    from queues.messages import PromptTask, TrainBatch, TrainGroup, pack_floats, pack_ids

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model = spec["model"]
    mdir = build_model_dir(model)
    kw = SHAPES[model]
    res = dict(model=model, zero=spec["zero"], attn=spec["attn"], path=spec["path"], phases={}, mem={})
    ph, memr = res["phases"], res["mem"]

    def dev_mem():
        if not cuda:
            return {}
        free, total = torch.cuda.mem_get_info()
        return dict(learner_alloc_gib=round(torch.cuda.memory_allocated() / 2**30, 3),
                    device_used_gib=round((total - free) / 2**30, 3))

    ctx = mp.get_context("spawn")
    cmd_q, res_q = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_engine_child, args=(mdir, cmd_q, res_q, device), daemon=True)
    t = time.perf_counter()
    child.start()

    def answer(timeout):
        """The engine process's next answer, within `timeout`; its exit ends the wait at once."""
        import queue

        deadline = time.monotonic() + timeout
        while True:
            try:
                return res_q.get(timeout=1.0)
            except queue.Empty:
                if not child.is_alive():
                    raise RuntimeError(f"engine process exited (code {child.exitcode}) without an answer") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"engine process: no answer within {timeout} s") from None

    def call(cmd, arg=None, timeout=600):
        cmd_q.put((cmd, arg))
        status, val = answer(timeout)
        if status == "error":
            raise RuntimeError(f"engine process: {val}")
        return val

    st, ready = answer(600)
    if st != "ready":
        raise RuntimeError(ready)
    ph["engine_init_s"] = round(time.perf_counter() - t, 2)
    memr["engine_ready"] = ready["mem"]
    learner, info = make_learner(model, spec["zero"], spec["attn"], spec["path"], spec["mb_tokens"], lr=spec.get("lr", 1e-4),
                                 gc=spec.get("gc", True), offload_optimizer=spec.get("offload", False))
    ph["learner_init_s"] = info["init_s"]
    res["varlen"] = info.get("varlen")
    memr["both_ready"] = dev_mem()
    learner.sleep()
    memr["learner_slept_initially"] = dev_mem()

    import numpy as np

    rng = np.random.default_rng(5)
    plen = LENS["prompt"][0] + 300 if not SMOKE else 30
    prompt = rng.integers(1, kw["vocab_size"], plen).tolist()
    n = LENS["n"]
    max_tokens = int(spec.get("max_tokens", 128 if not SMOKE else 8))
    sampled = PromptTask(task_id="0:0:0", prompt_id="q0", step=0, policy_version=0, prompt_tokens=pack_ids(prompt), n=n,
                         sampling=dict(max_tokens=max_tokens, temperature=1.0))
    greedy = PromptTask(task_id="0:1:0", prompt_id="q1", step=0, policy_version=0, prompt_tokens=pack_ids(prompt), n=1,
                        sampling=dict(max_tokens=32 if not SMOKE else 6, temperature=0.0))
    # 1. generate (v0)
    g0 = call("generate", [sampled, greedy])
    ph["generate_v0_s"] = g0["s"]
    res["gen_tokens_v0"] = sum(len(s[0]) for s in g0["groups"][0]) + len(g0["groups"][1][0][0])
    greedy_v0_tokens, greedy_v0_lp = g0["groups"][1][0]
    # 2. engine sleep(2)
    s = call("sleep", 2)
    ph["engine_sleep_s"] = s["s"]
    memr["engine_sleep_before"], memr["engine_sleep_after"] = s["before"], s["after"]
    memr["device_after_engine_sleep"] = dev_mem()
    # 3. learner wake, train step on the sampled group, learner sleep
    t = time.perf_counter()
    learner.wake()
    if cuda:
        torch.cuda.synchronize()
    ph["learner_wake_s"] = round(time.perf_counter() - t, 4)
    comps = [c for c, _ in g0["groups"][0]]
    lps = [lp for _, lp in g0["groups"][0]]
    rewards = np.array([float(i % 2) for i in range(n)])
    adv = ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).tolist()
    tg = TrainGroup(prompt_id="q0", prompt_tokens=pack_ids(prompt), completions=[pack_ids(c) for c in comps],
                    gen_logprobs=[pack_floats(np.array(x, dtype="float32")) for x in lps], advantages=adv,
                    rewards=rewards.tolist(), policy_version=0)
    lengths = [len(prompt) + len(c) for c in comps]
    plan = plan_micro_batches(lengths, spec["mb_tokens"])
    batch = TrainBatch(step=0, policy_version=0, groups=[tg], micro_batches=[[(0, i) for i in mb] for mb in plan],
                       minibatches=[list(range(len(plan)))], num_tokens=sum(lengths))
    # teacher-forced log-probs of the engine's own samples before the update: the PPO ratio-1 check
    with torch.no_grad():
        lp_before = learner.logprobs([(prompt, c) for c in comps[:4]])
    res["sampler_vs_learner_v0_maxabs"] = float(max((lp_before[i] - torch.tensor(lps[i])).abs().max() for i in range(len(lp_before))))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    m = learner.train_step(batch)
    if cuda:
        torch.cuda.synchronize()
    ph["train_step_s"] = round(time.perf_counter() - t, 3)
    res["train_metrics"] = {k: round(v, 5) for k, v in m.items() if k in ("loss", "ppo_kl", "ratio_mean", "grad_norm", "num_tokens", "micro_batches")}
    memr["learner_train_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None
    memr["device_after_train"] = dev_mem()
    # teacher-forced log-probs of the v0 greedy tokens under the new weights (the learner's own view)
    with torch.no_grad():
        lp_v1_of_v0 = learner.logprobs([(prompt, greedy_v0_tokens)])[0]
    t = time.perf_counter()
    learner.sleep()
    if cuda:
        torch.cuda.synchronize()
    ph["learner_sleep_s"] = round(time.perf_counter() - t, 4)
    memr["device_after_learner_sleep"] = dev_mem()
    # 4. engine wake weights -> CUDA IPC sync -> wake kv_cache -> finish
    w = call("wake", ["weights"])
    ph["engine_wake_weights_s"] = w["s"]
    memr["engine_wake_weights_after"] = w["after"]
    t = time.perf_counter()
    bucket_mb = int(spec.get("bucket_mb", 512))
    if cuda:
        from weights import CudaIpcSender, SyncSummary

        # export on the GPU: Learner.export_weights defaults to device="cpu", which would send the
        # weights device->host->device before the IPC copy.
        sender = CudaIpcSender(lambda mb: learner.export_weights(mb, device="cuda"), bucket_mb=bucket_mb, device="cuda")
        sender.start(1)
        nb = 0
        while True:
            msg = sender.next_bucket()
            r = call("ipc", msg)
            if isinstance(msg, SyncSummary):
                if r["version"] != 1:
                    raise RuntimeError(f"receiver returned {r}")
                res["sync_summary"] = dict(buckets=msg.num_buckets, tensors=msg.num_tensors, gib=round(msg.nbytes / 2**30, 3))
                break
            nb += 1
        sender.abort()
        del sender
    else:
        for bucket in learner.export_weights(bucket_mb, device="cpu"):
            call("load", (bucket, 1))
        res["sync_summary"] = dict(transport="cpu queue (SMOKE)")
    ph["weight_sync_s"] = round(time.perf_counter() - t, 4)
    res["sync_gbps"] = round(res["sync_summary"].get("gib", 0) * 2**30 / 1e9 / ph["weight_sync_s"], 2) if cuda else None
    w = call("wake", ["kv_cache"])
    ph["engine_wake_kv_s"] = w["s"]
    f = call("finish", 1)
    memr["engine_after_sync"] = f["mem"]
    memr["device_after_sync"] = dev_mem()
    # 5. generate again (v1) and prove the weights
    g1 = call("generate", [greedy])
    ph["generate_v1_greedy_s"] = g1["s"]
    res["engine_version_after"] = g1["versions"][0]
    greedy_v1_tokens, greedy_v1_lp = g1["groups"][0][0]
    fp_engine = call("fingerprint")["fp"]
    fp_learner = fingerprint([(n_, t_) for b in learner.export_weights(bucket_mb, device=device) for n_, t_ in b])
    res["fingerprint_engine"], res["fingerprint_learner"] = fp_engine, fp_learner
    res["weights_bitwise_equal"] = fp_engine == fp_learner
    with torch.no_grad():
        lp_learner_v1 = learner.logprobs([(prompt, greedy_v1_tokens)])[0]
    tf_engine_v1 = torch.tensor(call("teacher", (prompt, greedy_v1_tokens))["lp"])
    e1 = torch.tensor(greedy_v1_lp)
    e0 = torch.tensor(greedy_v0_lp)
    res["greedy_tokens_changed"] = greedy_v0_tokens != greedy_v1_tokens
    res["greedy_first_diff_at"] = next((i for i, (a, b) in enumerate(zip(greedy_v0_tokens, greedy_v1_tokens)) if a != b), None)
    res["proof"] = dict(
        engine_v1_vs_learner_v1_maxabs=round(float((e1 - lp_learner_v1).abs().max()), 5),
        engine_v1_vs_learner_v1_meanabs=round(float((e1 - lp_learner_v1).abs().mean()), 6),
        engine_v1_vs_engine_teacher_forced_v1_maxabs=round(float((e1 - tf_engine_v1).abs().max()), 5),
        engine_teacher_v1_vs_learner_v1_maxabs=round(float((tf_engine_v1 - lp_learner_v1).abs().max()), 5),
        engine_v0_vs_learner_v1_on_v0_tokens_maxabs=round(float((e0 - lp_v1_of_v0).abs().max()), 5),
        engine_v0_vs_learner_v1_on_v0_tokens_meanabs=round(float((e0 - lp_v1_of_v0).abs().mean()), 6),
    )
    # 6. a second train/sleep cycle: the steady-state wake and sleep (the first sleep after training
    # is also the first time the Adam moments leave the device)
    t = time.perf_counter()
    learner.wake()
    if cuda:
        torch.cuda.synchronize()
    ph["learner_wake_2_s"] = round(time.perf_counter() - t, 4)
    t = time.perf_counter()
    learner.train_step(batch)
    if cuda:
        torch.cuda.synchronize()
    ph["train_step_2_s"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    learner.sleep()
    if cuda:
        torch.cuda.synchronize()
    ph["learner_sleep_2_s"] = round(time.perf_counter() - t, 4)
    memr["device_after_learner_sleep_2"] = dev_mem()
    call("stop")
    child.join(timeout=60)
    return res


if __name__ == "__main__":
    import json
    import os
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "--colo":
        raise SystemExit("usage: python -m bench.gpu.learner_colo --colo '<spec json>' (bench.gpu.learner starts it)")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    print("ROW " + json.dumps(run_colo(json.loads(sys.argv[2]))), flush=True)
