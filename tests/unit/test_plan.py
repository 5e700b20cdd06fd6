"""launch.plan: placement and per-GPU memory arithmetic of the --dry-run plan (no GPU anywhere)."""
import json

import pytest

from config import ConfigError, apply_overrides
from config.memory import GIB, QWEN3_SHAPES, model_shape
from config.recipes import get_recipe
from launch.plan import make_plan


def plan_for(recipe: str, *overrides: str):
    return make_plan(apply_overrides(get_recipe(recipe), list(overrides)))


def engine_learner_gpus(plan):
    (shared,) = [g for g in plan.gpu_memory if g.role == "engine+learner"]
    return shared


def test_qwen3_param_counts_match_the_published_sizes():
    # Model cards give 0.6B, 1.7B, 4.0B, 8.2B, 14.8B, 32.8B total parameters; these pin the shape table to 0.5 %.
    expected = {"qwen/qwen3-0.6b": 0.596e9, "qwen/qwen3-1.7b": 1.721e9, "qwen/qwen3-4b": 4.022e9,
                "qwen/qwen3-8b": 8.191e9, "qwen/qwen3-14b": 14.768e9, "qwen/qwen3-32b": 32.762e9}
    for name, count in expected.items():
        assert QWEN3_SHAPES[name].num_params == pytest.approx(count, rel=0.005), name


def test_bird_32b_places_8_tp4_engines_without_crossing_nodes_and_32_learner_ranks():
    plan = plan_for("bird_32b")
    assert plan.fits, plan.errors
    assert plan.total_gpus == 32 and plan.learner_world_size == 32
    engines = [p for p in plan.placements if p.actor.startswith("generator-")]
    assert len(engines) == 8
    assert all(len(p.gpus) == 4 and 0 <= p.node < 4 for p in engines)
    used = [(p.node, g) for p in engines for g in p.gpus]
    assert len(set(used)) == 32  # every GPU exactly once
    assert {p.node for p in plan.placements if p.actor in ("coordinator", "assembler") or p.actor.startswith("scorer-")} == {0}


def test_bird_32b_memory_numbers_are_the_hand_computed_ones():
    plan = plan_for("bird_32b")
    n = 32_762_123_264
    assert plan.num_params == n
    gpus = engine_learner_gpus(plan)
    gen, train = gpus.phases["generation"], gpus.phases["training"]
    assert plan.facts["vLLM weights total, GiB"] == pytest.approx(2 * n / GIB, abs=0.01)  # ~61 GiB
    assert 60.5 < plan.facts["vLLM weights total, GiB"] < 61.5
    assert gen["vLLM weights shard"] == pytest.approx(2 * n / 4 / GIB)  # ~15.3 GiB per TP-4 shard
    assert gen["vLLM weights shard"] + gen["vLLM KV cache"] == pytest.approx(0.5 * 80)
    zero3 = train["learner weights"] + train["learner grads"] + train["learner optimizer"]
    assert zero3 == pytest.approx((2 + 2 + 12) * n / 32 / GIB)  # ~15.3 GiB
    assert 14.5 < zero3 < 16
    # KV: 2 x 64 layers x (8 kv heads / TP 4) x 128 x 2 bytes per token per GPU
    assert plan.facts["KV bytes per token per GPU"] == 2 * 64 * 2 * 128 * 2
    assert plan.facts["KV cache tokens per engine"] == int(gen["vLLM KV cache"] * GIB // (2 * 64 * 2 * 128 * 2))
    # sleep level 2: nothing of vLLM but its context while training
    assert not any(k.startswith("vLLM weights") or k.startswith("vLLM KV") for k in train)
    assert 40 < gpus.peak_gib <= 80


def test_bird_1p7b_is_one_node_of_8_tp1_engines_under_zero2():
    plan = plan_for("bird_1p7b")
    assert plan.fits, plan.errors
    gpus = engine_learner_gpus(plan)
    train = gpus.phases["training"]
    n = QWEN3_SHAPES["qwen/qwen3-1.7b"].num_params
    assert train["learner weights"] == pytest.approx(2 * n / GIB)  # ZeRO-2 keeps full weights
    assert train["learner grads"] == pytest.approx(2 * n / 8 / GIB)
    assert train["learner optimizer"] == pytest.approx(12 * n / 8 / GIB)
    assert "ZeRO-3 gather working set" not in train


@pytest.mark.parametrize("override", ["cluster.gpu_memory_gib=24", "generator.gpu_memory_utilization=0.95"])
def test_an_unfittable_override_fails_with_the_phase_gpu_and_numbers(override):
    plan = plan_for("bird_32b", override, "learner.zero_stage=0")
    assert not plan.fits
    text = plan.render()
    assert "DOES NOT FIT" in text and "FITS\n" not in text
    assert any("generation phase, GPU node0:0" in e and "GiB" in e and "cluster.gpu_memory_gib" in e for e in plan.errors)


def test_24_gib_gpus_cannot_hold_vllms_shard_in_its_fraction():
    plan = plan_for("bird_32b", "cluster.gpu_memory_gib=24")
    assert not plan.fits
    assert any("does not hold its weight shard of 15.26 GiB" in e and "0.5 x 24 = 12.00 GiB" in e for e in plan.errors)


def test_zero_stages_shrink_the_learner_monotonically():
    peaks = [engine_learner_gpus(plan_for("bird_1p7b", f"learner.zero_stage={s}")).phases["training"]
             for s in (0, 1, 2, 3)]
    states = [p["learner weights"] + p["learner grads"] + p["learner optimizer"] for p in peaks]
    assert states[0] > states[1] > states[2] > states[3]


def test_checkpointing_and_liger_each_shrink_the_training_phase():
    def training(*o):
        return engine_learner_gpus(plan_for("bird_32b", *o)).phase_total("training")
    base = training()
    assert training("learner.use_liger=false") > base + 15  # full fp32 logits: 32768 x 151936 x 4 B = 18.5 GiB
    no_ckpt = plan_for("bird_32b", "learner.gradient_checkpointing=false")
    assert not no_ckpt.fits and any(e.startswith("training phase") for e in no_ckpt.errors)


def test_checkpoint_layers_plans_activations_between_all_and_none():
    def activations(*o):
        phase = engine_learner_gpus(plan_for("bird_1p7b", *o)).phases["training"]
        return next(v for k, v in phase.items() if k.startswith("activations"))
    every, none = activations(), activations("learner.gradient_checkpointing=false")
    half = activations("learner.checkpoint_layers=14")  # Qwen3-1.7B has 28 layers
    assert activations("learner.checkpoint_layers=28") == every < half < none
    # 14 layers keep everything, 14 keep their input, plus one layer's recompute working set
    one_layer = none / 28
    assert half == pytest.approx((every - one_layer) / 2 + none / 2 + one_layer)
    assert "gradient checkpointing on for 14 of 28 layers" in "\n".join(plan_for("bird_1p7b", "learner.checkpoint_layers=14").notes)
    with pytest.raises(ConfigError, match="'learner.checkpoint_layers': 29 exceeds the model's 28 decoder layers"):
        plan_for("bird_1p7b", "learner.checkpoint_layers=29")


def test_sleep_level_1_at_32b_is_planned_as_keeping_vllm_resident_and_does_not_fit():
    plan = plan_for("bird_32b", "generator.sleep_level=1")
    assert not plan.fits
    train = engine_learner_gpus(plan).phases["training"]
    assert "vLLM weights kept (sleep_level 1)" in train
    assert any(e.startswith("training phase, GPU node0:0") for e in plan.errors)


def test_async_mode_puts_engines_and_learner_on_disjoint_gpus():
    plan = plan_for("bird_32b", "coordinator.mode=async", "generator.num_engines=4")
    assert plan.fits, plan.errors
    assert plan.learner_world_size == 16
    roles = {g.role: set(g.gpus) for g in plan.gpu_memory}
    assert set(roles) == {"engine", "learner"}
    assert not roles["engine"] & roles["learner"] and len(roles["engine"] | roles["learner"]) == 32


def test_a_tp_group_never_crosses_a_node():
    plan = plan_for("bird_32b", "generator.tensor_parallel_size=16", "generator.num_engines=2")
    assert not plan.fits and any("never crosses a node" in e for e in plan.errors)
    plan = plan_for("bird_32b", "generator.tensor_parallel_size=3", "generator.num_engines=8")
    # 2 engines of TP 3 per 8-GPU node: 8 engines need 4 nodes; a 9th would not fit
    assert plan.fits, plan.errors
    assert all(max(p.gpus) < 8 for p in plan.placements if p.actor.startswith("generator-"))
    assert not plan_for("bird_32b", "generator.tensor_parallel_size=3", "generator.num_engines=9").fits


def test_kv_cache_too_small_for_one_sequence_fails():
    plan = plan_for("bird_32b", "generator.gpu_memory_utilization=0.2", "generator.max_tokens=200000")
    assert not plan.fits and any("KV cache holds" in e for e in plan.errors)


def test_tiny_is_a_cpu_plan_that_fits_and_fails_on_too_few_cpus():
    plan = plan_for("tiny")
    assert plan.fits and plan.total_gpus == 0 and plan.gpu_memory == []
    assert plan.cpu_requested == pytest.approx(0.5 + 0.5 + 0.25 + 0.25 + 0.25)
    assert "CPU only" in plan.render()
    sized = plan_for("tiny", "cluster.num_cpus=1")  # validation sizes the asks to it (test_cpu_sizing.py)
    assert sized.fits and 0.99 <= sized.cpu_requested <= 1
    cfg = apply_overrides(get_recipe("tiny"), [])
    cfg.cluster.num_cpus = 1  # past validation, as a hand-edited config would be: the plan still says so
    small = make_plan(cfg)
    assert not small.fits and "CPU requests sum to 1.75" in small.errors[0]


def test_local_config_json_is_read(tmp_path):
    cfg = {"hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 512, "vocab_size": 1000, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = model_shape(apply_overrides(get_recipe("bird_1p7b"), [f"model.path={tmp_path}"]))
    assert (shape.hidden_size, shape.num_layers, shape.head_dim, shape.tie_word_embeddings) == (256, 3, 64, False)
    layer = 256 * 256 + 2 * 256 * 128 + 256 * 256 + 3 * 256 * 512 + 2 * 256 + 2 * 64
    assert shape.num_params == 2 * 1000 * 256 + 3 * layer + 256


def test_unknown_hub_id_is_a_one_line_error():
    with pytest.raises(ConfigError) as e:
        plan_for("bird_32b", "model.path=someone/not-a-model")
    assert "someone/not-a-model" in str(e.value) and "\n" not in str(e.value)


def test_to_dict_is_json_and_carries_the_verdict():
    d = plan_for("bird_32b").to_dict()
    assert json.loads(json.dumps(d))["fits"] is True
    assert d["gpu_memory"][0]["peak_phase"] in ("generation", "weight_sync", "training")


def test_gpu1_0p6b_plan_states_the_start_up_phases_and_the_mid_run_checkpoint():
    """The learner is built alone and asleep before the engine starts (launch/place.py): its build holds its
    states + 8 bytes a parameter (DeepSpeed's Adam step at build: 24 bytes a parameter in bf16), then the
    engine starts beside the sleeping learner (the generation phase: vLLM's fraction and both contexts); the
    warm start (engines asleep) and step 1 (learner asleep) add nothing. A mid-run checkpoint wakes the
    optimizer (12 bytes a parameter) beside a generating engine."""
    plan = plan_for("gpu1_0p6b")
    assert plan.fits, plan.errors
    g = engine_learner_gpus(plan)
    n = plan.num_params
    assert g.phase_total("learner build") == pytest.approx(24 * n / GIB + 0.5)  # 8.42; the H200 showed 9.07
    assert g.phase_total("generation") == pytest.approx(0.3 * 141 + 0.5 + (2 + 2) * n / GIB + 0.5)
    assert g.peak_phase == "generation" and 44 < g.peak_gib < 45  # measured steady: 44.6-44.7
    assert plan.facts["engine+learner GPU peak before step 1, GiB"] == round(g.peak_gib, 2)
    assert "start-up" not in g.phases and "checkpoint" not in g.phases  # checkpoint_every=0: the final one, asleep
    mid = engine_learner_gpus(plan_for("gpu1_0p6b", "coordinator.checkpoint_every=10"))
    assert mid.phase_total("checkpoint") == pytest.approx(mid.phase_total("generation") + 12 * n / GIB)
    fp32 = engine_learner_gpus(plan_for("gpu1_0p6b", "learner.dtype=float32"))
    assert set(fp32.phases["learner build"]) == {"learner weights", "learner CUDA context"}  # AdamW's state is lazy


def test_gpu1_0p6b_async_plan_keeps_both_resident_and_states_each_process_s_budget():
    plan = plan_for("gpu1_0p6b", "coordinator.mode=async", "assembler.max_staleness=1")
    assert plan.fits, plan.errors
    g = engine_learner_gpus(plan)
    assert set(g.phases) == {"learner build", "generation+training", "weight_sync"}
    both = g.phases["generation+training"]
    assert both["vLLM KV cache"] + both["vLLM weights shard"] == pytest.approx(0.3 * 141)
    assert "learner optimizer" in both and any(k.startswith("activations") for k in both)  # nothing sleeps
    assert g.phase_total("weight_sync") == pytest.approx(g.phase_total("generation+training") + 1.0)
    assert plan.facts["per-process budget, GiB: vLLM (fraction + context)"] == round(0.3 * 141 + 0.5, 2)
    assert plan.facts["per-process budget, GiB: learner (the rest of the GPU)"] == round(141 - 0.3 * 141 - 0.5, 2)
    assert 45 < g.peak_gib < 55 and plan.placement.weight_sync == "cuda_ipc"
    assert "async on shared GPUs" in plan.render()


def test_async_on_a_shared_gpu_that_cannot_fit_is_refused_naming_the_fields():
    from config import check_inputs

    over = ["coordinator.mode=async", "assembler.max_staleness=1", "generator.gpu_memory_utilization=0.95"]
    plan = plan_for("gpu1_0p6b", *over)
    assert not plan.fits and any("'generator.gpu_memory_utilization'" in e for e in plan.errors)
    with pytest.raises(ConfigError) as e:
        check_inputs(apply_overrides(get_recipe("gpu1_0p6b"), over))
    msg = str(e.value)
    assert "\n" not in msg and "'generator.gpu_memory_utilization', 'assembler.micro_batch_tokens'" in msg
    assert "the learner's budget is 6.55 GiB" in msg, msg
    check_inputs(apply_overrides(get_recipe("gpu1_0p6b"), over[:2]))  # the recipe's 0.3 fits


