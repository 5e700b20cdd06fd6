"""bench/gpu/vllm_sync.py's plumbing on CPU: the transformers engine stands in for vLLM (no GPU here),
the object store's plain path for CUDA IPC; the real Learner, batches, sync and mismatch statistics."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_vllm_sync_bench_runs_on_cpu_with_the_transformers_engine_standing_in_for_vllm(tmp_path):
    env = dict(os.environ, ENGINE="transformers", MODEL="smoke", CYCLES="2", OUT=str(tmp_path),
               ARL_BENCH_WORK=str(tmp_path / "work"), PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "bench.gpu.vllm_sync"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads((tmp_path / "gpu_vllm_sync_ipc.json").read_text())
    edges = [(r["cycle"], r["edge"]) for r in res["edges"]]
    assert edges[:3] == [(0, "engine_start"), (0, "learner_init_and_sleep"), (0, "generate")]
    assert [e for c, e in edges if c == 1] == ["engine_sleep2", "learner_wake", "learner_logprobs", "train_step",
                                               "learner_sleep", "engine_wake_weights", "weight_sync",
                                               "engine_wake_kv", "finish_update", "generate"]
    assert [m["version"] for m in res["mismatch_by_version"]] == [0, 1, 2]
    # after each sync the engine samples from the learner's weights, and far less from the initial ones
    assert max(m["mean_abs"] for m in res["mismatch_by_version"]) < res["v1_samples_vs_initial_weights"]["mean_abs"]


def test_gpu_colocated_learner_bench_runs_on_cpu_and_the_engine_ends_with_the_learner_s_bits(tmp_path):
    """bench/gpu/learner_colo.py's CPU smoke: its engine process is built from typed configs (a stand-in
    namespace without `lora` killed it after LoRA landed, and the parent then waited 300 s for an answer)."""
    spec = {"model": "smoke", "zero": 0, "attn": "varlen", "path": "plain", "mb_tokens": 128, "gc": True,
            "checkpoint_layers": -1, "lr": 1e-4, "offload": False}
    env = dict(os.environ, SMOKE="1", OUT=str(tmp_path), ARL_BENCH_WORK=str(tmp_path / "work"), PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "bench.gpu.learner_colo", "--colo", json.dumps(spec)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    rows = [json.loads(line[4:]) for line in out.stdout.splitlines() if line.startswith("ROW ")]
    assert out.returncode == 0 and rows, out.stderr[-2000:]
    assert rows[-1]["weights_bitwise_equal"] and rows[-1]["engine_version_after"] == 1, rows[-1]
