"""launch.cluster's command line: flags may stand anywhere among the recipe and its overrides (as the docs write them)."""
from launch.cluster import parse_args


def test_flag_after_recipe_and_before_overrides():
    a = parse_args(["gpu1_0p6b", "--dry-run", "learner.lr=1e-5", "cluster.gpu_memory_gib=80"])
    assert a.recipe == "gpu1_0p6b" and a.dry_run
    assert a.overrides == ["learner.lr=1e-5", "cluster.gpu_memory_gib=80"]


def test_flag_first_and_last():
    assert parse_args(["--dry-run", "tiny", "learner.lr=1e-5"]).overrides == ["learner.lr=1e-5"]
    a = parse_args(["tiny", "learner.lr=1e-5", "--print-config"])
    assert a.print_config and a.overrides == ["learner.lr=1e-5"]
