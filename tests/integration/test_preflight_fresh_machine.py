"""--preflight --simulate on a machine where Ray never ran: no /tmp/ray (launch/preflight.py simulated_cluster).

Its own module: test_preflight.py's clusters stay connected for their module, and a second ray.init would be refused.
"""
from config.placement import make_placement
from config.recipes import get_recipe
from launch.preflight import _restore, simulated_cluster


def test_simulation_on_a_machine_without_ray_s_temp_dir_leaves_its_address_file_as_found(tmp_path, monkeypatch):
    """A fresh machine has no /tmp/ray: Ray's Cluster still writes its address there (its own temp dir does not
    move that file) and failed with FileNotFoundError from deep inside Ray (seen in CI on a new machine, where
    test_async_one_gpu's cluster was the run's first Ray). RAY_TMPDIR stands in for /tmp here."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    address_file = tmp_path / "ray" / "ray_current_cluster"
    with simulated_cluster(make_placement(get_recipe("tiny"))) as cluster:
        assert address_file.read_text() == cluster.address
    assert not address_file.exists()  # none before, none after
    _restore(address_file, b"10.0.0.7:6379")  # a user's cluster recorded there before: put back as it was
    assert address_file.read_bytes() == b"10.0.0.7:6379"
