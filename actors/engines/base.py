"""The inference-engine interface every generator drives, and the rules all engines share.

Invariants:
- `generate(task)` is one request for one prompt: it returns one RolloutGroup holding `n`
  samples, each with its sampled tokens, the sampler's log-prob of every sampled token, a
  finish reason and the decoded text (special tokens skipped). Concurrent calls are the
  engine's business to batch; a caller never waits for another prompt's samples.
- Sampling settings are the generator config's (temperature, top_p, top_k, max_tokens, stop,
  n = task.n) with `task.sampling` merged over them; an unknown override key is an error that
  names the key, never silently ignored (`resolve_sampling`).
- Weight versions: `load_weights(named_tensors, version)` is called once per bucket and only
  copies tensors; `finish_weight_update(version)` ends the update and is the ONE call that
  sets the engine's policy version. A group is stamped with the version current when its
  request started.
- Transports: the engine knows none. An engine whose weights live in other processes (vLLM's
  workers) has `loads_in_workers = True`, says how many workers it has (`num_workers`) and runs a
  transport's worker step in every one of them (`in_workers(key, step)`, weights.protocol);
  the transport then hands it messages instead of tensors. Every other engine takes tensors
  through `load_weights`.
- Partial rollouts (async mode): an engine with `supports_partial` parks its running requests on
  `interrupt()` (returns once nothing decodes; their `generate` calls stay pending) and continues
  them on `continue_interrupted()` from the tokens they have, under whatever weights it holds then.
  Every token's version is the version of the weights that produced it (`Sample.versions`); log-
  probs stay aligned with tokens; a group's `policy_version` is its first token's version.
- A task the engine cannot run (empty prompt, prompt too long for the model, n < 1, bad
  override) raises `TaskError` with a one-line message; the generator turns it into an error
  group and keeps serving.
- `dead()` says, in one line, why an engine can serve nothing more (vLLM's engine core process died
  under it), else None: the generator's health reports it and the coordinator restarts the generator.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Iterable

from config import GeneratorConfig
from queues.messages import PromptTask, RolloutGroup, unpack_ids


class TaskError(ValueError):
    """This task cannot be generated (the message is one line, naming the field)."""


class EngineAsleep(RuntimeError):
    """generate() or load_weights() on an engine whose weights are released."""


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "stop", "n", "seed")


@dataclass
class SamplingSettings:
    n: int
    temperature: float
    top_p: float
    top_k: int  # -1 or 0: no top-k
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def resolve_sampling(generator_cfg: GeneratorConfig, task: PromptTask) -> SamplingSettings:
    """Generator config merged with the task's overrides, checked (TaskError on a bad one)."""
    over = dict(task.sampling or {})
    unknown = sorted(set(over) - set(SAMPLING_KEYS))
    if unknown:
        raise TaskError(f"task {task.task_id}: unknown sampling override(s) {unknown}; known: {list(SAMPLING_KEYS)}")
    try:
        s = SamplingSettings(
            n=int(over.get("n", task.n)),
            temperature=float(over.get("temperature", generator_cfg.temperature)),
            top_p=float(over.get("top_p", generator_cfg.top_p)),
            top_k=int(over.get("top_k", generator_cfg.top_k)),
            max_tokens=int(over.get("max_tokens", generator_cfg.max_tokens)),
            stop=list(over.get("stop", generator_cfg.stop) or []),
            seed=None if over.get("seed") is None else int(over["seed"]),
        )
    except (TypeError, ValueError) as e:
        raise TaskError(f"task {task.task_id}: bad sampling override: {e}") from None
    if s.n < 1:
        raise TaskError(f"task {task.task_id}: n must be >= 1, got {s.n}")
    if s.temperature < 0:
        raise TaskError(f"task {task.task_id}: sampling.temperature must be >= 0, got {s.temperature}")
    if not 0 < s.top_p <= 1:
        raise TaskError(f"task {task.task_id}: sampling.top_p must be in (0, 1], got {s.top_p}")
    if s.max_tokens < 1:
        raise TaskError(f"task {task.task_id}: sampling.max_tokens must be >= 1, got {s.max_tokens}")
    if not all(isinstance(x, str) and x for x in s.stop):
        raise TaskError(f"task {task.task_id}: sampling.stop must be non-empty strings, got {s.stop!r}")
    return s


def prompt_ids(task: PromptTask, max_model_len: int, vocab_size: int | None = None) -> list[int]:
    """The task's prompt token ids, checked: non-empty, in vocabulary, and short enough to
    leave room for at least one generated token (TaskError otherwise)."""
    if len(task.prompt_tokens) % 4:
        raise TaskError(f"task {task.task_id}: prompt_tokens is {len(task.prompt_tokens)} bytes, not packed int32")
    ids = unpack_ids(task.prompt_tokens).tolist()
    if not ids:
        raise TaskError(f"task {task.task_id}: prompt_tokens is empty")
    if len(ids) >= max_model_len:
        raise TaskError(f"task {task.task_id}: prompt is {len(ids)} tokens, the model's limit is {max_model_len} "
                        f"(max_position_embeddings) including at least one generated token")
    if vocab_size is not None:
        bad = [t for t in ids if t < 0 or t >= vocab_size]
        if bad:
            raise TaskError(f"task {task.task_id}: prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return ids


class Engine(abc.ABC):
    """One inference engine. Plain class: no Ray, no Redis."""

    version: int = 0
    loads_in_workers: bool = False  # True: the transport messages below are opened in the engine's workers
    supports_partial: bool = False  # True: interrupt() / continue_interrupted() below work

    async def interrupt(self, timeout_s: float = 60.0) -> int:
        """Parks every running request (see the module invariant); returns how many are parked."""
        raise NotImplementedError(f"{type(self).__name__} cannot interrupt requests (supports_partial is False)")

    def continue_interrupted(self) -> int:
        """Continues every parked request under the current weights; returns how many."""
        return 0

    def enable_partial(self) -> None:
        """Async mode with generator.partial_rollouts: switch to requests it can interrupt and resubmit where
        the engine must (vLLM: streaming per-sample requests); a no-op for the others."""

    def num_workers(self) -> int:
        """Worker processes that hold this engine's weights (vLLM: one per tensor-parallel rank)."""
        return 1

    async def in_workers(self, key: Any, step: dict, timeout: float | None = 600.0) -> list:
        """Runs `step` (a weight-sync transport's worker step as plain builtins, weights.protocol.to_worker)
        of transport `key` in every worker; each worker's result."""
        raise NotImplementedError(f"{type(self).__name__} takes tensors through load_weights")

    @abc.abstractmethod
    async def generate(self, task: PromptTask) -> RolloutGroup:
        """n samples of one prompt (raises TaskError for a task it cannot run)."""

    @abc.abstractmethod
    async def sleep(self, level: int) -> None:
        """Releases memory: level 1 offloads weights (kept on CPU) and frees the KV cache;
        level 2 discards weights too (a later wake(["weights"]) needs load_weights)."""

    @abc.abstractmethod
    async def wake(self, tags: list[str] | None = None) -> None:
        """Re-allocates what sleep released; tags is a subset of ["weights", "kv_cache"], None = all."""

    @abc.abstractmethod
    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Copies one bucket of (HF parameter name, tensor) pairs into the model; does not
        change the version (see finish_weight_update)."""

    @abc.abstractmethod
    async def finish_weight_update(self, version: int) -> None:
        """Ends a weight update: from now on groups are stamped with `version`."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Stops every in-flight request; their groups come back with finish_reason "abort"."""

    @abc.abstractmethod
    def stats(self) -> dict[str, float]:
        """Scalars only."""

    async def close(self) -> None:  # optional
        return None

    async def memory(self) -> dict[str, float]:
        """The engine's device memory (actors/device_memory.py: GiB, peaks since the last call); {} where it
        holds none (CPU, simulated)."""
        return {}

    def dead(self) -> str | None:
        """Why this engine can serve nothing more (module invariant), or None while it can."""
        return None


class DeferredEngine(Engine):
    """An engine not built until its first wake(): what a colocated generator that Ray restarted
    holds, so that coming back costs no device memory while the learner may be training on the
    same GPU (a vLLM engine takes its weights and `gpu_memory_utilization` of KV cache the moment
    it is built). Until then it behaves as an engine asleep at level 2: generate() and
    load_weights() raise EngineAsleep, sleep() is a no-op, the version is kept for the engine."""

    def __init__(self, build: Any):
        self._build = build  # () -> Engine, run in a thread: loading a model blocks for seconds
        self.engine: Engine | None = None
        self._version = 0
        self._lock = None

    @property
    def built(self) -> bool:
        return self.engine is not None

    @property
    def version(self) -> int:  # type: ignore[override]
        return self.engine.version if self.engine is not None else self._version

    @version.setter
    def version(self, value: int) -> None:
        if self.engine is not None:
            self.engine.version = value
        else:
            self._version = value

    async def generate(self, task: PromptTask) -> RolloutGroup:
        if self.engine is None:
            raise EngineAsleep("engine not built yet (restarted while colocated): wake it first")
        return await self.engine.generate(task)

    async def sleep(self, level: int) -> None:
        if self.engine is not None:
            await self.engine.sleep(level)

    async def wake(self, tags: list[str] | None = None) -> None:
        import asyncio

        check_wake_tags(tags)
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # concurrent wakes build once
            if self.engine is None:
                engine = await asyncio.to_thread(self._build)
                engine.version = self._version
                self.engine = engine
        await self.engine.wake(tags)

    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        if self.engine is None:
            raise EngineAsleep("load_weights on an engine not built yet: wake(['weights']) first")
        await self.engine.load_weights(named_tensors, version)

    async def finish_weight_update(self, version: int) -> None:
        if self.engine is None:
            raise EngineAsleep("finish_weight_update on an engine not built yet: wake(['weights']) first")
        await self.engine.finish_weight_update(version)

    @property
    def loads_in_workers(self) -> bool:  # type: ignore[override]
        return self.engine is not None and self.engine.loads_in_workers

    def _built(self, what: str) -> Engine:
        if self.engine is None:
            raise EngineAsleep(f"{what} on an engine not built yet: wake(['weights']) first")
        return self.engine

    def num_workers(self) -> int:
        return self.engine.num_workers() if self.engine is not None else 1

    async def in_workers(self, key: Any, step: dict, timeout: float | None = 600.0) -> list:
        return await self._built("in_workers").in_workers(key, step, timeout=timeout)

    @property
    def supports_partial(self) -> bool:  # type: ignore[override]
        return self.engine is not None and self.engine.supports_partial

    async def interrupt(self, timeout_s: float = 60.0) -> int:
        return await self._built("interrupt").interrupt(timeout_s)

    def continue_interrupted(self) -> int:
        return self.engine.continue_interrupted() if self.engine is not None else 0

    def abort(self) -> None:
        if self.engine is not None:
            self.engine.abort()

    def stats(self) -> dict[str, float]:
        out = self.engine.stats() if self.engine is not None else {}
        return {**out, "engine_built": float(self.engine is not None)}

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()

    async def memory(self) -> dict[str, float]:
        return await self.engine.memory() if self.engine is not None else {}

    def dead(self) -> str | None:
        return self.engine.dead() if self.engine is not None else None


def check_wake_tags(tags: list[str] | None) -> list[str]:
    if tags is None:
        return ["weights", "kv_cache"]
    bad = [t for t in tags if t not in ("weights", "kv_cache")]
    if bad:
        raise ValueError(f"wake tags must be a subset of ['weights', 'kv_cache'], got {bad}")
    return list(tags)


def set_visible_devices(device_ids: Any, generator_cfg: GeneratorConfig | None = None, environ: dict | None = None) -> str:
    """CUDA_VISIBLE_DEVICES = the engine's node-local GPU ids (the placement's, as Ray reports them);
    call before anything initialises CUDA in this process. One-line ValueError naming `device_ids`."""
    import os

    env = os.environ if environ is None else environ
    if not isinstance(device_ids, (list, tuple)) or not device_ids:
        raise ValueError(f"generator device_ids must be a non-empty list of GPU ids, got {device_ids!r}")
    ok = all((isinstance(d, int) and not isinstance(d, bool) and d >= 0) or (isinstance(d, str) and d.isdigit())
             for d in device_ids)
    if not ok:
        raise ValueError(f"generator device_ids must be non-negative GPU ids, got {device_ids!r}")
    ids = [int(d) for d in device_ids]
    if len(set(ids)) != len(ids):
        raise ValueError(f"generator device_ids lists a GPU twice: {ids}")
    tp = None if generator_cfg is None else generator_cfg.tensor_parallel_size
    if tp is not None and int(tp) != len(ids):
        raise ValueError(f"generator device_ids has {len(ids)} GPU(s), generator.tensor_parallel_size is {tp}")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in ids)
    return env["CUDA_VISIBLE_DEVICES"]
