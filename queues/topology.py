"""The run's streams, declared once: each stream's name, its one consumer group, who writes and who reads.

    coordinator --PromptTask--> prompts (generators) --RolloutGroup--> rollouts (scorers)
      --ScoredGroup--> scored (assembler) --TrainBatch--> batches (learner)
    every actor --Event--> events (coordinator)

Invariants:
- Every Redis key of a run is ``arl:<run>:<name>`` (``run_key``), so runs can share one Redis and
  ``purge_run`` drops a run's keys by that prefix alone.
- This module is the only place a stream's (or the run's hash's) name or consumer group is written:
  every stage opens its streams by these specs (``RunStreams.stream(PROMPTS)``), and the redis-cli
  lines the docs give come from ``redis_cli`` (``python -m queues.topology RUN_ID`` prints them).
- A stream has ONE consumer group, the stage that reads it; a publisher opens the same spec (its
  group is then only what ``ensure_group`` creates, never a second group that would keep the stream
  from being trimmed).
- Imports nothing of ours (queues/ is the ground floor, beside config/).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

KEY_FORMAT = "arl:{run}:{name}"


def run_key(run_id: str, name: str) -> str:
    """The Redis key of stream (or hash) `name` of run `run_id`."""
    return KEY_FORMAT.format(run=run_id, name=name)


@dataclass(frozen=True)
class StreamSpec:
    """One stream of the run: its name (the key's last part), the consumer group that reads it, who
    publishes to it and what (the msgspec type in queues.messages)."""

    name: str
    group: str
    producers: str
    message: str

    def key(self, run_id: str) -> str:
        return run_key(run_id, self.name)


@dataclass(frozen=True)
class HashSpec:
    """A run-scoped hash: its name and the stage that writes it."""

    name: str
    owner: str
    holds: str

    def key(self, run_id: str) -> str:
        return run_key(run_id, self.name)


PROMPTS = StreamSpec("prompts", group="generators", producers="coordinator", message="PromptTask")
ROLLOUTS = StreamSpec("rollouts", group="scorers", producers="generators", message="RolloutGroup")
SCORED = StreamSpec("scored", group="assembler", producers="scorers", message="ScoredGroup")
BATCHES = StreamSpec("batches", group="learner", producers="assembler", message="TrainBatch")
EVENTS = StreamSpec("events", group="coordinator", producers="every actor", message="Event")

# The data flow, in order: the streams the coordinator reports queue depths of.
DATA_FLOW: tuple[StreamSpec, ...] = (PROMPTS, ROLLOUTS, SCORED, BATCHES)
STREAMS: tuple[StreamSpec, ...] = (*DATA_FLOW, EVENTS)

# Each assembled step's result, written before its groups are acked (actors/assembler.py).
ASSEMBLED = HashSpec("assembled", owner="assembler", holds="step -> its outcomes (JSON)")


def redis_cli(run_id: str = "<run_id>", cli: str = "redis-cli") -> list[str]:
    """The redis-cli lines that show a run's queues, each with what it shows (docs/guide/operate.md
    holds them for `cli="redis-cli -s $S"`; tests/unit/test_topology.py keeps the two equal)."""
    rows = [
        (f"XLEN {ROLLOUTS.key(run_id)}", "entries kept (acked ones too, until trimmed)"),
        (f"XINFO GROUPS {ROLLOUTS.key(run_id)}", "consumers, pending, lag (= queue depth)"),
        (f"XPENDING {SCORED.key(run_id)} {SCORED.group}", "delivered, not yet acked"),
        (f"HKEYS {ASSEMBLED.key(run_id)}", f"steps the {ASSEMBLED.owner} has assembled"),
    ]
    return [f"{cli + ' ' + command:<58} # {what}" for command, what in rows]


def describe(run_id: str = "<run_id>") -> list[str]:
    """The topology as a table (key, group, written by, message), then the redis-cli lines."""
    rows = [f"{'key':<28} {'group':<12} {'written by':<12} message"]
    rows += [f"{s.key(run_id):<28} {s.group:<12} {s.producers:<12} {s.message}" for s in STREAMS]
    rows.append(f"{ASSEMBLED.key(run_id):<28} {'(hash)':<12} {ASSEMBLED.owner:<12} {ASSEMBLED.holds}")
    return rows + [""] + redis_cli(run_id)


def main(argv: list[str]) -> None:
    """`python -m queues.topology [RUN_ID]`: the table and the redis-cli lines for that run."""
    print("\n".join(describe(*argv[:1])))


if __name__ == "__main__":
    main(sys.argv[1:])
