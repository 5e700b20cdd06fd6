"""gpu1_0p6b_async's placement built by the launcher on a real local Ray cluster of its shape: one node, one
logical GPU (ray.cluster_utils.Cluster, launch.preflight.simulated_cluster). No GPU exists here: the engine and
the learner rank are stand-ins (tests/gpu_standins.py) that report where Ray put them and when they were
built and put to sleep."""
import pytest

from config import apply_overrides
from config.placement import make_placement
from config.recipes import get_recipe
from launch.preflight import simulated_cluster
from tests.gpu_standins import GpuStandIn

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster_1gpu():
    with simulated_cluster(make_placement(apply_overrides(get_recipe("gpu1_0p6b_async"), []))) as cluster:
        yield cluster


def test_async_on_one_gpu_places_engine_and_rank_on_one_bundle_learner_asleep_first_fake_gpu_actors_stand_in(
        cluster_1gpu, monkeypatch, tmp_path):
    """gpu1_0p6b_async: the engine and the learner rank share one bundle's one (logical) GPU, and the
    launcher builds the learner and puts it to sleep before the engine's actor exists (so vLLM's start-up
    profile sees a quiet device), marking both phases' memory."""
    import ray
    import structlog

    import actors.assembler
    import actors.generator.shell
    import actors.learner.shell
    import actors.scorer
    from config import RunContext
    from launch.create import create_actors
    from launch.groups import remove_groups
    from launch.startup_memory import StartupMemory

    for module, name in ((actors.generator.shell, "GeneratorShell"), (actors.learner.shell, "LearnerShell"),
                         (actors.scorer, "ScorerShell"), (actors.assembler, "Assembler")):
        monkeypatch.setattr(module, name, GpuStandIn)
    memory = StartupMemory(structlog.get_logger("test"), enabled=True, timeout_s=120)
    learner, generators, scorers, assembler, placement, groups = create_actors(
        apply_overrides(get_recipe("gpu1_0p6b_async"), []), RunContext(run_id="async1", run_dir=str(tmp_path)),
        "/no/model", 1, names="async1", memory=memory)
    try:
        assert placement.shared and placement.weight_sync == "cuda_ipc"
        (rank,), (engine,) = learner.ranks, generators
        rank_report, engine_report = ray.get([rank.report.remote(), engine.report.remote()], timeout=120)
        assert rank_report["gpu_ids"] == engine_report["gpu_ids"] == ray.get(engine.got_device_ids.remote())
        assert len(rank_report["gpu_ids"]) == 1
        (_, slept), (engine_built, _) = ray.get([rank.times.remote(), engine.times.remote()], timeout=60)
        assert slept is not None and slept <= engine_built
        assert [r["phase"] for r in memory.rows] == ["learner built", "learner asleep"]
        assert memory.rows[0]["learner_reserved_gib"] == 0.0
    finally:
        remove_groups(groups)
