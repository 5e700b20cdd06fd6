"""Partial rollouts on vLLM: interrupt running requests at a weight update, resubmit them after it.

Used by VLLMEngine (actors/engines/vllm_engine.py) once `enable_partial()` was called, which the
generator shell does in async mode with `generator.partial_rollouts` (colocated mode keeps the
one-request-per-prompt FINAL_ONLY path).

Invariants:
- A group of n samples is n requests of n=1 with DELTA outputs, each over prompt + the tokens its
  row already has: the engine itself accumulates every row's tokens, log-probs, text and, per
  token, the version current when the request producing it was submitted (weights only change
  while no request runs: `interrupt()` aborts them all and returns once none streams).
- A request that ends because of `interrupt()` leaves its row unfinished; its group waits at the
  gate and resubmits only the unfinished rows on `continue_interrupted()`, with max_tokens reduced
  by what the row has. Tokens and log-probs kept from before stay as they were; nothing repeats.
- A request ended by `abort()` (the user's stop), or a stream that ends without a finish reason
  outside an interruption, finishes its row with "abort": no group resubmits forever.
- Known limit: a stop string that straddles the resubmission point is not seen by vLLM (each
  request checks its own output); the row then runs on to its next stop or max_tokens.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from queues.messages import PromptTask, RolloutGroup, Sample, pack_floats, pack_ids, unpack_floats, unpack_ids


@dataclass
class _Row:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish: str = ""


class PartialRequests:
    """Mixin for VLLMEngine: needs self.llm, self.version, self._inflight, self._ids, self._m, and
    the module's `_sym` / `sample_from_completion` passed in as `_sym_fn` / `_sample_fn`."""

    _partial = False
    _interrupting = False
    _streaming = 0
    _parked = 0
    _abort_epoch = 0
    _go: asyncio.Event | None = None

    def enable_partial(self) -> None:
        self._partial = True
        self._aborted: set[str] = set()
        self._row_ids = itertools.count()

    @property
    def supports_partial(self) -> bool:
        return self._partial

    async def interrupt(self, timeout_s: float = 60.0) -> int:
        if not self._partial:
            raise RuntimeError("vLLM engine: partial rollouts are off (async mode with generator.partial_rollouts)")
        self._interrupting, self._go = True, asyncio.Event()
        ids = list(self._inflight)
        if ids:
            await self.llm.abort(request_id=ids)
        deadline = time.monotonic() + timeout_s
        while self._streaming:
            if time.monotonic() > deadline:
                raise RuntimeError(f"interrupt: {self._streaming} vLLM requests still streaming after {timeout_s} s")
            await asyncio.sleep(0.005)
        await asyncio.sleep(0)  # let every group whose requests just ended reach the gate
        return self._parked

    def continue_interrupted(self) -> int:
        parked, self._interrupting = self._parked, False
        if self._go is not None:
            self._go.set()
        return parked

    def _abort_partial(self) -> None:
        """abort(): rows of the running requests end "abort", and parked groups end too."""
        self._aborted.update(self._inflight)
        self._abort_epoch += 1
        self._interrupting = False
        if self._go is not None:
            self._go.set()

    async def _generate_partial(self, task: PromptTask, s: Any, ids: list[int], limit: int) -> RolloutGroup:
        rows = [_Row() for _ in range(s.n)]
        started, version = time.time(), self.version
        while any(not r.finish for r in rows):
            if self._interrupting:
                epoch = self._abort_epoch
                self._parked += 1
                try:
                    await self._go.wait()
                finally:
                    self._parked -= 1
                if epoch != self._abort_epoch:  # abort() while parked
                    for r in rows:
                        r.finish = r.finish or "abort"
                    break
            await asyncio.gather(*(self._stream_row(task, s, ids, limit, i, r) for i, r in enumerate(rows) if not r.finish))
        samples = [Sample(tokens=pack_ids(r.tokens), logprobs=pack_floats(r.logprobs), finish_reason=r.finish,
                          text=r.text, versions=pack_ids(r.versions) if any(v != version for v in r.versions) else b"")
                   for r in rows]
        finished = time.time()
        self._m["tokens"] += sum(len(r.tokens) for r in rows)
        self._m["busy_s"] += finished - started
        return RolloutGroup(task=task, samples=samples, policy_version=version, started_at=started, finished_at=finished)

    async def _stream_row(self, task: PromptTask, s: Any, ids: list[int], limit: int, i: int, row: _Row) -> None:
        remaining = limit - len(row.tokens)
        if remaining <= 0:
            row.finish = "length"
            return
        params = self._sym_fn("vllm.SamplingParams")(
            n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else -1, max_tokens=remaining,
            stop=s.stop or None, logprobs=0, seed=None if s.seed is None else s.seed + 7919 * i + len(row.tokens),
            skip_special_tokens=True, output_kind=self._sym_fn("vllm.sampling_params.RequestOutputKind.DELTA"))
        prompt = self._sym_fn("vllm.inputs.TokensPrompt")(prompt_token_ids=ids + row.tokens)
        request_id = f"{task.task_id}#{next(self._ids)}.{i}"
        version, reason = self.version, ""
        self._inflight.add(request_id)
        self._m["requests"] += 1
        self._streaming += 1
        try:
            async for out in self.llm.generate(prompt=prompt, sampling_params=params, request_id=request_id,
                                               **self._lora_kw()):
                for c in out.outputs:
                    delta = self._sample_fn(c) if c.token_ids else None
                    if delta is not None:
                        new = unpack_ids(delta.tokens).tolist()
                        row.tokens += new
                        row.logprobs += unpack_floats(delta.logprobs).tolist()
                        row.versions += [version] * len(new)
                    row.text += c.text or ""
                    reason = c.finish_reason or reason
        finally:
            self._inflight.discard(request_id)
            self._streaming -= 1
        if request_id in self._aborted:
            self._aborted.discard(request_id)
            row.finish = "abort"
        elif reason and reason != "abort":
            row.finish = reason if reason in ("stop", "length") else "error"
        elif not self._interrupting:
            row.finish = "abort"  # ended with no reason and no interruption: never resubmit it
