"""The transformers engine's requests and rows: what one prompt's n samples hold while they decode, when a row
ends, and the RolloutGroup a request becomes (actors/engines/hf.py runs the loop over them).

Invariants:
- A row ends with "stop" on an eos/pad token (the token kept in `tokens`, as vLLM does) or when a configured
  stop string appears in its decoded text (tokens kept up to and including the one completing the string,
  the text cut before the string), with "length" at max_tokens or at the model's last position; a row that
  never ended is "abort" after an abort, else "length".
- A row's log-probs and versions run beside its tokens, one per token; `versions` is sent only when they differ
  from the request's version (a partial rollout that spanned a weight update).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from actors.engines.base import SamplingSettings
from queues.messages import PromptTask, RolloutGroup, Sample, pack_floats, pack_ids


@dataclass(eq=False)
class Request:
    task: PromptTask
    params: SamplingSettings
    ids: list[int]
    future: asyncio.Future
    submitted_at: float
    started_at: float = 0.0
    version: int = 0
    rows: list["Row"] = field(default_factory=list)
    interrupted: int = 0  # times this request was parked by interrupt()


@dataclass(eq=False)
class Row:
    req: Request
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""
    text: str | None = None  # set when a stop string cut the text


def row_ended(row: Row, pos_next: int, eos_ids: set[int], max_model_len: int, tokenizer) -> bool:
    """Whether `row` ended with its last token (its finish_reason then set); `pos_next` is its next position."""
    p = row.req.params
    if row.tokens[-1] in eos_ids:
        row.finish_reason = "stop"
    elif p.stop and hit_stop(row, tokenizer):
        row.finish_reason = "stop"
    elif len(row.tokens) >= p.max_tokens or pos_next + 1 >= max_model_len:
        row.finish_reason = "length"
    return bool(row.finish_reason)


def hit_stop(row: Row, tokenizer) -> bool:
    """Whether a stop string completed in the row's text (then `row.text` is the text before it)."""
    stops = row.req.params.stop
    window = max(len(s) for s in stops) + 2  # a byte-level token is at least one byte
    tail = tokenizer.decode(row.tokens[-window:], skip_special_tokens=True)
    if not any(s in tail for s in stops):
        return False
    text = tokenizer.decode(row.tokens, skip_special_tokens=True)
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    if cut < 0:
        return False
    row.text = text[:cut]
    return True


def to_group(req: Request, tokenizer, abort: bool = False) -> RolloutGroup:
    """The request's RolloutGroup: a Sample per row (a row without one yet: no tokens)."""
    samples = []
    for row in req.rows or [Row(req=req) for _ in range(req.params.n)]:
        reason = row.finish_reason or ("abort" if abort else "length")
        text = row.text if row.text is not None else tokenizer.decode(row.tokens, skip_special_tokens=True)
        spans = any(v != req.version for v in row.versions)
        samples.append(Sample(tokens=pack_ids(row.tokens), logprobs=pack_floats(row.logprobs),
                              finish_reason=reason, text=text, versions=pack_ids(row.versions) if spans else b""))
    now = time.time()
    return RolloutGroup(task=req.task, samples=samples, policy_version=req.version,
                        started_at=req.started_at or now, finished_at=now)
