"""bench/peers/gpu.py (us against TRL on the H200, vLLM on both sides) as far as a CPU goes: the settings both sides
get from the recipe, the table, and TRL's side driving vLLM in colocate mode -- against a FAKE vLLM
(tests/fake_vllm_site: a transformers model samples; vLLM itself needs a GPU), in the peer venv when it can be
had without the network (bench/peers/venv.py; the test skips, saying why, otherwise)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.peers.venv import PeerVenvUnavailable, ensure_venv

REPO = Path(__file__).resolve().parents[2]
FAKE_SITE = REPO / "tests" / "fake_vllm_site"


def gpu_module(monkeypatch, **env):
    """bench.peers.gpu imported afresh under `env` (its settings are read at import)."""
    import importlib

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    sys.modules.pop("bench.peers.gpu", None)
    return importlib.import_module("bench.peers.gpu")


def test_both_sides_get_the_recipes_engine_and_training_settings_at_the_generation_heavy_shape(monkeypatch):
    g = gpu_module(monkeypatch, RECIPE="gpu1_0p6b", SMOKE="0", STEPS="5", PROMPTS="64", N="8", MAX_TOKENS="256")
    from bench.peers import ours

    cfg = ours.recipe_config(g.overrides(), recipe="gpu1_0p6b")
    assert (cfg.coordinator.prompts_per_step, cfg.generator.n_samples, cfg.generator.max_tokens) == (64, 8, 256)
    assert cfg.model.tiny_sft_steps == 0 and cfg.coordinator.eval_every == 0 and not cfg.assembler.filter_zero_variance
    assert cfg.learner.warmup_ratio == 0 and cfg.data.synthetic_seed == ours.recipe_config(recipe="gpu1_0p6b").data.synthetic_seed
    s = g.settings(cfg)
    assert (s["lr"], s["clip_low"], s["clip_high"], s["temperature"]) == (cfg.learner.lr, 0.2, 0.28, 1.0)
    assert s["gradient_checkpointing"] is True and s["micro_batch"] == 32 and 64 * 8 % s["micro_batch"] == 0
    assert g.vllm_spec(cfg) == {"gpu_memory_utilization": cfg.generator.gpu_memory_utilization,
                                "enable_sleep_mode": True, "correction_cap": cfg.learner.correction_cap}
    rows = [{"name": "ours", "side": "ours", "samples_per_s_e2e": 30.0, "samples_per_s_step": 40.0, "device_peak_gib": 45.0},
            {"name": "TRL", "side": "trl", "samples_per_s_e2e": 10.0, "samples_per_s_step": 20.0, "device_peak_gib": None}]
    text = g.report(rows, ["a note"])
    assert "| ours | 30.0 | 40.0 |" in text and "samples/s end to end 3.00x, per step 2.00x, peak device memory -" in text
    assert text.endswith("- a note")
    # A side cut short has no end-to-end throughput (the 2026-12-07 H100 run printed 11.4 for 0 steps in 225 s).
    done = {"rc": 0, "timed_out": False, "steps": g.STEPS, "wall_s": 100.0}
    assert g.end_to_end(dict(done), 512)["samples_per_s_e2e"] == g.STEPS * 512 / 100.0
    for cut in ({"rc": -9, "timed_out": True, "steps": 0}, {"rc": 0, "steps": g.STEPS - 1}, {"rc": 1}):
        row = g.end_to_end({**done, **cut}, 512)
        assert row["samples_per_s_e2e"] is None
        assert "| ours | - |" in g.report([{**row, "name": "ours", "side": "ours"}], [])


@pytest.mark.slow
def test_fake_vllm_trl_side_drives_vllm_colocate_with_the_weights_synced_each_step(tmp_path, monkeypatch):
    """TRL's side in vllm_mode=colocate on CPU, with the FAKE vLLM: the engine is built once for one process
    (external launcher, rank 0 of 1) with the recipe's memory share and sleep mode, put to sleep, and every
    step wakes its weights, receives every parameter, resets its prefix cache, wakes its KV cache, generates
    the step's prompts x samples one request each, and sleeps again; the steps are timed and the table printed."""
    try:
        ensure_venv(offline=True, log=lambda m: None)
    except PeerVenvUnavailable as e:
        pytest.skip(f"no peer venv without the network: {e}")
    calls = tmp_path / "fake_vllm.jsonl"
    env = dict(os.environ, SMOKE="1", SIDES="trl", TRL_VLLM="1", TRL_SITE=str(FAKE_SITE), FAKE_VLLM_LOG=str(calls),
               STEPS="2", PROMPTS="2", N="2", MAX_TOKENS="6", OUT=str(tmp_path / "out"), RUN_ROOT=str(tmp_path / "runs"),
               PEERS_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "bench.peers.gpu"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:] + (tmp_path / "out" / "trl.console.txt").read_text()[-3000:]
    events = [json.loads(x) for x in calls.read_text().splitlines()]
    init = events[0]
    assert init["call"] == "init" and init["distributed_executor_backend"] == "external_launcher"
    assert (init["rank"], init["world_size"], init["enable_sleep_mode"]) == ("0", "1", True)
    assert [e["call"] for e in events[1:]] == ["sleep"] + ["wake_up", "reset_prefix_cache", "wake_up", "generate", "sleep"] * 2
    wakes = [e for e in events if e["call"] == "wake_up"]
    assert [w["tags"] for w in wakes] == [["weights"], ["kv_cache"]] * 2
    # every parameter pushed before each generation (the tiny model's 2 layers: 24 tensors)
    assert [w["loaded"] for w in wakes if w["tags"] == ["kv_cache"]] == [24, 24]
    gens = [e for e in events if e["call"] == "generate"]
    assert all((e["prompts"], e["n"], e["max_tokens"], e["temperature"]) == (4, 1, 6, 1.0) for e in gens)
    result = json.loads((tmp_path / "out" / "peers_gpu.json").read_text())
    row = result["rows"][0]
    assert row["side"] == "trl" and row["rc"] == 0 and row["steps"] == 2 and row["meta"]["vllm"] is True
    assert row["meta"]["prompt_ids_mismatched"] == 0 and row["meta"]["versions"]["vllm"] == "0.26.0"
    assert "| | samples/s end to end |" in p.stdout and "(vLLM colocate)" in p.stdout
