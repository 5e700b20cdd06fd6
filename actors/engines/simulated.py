"""SimulatedEngine: a latency model of a batching inference engine, for benchmarks and the planner.

Invariants:
- It never runs a model: tokens are random ids, log-probs are random negatives. It says so
  everywhere: every Sample.text starts with "[simulated]", stats() has simulated=1.0, and the
  finish reasons are the model's ("length" at max_tokens, else "stop").
- Response lengths are lognormal around `mean_response_tokens` (default 1,200) with a long tail
  (sigma 0.6), capped at max_tokens. Decoding runs in ticks: each tick emits one token for every
  live sequence (up to `max_concurrent_seqs`) and lasts `tick_s + per_seq_s * live` seconds, so
  throughput grows with concurrency and saturates like a real batch. A group returns when its
  n sequences end; prefill costs `prefill_s_per_token` per prompt token.
- Partial rollouts: `interrupt()` parks every group at its next tick (and holds new ones before
  their prefill) and returns once none ticks; `continue_interrupted()` lets them go on, each paying
  a prefill of prompt + the tokens it has. Every tick's tokens carry the version current at that
  tick (`Sample.versions`, empty when a sample never spanned two versions).
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from typing import Any, Iterable

from actors.engines.base import Engine, check_wake_tags, prompt_ids, resolve_sampling
from config import GeneratorConfig, ModelConfig
from queues.messages import PromptTask, RolloutGroup, Sample, pack_floats, pack_ids


class SimulatedEngine(Engine):
    def __init__(self, generator_cfg: GeneratorConfig, model_cfg: ModelConfig | None = None, model_path: str = "", *,
                 mean_response_tokens: float = 1200.0, sigma: float = 0.6, tick_s: float = 0.02,
                 per_seq_s: float = 0.0001, prefill_s_per_token: float = 1e-5, max_concurrent_seqs: int = 256,
                 vocab_size: int = 32000, max_model_len: int = 32768, seed: int = 0):
        self.cfg = generator_cfg
        self.version = 0
        self.mean_response_tokens = mean_response_tokens
        self.sigma = sigma
        self.tick_s, self.per_seq_s, self.prefill_s_per_token = tick_s, per_seq_s, prefill_s_per_token
        self.max_concurrent_seqs = max_concurrent_seqs
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.rng = random.Random(seed)
        self._live = 0
        self._ticking = 0  # groups inside their decode loop (parked ones included)
        self._parked = 0
        self._interrupting = False
        self._go: asyncio.Event | None = None
        self._asleep = False
        self._m = {"tokens": 0, "groups": 0, "busy_s": 0.0}

    def response_length(self, max_tokens: int) -> int:
        mu = math.log(self.mean_response_tokens) - self.sigma ** 2 / 2  # mean of the lognormal = mean_response_tokens
        return max(1, min(max_tokens, int(self.rng.lognormvariate(mu, self.sigma))))

    async def generate(self, task: PromptTask) -> RolloutGroup:
        s = resolve_sampling(self.cfg, task)
        ids = prompt_ids(task, self.max_model_len, self.vocab_size)
        if self._asleep:
            from actors.engines.base import EngineAsleep

            raise EngineAsleep("simulated engine is asleep: call wake() first")
        self._ticking += 1
        try:
            await self._gate()
            started, version = time.time(), self.version
            await asyncio.sleep(self.prefill_s_per_token * len(ids))
            lengths = [self.response_length(s.max_tokens) for _ in range(s.n)]
            tick_versions: list[int] = []
            # Sequences of this group tick together; the tick length reflects everyone live.
            self._live += s.n
            try:
                for _ in range(max(lengths)):
                    if self._interrupting:
                        self._live -= s.n
                        try:
                            await self._gate()
                        finally:
                            self._live += s.n
                        await asyncio.sleep(self.prefill_s_per_token * (len(ids) + len(tick_versions)))
                    live = min(self._live, self.max_concurrent_seqs)
                    await asyncio.sleep(self.tick_s + self.per_seq_s * live)
                    tick_versions.append(self.version)
            finally:
                self._live -= s.n
        finally:
            self._ticking -= 1
        samples = []
        for n_tok in lengths:
            tokens = [self.rng.randrange(self.vocab_size) for _ in range(n_tok)]
            lps = [-self.rng.expovariate(1.0) for _ in range(n_tok)]
            v = tick_versions[:n_tok]
            samples.append(Sample(tokens=pack_ids(tokens), logprobs=pack_floats(lps),
                                  finish_reason="length" if n_tok >= s.max_tokens else "stop",
                                  text=f"[simulated] {n_tok} random tokens",
                                  versions=pack_ids(v) if v and v[0] != v[-1] else b""))
        finished = time.time()
        self._m["tokens"] += sum(lengths)
        self._m["groups"] += 1
        self._m["busy_s"] += finished - started
        return RolloutGroup(task=task, samples=samples, policy_version=version, started_at=started, finished_at=finished)

    async def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self._asleep = True

    async def wake(self, tags: list[str] | None = None) -> None:
        if "weights" in check_wake_tags(tags):
            self._asleep = False

    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        for _ in named_tensors:
            pass

    async def finish_weight_update(self, version: int) -> None:
        self.version = int(version)

    def abort(self) -> None:
        pass

    # -- partial rollouts ---------------------------------------------------------------------

    supports_partial = True

    async def _gate(self) -> None:
        """Where a group waits while the engine is interrupted (it counts as parked meanwhile)."""
        if not self._interrupting:
            return
        if self._go is None:
            self._go = asyncio.Event()
        self._parked += 1
        try:
            await self._go.wait()
        finally:
            self._parked -= 1

    async def interrupt(self, timeout_s: float = 60.0) -> int:
        self._interrupting = True
        self._go = asyncio.Event()
        deadline = time.monotonic() + timeout_s
        while self._parked < self._ticking:
            if time.monotonic() > deadline:
                raise RuntimeError(f"interrupt: {self._ticking - self._parked} simulated groups still ticking "
                                   f"after {timeout_s} s")
            await asyncio.sleep(self.tick_s / 4)
        return self._parked

    def continue_interrupted(self) -> int:
        parked = self._parked
        self._interrupting = False
        if self._go is not None:
            self._go.set()
        return parked

    def stats(self) -> dict[str, float]:
        return {"simulated": 1.0, "engine_tokens_generated": float(self._m["tokens"]),
                "engine_groups_done": float(self._m["groups"]), "engine_live_seqs": float(self._live),
                "policy_version": float(self.version)}
