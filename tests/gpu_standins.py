"""A stand-in for the GPU actors that cannot start on a CPU machine (vLLM engines, CUDA learner ranks), for the
tests that place a recipe on a real local Ray cluster with logical GPUs (ray.cluster_utils.Cluster).

Invariant: built on launch.probe.Probe (so importing this module imports Ray: integration tests only); it
answers the calls the launcher makes on those actors (where it is, sleep, memory, the rendezvous) at once,
loads nothing, and reports where Ray put it and when it was built and put to sleep.
"""
from __future__ import annotations

import time

from launch.probe import Probe


class GpuStandIn(Probe):
    """Stands in for the GPU actors that cannot start here (vLLM engines, CUDA learner ranks): reports where it is."""

    def __init__(self, *args, device_ids=None, **kwargs):
        super().__init__("stand-in")
        self.device_ids = device_ids
        self.built_at, self.slept_at = time.time(), None

    def node_ip(self):  # LearnerGroup's rendezvous calls: where this rank is, where rank 0 listens, join
        import ray

        return ray.util.get_node_ip_address()

    def listen(self, host=None):
        return host or "127.0.0.1", 0

    def sleep(self, *args):  # the learner's, before engines start on its GPU (launch.create.create_actors)
        self.slept_at = time.time()

    def memory(self):  # a GPU process answers actors/device_memory.py's stats; no device here
        return {"reserved_gib": 0.0}

    def times(self):
        return self.built_at, self.slept_at

    def join(self, host, port, local=None):
        return None

    def got_device_ids(self):
        return self.device_ids
