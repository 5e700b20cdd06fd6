"""Value pools of the synthetic task (`data.synthetic_value_pool`, issue 25 point 1): every database names
its places and categories with words of its own, so a model cannot answer a held-out question by recalling
a training text and has to carry the question's value into the SQL.

With the domains' own word lists (16 places and 8 categories per domain, shared by every instance of a
domain), tiny's widened task has a few hundred distinct training texts, which a 354M model memorises in
a 500-step warm start: GRPO then sharpens answers to texts it has seen ~24 times and the held-out
figures barely move (docs/perf/vllm_sync.md). With a pool, database k's places and categories are
made-up names (`Tavrel`, `Osmundi`) drawn for it alone.

Invariants:
- Seeded and pure: `pools` depends only on its arguments (string-seeded RNGs, no hashing order).
- Disjoint: no name is given to two databases, nor to two columns, and none is a word of DOMAINS
  (so the held-out databases' values never appear in a training question).
- Names are Title case ASCII letters only (the SQL quotes them with no escaping; `LIKE` probes work).
- Off is nothing: tasks/synthetic.py calls this module only when the option is on, so its output with
  the option off is byte-identical to before.
"""
from __future__ import annotations

import random

_ONSETS = ("b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kr",
           "pl", "st", "tr", "sh", "th")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou")
_CODAS = ("", "", "n", "r", "l", "s", "m", "nd", "rk", "th")
CATEGORIES = 8  # categories per database, as the domains' own lists (template 8's counts depend on it)


def _name(rng: random.Random) -> str:
    syllables = rng.choice((2, 2, 3))
    word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)) + rng.choice(_CODAS)
    return word.capitalize()


def pools(seed: int, databases: int, places: int, reserved: set[str] = frozenset()) -> list[dict[str, list[str]]]:
    """[{"places": [...], "cats": [...]}] for `databases` databases in build order: `places` place names
    and CATEGORIES category names each, all distinct, none in `reserved`."""
    if places < 2:
        raise ValueError(f"value pool: need at least 2 places per database, got {places}")
    rng = random.Random(f"{seed}:value_pool")
    taken = {w.lower() for w in reserved}
    out = []
    for _ in range(databases):
        got: dict[str, list[str]] = {}
        for key, n in (("places", places), ("cats", CATEGORIES)):
            names: list[str] = []
            while len(names) < n:
                w = _name(rng)
                if w.lower() not in taken:
                    taken.add(w.lower())
                    names.append(w)
            got[key] = names
        out.append(got)
    return out
