"""vLLM partial rollouts (actors/engines/vllm_partial.py) over a FAKE AsyncLLM (vLLM needs a GPU):
interrupted requests are aborted, resubmitted with their tokens appended and finish under the new
version; log-probs stay as they were; abort() while parked ends the group."""
import asyncio
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from actors.engines import vllm_partial
from actors.engines.vllm_engine import VLLM_API, VLLMEngine
from config import GeneratorConfig
from queues.messages import PromptTask, pack_ids, sample_versions, unpack_floats, unpack_ids


@dataclass
class _Logprob:
    logprob: float


class FakeAsyncLLM:
    """Streams one token per 2 ms per request (DELTA), token = position in the sequence, log-prob =
    -(position) / 100 - version; abort ends a stream with finish_reason "abort". With `hold_at`, every
    first-submitted stream stops before its token `hold_at` (counted in `held`) until an abort: a test
    interrupts requests it knows are mid-stream, whatever the machine's load."""

    def __init__(self, engine, hold_at=None):
        self.engine, self.prompts, self.aborted = engine, [], set()
        self.hold_at, self.held, self.released = hold_at, 0, asyncio.Event()
        self.errored = False  # vLLM's AsyncLLM.errored: its engine core process died

    async def generate(self, prompt, sampling_params, request_id):
        ids = prompt["prompt_token_ids"]
        self.prompts.append(list(ids))
        for k in range(sampling_params["max_tokens"]):
            await asyncio.sleep(0.002)
            if k == self.hold_at and not self.released.is_set():
                self.held += 1
                await self.released.wait()
            if request_id in self.aborted:
                yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[], logprobs=[], text="", finish_reason="abort")])
                return
            tok = len(ids) + k
            lp = -tok / 100 - self.engine.version
            last = k == sampling_params["max_tokens"] - 1
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[tok], logprobs=[{tok: _Logprob(lp)}], text="x",
                                                           finish_reason="length" if last else None)])

    async def abort(self, request_id):
        self.aborted.update(request_id)
        self.released.set()


def fake_sym(name):
    return {"vllm.SamplingParams": dict, "vllm.inputs.TokensPrompt": dict,
            "vllm.sampling_params.RequestOutputKind.DELTA": "delta"}[name]


def make_engine(max_tokens=30, hold_at=None):
    eng = object.__new__(VLLMEngine)  # no vLLM here: only the state generate() and the mixin use
    eng.cfg = GeneratorConfig(engine="vllm", max_tokens=max_tokens, temperature=1.0)
    eng.version, eng.max_model_len, eng.vocab_size = 0, 4096, None
    eng._ids, eng._inflight = iter(range(10**6)), set()
    eng._m = {"requests": 0, "tokens": 0, "busy_s": 0.0, "prompt_tokens": 0, "cached_tokens": 0}
    eng._sym_fn = fake_sym
    eng.llm = FakeAsyncLLM(eng, hold_at)
    eng.enable_partial()
    return eng


def _task(n=2):
    return PromptTask(task_id="0:0:0", prompt_id="q", step=0, policy_version=0, prompt_tokens=pack_ids([7, 8, 9]), n=n)


async def test_fake_vllm_interrupted_group_is_resubmitted_with_its_tokens_and_finishes_under_the_new_version():
    eng = make_engine(hold_at=5)
    running = asyncio.create_task(eng.generate(_task()))
    while eng.llm.held < 2:  # both samples mid-stream, 5 tokens in
        await asyncio.sleep(0.001)
    assert await eng.interrupt() == 1 and not running.done()
    eng.version = 1
    assert eng.continue_interrupted() == 1
    group = await asyncio.wait_for(running, 10)
    assert group.policy_version == 0
    for s in group.samples:
        tokens, lps = unpack_ids(s.tokens).tolist(), unpack_floats(s.logprobs).tolist()
        versions = sample_versions(s, 0).tolist()
        assert tokens == list(range(3, 3 + 30)) and s.finish_reason == "length"  # nothing lost, nothing repeated
        k = versions.count(0)
        assert 0 < k < 30 and versions == [0] * k + [1] * (30 - k)
        assert lps == pytest.approx([-t / 100 - v for t, v in zip(tokens, versions)], abs=1e-6)
    resubmitted = eng.llm.prompts[2:]
    assert len(resubmitted) == 2 and all(p[:3] == [7, 8, 9] and len(p) > 3 for p in resubmitted)


async def test_fake_vllm_abort_while_parked_ends_the_group_instead_of_resubmitting():
    eng = make_engine(hold_at=5)
    running = asyncio.create_task(eng.generate(_task(n=1)))
    while eng.llm.held < 1:  # mid-stream, 5 tokens in
        await asyncio.sleep(0.001)
    assert await eng.interrupt() == 1  # parked
    eng.abort()
    group = await asyncio.wait_for(running, 10)
    assert group.samples[0].finish_reason == "abort" and len(eng.llm.prompts) == 1


def test_every_vllm_symbol_the_partial_path_uses_is_in_VLLM_API():
    source = Path(vllm_partial.__file__).read_text()
    used = set(re.findall(r'_sym_fn\("([^"]+)"\)', source))
    assert used and used <= {path for path, _ in VLLM_API}
    assert set(re.findall(r"self\.llm\.(\w+)\(", source)) <= {p.rsplit(".", 1)[1] for p, _ in VLLM_API if ".AsyncLLM." in p}


async def test_fake_vllm_engine_core_death_is_in_the_generator_s_health_and_the_coordinator_restarts_it():
    """A vLLM engine whose engine core died (AsyncLLM.errored) fails every request from then on: its generator
    would turn each task into a failed group, run after run of steps. Its health says so (`engine_dead`), and
    the coordinator's health round (WeightSync.heal) restarts it in place, with a warning naming it and the
    engine's error; a live engine is left alone. Fake: the AsyncLLM stand-in above; the Ray actor's shell is
    built without Ray (its health is plain). Before: health had no `engine_dead`, nothing was restarted."""
    from actors.coordinator.coordinator import Coordinator
    from actors.generator.generator import Generator
    from actors.generator.shell import GeneratorShell
    from config import RunContext, apply_overrides
    from config.recipes import get_recipe

    eng = make_engine()
    shell = object.__new__(GeneratorShell)  # the actor's state health() reads (no Ray here)
    shell.gen, shell.needs_weights, shell.reconstructed = Generator(eng, eng.cfg), False, False
    warnings = []
    log = type("Log", (), {"info": lambda self, e, **kw: None,
                           "warning": lambda self, e, **kw: warnings.append((e, kw))})()
    coord = Coordinator(apply_overrides(get_recipe("tiny"), []), RunContext(run_id="dead"), [], [],
                        generators=[shell], learner=None, assembler=None, log=log)
    restarted = []
    coord.generators.restart = lambda g: restarted.append(g) or True
    assert (await shell.health())["engine_dead"] is None
    assert await coord.weights.heal(0) == 0 and restarted == [] and warnings == []

    eng.llm.errored = True  # the engine core process is gone
    assert "engine core died" in (await shell.health())["engine_dead"]
    await coord.weights.heal(0)
    assert restarted == [shell] and coord.generators.frozen_restarts == 1
    (event, kw), = warnings
    assert event == "generator's engine died: restarted in place" and kw["generator"] == "generator-0"
    assert "engine core died" in kw["error"]


# -- an episode over the partial path: interrupted inside a tool block's close tag -----------------------


class ScriptedFakeAsyncLLM:
    """Stands in for vLLM and the model's choices (a GPU engine; a random model never writes a tool
    block): each new request streams the next scripted ids, one DELTA per id; a resubmitted request
    (its prompt ends with what the script streamed) continues the script. Like vLLM, a stop string is
    checked on this request's own output only. At `hold` ids into script 0 it waits until aborted."""

    def __init__(self, engine, tokenizer, scripts, hold):
        self.engine, self.tok, self.scripts, self.hold = engine, tokenizer, list(scripts), hold
        self.prompts, self.aborted, self.sent, self.script = [], set(), [], None
        self.held, self.gate = asyncio.Event(), asyncio.Event()

    async def generate(self, prompt, sampling_params, request_id):
        ids = prompt["prompt_token_ids"]
        self.prompts.append(list(ids))
        if not (self.sent and self.script and ids[-len(self.sent):] == self.sent):
            self.script, self.sent = self.scripts.pop(0), []
        own = []
        for _ in range(sampling_params["max_tokens"]):
            if self.hold is not None and len(self.sent) == self.hold:
                self.hold = None
                self.held.set()
                await self.gate.wait()
            await asyncio.sleep(0)
            if request_id in self.aborted:
                yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[], logprobs=[], text="", finish_reason="abort")])
                return
            tok = self.script[len(self.sent)]
            self.sent.append(tok)
            own.append(tok)
            text = self.tok.decode(own)
            stopped = any(st in text for st in sampling_params["stop"] or [])
            done = stopped or len(self.sent) == len(self.script)
            if done:
                self.script = None
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[tok], logprobs=[{tok: _Logprob(-0.1 - self.engine.version)}],
                                                           text="", finish_reason="stop" if done else None)])
            if done:
                return

    async def abort(self, request_id):
        self.aborted.update(request_id)
        self.gate.set()


async def test_fake_vllm_episode_interrupted_inside_the_close_tag_continues_and_ends_its_turn_there(tmp_path):
    from actors.generator.episode import EpisodeRunner
    from config import ModelConfig
    from policies import episode as ep
    from tasks.bird import load_split
    from tasks.executor import ToolExecutor
    from tasks.synthetic import write_dataset
    from tasks.tiny_model import build_tokenizer

    tok = build_tokenizer(None, ModelConfig().tiny_vocab_size, str(tmp_path / "tok"))
    q = load_split(write_dataset(tmp_path / "syn", num_databases=1, num_questions=4, seed=3), "dev")[0]
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    turn1 = enc("<sql>" + q.sql + "</sql>")
    run_on = enc(" and then more")  # what the model wrote past the tag vLLM did not see
    turn2 = enc("```sql\n" + q.sql + "\n```")
    close = len(enc(ep.TOOL_CLOSE))
    assert close > 2
    eng = make_engine(max_tokens=400)
    eng.llm = ScriptedFakeAsyncLLM(eng, tok, [turn1 + run_on, turn2], hold=len(turn1) - close + 2)
    executor = ToolExecutor(workers=1, timeout_s=2.0, max_rows=100)
    cfg = GeneratorConfig(engine="vllm", max_tokens=400, max_turns=3, max_observation_tokens=64)
    prompt = [7, 8, 9]
    task = PromptTask(task_id="0:0:0", prompt_id="q", step=0, policy_version=0, prompt_tokens=pack_ids(prompt), n=1,
                      db_id=q.db_id, db_path=q.db_path, gold_sql=q.sql)
    try:
        running = asyncio.create_task(EpisodeRunner(eng, cfg, tok, executor).generate(task))
        await asyncio.wait_for(eng.llm.held.wait(), 10)
        assert await eng.interrupt() == 1  # parked two ids into the close tag
        eng.version = 1
        eng.continue_interrupted()
        group = await asyncio.wait_for(running, 30)
    finally:
        executor.close()
    (s,) = group.samples
    ids, lps = unpack_ids(s.tokens).tolist(), unpack_floats(s.logprobs).tolist()
    versions = sample_versions(s, group.policy_version).tolist()
    # the turn ends at its tag (the run-on ids are dropped); the observation follows; the second request is
    # the prompt plus exactly those ids, and its answer ends the episode
    obs = eng.llm.prompts[2][len(prompt) + len(turn1):]
    assert eng.llm.prompts[1] == prompt + turn1[:len(turn1) - close + 2] and len(eng.llm.prompts) == 3
    assert ids == turn1 + obs + turn2 and tok.decode(obs).strip().startswith("<observation>")
    assert (s.turns, s.queries, s.answer, s.finish_reason) == (2, [q.sql], q.sql, "stop")
    assert s.text.startswith("<sql>" + q.sql + "</sql>" + ep.OBS_OPEN) and "then more" not in s.text  # the transcript
    k = len(turn1) - close + 2
    assert versions == [0] * k + [1] * (len(ids) - k) and group.policy_version == 0
    assert lps[:k] == pytest.approx([-0.1] * k) and lps[len(turn1):len(turn1) + len(obs)] == [0.0] * len(obs)
