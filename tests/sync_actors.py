"""The real Ray shells of a learner and generators (transformers engine) with a Coordinator over them, built as
the launcher builds them, for the tests of the weight-sync and heal paths through Ray; and what those tests
read back (the learner's weights, the names an engine holds differently).

Invariant: the caller holds a local Ray (tests/clusters.py); nothing here starts one, nor Redis or an assembler.
"""
from __future__ import annotations

import torch

from actors.coordinator.coordinator import Coordinator
from config import RunContext, apply_overrides
from config.recipes import tiny
from tasks.tiny_model import build_tiny


def learner_weights(shell) -> dict[str, torch.Tensor]:
    return shell.learner.state_dict_hf()


def engine_mismatches(actor, want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensor in this generator's engine is not bit-identical to the learner's."""
    engine = getattr(actor.gen.engine, "engine", actor.gen.engine)  # a DeferredEngine's built one
    return sorted(n for n, t in want.items() if not torch.equal(engine._params[engine._aliases[n]].detach().cpu(), t))


class RecordingLog:
    """Stands in for the coordinator's structlog logger: (level, event) of each call."""

    def __init__(self):
        self.events: list[tuple[str, str]] = []

    def info(self, event: str, **kw) -> None:
        self.events.append(("info", event))

    def warning(self, event: str, **kw) -> None:
        self.events.append(("warning", event))


def learner_generators_coordinator(tmp_path, weight_sync: str, colocated: list[bool], overrides: tuple = ()):
    """A LearnerActor on a fresh tiny model, one GeneratorActor per flag (Ray restarts them: their
    class's RAY_OPTIONS) and a Coordinator over them (no Redis, no assembler: only its sync and heal
    paths are called), built as the launcher builds them (actors.shell.spawn)."""
    from actors.generator.shell import GeneratorShell
    from actors.learner.shell import LearnerShell
    from actors.shell import spawn

    cfg = apply_overrides(tiny(), list(overrides))
    cfg.coordinator.weight_sync = weight_sync
    model_dir = build_tiny(str(tmp_path / "model"), model_cfg=cfg.model, seed=0)
    learner = spawn(LearnerShell, cfg.learner, RunContext(), options={"num_cpus": 0}, model_cfg=cfg.model,
                    model_path=model_dir, total_steps=10, micro_batch_tokens=cfg.assembler.micro_batch_tokens)
    gens = [spawn(GeneratorShell, cfg.generator, RunContext(), options={"num_cpus": 0}, model_cfg=cfg.model,
                  model_path=model_dir, colocated=flag) for flag in colocated]
    coord = Coordinator(cfg, RunContext(run_id="wsa", run_dir=str(tmp_path)), [], [], generators=gens, learner=learner,
                        assembler=None, log=RecordingLog())
    return learner, gens, coord
