"""The coordinator's calls to actors, each with a bound (shared/DESIGN.md: every wait has a bound).

A mixin of `actors.coordinator.coordinator.Coordinator`; it uses the coordinator's `cfg`, `generators`,
`learner` and `assembler`. A frozen actor (SIGSTOP, a stuck device, a lost node) is alive to Ray, so
no death notice ends a wait on it: every call here goes through `actors.shell.call_within` with the
bound `call_bound` gives it, and one past its bound raises ActorCallTimeout, one line naming the actor
(`generator-<i>`, `learner`, `assembler`) and the method, which the launcher handles as a death
(launch/run.py actor_died: a relaunch from the latest checkpoint, or that line). A generator is the
exception: Ray restarts it in place (actors.shell.RESTARTABLE), so one frozen past a control call's bound
is killed and restarted (`restart_frozen`, actors.shell.restart_in_place) and the call is made once more,
within the bound plus coordinator.call_timeout_s for the new instance to start; the run goes on
(heal_generators / the next sync give it the current weights; its pending prompts are taken back). A step's
wait for its groups that ends with some missing makes such a call (health) to every generator
(`restart_frozen_generators`), so a frozen generator holding them is restarted then, and the step waits for
them once more, served by the new instance, instead of failing them.

Invariants:
- `call_bound` is pure: coordinator.call_timeout_s on top of the wait the call is given itself (a
  generator's sleep or pause: generator.pause_timeout_s; the assembler's collect / collect_eval / peek
  and the learner's training step: coordinator.step_timeout_s).
- The learner (actors/learner/group.py LearnerGroup) bounds each rank's call itself and names the rank
  that did not answer; the coordinator's bound on a learner call is GROUP_SLACK_S later, so the group's
  line is the one the user reads.
- A frozen generator costs one restart in place per call, never more: if the call runs past its bound
  again on the new instance, that ActorCallTimeout goes to the launcher as before. Every restart is a
  warning naming the generator and the call, counted in `frozen_restarts` (saved with the cursor).
- The weight sync's verbs (the learner's send_weights, each generator's receive_weights) are bounded the
  same way (`bounded_verb`) without naming them as strings: the transport calls them as before.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from actors.shell import ActorCallTimeout, await_within, call_within, restart_in_place
from weights.base import maybe_await

# The learner group's own bound on a rank's call is the same as ours; ours waits this much longer so the
# group's line, which names the rank, is the one raised.
GROUP_SLACK_S = 10.0

# Calls that carry a wait of their own, and the config key (section, field) of that wait.
OWN_WAIT = {("generator", "sleep"): ("generator", "pause_timeout_s"),
            ("generator", "pause"): ("generator", "pause_timeout_s"),
            ("assembler", "collect"): ("coordinator", "step_timeout_s"),
            ("assembler", "collect_eval"): ("coordinator", "step_timeout_s"),
            ("assembler", "peek"): ("coordinator", "step_timeout_s"),
            ("learner", "train_from_stream"): ("coordinator", "step_timeout_s")}


def call_bound(cfg: Any, role: str, method: str) -> float:
    """Seconds the coordinator waits for `role`'s `method` (role: generator, learner, assembler)."""
    own = OWN_WAIT.get((role, method))
    extra = float(getattr(getattr(cfg, own[0]), own[1])) if own else 0.0
    return cfg.coordinator.call_timeout_s + extra + (GROUP_SLACK_S if role == "learner" else 0.0)


def bounded_verb(fn: Callable[[Any], Any], timeout_s: float, what: str) -> Callable[[Any], Any]:
    """A weight-sync verb (a Ray actor method's `.remote`, or a plain method) whose every call is bounded."""
    async def bounded(arg: Any) -> Any:
        return await await_within(maybe_await(fn(arg)), timeout_s, what)
    return bounded


class BoundedCalls:
    """_learner / _assembler / _generator_call / _all_generators for the Coordinator."""

    def generator_label(self, g: Any) -> str:
        return next((f"generator-{i}" for i, h in enumerate(self.generators) if h is g), "generator")

    # Kills a frozen generator so that Ray restarts it in place; False where it cannot (a plain object).
    restart_frozen: Callable[[Any], bool] = staticmethod(restart_in_place)

    async def _generator_call(self, g: Any, method: str, *args) -> Any:
        bound, label = call_bound(self.cfg, "generator", method), self.generator_label(g)
        try:
            return await call_within(bound, label, g, method, *args)
        except ActorCallTimeout as e:
            if not self.restart_frozen(g):
                raise
            self.frozen_restarts = getattr(self, "frozen_restarts", 0) + 1
            if getattr(self, "log", None) is not None:
                self.log.warning("generator frozen past its bound: restarted in place", generator=label, call=method,
                                 error=str(e))
        return await call_within(bound + self.cfg.coordinator.call_timeout_s, label, g, method, *args)

    async def restart_frozen_generators(self) -> int:
        """A bounded call (health) to every generator: one frozen past it is restarted in place
        (_generator_call). Returns how many were restarted; a step's wait that timed out with groups missing
        asks (coordinator.py _wait_generated), so a frozen generator is not first met by the next control call."""
        before = getattr(self, "frozen_restarts", 0)
        await self._all_generators("health", targets=[g for g in self.generators if hasattr(g, "health")])
        return getattr(self, "frozen_restarts", 0) - before

    async def _all_generators(self, method: str, *args, targets: list | None = None) -> list:
        """`method` on every generator (or `targets`) at once, each bounded."""
        gens = self.generators if targets is None else targets
        return list(await asyncio.gather(*(self._generator_call(g, method, *args) for g in gens)))

    async def _learner(self, method: str, *args) -> Any:
        return await call_within(call_bound(self.cfg, "learner", method), "learner", self.learner, method, *args)

    async def _assembler(self, method: str, *args) -> Any:
        return await call_within(call_bound(self.cfg, "assembler", method), "assembler", self.assembler, method, *args)
