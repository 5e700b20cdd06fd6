"""A local Ray cluster fits the recipe's CPU requests as written (config.placement.local_num_cpus):
`tiny learner.num_ranks=2` asks for more CPUs than a 2-core host has, and its cluster gets them."""
from config import apply_overrides
from config.placement import local_num_cpus, make_placement
from config.recipes import get_recipe


def test_tiny_with_two_learner_ranks_fits_a_two_core_host():
    # cluster.num_cpus=0: with tiny's own 2 the asks are sized to it instead (tests/integration/test_cpu_sizing.py)
    cfg = apply_overrides(get_recipe("tiny"), ["learner.num_ranks=2", "cluster.num_cpus=0"])
    placement = make_placement(cfg)
    want = sum(a.num_cpus for a in placement.actors)
    assert want > 2  # the case the issue hit: "the actors ask for 2.25 CPUs but the Ray cluster has 2"
    cpus = local_num_cpus(placement, host_cpus=2)
    assert cpus >= want and cpus == int(cpus)
    assert local_num_cpus(placement, host_cpus=64) is None  # they fit: Ray counts the host itself


def test_plain_tiny_keeps_the_host_count():
    placement = make_placement(get_recipe("tiny"))
    assert local_num_cpus(placement, host_cpus=16) is None
