"""tiny's multi-turn warm start (tasks/synthetic_episodes.py, launch/warm_start.py): error-then-fix
episodes built by concatenation, observed for real, masked, and the same answer mixture as one-shot."""
import random

import pytest
from transformers import AutoTokenizer

from config import ConfigError, ModelConfig, apply_overrides
from config.recipes import get_recipe
from policies import episode as ep
from tasks.bird import load_split
from tasks.sandbox import execute_readonly
from tasks.synthetic import TINY_TEMPLATES, write_dataset
from tasks.synthetic_episodes import episode_target, misspelt, misspelt_value
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


def _episodes(questions, tok, seed: int, kind: str) -> list[tuple]:
    """(question, ids, mask) of every slip-then-fix episode made for the first 40 questions."""
    rng = random.Random(seed)
    made = [(q, episode_target(tok, q.sql, q.db_path, rng, 32, error_first=True, kind=kind)) for q in questions[:40]]
    return [(q, *got) for q, got in made if got is not None]


def test_error_then_fix_episode_is_concatenated_observed_and_masked(data):
    questions, tok = data
    rng = random.Random(1)
    made = _episodes(questions, tok, 1, "identifier")
    for q, ids, mask in made:
        final = tok(" " + q.sql, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert ids[-len(final):] == final and mask[-len(final):] == [1] * len(final)
        obs = [i for i, m in zip(ids, mask) if m == 0]
        text = tok.decode(obs)
        assert text.startswith(ep.OBS_OPEN) and text.endswith(ep.OBS_CLOSE) and "error:" in text and len(obs) <= 32
        call = ids[:mask.index(0)]
        assert tok.decode(call).startswith(ep.TOOL_OPEN) and tok.decode(call).endswith(ep.TOOL_CLOSE)
        assert ep.tool_query(tok.decode(call)) != q.sql  # the first query is the slip, the answer the fix
    assert len(made) >= 10
    direct_ids, direct_mask = episode_target(tok, questions[0].sql, questions[0].db_path, rng, 32, error_first=False)
    assert 0 not in direct_mask and direct_ids[-1] == tok.eos_token_id


def test_tiny_mt_recipe_is_tiny_with_three_turns_and_error_fix_warm_start():
    mt, one = apply_overrides(get_recipe("tiny_mt"), []), apply_overrides(get_recipe("tiny"), [])
    assert (mt.generator.max_turns, one.generator.max_turns) == (3, 1)
    assert mt.model.tiny_sft_episodes > 0 and mt.model.tiny_sft_slip == one.model.tiny_sft_slip
    assert mt.coordinator.steps == one.coordinator.steps and mt.learner.lr == one.learner.lr


def test_misspelt_value_swaps_letters_inside_one_quoted_value_only():
    rng = random.Random(0)
    sql = "SELECT COUNT(*) FROM customer WHERE city = 'Paris'"
    bads = {misspelt_value(sql, rng) for _ in range(20)}
    assert len(bads) > 1 and sql not in bads and all(sorted(b) == sorted(sql) for b in bads)
    assert all(b[:-7] == sql[:-7] and sum(x != y for x, y in zip(b, sql)) == 2 for b in bads)  # inside 'Paris'
    assert misspelt_value("SELECT COUNT(*) FROM customer WHERE year >= 1990", rng) is None


def test_value_slip_episode_runs_shows_other_rows_and_is_built_by_concatenation(data):
    questions, tok = data
    made = _episodes(questions, tok, 2, "value")
    for q, ids, mask in made:
        cut = mask.index(0)
        call_text = tok.decode(ids[:cut])
        bad = ep.tool_query(call_text)
        assert bad != q.sql and sorted(bad) == sorted(q.sql)  # one value misspelt
        ran, right = execute_readonly(q.db_path, bad, 5.0, 1000), execute_readonly(q.db_path, q.sql, 5.0, 1000)
        assert ran.status == "ok" and sorted(map(repr, ran.rows)) != sorted(map(repr, right.rows))
        obs = ep.observation_ids(tok, ep.observation_text(ran.status, ran.columns, ran.rows, ran.error), 32)
        final = tok(" " + q.sql, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        call = tok(ep.TOOL_OPEN + bad + ep.TOOL_CLOSE, add_special_tokens=False)["input_ids"]
        assert ids == call + obs + final  # concatenated pieces, never the whole history re-tokenized
        assert mask == [1] * len(call) + [0] * len(obs) + [1] * len(final)
        assert "error:" not in tok.decode(obs)
    assert len(made) >= 10
    with pytest.raises(ValueError, match="kind"):
        episode_target(tok, questions[0].sql, questions[0].db_path, random.Random(0), 32, True, kind="typo")


def test_value_slip_share_out_of_range_is_a_one_line_config_error():
    with pytest.raises(ConfigError, match="model.tiny_sft_value_slips"):
        apply_overrides(get_recipe("tiny_mt"), ["model.tiny_sft_value_slips=1.5"])


def test_revise_episode_runs_the_first_guess_for_real_and_answers_gold(data):
    """kind "revise" (model.tiny_sft_revise): the one-shot draw (the template's slip here) as the query,
    its real rows as the masked observation, the gold SQL as the answer; built by concatenation."""
    from tasks.synthetic import slipped
    from tasks.synthetic_episodes import revise_target

    questions, tok = data
    made = 0
    for q in questions[:30]:
        slip = slipped(q.sql)
        if slip is None:
            continue
        ids, mask = revise_target(tok, slip, q.sql, q.db_path, 32)
        ran = execute_readonly(q.db_path, slip, 5.0, 1000)
        call = tok(ep.TOOL_OPEN + slip + ep.TOOL_CLOSE, add_special_tokens=False)["input_ids"]
        obs = ep.observation_ids(tok, ep.observation_text(ran.status, ran.columns, ran.rows, ran.error), 32)
        final = tok(" " + q.sql, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert ran.status == "ok" and ids == call + obs + final
        assert mask == [1] * len(call) + [0] * len(obs) + [1] * len(final)
        made += 1
    assert made >= 10
    same, mask = revise_target(tok, questions[0].sql, questions[0].sql, questions[0].db_path, 32)  # a gold first guess
    assert ep.tool_query(tok.decode(same[:mask.index(0)])) == questions[0].sql


def test_revise_share_out_of_range_is_a_one_line_config_error():
    with pytest.raises(ConfigError, match="model.tiny_sft_revise"):
        apply_overrides(get_recipe("tiny_mt"), ["model.tiny_sft_revise=-0.1"])


def test_look_episode_shows_the_stored_form_and_answers_in_it(data, tmp_path):
    """kind "look" (model.tiny_sft_look, data.synthetic_value_forms): the probe of the gold's value as the
    query, its real rows (the value as stored) as the masked observation, then the answer; built by
    concatenation; a question with no place or category value has no look episode."""
    from tasks.synthetic_episodes import look_target, probe

    bird = write_dataset(tmp_path / "syn", num_databases=3, num_questions=60, seed=4, templates=list(TINY_TEMPLATES),
                         value_forms="suffix")
    tok = data[1]
    made = 0
    for q in load_split(bird, "train")[:30]:
        got = look_target(tok, q.sql, q.sql, q.db_path, 128)  # the untrained tokenizer spends a byte a token
        if probe(q.sql) is None:
            assert got is None
            continue
        ids, mask = got
        ran = execute_readonly(q.db_path, probe(q.sql), 5.0, 1000)
        call = tok(ep.TOOL_OPEN + probe(q.sql) + ep.TOOL_CLOSE, add_special_tokens=False)["input_ids"]
        obs = ep.observation_ids(tok, ep.observation_text(ran.status, ran.columns, ran.rows, ran.error), 128)
        final = tok(" " + q.sql, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert ids == call + obs + final and mask == [1] * len(call) + [0] * len(obs) + [1] * len(final)
        stored = q.sql.split("'")[1]
        assert stored.endswith(("-1", "-2")) or stored in q.question
        assert ran.rows == [(stored,)] and f"\n{stored}\n" in tok.decode(obs)  # the observation shows the stored form
        made += 1
    assert made >= 10


def test_tiny_look_recipe_is_tiny_forms_with_three_turns_and_look_warm_start():
    one, look = get_recipe("tiny_forms"), get_recipe("tiny_look")
    assert one.data == look.data and one.data.synthetic_value_forms == "suffix" and one.data.sample_values == 0
    assert one.generator.max_turns == 1 and look.generator.max_turns == 3
    assert one.model.tiny_sft_episodes == 0 and look.model.tiny_sft_episodes > 0
    assert 0 < look.model.tiny_sft_look < 1  # a share of the episodes stays error-then-fix (issue 24 point 9)
    assert one.model.tiny_sft_slip == look.model.tiny_sft_slip == get_recipe("tiny").model.tiny_sft_slip
    with pytest.raises(ConfigError, match="model.tiny_sft_look"):
        apply_overrides(look, ["model.tiny_sft_look=2"])
