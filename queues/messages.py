"""Wire messages between the actors: msgspec Structs, msgpack-encoded, versioned.

Invariants:
- Every message carries `schema`; a decoder refuses a schema it does not know, with a one-line
  error, instead of misreading fields. Schema 2 added per-token policy versions (`Sample.versions`);
  a schema-1 message still decodes and its tokens all carry the group's `policy_version`.
  Schema 3 added per-token loss masks (`Sample.loss_mask`, `TrainGroup.loss_masks`) for multi-turn
  episodes; a schema-1/2 message decodes with empty masks: every response token is the model's.
- Loss masks: empty (every token is trained) or packed int32 0/1, one per response token
  (`sample_loss_mask`). 0 marks an observation token (a tool's output appended to the episode,
  never sampled: its behaviour log-prob is 0.0 and it never reaches the loss).
- Per-token versions: `Sample.versions` is empty (every token was produced by the group's
  `policy_version`) or packed int32, one per token, non-decreasing (a partial rollout continued
  across weight updates). A group's `policy_version` is its OLDEST token's version
  (`oldest_version`), the one staleness admission counts.
- Token ids travel as packed little-endian int32 bytes and per-token floats as float32 bytes,
  never as Python lists (a 16 x 1,200-token group is ~77 KB, not ~1 MB of msgpack ints).
- A RolloutGroup holds its prompt once (inside its PromptTask), however many samples it has.
- One encoder and one decoder per type, built once and reused (see `codec`).
"""
from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import numpy as np

SCHEMA = 3
READABLE_SCHEMAS = (1, 2, 3)  # schema 1: no Sample.versions; 1-2: no loss masks


class SchemaError(ValueError):
    """A message whose schema version this code does not understand."""


def pack_ids(ids: Any) -> bytes:
    """Token ids (list, tuple, ndarray or tensor) -> packed int32 bytes."""
    if hasattr(ids, "detach"):  # torch tensor, without importing torch here
        ids = ids.detach().cpu().numpy()
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype="<i4")


def pack_floats(values: Any) -> bytes:
    if hasattr(values, "detach"):
        values = values.detach().float().cpu().numpy()
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_floats(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype="<f4")


# -- task ids: built and parsed only here --------------------------------------------------------
# A training task is "<step>:<slot>:<attempt>", an eval task "eval:<step>:<tag><k>", a turn of a
# multi-turn episode asks the engine as "<task id>/e<episode>t<turn>".

EVAL_PREFIX = "eval:"


def train_task_id(step: int, slot: int, attempt: int = 0) -> str:
    return f"{step}:{slot}:{attempt}"


def eval_task_id(step: int, tag: str, k: int) -> str:
    return f"{EVAL_PREFIX}{step}:{tag}{k}"


def episode_turn_id(task_id: str, episode: int, turn: int) -> str:
    return f"{task_id}/e{episode}t{turn}"


def is_eval_task(task_id: str) -> bool:
    return task_id.startswith(EVAL_PREFIX)


def task_step(key: str) -> int | None:
    """The step a task id or memo key belongs to: "<step>:<slot>:<attempt>", "eval:<step>:<tag><k>" or a
    step number; None for anything else."""
    head = key[len(EVAL_PREFIX):] if is_eval_task(key) else key
    head = head.split(":", 1)[0]
    return int(head) if head.lstrip("-").isdigit() else None


class Message(msgspec.Struct, kw_only=True, omit_defaults=False):
    schema: int = SCHEMA


class PromptTask(Message, kw_only=True):
    """One prompt to sample `n` completions for, published by the coordinator."""

    task_id: str  # unique per (step, slot, attempt): "<step>:<slot>:<attempt>"
    prompt_id: str  # the dataset question id; eval tasks start with "eval:"
    step: int  # the training step this prompt belongs to (-1 for eval)
    policy_version: int  # the policy version current when the task was published
    prompt_tokens: bytes  # packed int32
    n: int
    db_id: str = ""
    db_path: str = ""  # absolute path of the SQLite file the SQL runs against
    gold_sql: str = ""
    difficulty: str = ""
    # Per-task sampling overrides (e.g. greedy for eval): merged over the generator's config.
    sampling: dict[str, Any] = {}
    published_at: float = 0.0


class Sample(msgspec.Struct, kw_only=True):
    """One completion of a prompt."""

    tokens: bytes  # packed int32, the sampled completion tokens only
    logprobs: bytes  # packed float32, the sampler's log-prob of each sampled token
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    text: str = ""
    versions: bytes = b""  # packed int32, the policy version of each token; b"": all the group's
    loss_mask: bytes = b""  # packed int32 0/1 per token (0: an observation token); b"": all ones
    # Multi-turn episodes (generator.max_turns > 1; policies/episode.py). One-shot samples keep the defaults.
    turns: int = 1  # model turns in the episode
    queries: list[str] = []  # the SQL the model ran, in order
    tool_errors: int = 0  # queries that errored or timed out
    answer: str = ""  # the final SQL the reward scores; "": the scorer extracts it from `text`
    executor_wait_s: float = 0.0  # seconds the episode waited on its queries


def sample_versions(sample: Sample, group_version: int) -> np.ndarray:
    """The policy version of each of `sample`'s tokens (int32 array, one per token)."""
    n = len(sample.tokens) // 4
    if not sample.versions:
        return np.full(n, group_version, dtype="<i4")
    v = unpack_ids(sample.versions)
    if len(v) != n:
        raise ValueError(f"Sample.versions has {len(v)} entries for {n} tokens")
    return v


def unpack_loss_mask(buf: bytes, n: int, field: str = "loss_mask") -> "np.ndarray | None":
    """A packed 0/1 loss mask -> a bool array of `n` entries, or None when `buf` is empty (all ones).

    A mask of another length, or with a value other than 0 or 1, is a ValueError naming `field`."""
    if not buf:
        return None
    if len(buf) % 4:
        raise ValueError(f"{field} is {len(buf)} bytes, not packed int32")
    m = unpack_ids(buf)
    if len(m) != n:
        raise ValueError(f"{field} has {len(m)} entries for {n} tokens")
    if ((m != 0) & (m != 1)).any():
        raise ValueError(f"{field} holds values other than 0 and 1")
    return m.astype(bool)


def oldest_version(group: "RolloutGroup") -> int:
    """The version of the group's oldest token (its policy_version when no sample says more)."""
    olds = [int(unpack_ids(s.versions).min()) for s in group.samples if s.versions]
    return min([group.policy_version, *olds])


class RolloutGroup(Message, kw_only=True):
    """The n completions of one PromptTask, published by a generator as soon as they finish."""

    task: PromptTask
    samples: list[Sample]
    policy_version: int  # the weights version that produced the samples' first tokens (the oldest)
    generator_id: str = ""
    error: str = ""  # non-empty: the task could not be generated (samples may be empty)
    queued_at: float = 0.0  # when the generator pulled the task
    started_at: float = 0.0
    finished_at: float = 0.0
    published_at: float = 0.0


class ScoredGroup(Message, kw_only=True):
    """A RolloutGroup with one reward and one verdict per sample, published by a scorer."""

    rollout: RolloutGroup
    rewards: list[float]
    verdicts: list[str]  # "match" | "wrong_result" | "sql_error" | "timeout" | "no_sql" | "too_many_rows" | "gold_failed" | "generation_error"
    gold_failed: bool = False
    scorer_id: str = ""
    score_seconds: float = 0.0
    scored_at: float = 0.0
    # Per sample: the reward the episode's first query would have earned as its answer (the final
    # answer's reward when it ran none); [] for one-shot groups. revision_gain = rewards - these.
    first_query_rewards: list[float] = []


class TrainGroup(msgspec.Struct, kw_only=True):
    """One prompt's samples as the learner needs them; the prompt is stored once."""

    prompt_id: str
    prompt_tokens: bytes  # packed int32
    completions: list[bytes]  # packed int32, one per sample
    gen_logprobs: list[bytes]  # packed float32, the sampler's log-probs, one per sample
    advantages: list[float]  # one per sample, broadcast over its tokens
    rewards: list[float]
    policy_version: int
    # Packed int32 0/1 per completion token, one per sample (Sample.loss_mask); [] or b"": all ones.
    loss_masks: list[bytes] = []


class TrainBatch(Message, kw_only=True):
    """Everything the learner trains on for one step, published by the assembler.

    `micro_batches` is the packing plan: each micro-batch lists (group, sample) pairs whose
    prompt+completion sequences are concatenated into one packed sequence under the learner's
    token budget. `minibatches` groups micro-batch indices into optimizer steps.
    """

    step: int
    policy_version: int
    groups: list[TrainGroup]
    micro_batches: list[list[tuple[int, int]]]
    minibatches: list[list[int]]
    num_tokens: int = 0
    metrics: dict[str, float] = {}


class Event(Message, kw_only=True):
    """Actor -> coordinator notices: progress, drops, replacements, metrics (all scalars)."""

    kind: str  # "generated" | "scored" | "dropped" | "batch_ready" | "replace" | "metrics" | "error"
    source: str
    step: int = -1
    prompt_id: str = ""
    task_id: str = ""
    reason: str = ""
    values: dict[str, float] = {}
    at: float = 0.0


T = TypeVar("T", bound=Message)


class Codec:
    """A reused msgpack encoder/decoder pair for one message type."""

    def __init__(self, kind: type[T]):
        self.kind = kind
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(kind)

    def encode(self, msg: Message) -> bytes:
        return self._enc.encode(msg)

    def decode(self, buf: bytes):
        try:
            msg = self._dec.decode(buf)
        except msgspec.ValidationError as e:
            raise SchemaError(f"cannot decode {self.kind.__name__}: {e}") from None
        if msg.schema not in READABLE_SCHEMAS:
            raise SchemaError(f"{self.kind.__name__} has schema {msg.schema}, this code reads schemas "
                              f"{', '.join(map(str, READABLE_SCHEMAS))}")
        return msg


_CODECS: dict[type, Codec] = {}


def codec(kind: type[T]) -> Codec:
    c = _CODECS.get(kind)
    if c is None:
        c = _CODECS[kind] = Codec(kind)
    return c
