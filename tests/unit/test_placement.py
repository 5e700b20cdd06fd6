"""config.placement: the one placement function behind --dry-run, --preflight and the launcher (pure, no Ray)."""
import importlib.util
from collections import defaultdict

import pytest

from config import ConfigError, LearnerConfig, apply_overrides, check_attention
from config.placement import make_placement
from config.recipes import get_recipe
from launch.plan import make_plan


def cfg_for(recipe: str, *overrides: str):
    return apply_overrides(get_recipe(recipe), list(overrides))


def check_invariants(p):
    """Every GPU bundle used, shares within one GPU and the bundle's CPUs, engines on one node."""
    gpu_use, cpu_use = defaultdict(float), defaultdict(float)
    covered = defaultdict(list)
    for a in p.actors:
        assert a.bundle is not None and 0 <= a.node < p.num_nodes
        gpu_use[(a.node, a.bundle)] += a.num_gpus
        cpu_use[(a.node, a.bundle)] += a.num_cpus
        for g in a.gpus:
            covered[(a.node, g)].append(a)
    for node, row in enumerate(p.bundles):
        for i, bundle in enumerate(row):
            assert gpu_use[(node, i)] <= bundle.get("GPU", 0) + 1e-9, (node, i)
            assert cpu_use[(node, i)] <= bundle.get("CPU", 0) + 1e-9, (node, i)
            if "GPU" in bundle:
                roles = sorted(a.role for a in covered[(node, i)])
                assert roles in (["learner"], ["generator"], ["generator", "learner"]), (node, i, roles)
    names = [a.name for a in p.actors]
    assert len(names) == len(set(names))


def test_bird_32b_colocated_bundles_engines_and_ranks():
    p = make_placement(cfg_for("bird_32b"))
    assert not p.errors and p.weight_sync == "cuda_ipc" and p.learner_world_size == 32
    assert [len(row) for row in p.bundles] == [9, 8, 8, 8]  # node 0 also holds the CPU actors' bundle
    assert p.bundles[1] == [{"GPU": 1.0, "CPU": 2.0}] * 8 and p.bundles[0][8] == {"CPU": 1.0}
    check_invariants(p)
    engines = p.by_role("generator")
    assert [(e.node, e.gpus, e.bundle, e.num_gpus) for e in engines] == [
        (n, tuple(range(s, s + 4)), s, 0.5) for n in range(4) for s in (0, 4)]
    ranks = p.by_role("learner")
    assert [(r.rank, r.node, r.gpus, r.num_gpus) for r in ranks] == [(i, i // 8, (i % 8,), 0.5) for i in range(32)]
    assert {a.bundle for a in p.actors if a.role in ("coordinator", "scorer", "assembler")} == {8}


def test_bird_1p7b_one_node_eight_tp1_engines():
    p = make_placement(cfg_for("bird_1p7b"))
    assert not p.errors and p.learner_world_size == 8 and p.num_nodes == 1
    check_invariants(p)
    assert [(e.bundle, e.gpus) for e in p.by_role("generator")] == [(i, (i,)) for i in range(8)]


def test_colocated_gpu_without_engine_gives_the_rank_the_whole_gpu():
    p = make_placement(cfg_for("bird_1p7b", "generator.num_engines=6"))
    check_invariants(p)
    assert [r.num_gpus for r in p.by_role("learner")] == [0.5] * 6 + [1.0] * 2
    assert p.bundles[0][6] == {"GPU": 1.0, "CPU": 1.0}  # learner.num_cpus only


def test_async_engines_and_ranks_on_separate_bundles():
    p = make_placement(cfg_for("bird_32b", "coordinator.mode=async", "generator.num_engines=4"))
    assert not p.errors and p.weight_sync == "nccl" and p.learner_world_size == 16
    check_invariants(p)
    engine_gpus = {(e.node, g) for e in p.by_role("generator") for g in e.gpus}
    learner_gpus = {(r.node, r.gpus[0]) for r in p.by_role("learner")}
    assert not engine_gpus & learner_gpus and len(engine_gpus | learner_gpus) == 32
    assert all(a.num_gpus == 1.0 for a in p.actors if a.role in ("generator", "learner"))
    assert p.bundles[0][0] == {"GPU": 1.0, "CPU": 1.0}  # generator.num_cpus alone


def test_async_with_engines_on_every_gpu_shares_them_with_the_learner_ranks():
    """gpu1_0p6b coordinator.mode=async: one GPU, one engine: the rank and the engine share its bundle
    0.5/0.5 (as colocated ones do), the weights go over CUDA IPC, and nothing is an error."""
    p = make_placement(cfg_for("gpu1_0p6b", "coordinator.mode=async", "assembler.max_staleness=1"))
    assert not p.errors and p.shared and p.gpu_shared and p.weight_sync == "cuda_ipc" and p.learner_world_size == 1
    check_invariants(p)
    assert p.bundles == [[{"GPU": 1.0, "CPU": 2.0}, {"CPU": 1.0}]]
    (engine,), (rank,) = p.by_role("generator"), p.by_role("learner")
    assert (engine.bundle, engine.gpus, engine.num_gpus) == (rank.bundle, rank.gpus, rank.num_gpus) == (0, (0,), 0.5)
    assert make_placement(cfg_for("gpu1_0p6b_async")).to_dict() == p.to_dict()
    full = make_placement(cfg_for("bird_32b", "coordinator.mode=async"))  # 8 x TP 4 on 32 GPUs: all shared
    assert not full.errors and full.shared and full.learner_world_size == 32 and full.weight_sync == "cuda_ipc"
    check_invariants(full)
    # GPUs left for the learner: separate GPUs, as before; colocated is never "shared" async
    assert not make_placement(cfg_for("bird_32b", "coordinator.mode=async", "generator.num_engines=4")).shared
    colo = make_placement(cfg_for("gpu1_0p6b"))
    assert not colo.shared and colo.gpu_shared and not make_placement(cfg_for("tiny")).gpu_shared


def test_nccl_between_an_engine_and_a_rank_sharing_a_gpu_is_a_config_error():
    with pytest.raises(ConfigError, match="'coordinator.weight_sync': nccl cannot broadcast") as e:
        make_placement(cfg_for("gpu1_0p6b_async", "coordinator.weight_sync=nccl"))
    assert "async on shared GPUs" in str(e.value) and "\n" not in str(e.value)
    assert make_placement(cfg_for("gpu1_0p6b_async", "coordinator.weight_sync=cuda_ipc")).weight_sync == "cuda_ipc"


def test_impossible_placements_are_errors_not_exceptions():
    wide = make_placement(cfg_for("bird_32b", "generator.tensor_parallel_size=16", "generator.num_engines=2"))
    assert any("never crosses a node" in e for e in wide.errors)


@pytest.mark.parametrize("recipe,overrides,expected", [
    ("bird_32b", [], "cuda_ipc"),
    ("bird_32b", ["coordinator.mode=async", "generator.num_engines=4"], "nccl"),
    ("tiny", ["coordinator.weight_sync=auto"], "object_store"),
    ("tiny", ["coordinator.weight_sync=nccl"], "nccl"),  # gloo broadcast on CPU
    ("bird_1p7b", ["coordinator.weight_sync=object_store"], "object_store"),
])
def test_weight_sync_follows_the_placement(recipe, overrides, expected):
    assert make_placement(cfg_for(recipe, *overrides)).weight_sync == expected


@pytest.mark.parametrize("recipe,overrides", [
    ("bird_32b", ["coordinator.mode=async", "generator.num_engines=4", "coordinator.weight_sync=cuda_ipc"]),
    ("tiny", ["coordinator.weight_sync=cuda_ipc"]),
    ("bird_1p7b", ["coordinator.weight_sync=nccl"]),
])
def test_an_impossible_transport_is_a_config_error_naming_the_key(recipe, overrides):
    with pytest.raises(ConfigError, match="'coordinator.weight_sync'") as e:
        make_placement(cfg_for(recipe, *overrides))
    assert "\n" not in str(e.value)


def test_cpu_recipe_has_num_ranks_processes_and_no_placement_group():
    p = make_placement(cfg_for("tiny"))
    assert p.bundles == [[]] and p.cpu_bundle is None and p.learner_world_size == 1
    assert all(a.bundle is None and a.num_gpus == 0 for a in p.actors)
    if not hasattr(LearnerConfig, "num_ranks"):
        pytest.skip("learner.num_ranks not in LearnerConfig yet (helper L's change)")
    p2 = make_placement(cfg_for("tiny", "learner.num_ranks=2"))
    assert [r.name for r in p2.by_role("learner")] == ["learner-0", "learner-1"] and p2.learner_world_size == 2


def test_num_ranks_that_disagrees_with_the_gpus_is_a_config_error():
    if not hasattr(LearnerConfig, "num_ranks"):
        pytest.skip("learner.num_ranks not in LearnerConfig yet (helper L's change)")
    with pytest.raises(ConfigError, match="'learner.num_ranks': 4, but the placement gives the learner 8 GPUs"):
        make_placement(cfg_for("bird_1p7b", "learner.num_ranks=4"))
    assert make_placement(cfg_for("bird_1p7b", "learner.num_ranks=8")).learner_world_size == 8


def test_the_plan_renders_the_placement_function_s_result():
    for recipe in ("bird_32b", "bird_1p7b", "tiny"):
        cfg = cfg_for(recipe)
        plan = make_plan(cfg)
        assert plan.placement.to_dict() == make_placement(cfg).to_dict()
        assert plan.learner_world_size == plan.placement.learner_world_size
        text = plan.render()
        for e in plan.placement.by_role("generator"):
            row = next(r for r in plan.placements if r.actor == e.name)
            assert (row.node, row.gpus, row.num_gpus, row.num_cpus) == (e.node, list(e.gpus), e.num_gpus, e.num_cpus)
        ranks = plan.placement.by_role("learner")
        learner_rows = [r for r in plan.placements if r.actor.startswith("learner-")]
        assert sum(len(r.gpus) for r in learner_rows) == (len(ranks) if plan.total_gpus else 0)
        assert all(r.num_cpus == ranks[0].num_cpus for r in learner_rows)
        assert f"weight sync: {plan.placement.weight_sync}" in text


def test_bird_recipes_ask_for_an_attention_that_runs():
    for recipe in ("bird_1p7b", "bird_32b"):
        assert get_recipe(recipe).model.attn_implementation != "flash_attention_2"
        check_attention(get_recipe(recipe))
    with pytest.raises(ConfigError, match="'model.attn_implementation': 'flash_attention_2' cannot express learner.share_prompt"):
        cfg_for("bird_1p7b", "model.attn_implementation=flash_attention_2")  # shared prompts need flex or the dense mask
    flash = cfg_for("bird_1p7b", "model.attn_implementation=flash_attention_2", "learner.share_prompt=false")
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn imports on this machine")
    with pytest.raises(ConfigError, match="'model.attn_implementation': flash_attention_2 needs the flash-attn"):
        check_attention(flash)


def test_the_plan_counts_the_cpus_node_0_s_placement_group_reserves():
    plan = make_plan(cfg_for("bird_1p7b", "cluster.num_cpus=16"))
    assert plan.cpu_requested == 8 * 2 + 1  # 8 x {GPU 1, CPU 2} + the CPU actors' {CPU 1}
    assert not plan.fits and "node 0's placement group reserves 17 CPUs but cluster.num_cpus gives 16" in plan.errors[-1]
    assert make_plan(cfg_for("bird_1p7b", "cluster.num_cpus=17")).fits
