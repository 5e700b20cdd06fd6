"""A CPU recipe sizes its own CPU asks to cluster.num_cpus (config.placement.fit_cpu_asks, resolved once in
validation): `tiny learner.num_ranks=2` asked for 2.25 CPUs of tiny's 2 and failed with PlacementFailed;
now --dry-run shows the sized asks and they are all placed at once on a local 2-CPU Ray. Where the asks
still cannot fit (a joined cluster), the one-line error names the override that sizes them."""
import pytest

from config import apply_overrides
from config.placement import CPU_GRAIN, fit_cpu_asks, make_placement
from config.recipes import get_recipe


def _asks(cfg) -> float:
    return sum(a.num_cpus for a in make_placement(cfg).actors)


def test_asks_over_the_cluster_are_scaled_by_one_factor_to_fit():
    raw = apply_overrides(get_recipe("tiny"), ["learner.num_ranks=2", "cluster.num_cpus=0"])
    placement = make_placement(raw)
    assert _asks(raw) == pytest.approx(2.25)
    sized = fit_cpu_asks(placement, 2)
    assert set(sized) == {"generator", "learner", "coordinator", "scorer", "assembler"}
    total = sum(sized[a.role] for a in placement.actors)
    assert 2 - 6 * CPU_GRAIN <= total <= 2  # fits, and loses at most one grain an actor
    assert sized["learner"] == pytest.approx(2 * sized["coordinator"], abs=CPU_GRAIN)  # proportions kept
    assert all(v > 0 for v in sized.values())


def test_asks_that_fit_or_an_unset_count_or_a_gpu_recipe_are_left_alone():
    tiny = make_placement(apply_overrides(get_recipe("tiny"), ["cluster.num_cpus=0"]))
    assert fit_cpu_asks(tiny, 2) == {}  # 1.75 of 2
    two = make_placement(apply_overrides(get_recipe("tiny"), ["learner.num_ranks=2", "cluster.num_cpus=0"]))
    assert fit_cpu_asks(two, 0) == {}  # 0: the local cluster is given enough instead (local_num_cpus)
    assert fit_cpu_asks(make_placement(get_recipe("bird_1p7b")), 2) == {}


def test_validation_writes_the_sized_asks_into_the_config_once():
    cfg = apply_overrides(get_recipe("tiny"), ["learner.num_ranks=2"])  # tiny sets cluster.num_cpus=2
    assert _asks(cfg) <= 2
    assert cfg.learner.num_cpus < 0.5 and cfg.generator.num_cpus < 0.5
    again = apply_overrides(cfg, [])  # the saved config loads back to the same asks
    assert again.learner.num_cpus == cfg.learner.num_cpus and _asks(again) == _asks(cfg)
    plain = apply_overrides(get_recipe("tiny"), [])
    assert plain.learner.num_cpus == 0.5  # tiny as shipped fits: untouched


def test_the_dry_run_shows_the_sized_asks_and_fits():
    from launch.plan import make_plan

    plan = make_plan(apply_overrides(get_recipe("tiny"), ["learner.num_ranks=2"]))
    assert plan.fits, plan.errors
    assert "CPU only: 1.998 CPUs requested of 2" in plan.render()


def test_asks_a_cluster_cannot_hold_name_the_override_that_sizes_them(local_ray):
    from launch.groups import PlacementFailed, check_cpus

    placement = make_placement(apply_overrides(get_recipe("tiny"), ["learner.num_ranks=3", "cluster.num_cpus=0"]))
    with pytest.raises(PlacementFailed, match=r"ask for 2\.75 CPUs but the Ray cluster has 2 .*cluster\.num_cpus=2"):
        check_cpus(placement)


def test_tiny_with_two_learner_ranks_places_every_actor_at_once_on_a_two_cpu_ray(local_ray):
    """The issue's command's placement, built as the launcher builds it (check_cpus, actor_options) on a local
    Ray of 2 CPUs: every actor starts; with the asks as written the sixth would wait for a CPU forever."""
    import ray

    from launch.groups import actor_options, check_cpus

    placement = make_placement(apply_overrides(get_recipe("tiny"), ["learner.num_ranks=2"]))
    check_cpus(placement)

    @ray.remote
    class Slot:
        def ready(self) -> bool:
            return True

    actors = [Slot.options(**actor_options(slot, [])).remote() for slot in placement.actors]
    refs = [a.ready.remote() for a in actors]
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=120)
    assert not pending, f"{len(pending)} of {len(refs)} actors not placed"
    for a in actors:
        ray.kill(a)
