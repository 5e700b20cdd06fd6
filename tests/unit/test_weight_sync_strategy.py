"""The one factory (weights.strategy) for every placement, and each transport's steps per learner rank."""
from __future__ import annotations

import pytest

from config import ConfigError, apply_overrides
from config.recipes import get_recipe
from weights import WeightSyncError
from weights.bucketed import Abort, Next
from weights.nccl import Export, Listen, Send
from weights.protocol import SenderStep, WorkerStep
from weights.strategy import REGISTRY, get_transport, transport_for


def _cfg(*overrides, recipe="tiny"):
    return apply_overrides(get_recipe(recipe), list(overrides))


@pytest.mark.parametrize("recipe, overrides, kind", [
    ("tiny", [], "object_store"),                                      # CPU
    ("gpu1_0p6b", [], "cuda_ipc"),                                     # colocated, one GPU
    ("bird_1p7b", [], "cuda_ipc"),                                     # colocated, 8 GPUs
    ("bird_1p7b", ["coordinator.mode=async", "generator.num_engines=4"], "nccl"),  # disaggregated
])
def test_factory_picks_the_placements_transport(recipe, overrides, kind):
    cfg = _cfg(*overrides, recipe=recipe)
    transport = transport_for(cfg.coordinator)
    assert cfg.coordinator.weight_sync == kind and transport.key.kind == kind
    assert transport.per_bucket == (kind != "nccl")


def test_every_registered_transport_imports_and_carries_its_key():
    for kind in REGISTRY:
        assert get_transport(kind).key.kind == kind


def test_an_unregistered_kind_and_the_removed_impl_key_are_one_line_errors():
    """coordinator.weight_sync_impl (vLLM's own weight transfer, removed after the H200 measurement of
    issue 23) is now an unknown key like any other, refused in one line."""
    with pytest.raises(WeightSyncError, match="no transport 'shm'") as e:
        get_transport("shm")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="unknown config key 'coordinator.weight_sync_impl'; closest: "
                                          "coordinator.weight_sync") as e:
        _cfg("coordinator.weight_sync_impl=vllm", recipe="gpu1_0p6b")
    assert "\n" not in str(e.value)


def test_fan_out_names_the_ranks_of_each_step_and_a_missing_step_is_one_line():
    store, ipc, nccl = (get_transport(k) for k in ("object_store", "cuda_ipc", "nccl"))
    ranks = lambda t, step, zero=0: [(r, type(c.step)) for r, c in t.fan_out(t.call(step), 4, zero)]  # noqa: E731
    assert ranks(store, Next()) == [(0, Next)]                           # rank 0 alone sends
    assert ranks(store, Next(), 3) == [(r, Next) for r in range(4)]      # ZeRO-3: every rank gathers
    assert ranks(store, Abort()) == [(r, Abort) for r in range(4)]       # an abort reaches every rank
    assert ranks(ipc, Next()) == [(r, Next) for r in range(4)]           # each rank its own GPU
    assert ranks(nccl, Send(1)) == [(0, Send)]
    assert ranks(nccl, Send(1), 3) == [(0, Send)] + [(r, Export) for r in (1, 2, 3)]
    assert ranks(nccl, Listen(2, 1), 3) == [(0, Listen)]

    class fly(SenderStep, frozen=True):  # a step no transport takes  # noqa: N801
        pass

    class fly_(WorkerStep, frozen=True, tag="fly"):  # noqa: N801
        pass

    for where, run in [("sender", lambda t: t.on_sender(None, fly())),
                       ("worker", lambda t: t.on_worker(None, {"type": "fly"})),
                       ("worker", lambda t: t.on_worker(None, fly_()))]:
        for t in (store, ipc, nccl):
            with pytest.raises(WeightSyncError, match=f"no {where} step 'fly'") as e:
                run(t)
            assert "\n" not in str(e.value)
