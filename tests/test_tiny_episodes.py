"""tiny's multi-turn warm start (tasks/synthetic_episodes.py, launch/warm_start.py): error-then-fix
episodes built by concatenation, observed for real, masked, and the same answer mixture as one-shot."""
import random

import pytest
from transformers import AutoTokenizer

from config import ModelConfig, apply_overrides
from config.recipes import get_recipe
from policies import episode as ep
from tasks.bird import load_split
from tasks.synthetic import TINY_TEMPLATES, write_dataset
from tasks.synthetic_episodes import episode_target, misspelt
from tasks.tiny_model import build_tiny


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_ep")
    bird = write_dataset(root / "syn", num_databases=2, num_questions=60, seed=4, templates=list(TINY_TEMPLATES))
    tok = AutoTokenizer.from_pretrained(build_tiny(root / "model", model_cfg=ModelConfig(source="tiny"), seed=0))
    return load_split(bird, "train"), tok


def test_misspelt_swaps_one_identifier_and_never_a_keyword_or_a_value():
    rng = random.Random(0)
    sql = "SELECT COUNT(*) FROM customer WHERE city = 'Paris'"
    for _ in range(20):
        bad = misspelt(sql, rng)
        assert bad != sql and "'Paris'" in bad and bad.startswith("SELECT COUNT(*) FROM ")
        assert sum(a != b for a, b in zip(bad, sql)) == 2 and len(bad) == len(sql)
    assert misspelt("SELECT 1", rng) is None


def test_error_then_fix_episode_is_concatenated_observed_and_masked(data):
    questions, tok = data
    rng = random.Random(1)
    made = 0
    for q in questions[:20]:
        got = episode_target(tok, q.sql, q.db_path, rng, 32, error_first=True)
        if got is None:
            continue
        made += 1
        ids, mask = got
        final = tok(" " + q.sql, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert ids[-len(final):] == final and mask[-len(final):] == [1] * len(final)
        obs = [i for i, m in zip(ids, mask) if m == 0]
        text = tok.decode(obs)
        assert text.startswith(ep.OBS_OPEN) and text.endswith(ep.OBS_CLOSE) and "error:" in text and len(obs) <= 32
        call = ids[:mask.index(0)]
        assert tok.decode(call).startswith(ep.TOOL_OPEN) and tok.decode(call).endswith(ep.TOOL_CLOSE)
        assert ep.tool_query(tok.decode(call)) != q.sql  # the first query is the slip, the answer the fix
    assert made >= 10
    direct_ids, direct_mask = episode_target(tok, questions[0].sql, questions[0].db_path, rng, 32, error_first=False)
    assert 0 not in direct_mask and direct_ids[-1] == tok.eos_token_id


def test_tiny_mt_recipe_is_tiny_with_three_turns_and_error_fix_warm_start():
    mt, one = apply_overrides(get_recipe("tiny_mt"), []), apply_overrides(get_recipe("tiny"), [])
    assert (mt.generator.max_turns, one.generator.max_turns) == (3, 1)
    assert mt.model.tiny_sft_episodes > 0 and mt.model.tiny_sft_slip == one.model.tiny_sft_slip
    assert mt.coordinator.steps == one.coordinator.steps and mt.learner.lr == one.learner.lr
