"""Multi-turn episodes: the protocol (policies/episode.py), the executor (tasks/executor.py), the runner
(actors/generator/episode.py) over the real TransformersEngine and over a scripted model, the scorer's
final answers and first-query rewards, and the step metrics."""

import msgspec
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from actors.engines.hf import TransformersEngine
from actors.generator.episode import EpisodeRunner
from actors.generator.generator import Generator
from actors.scorer import Scorer
from config import GeneratorConfig, ModelConfig, ScorerConfig
from config.recipes import get_recipe
from policies import episode as ep
from policies.prompt import render_prompt
from queues.messages import (
    PromptTask,
    RolloutGroup,
    Sample,
    codec,
    pack_floats,
    pack_ids,
    unpack_floats,
    unpack_ids,
    unpack_loss_mask,
)
from tasks.bird import load_split
from tasks.synthetic import write_dataset
from tests.builders import synthetic_question


@pytest.fixture(scope="module")
def question(tmp_path_factory):
    return synthetic_question(tmp_path_factory, "episode", seed=3)

torch.set_num_threads(1)
MODEL_CFG = ModelConfig(source="tiny", dtype="float32")


def _task(q, ids, n=2, **sampling):
    return PromptTask(task_id="0:0:0", prompt_id="q0", step=0, policy_version=0, prompt_tokens=pack_ids(ids), n=n,
                      db_id=q.db_id, db_path=q.db_path, gold_sql=q.sql, sampling=sampling)


# -- the protocol ------------------------------------------------------------------------------------


def test_tool_query_observation_and_final_answer():
    assert ep.tool_query("let me look <sql>SELECT a FROM t;</sql>") == "SELECT a FROM t"
    assert ep.tool_query("<sql>SELECT 1</sql> and then more") is None  # the block did not end the turn
    assert ep.tool_query("```sql\nSELECT 1\n```") is None
    table = ep.observation_text("ok", ["name", "year"], [("Alice", 1999)] * 7)
    assert table.splitlines()[0] == "name | year" and "(7 rows, first 5 shown)" in table
    assert ep.observation_text("ok", ["n"], []) == "n\n(0 rows)"
    assert ep.observation_text("error", [], [], "no such column: nme\nmore") == "error: no such column: nme"
    from policies.sql_reward import extract_sql
    assert ep.final_answer("so:\n```sql\nSELECT 2\n```", ["SELECT 1"], extract_sql) == "SELECT 2"
    assert ep.final_answer("<sql>SELECT 3</sql>", ["SELECT 1", "SELECT 3"], extract_sql) == "SELECT 3"
    assert ep.final_answer("I give up", [], extract_sql) == ""


def test_one_turn_prompts_are_the_one_shot_prompts_and_more_turns_say_how_to_query():
    for style in ("omnisql", "compact"):
        base = render_prompt("How many?", "", "t(a)", style)
        assert render_prompt("How many?", "", "t(a)", style, max_turns=1) == base
        multi = render_prompt("How many?", "", "t(a)", style, max_turns=3)
        assert multi != base and ep.TOOL_OPEN in multi and "3" in multi


def test_observation_ids_are_tokenized_alone_cut_to_budget_and_keep_the_closing_tag(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    body = "name | year\n" + "\n".join(f"row{i} | {i}" for i in range(50))
    ids = ep.observation_ids(tok, body, 40)
    tail = tok(ep.OBS_CLOSE, add_special_tokens=False)["input_ids"]
    assert len(ids) <= 40 and ids[-len(tail):] == tail
    short = ep.observation_ids(tok, "error: x", 128)
    assert short == (tok(ep.OBS_OPEN, add_special_tokens=False)["input_ids"] + tok("error: x", add_special_tokens=False)["input_ids"]
                     + tail)


async def test_executor_runs_read_only_bounded_and_counts(question, executor):
    ok = await executor.run(question.db_path, question.sql)
    assert ok.status == "ok" and ok.columns and ok.seconds > 0
    bad = await executor.run(question.db_path, "SELECT nope FROM nowhere")
    write = await executor.run(question.db_path, "DELETE FROM " + ok.columns[0])
    endless = await executor.run(question.db_path, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT count(*) FROM c")
    assert bad.status == "error" and write.status == "error" and endless.status == "timeout"
    assert executor.stats()["tool_queries"] == 4 and executor.stats()["tool_errors"] == 3


# -- the runner over a scripted model ------------------------------------------------------------------


class ScriptedModelFakeEngine:
    """Stands in for the model's CHOICES only (a random-init model never writes a tool block): each
    request gets the next scripted ids, with the real tokenizer's decode as its text, as an engine
    returns them (stop strings cut from the text, kept in the tokens). Records every request."""

    def __init__(self, tokenizer, turns: list[list[int]]):
        self.tokenizer, self.turns, self.requests, self.version = tokenizer, list(turns), [], 0

    async def generate(self, task: PromptTask) -> RolloutGroup:
        self.requests.append(task)
        ids = self.turns.pop(0)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        stops = [s for s in task.sampling.get("stop", []) if s in text]
        if stops:
            text = text[:text.find(stops[0])]
        lps = [-0.5 - 0.01 * i for i in range(len(ids))]
        return RolloutGroup(task=task, policy_version=self.version, samples=[Sample(
            tokens=pack_ids(ids), logprobs=pack_floats(lps), finish_reason="stop", text=text)])


def _char_ids(tok, text: str) -> list[int]:
    """`text` spelled one character a token: a tokenization that re-encoding the decoded text changes."""
    ids = [tok.convert_tokens_to_ids(c) for c in text.replace(" ", "Ġ").replace("\n", "Ċ")]
    assert tok.unk_token_id not in ids and None not in ids
    return ids


async def test_token_in_token_out_at_every_turn_boundary_fake_model(tiny_dir, question, executor):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    table = question.sql.split("FROM", 1)[1].split()[0]
    turns = [_char_ids(tok, "<sql>SELECT nope FROM " + table + "</sql>"),
             _char_ids(tok, "<sql>" + question.sql + "</sql>"),
             _char_ids(tok, "ok\n```sql\n" + question.sql + "\n```")]
    for t in turns:  # the premise: decode + re-encode would change these ids
        assert tok(tok.decode(t), add_special_tokens=False)["input_ids"] != t
    engine = ScriptedModelFakeEngine(tok, turns)
    cfg = GeneratorConfig(engine="transformers", max_turns=3, max_tokens=4000, max_observation_tokens=96)
    prompt = tok("Q: how many?\nSQL:")["input_ids"]
    group = await EpisodeRunner(engine, cfg, tok, executor).generate(_task(question, prompt, n=1))
    (s,) = group.samples
    ids, lps = unpack_ids(s.tokens).tolist(), unpack_floats(s.logprobs).tolist()
    mask = unpack_loss_mask(s.loss_mask, len(ids)).tolist()
    obs = [i for i, m in enumerate(mask) if not m]
    # the sample is turn 1 + observation 1 + turn 2 + observation 2 + turn 3, id for id
    o1 = unpack_ids(engine.requests[1].prompt_tokens).tolist()[len(prompt) + len(turns[0]):]
    o2 = unpack_ids(engine.requests[2].prompt_tokens).tolist()[len(prompt) + len(turns[0]) + len(o1) + len(turns[1]):]
    assert ids == turns[0] + o1 + turns[1] + o2 + turns[2]
    # every request is the prompt plus the episode's ids so far, never re-tokenized
    assert unpack_ids(engine.requests[2].prompt_tokens).tolist() == prompt + turns[0] + o1 + turns[1] + o2
    err = await executor.run(question.db_path, "SELECT nope FROM " + table)
    assert o1 == ep.observation_ids(tok, ep.observation_text(err.status, err.columns, err.rows, err.error), 96)
    assert "no such column: nope" in tok.decode(o1)
    assert tok.decode(o2).strip().startswith("<observation>") and "row" in tok.decode(o2)
    # masks and log-probs: observations 0 / 0.0, the model's ids 1 / the sampler's
    assert len(obs) == len(o1) + len(o2) and all(lps[i] == 0.0 for i in obs)
    assert all(lps[i] < 0 for i, m in enumerate(mask) if m)
    assert (s.turns, s.queries, s.tool_errors) == (3, ["SELECT nope FROM " + table, question.sql], 1)
    assert s.answer == question.sql and s.executor_wait_s > 0
    assert all(ep.TOOL_CLOSE in r.sampling["stop"] and r.sampling["n"] == 1 for r in engine.requests)
    # the wire: schema 3 carries the episode, and the scorer rewards the final answer, not the first query
    group = codec(RolloutGroup).decode(codec(RolloutGroup).encode(group))
    scorer = Scorer(ScorerConfig(workers=1, timeout_s=2.0), scorer_id="t")
    try:
        scored = await scorer.score(group)
    finally:
        scorer.close()
    assert scored.verdicts == ["match"] and scored.rewards[0] > 0
    assert scored.first_query_rewards[0] < scored.rewards[0]
    m = ep.episode_metrics([scored])
    assert m["turns_mean"] == 3 and m["tool_use_frac"] == 1 and m["tool_errors"] == 1
    assert m["obs_tokens_mean"] == len(obs) and m["revision_gain"] > 0 and m["executor_wait_s"] > 0


async def test_the_last_turn_s_query_is_the_answer_when_turns_run_out_fake_model(tiny_dir, question, executor):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    engine = ScriptedModelFakeEngine(tok, [tok("<sql>SELECT 1</sql>", add_special_tokens=False)["input_ids"],
                                           tok("<sql>" + question.sql + "</sql>", add_special_tokens=False)["input_ids"]])
    cfg = GeneratorConfig(engine="transformers", max_turns=2, max_tokens=4000)
    (s,) = (await EpisodeRunner(engine, cfg, tok, executor).generate(_task(question, [1, 2], n=1))).samples
    assert s.turns == 2 and s.answer == question.sql and len(engine.requests) == 2
    assert executor.stats()["tool_queries"] == 1  # the last query is the answer: it is not run as a tool call


# -- the runner over the real engine ---------------------------------------------------------------------


async def test_real_engine_episodes_keep_every_invariant(tiny_dir, question, executor):
    """The tiny random model rarely writes a tool block; whatever it writes, the episode's ids are its
    requests' ids plus what came back, and masks, log-probs and lengths line up."""
    cfg = GeneratorConfig(engine="transformers", device="cpu", max_turns=3, max_tokens=48, max_batch_prompts=8, seed=1)
    engine = TransformersEngine(cfg, MODEL_CFG, tiny_dir)
    requests = []
    real = engine.generate

    async def spy(task):
        requests.append(task)
        return await real(task)

    engine.generate = spy
    prompt = engine.tokenizer("Q: how many singers?\nSQL:")["input_ids"]
    group = await EpisodeRunner(engine, cfg, engine.tokenizer, executor).generate(_task(question, prompt, n=3))
    assert len(group.samples) == 3 and len(requests) >= 3
    for s in group.samples:
        n = len(s.tokens) // 4
        assert len(s.logprobs) // 4 == n and 1 <= s.turns <= 3 and n <= 48
        mask = unpack_loss_mask(s.loss_mask, n)
        if mask is not None:
            assert np.all(unpack_floats(s.logprobs)[~mask] == 0.0)


async def test_max_turns_1_is_the_one_shot_path_token_for_token(tiny_dir, tmp_path):
    """generator.max_turns=1 on tiny's prompts (its templates, rendered as a run renders them): the same
    ids, log-probs, text and rewards as the engine alone, same seed, and the prompts are the one-shot ones."""
    from tasks.bird import build_prompts
    from tasks.synthetic import TINY_TEMPLATES

    tiny = get_recipe("tiny")
    bird = write_dataset(tmp_path / "tiny", num_databases=1, num_questions=20, seed=1, templates=list(TINY_TEMPLATES))
    questions = load_split(bird, "dev")[:2]
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    build = dict(style="compact", sample_values=tiny.data.sample_values)  # launch/run.py: tiny models render compact
    items, dropped = build_prompts(questions, tok, tiny.data.max_prompt_tokens, **build)
    assert len(items) == 2 and not dropped
    assert [i.prompt_tokens for i in items] == [i.prompt_tokens for i in build_prompts(
        questions, tok, tiny.data.max_prompt_tokens, max_turns=1, **build)[0]]
    scorer = Scorer(ScorerConfig(workers=1, timeout_s=2.0), scorer_id="t")
    out = []
    try:
        for turns in (1, None):
            cfg = GeneratorConfig(engine="transformers", device="cpu", max_tokens=24, max_batch_prompts=8, seed=5)
            if turns:
                cfg = msgspec.structs.replace(cfg, max_turns=turns)
            engine = TransformersEngine(cfg, MODEL_CFG, tiny_dir)
            run = []
            for q, item in zip(questions, items):
                task = _task(q, unpack_ids(item.prompt_tokens).tolist(), n=3)
                group = await (Generator(engine, cfg).generate_one(task) if turns else engine.generate(task))
                scored = await scorer.score(codec(RolloutGroup).decode(codec(RolloutGroup).encode(group)))
                run.append(([(s.tokens, s.logprobs, s.text, s.loss_mask, s.turns, s.answer) for s in group.samples],
                            scored.rewards, scored.verdicts, scored.first_query_rewards))
            out.append(run)
    finally:
        scorer.close()
    assert out[0] == out[1] and all(fq == [] for *_, fq in out[0])


async def test_generator_runs_episodes_for_max_turns_above_1(tiny_dir, question):
    cfg = GeneratorConfig(engine="transformers", device="cpu", max_turns=2, max_tokens=16, max_batch_prompts=8,
                          tool_workers=1, tool_timeout_s=2.0)
    gen = Generator(TransformersEngine(cfg, MODEL_CFG, tiny_dir), cfg)
    try:
        group = await gen.generate_one(_task(question, [5, 6, 7], n=2))
        assert not group.error and len(group.samples) == 2 and gen.episodes is not None
        assert "generator_tool_queries" in gen.stats()
    finally:
        gen.close_episodes()

