"""Multi-turn SQL episodes: the protocol as pure functions (text and token ids in, text and ids out).

An episode (generator.max_turns = k > 1): the model may run a query before it answers by writing it
inside a tool block, `<sql>SELECT ...</sql>`. Generation stops at the block's closing tag; the query
runs read-only under the scorer's limits (tasks/executor.py); an observation block follows,

    <observation>
    name | year
    Alice | 1999
    (2 rows, first 1 shown)
    </observation>

holding the first rows with the column names, or the one-line error; then the model continues. The
episode ends when a turn ends without a tool block (its text holds the final answer, in the one-shot
format: a ```sql block or a bare query) or after k turns (then the last query it ran is the answer).

Invariants:
- Token in, token out: a sample's ids are the engine's sampled ids of every turn, each followed by
  the ids of its observation tokenized ALONE (`observation_ids`); the history is never decoded and
  re-tokenized, so no separator can be dropped at a turn boundary.
- Observation ids carry loss mask 0 and log-prob 0.0 (no behaviour log-prob); the model's ids carry
  mask 1 and the sampler's log-probs.
- A turn ends at its first tool-block close tag (`tool_block_end`), whatever the engine ran on to.
- An observation is at most `max_observation_tokens` ids and always ends with its closing tag.
- max_turns = 1 is the one-shot protocol exactly: no instructions are added to the prompt, no stop
  string, and the generator takes its one-shot path (tested token for token).
- `episode_metrics` turns a step's groups into scalars with the issue's names.
"""
from __future__ import annotations

import re
from typing import Any, Iterable

TOOL_OPEN, TOOL_CLOSE = "<sql>", "</sql>"
OBS_OPEN, OBS_CLOSE = "\n<observation>\n", "\n</observation>\n"
ROWS_SHOWN = 5  # rows an observation shows at most
CELL_CHARS = 40  # characters of one value an observation shows at most

_TOOL = re.compile(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), re.S)

INSTRUCTIONS = {
    "omnisql": ("\nYou may run read-only SQLite queries against the database before you answer: write one "
                f"inside {TOOL_OPEN} ... {TOOL_CLOSE} and you will see its first rows (or its error) inside "
                "<observation> ... </observation>. Use them to check and revise your query. You have {turns} "
                "turns in all; when you are sure, give the final SQL query in a ```sql code block.\n"),
    "compact": f"\n(run: {TOOL_OPEN}query{TOOL_CLOSE}, {{turns}} turns)",
}


def instructions(style: str, max_turns: int) -> str:
    """The text the prompt gains for a k-turn episode ("" for one turn: the one-shot prompt)."""
    if max_turns <= 1:
        return ""
    return INSTRUCTIONS.get(style, INSTRUCTIONS["omnisql"]).replace("{turns}", str(max_turns))


def tool_query(turn_text: str) -> str | None:
    """The query of the tool block a turn ended with, or None (no block: the turn is an answer)."""
    if not turn_text.rstrip().endswith(TOOL_CLOSE):
        return None
    blocks = _TOOL.findall(turn_text)
    if not blocks:
        return None
    sql = blocks[-1].strip().rstrip(";").strip()
    return sql or None


def tool_block_end(tokenizer, ids: list[int]) -> int | None:
    """How many of a turn's sampled ids end at its first tool-block close tag: the id that completes
    the tag is the last one kept (as an engine's stop string keeps it). None: no close tag. An engine
    that ran past the tag (a stop string straddling a partial rollout's resubmission, which vLLM does
    not see) gets its turn cut here; ids after the tag were never the episode's."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if TOOL_CLOSE not in text:
        return None
    lo, hi = 1, len(ids)  # the smallest prefix whose text holds the tag (a prefix's text grows with it)
    while lo < hi:
        mid = (lo + hi) // 2
        if TOOL_CLOSE in tokenizer.decode(ids[:mid], skip_special_tokens=True):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _cell(v: Any) -> str:
    text = "NULL" if v is None else str(v)
    text = text.replace("\n", " ").replace("|", "/")
    return text if len(text) <= CELL_CHARS else text[:CELL_CHARS - 3] + "..."


def observation_text(status: str, columns: list[str], rows: list[tuple], error: str = "") -> str:
    """The observation block's body: a small table with the column names, or the one-line error."""
    if status != "ok":
        line = (error or status).splitlines()[0] if (error or status) else status
        return f"error: {line}"
    if not rows:
        return (" | ".join(columns) + "\n" if columns else "") + "(0 rows)"
    lines = [" | ".join(map(str, columns))] if columns else []
    lines += [" | ".join(_cell(v) for v in row) for row in rows[:ROWS_SHOWN]]
    more = f", first {ROWS_SHOWN} shown" if len(rows) > ROWS_SHOWN else ""
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''}{more})")
    return "\n".join(lines)


def _encode(tokenizer, text: str) -> list[int]:
    out = tokenizer(text, add_special_tokens=False)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(i) for i in ids]


def observation_ids(tokenizer, body: str, max_tokens: int) -> list[int]:
    """The observation block's ids, tokenized alone: open tag + body + close tag, the body cut so the
    whole block is at most `max_tokens` ids (the close tag always kept)."""
    head, tail = _encode(tokenizer, OBS_OPEN), _encode(tokenizer, OBS_CLOSE)
    room = max(0, max_tokens - len(head) - len(tail))
    return head + _encode(tokenizer, body)[:room] + tail


def final_answer(last_turn_text: str, queries: list[str], extract) -> str:
    """The SQL the episode answers with: the last turn's answer (`extract`, the one-shot rule) when the
    episode ended by answering, else the last query it ran; "" when it has neither."""
    if tool_query(last_turn_text) is None:
        sql = extract(last_turn_text)
        if sql:
            return sql
    return queries[-1] if queries else ""


def episode_metrics(groups: Iterable[Any]) -> dict[str, float]:
    """Scalars over a step's scored groups (ScoredGroup): turns_mean, turns_max, tool_use_frac (episodes
    that ran a query before answering), obs_tokens_mean (per sample), tool_errors (count),
    executor_wait_s (sum), revision_gain (mean final reward minus the first query's reward)."""
    turns: list[int] = []
    used = obs = errors = 0
    wait = 0.0
    gains: list[float] = []
    for g in groups:
        for i, s in enumerate(g.rollout.samples):
            turns.append(int(s.turns))
            used += int(bool(s.queries))
            errors += int(s.tool_errors)
            wait += float(s.executor_wait_s)
            if s.loss_mask:
                n = len(s.loss_mask) // 4
                obs += n - _ones(s.loss_mask)
        if g.first_query_rewards and len(g.first_query_rewards) == len(g.rewards):
            gains += [r - f for r, f in zip(g.rewards, g.first_query_rewards)]
    n = len(turns)
    return {
        "turns_mean": sum(turns) / n if n else 0.0,
        "turns_max": float(max(turns, default=0)),
        "tool_use_frac": used / n if n else 0.0,
        "obs_tokens_mean": obs / n if n else 0.0,
        "tool_errors": float(errors),
        "executor_wait_s": wait,
        "revision_gain": sum(gains) / len(gains) if gains else 0.0,
    }


def _ones(mask: bytes) -> int:
    import numpy as np

    return int(np.frombuffer(mask, dtype="<i4").sum())
