"""Multi-turn episodes on the vLLM engine over a FAKE AsyncLLM (vLLM needs a GPU): every turn continues
from the episode's token ids (prompt + sampled ids + observation ids, never re-tokenized), on both the
one-shot (FINAL_ONLY) and the partial-rollout (DELTA) paths; an interrupt in the middle of a turn after
an observation resumes the episode at its next token under the new version, nothing lost or repeated.
And the Generator over a real redis-server: one dying mid-episode leaves its prompt pending, and a
peer reclaims it and re-runs every episode from the prompt."""
import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from actors.engines import vllm_engine
from actors.engines.vllm_engine import VLLMEngine
from actors.generator.episode import EpisodeRunner
from actors.generator.generator import Generator
from config import GeneratorConfig
from queues.messages import (
    PromptTask,
    RolloutGroup,
    Sample,
    pack_floats,
    pack_ids,
    sample_versions,
    unpack_floats,
    unpack_ids,
    unpack_loss_mask,
)
from tests.builders import synthetic_question


@pytest.fixture(scope="module")
def question(tmp_path_factory):
    return synthetic_question(tmp_path_factory, "episode", seed=3)


@dataclass
class _Logprob:
    logprob: float


class ScriptedFakeAsyncLLM:
    """Stands in for vLLM's AsyncLLM: the model's turns are scripted ids, streamed one id per 2 ms from
    where the episode stands (a cursor that an abort leaves where it was, as a resubmission continues
    the same row); log-prob of an id = -0.1 - engine version. Records every request's prompt ids."""

    def __init__(self, engine, turns: list[list[int]]):
        self.engine, self.turns, self.prompts, self.aborted = engine, [list(t) for t in turns], [], set()
        self.turn, self.pos = 0, 0

    async def generate(self, prompt, sampling_params, request_id):
        self.prompts.append(list(prompt["prompt_token_ids"]))
        delta = sampling_params["output_kind"] == "delta"
        ids, lps = [], []
        script = self.turns[self.turn]
        while self.pos < len(script) and len(ids) < sampling_params["max_tokens"]:
            await asyncio.sleep(0.002)
            if request_id in self.aborted:
                yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[], logprobs=[], text="", finish_reason="abort")])
                return
            tok, lp = script[self.pos], -0.1 - self.engine.version
            self.pos += 1
            ids.append(tok)
            lps.append({tok: _Logprob(lp)})
            done = self.pos == len(script)
            if delta:
                yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[tok], logprobs=[lps[-1]], text="x",
                                                               finish_reason="stop" if done else None)])
        if self.pos == len(script):
            self.turn, self.pos = self.turn + 1, 0
        if not delta:
            yield SimpleNamespace(num_cached_tokens=0, outputs=[SimpleNamespace(
                token_ids=ids, logprobs=lps, text="x", finish_reason="stop" if self.pos == 0 else "length")])

    async def abort(self, request_id):
        self.aborted.update(request_id)


def fake_sym(name):
    return {"vllm.SamplingParams": dict, "vllm.inputs.TokensPrompt": dict,
            "vllm.sampling_params.RequestOutputKind.DELTA": "delta",
            "vllm.sampling_params.RequestOutputKind.FINAL_ONLY": "final"}[name]


def make_engine(turns, partial: bool):
    eng = object.__new__(VLLMEngine)  # no vLLM here: only the state generate() and the mixin use
    eng.cfg = GeneratorConfig(engine="vllm", max_tokens=400, temperature=1.0)
    eng.version, eng.max_model_len, eng.vocab_size = 0, 4096, None
    eng._ids, eng._inflight = iter(range(10**6)), set()
    eng._m = {"requests": 0, "tokens": 0, "busy_s": 0.0, "prompt_tokens": 0, "cached_tokens": 0}
    eng._sym_fn, eng._load_s = fake_sym, 0.0
    eng.llm = ScriptedFakeAsyncLLM(eng, turns)
    if partial:
        eng.enable_partial()
    return eng


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir)


def _script(tok, question):
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    return [enc("<sql>SELECT nope FROM nowhere</sql>"), enc("fixed <sql>" + question.sql + "</sql>"),
            enc("answer:\n```sql\n" + question.sql + "\n```")]


def _task(question, prompt):
    return PromptTask(task_id="0:0:0", prompt_id="q0", step=0, policy_version=0, prompt_tokens=pack_ids(prompt), n=1,
                      db_id=question.db_id, db_path=question.db_path, gold_sql=question.sql)


def _check_episode(s, turns, prompts, prompt):
    """The sample is turn 1 + obs 1 + turn 2 + obs 2 + turn 3 id for id, every request's prompt is the
    prompt + the episode so far, observations are masked with log-prob 0.0."""
    ids, lps = unpack_ids(s.tokens).tolist(), unpack_floats(s.logprobs).tolist()
    mask = unpack_loss_mask(s.loss_mask, len(ids)).tolist()
    obs1 = prompts[1][len(prompt) + len(turns[0]):]
    obs2 = prompts[-1][len(prompt) + len(turns[0]) + len(obs1) + len(turns[1]):]
    assert obs1 and obs2 and ids == turns[0] + obs1 + turns[1] + obs2 + turns[2]
    assert prompts[-1] == prompt + turns[0] + obs1 + turns[1] + obs2
    assert all(p == (prompt + ids)[:len(p)] for p in prompts)  # every request continues the episode's ids
    expect = [1] * len(turns[0]) + [0] * len(obs1) + [1] * len(turns[1]) + [0] * len(obs2) + [1] * len(turns[2])
    assert mask == expect and all(lp == 0.0 for lp, m in zip(lps, mask) if not m)
    assert all(lp < 0 for lp, m in zip(lps, mask) if m)
    assert (s.turns, s.tool_errors, s.finish_reason) == (3, 1, "stop")
    return ids, mask


async def test_fake_vllm_episode_continues_from_its_token_ids_every_turn(tok, question, executor, monkeypatch):
    monkeypatch.setattr(vllm_engine, "_sym", fake_sym)  # the one-shot path resolves its symbols module-wide
    turns = _script(tok, question)
    eng = make_engine(turns, partial=False)
    cfg = GeneratorConfig(engine="vllm", max_turns=3, max_tokens=400, max_observation_tokens=64)
    prompt = tok("Q: how many?\nSQL:")["input_ids"]
    (s,) = (await EpisodeRunner(eng, cfg, tok, executor).generate(_task(question, prompt))).samples
    _check_episode(s, turns, eng.llm.prompts, prompt)
    assert len(eng.llm.prompts) == 3 and s.answer == question.sql and s.queries[0] == "SELECT nope FROM nowhere"
    assert "no such table: nowhere" in tok.decode(eng.llm.prompts[1][len(prompt) + len(turns[0]):])
    assert eng.stats()["engine_prompt_tokens"] == sum(len(p) for p in eng.llm.prompts)


async def test_fake_vllm_interrupt_mid_episode_resumes_at_the_next_token_under_new_weights(tok, question, executor):
    turns = _script(tok, question)
    eng = make_engine(turns, partial=True)
    cfg = GeneratorConfig(engine="vllm", max_turns=3, max_tokens=400, max_observation_tokens=64)
    prompt = tok("Q: how many?\nSQL:")["input_ids"]
    running = asyncio.create_task(EpisodeRunner(eng, cfg, tok, executor).generate(_task(question, prompt)))
    while not (eng.llm.turn == 1 and 2 <= eng.llm.pos < len(turns[1]) - 2):  # inside turn 2, after observation 1
        assert not running.done()
        await asyncio.sleep(0.001)
    assert await eng.interrupt() == 1 and not running.done()
    eng.version = 1
    assert eng.continue_interrupted() == 1
    group = await asyncio.wait_for(running, 30)
    (s,) = group.samples
    ids, mask = _check_episode(s, turns, eng.llm.prompts, prompt)
    # the resubmission is the prompt + turn 1 + observation 1 + turn 2's ids so far: its next token
    resumed = eng.llm.prompts[2]
    k = len(resumed) - len(prompt)
    assert len(eng.llm.prompts) == 4 and resumed == prompt + ids[:k]
    assert len(turns[0]) < k < len(ids) and mask[k - 1] == 1
    versions = sample_versions(s, group.policy_version).tolist()
    assert group.policy_version == 0 and versions == [0] * k + [1] * (len(ids) - k)
    lps = unpack_floats(s.logprobs).tolist()
    assert lps == pytest.approx([(-0.1 - v) if m else 0.0 for v, m in zip(versions, mask)], abs=1e-6)
    assert s.answer == question.sql


class TurnScriptFakeEngine:
    """Stands in for the model's CHOICES (a random-init model never writes a tool block): turn 0 queries
    the gold SQL in a tool block, turn 1 answers with it; with `hold`, turn 1 never returns (the
    generator dies there, mid-episode, after its query ran)."""

    version = 0

    def __init__(self, tokenizer, sql: str, hold: bool):
        self.tokenizer, self.sql, self.hold, self.turns_seen = tokenizer, sql, hold, []

    async def generate(self, task: PromptTask) -> RolloutGroup:
        turn = int(task.task_id.rsplit("t", 1)[1])
        self.turns_seen.append(turn)
        if turn == 1 and self.hold:
            await asyncio.Event().wait()
        text = f"<sql>{self.sql}</sql>" if turn == 0 else f"```sql\n{self.sql}\n```"
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return RolloutGroup(task=task, policy_version=0, samples=[Sample(
            tokens=pack_ids(ids), logprobs=pack_floats([-0.5] * len(ids)), finish_reason="stop", text=text)])

    def stats(self) -> dict[str, float]:
        return {}


async def test_a_generator_dying_mid_episode_loses_nothing_its_prompt_is_reclaimed_and_rerun_fake_model(
        redis_url, tok, question):
    from queues.messages import codec
    from tests.rollout_streams import RUN, collect, streams

    cfg = GeneratorConfig(engine="transformers", max_turns=2, max_tokens=400, tool_workers=1, tool_timeout_s=2.0)
    prompts, rollouts = await streams(redis_url)
    task = PromptTask(task_id="0:0:0", prompt_id="q0", step=0, policy_version=0, n=2, db_id=question.db_id,
                      prompt_tokens=pack_ids(tok("Q: how many?\nSQL:")["input_ids"]), db_path=question.db_path,
                      gold_sql=question.sql)
    await prompts.publish(codec(PromptTask).encode(task))
    dying = TurnScriptFakeEngine(tok, question.sql, hold=True)
    dead = Generator(dying, cfg, reclaim_idle_s=0.2, tokenizer=tok)
    runner = asyncio.create_task(dead.run(redis_url, RUN, "dead"))
    while dying.turns_seen.count(1) < 2:  # both episodes ran their query and are inside turn 2
        assert not runner.done()
        await asyncio.sleep(0.01)
    runner.cancel()  # the generator dies mid-episode: nothing published, nothing acked
    with pytest.raises(asyncio.CancelledError):
        await runner
    dead.close_episodes()
    assert (await prompts.depth())["pending"] == 1 and (await rollouts.depth())["lag"] == 0
    live = Generator(TurnScriptFakeEngine(tok, question.sql, hold=False), cfg, reclaim_idle_s=0.2, tokenizer=tok)
    runner = asyncio.create_task(live.run(redis_url, RUN, "live"))
    try:
        ((_, group),) = await collect(rollouts, 1)
    finally:
        live.stop()
        await asyncio.wait_for(runner, 20)
        live.close_episodes()
    assert group.task.task_id == "0:0:0" and group.generator_id == "live" and not group.error
    assert [(s.turns, s.answer, s.queries) for s in group.samples] == [(2, question.sql, [question.sql])] * 2
    assert live.stats()["generator_tasks_reclaimed"] == 1 and (await prompts.depth())["pending"] == 0
