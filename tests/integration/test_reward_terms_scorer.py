"""Partial reward terms in the real scorer (its SQL worker processes) on a synthetic SQLite database: added only when
asked."""
import pytest

from actors.scorer import Scorer
from config import ScorerConfig
from tests.builders import rollout_group, synthetic_question


@pytest.fixture(scope="module")
def question(tmp_path_factory):
    return synthetic_question(tmp_path_factory, "scorer", seed=2)


async def test_real_scorer_adds_the_terms_only_when_asked(question):  # noqa: F811
    texts = [f"```sql\n{question.sql}\n```", "```sql\nSELECT 42\n```", "no idea", "```sql\nSELEC broken\n```"]
    kw = dict(workers=1, timeout_s=2.0, max_rows=1000, memory_mb=1024, temp_store_mb=64, gold_cache_size=8)
    plain, shaped = Scorer(ScorerConfig(**kw)), Scorer(ScorerConfig(**kw, reward_syntax=0.1, reward_format=0.05))
    try:
        a = await plain.score(rollout_group(question, texts))
        b = await shaped.score(rollout_group(question, texts))
    finally:
        plain.close(), shaped.close()
    assert a.rewards == [1.0, 0.1, 0.0, 0.0]  # today's
    assert a.verdicts == b.verdicts
    assert b.rewards == pytest.approx([1.15, 0.25, 0.0, 0.05])

