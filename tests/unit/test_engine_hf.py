"""TransformersEngine on a real tiny Qwen3: log-probs, per-prompt early return, weights, sleep/wake, bad tasks."""
import asyncio

import pytest
import torch

from actors.engines.base import EngineAsleep, TaskError
from actors.engines.hf import TransformersEngine, sample_tokens
from config import GeneratorConfig, ModelConfig
from queues.messages import PromptTask, pack_ids, unpack_floats, unpack_ids
from tasks.tiny_model import build_model

torch.set_num_threads(1)

MODEL_CFG = ModelConfig(source="tiny", dtype="float32")
GEN_CFG = GeneratorConfig(engine="transformers", device="cpu", max_tokens=24, n_samples=2, max_batch_prompts=16)


@pytest.fixture(scope="session")
def other_weights(tmp_path_factory, tiny_dir):
    """The same architecture and tokenizer with different random weights (seed 1)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tiny_model_seed1")
    model = build_model(MODEL_CFG, AutoTokenizer.from_pretrained(tiny_dir), str(out), seed=1)
    return str(out), {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture
def engine(tiny_dir):
    return TransformersEngine(GEN_CFG, MODEL_CFG, tiny_dir)


def make_task(engine, text, task_id="t", n=2, **sampling):
    ids = engine.tokenizer(text)["input_ids"]
    return PromptTask(task_id=task_id, prompt_id=task_id, step=0, policy_version=0, prompt_tokens=pack_ids(ids),
                      n=n, sampling=sampling)


PROMPTS = ["SELECT name FROM singer", "Question: How many students are older than 20?", "hi",
           "Database schema: CREATE TABLE student (id INTEGER PRIMARY KEY, name TEXT);"]


def teacher_forced_logprobs(model, prompt, completion, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logits = logits[len(prompt) - 1: len(prompt) - 1 + len(completion)]
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.8, "top_k": 20},
                                      {"temperature": 0}])
async def test_sampled_logprobs_equal_a_teacher_forced_forward(engine, sampling):
    tasks = [make_task(engine, p, task_id=str(i), n=3, **sampling) for i, p in enumerate(PROMPTS)]
    groups = await asyncio.gather(*[engine.generate(t) for t in tasks])
    checked = 0
    for g in groups:
        prompt = unpack_ids(g.task.prompt_tokens).tolist()
        assert len(g.samples) == 3
        for s in g.samples:
            completion = unpack_ids(s.tokens).tolist()
            got = torch.from_numpy(unpack_floats(s.logprobs).copy())
            assert len(completion) == len(got) > 0
            ref = teacher_forced_logprobs(engine.model, prompt, completion, sampling["temperature"])
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
            checked += len(completion)
    assert checked > 100


async def test_a_short_prompt_group_returns_while_a_long_one_still_generates(engine):
    short = make_task(engine, PROMPTS[0], "short", max_tokens=2)
    long = make_task(engine, PROMPTS[1], "long", max_tokens=300, temperature=0)  # greedy: no early eos here
    long_fut = asyncio.ensure_future(engine.generate(long))
    short_group = await engine.generate(short)
    assert not long_fut.done(), "the short group waited for the long one"
    long_group = await long_fut
    assert all(len(unpack_ids(s.tokens)) == 2 for s in short_group.samples)
    assert all(len(unpack_ids(s.tokens)) == 300 and s.finish_reason == "length" for s in long_group.samples)
    assert long_group.finished_at - short_group.finished_at > 0.5 * (long_group.finished_at - long_group.started_at)


async def test_eos_ends_a_sample_with_stop_and_the_eos_token_kept(engine):
    group = await engine.generate(make_task(engine, PROMPTS[1], "eos", n=8, max_tokens=300))
    reasons = [s.finish_reason for s in group.samples]
    assert "stop" in reasons  # the seed-0 tiny model samples eos (id 0) within 300 tokens
    for s in group.samples:
        tokens = unpack_ids(s.tokens).tolist()
        if s.finish_reason == "stop":
            assert tokens[-1] in engine.eos_ids and not any(t in engine.eos_ids for t in tokens[:-1])
            assert "<|endoftext|>" not in s.text
        else:
            assert s.finish_reason == "length" and len(tokens) == 300


async def test_greedy_output_does_not_depend_on_batch_company(engine):
    """Left padding and per-row positions: a prompt decodes the same alone or in a batch."""
    alone = await engine.generate(make_task(engine, PROMPTS[2], "alone", temperature=0, max_tokens=16))
    batch = await asyncio.gather(*[engine.generate(make_task(engine, p, str(i), temperature=0, max_tokens=16))
                                   for i, p in enumerate(PROMPTS)])
    assert engine.stats()["engine_mean_batch_rows"] > 2
    assert [s.tokens for s in batch[2].samples] == [s.tokens for s in alone.samples]
    assert alone.samples[0].tokens == alone.samples[1].tokens


async def test_stop_string_ends_the_sample_and_cuts_the_text(engine):
    first = await engine.generate(make_task(engine, PROMPTS[0], "a", n=1, temperature=0, max_tokens=24))
    text = first.samples[0].text
    stop = text[6:9]
    assert len(stop) == 3 and stop not in text[:6]
    cut = await engine.generate(make_task(engine, PROMPTS[0], "b", n=1, temperature=0, max_tokens=24, stop=[stop]))
    s = cut.samples[0]
    assert s.finish_reason == "stop"
    assert s.text == text[:6]
    assert len(unpack_ids(s.tokens)) < len(unpack_ids(first.samples[0].tokens))


async def test_load_weights_switches_greedy_outputs_to_the_new_weights(engine, tiny_dir, other_weights):
    other_dir, other_state = other_weights
    reference = TransformersEngine(GEN_CFG, MODEL_CFG, other_dir)
    tasks = [make_task(engine, p, str(i), temperature=0, max_tokens=16) for i, p in enumerate(PROMPTS)]
    before = [g.samples[0].tokens for g in await asyncio.gather(*[engine.generate(t) for t in tasks])]
    expected = [g.samples[0].tokens for g in await asyncio.gather(*[reference.generate(t) for t in tasks])]
    assert before != expected
    items = list(other_state.items())
    for i in range(0, len(items), 5):  # in buckets, as the weight sync sends them
        await engine.load_weights(items[i:i + 5], version=7)
    assert engine.version == 0, "the version moves only at finish_weight_update"
    await engine.finish_weight_update(7)
    after = await asyncio.gather(*[engine.generate(t) for t in tasks])
    assert [g.samples[0].tokens for g in after] == expected
    assert all(g.policy_version == 7 for g in after)


async def test_load_weights_rejects_unknown_names_and_bad_shapes(engine):
    with pytest.raises(KeyError, match="not_a_param"):
        await engine.load_weights([("not_a_param", torch.zeros(1))], 1)
    with pytest.raises(ValueError, match="shape"):
        await engine.load_weights([("model.norm.weight", torch.zeros(3))], 1)


async def test_tied_lm_head_loads_into_the_embedding(engine):
    emb = engine.model.get_input_embeddings().weight
    new = torch.randn_like(emb)
    await engine.load_weights([("lm_head.weight", new)], 1)
    assert torch.equal(emb.data, new) and torch.equal(engine.model.lm_head.weight.data, new)


async def test_sleep_level1_and_wake_keep_outputs_identical(engine):
    tasks = [make_task(engine, p, str(i), temperature=0, max_tokens=12) for i, p in enumerate(PROMPTS)]
    before = [[s.tokens for s in g.samples] for g in await asyncio.gather(*[engine.generate(t) for t in tasks])]
    await engine.sleep(1)
    assert all(p.numel() == 0 for p in engine.model.parameters())
    with pytest.raises(EngineAsleep):
        await engine.generate(tasks[0])
    await engine.wake(["weights"])
    await engine.wake(["kv_cache"])
    after = [[s.tokens for s in g.samples] for g in await asyncio.gather(*[engine.generate(t) for t in tasks])]
    assert after == before
    assert engine.model.lm_head.weight is engine.model.get_input_embeddings().weight


async def test_sleep_level2_needs_every_weight_reloaded_before_generating(engine):
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    task = make_task(engine, PROMPTS[1], "x", temperature=0, max_tokens=12)
    before = (await engine.generate(task)).samples[0].tokens
    await engine.sleep(2)
    await engine.wake(["weights"])
    with pytest.raises(EngineAsleep, match="load_weights"):
        await engine.generate(task)
    partial = [(k, v) for k, v in state.items() if k != "model.norm.weight"]
    await engine.load_weights(partial, 3)
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        await engine.finish_weight_update(3)
    await engine.load_weights([("model.norm.weight", state["model.norm.weight"])], 3)
    await engine.finish_weight_update(3)
    await engine.wake(["kv_cache"])
    after = await engine.generate(task)
    assert after.samples[0].tokens == before and after.policy_version == 3


@pytest.mark.parametrize("case", ["empty", "over_length", "n_zero", "unknown_override", "bad_token_id"])
async def test_a_malformed_task_is_a_one_line_error_and_the_engine_keeps_serving(engine, case):
    good = make_task(engine, PROMPTS[0], "good", max_tokens=3)
    bad = {
        "empty": PromptTask(task_id="e", prompt_id="e", step=0, policy_version=0, prompt_tokens=b"", n=2),
        "over_length": PromptTask(task_id="o", prompt_id="o", step=0, policy_version=0,
                                  prompt_tokens=pack_ids([5] * engine.max_model_len), n=2),
        "n_zero": make_task(engine, PROMPTS[0], "z", n=0),
        "unknown_override": make_task(engine, PROMPTS[0], "u", temprature=0.5),
        "bad_token_id": PromptTask(task_id="b", prompt_id="b", step=0, policy_version=0,
                                   prompt_tokens=pack_ids([1, 10**6]), n=1),
    }[case]
    words = {"empty": "empty", "over_length": "max_position_embeddings", "n_zero": "n must be",
             "unknown_override": "temprature", "bad_token_id": "vocabulary"}[case]
    with pytest.raises(TaskError, match=words) as info:
        await engine.generate(bad)
    assert "\n" not in str(info.value)
    group = await engine.generate(good)
    assert len(group.samples) == 2


async def test_abort_ends_in_flight_requests_with_abort(engine):
    fut = asyncio.ensure_future(engine.generate(make_task(engine, PROMPTS[1], "long", max_tokens=400)))
    while engine.stats()["engine_tokens_generated"] < 4:
        await asyncio.sleep(0.005)
    engine.abort()
    group = await asyncio.wait_for(fut, 10)
    assert all(s.finish_reason == "abort" for s in group.samples)
    assert all(0 < len(unpack_ids(s.tokens)) < 400 for s in group.samples)
    again = await engine.generate(make_task(engine, PROMPTS[0], "next", max_tokens=3))
    assert all(s.finish_reason == "length" for s in again.samples)


def test_top_k_and_top_p_restrict_sampling_but_not_the_reported_logprob():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    t = torch.full((4,), 0.8)
    tokens, lp = sample_tokens(logits, t, torch.ones(4), torch.ones(4, dtype=torch.long))  # top_k = 1
    assert torch.equal(tokens, logits.argmax(-1))
    full = torch.log_softmax(logits / 0.8, -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(lp, full)
    assert (lp < 0).all(), "a renormalised top-1 distribution would report log-prob 0"
    # top_p small enough: only the argmax survives
    tokens_p, _ = sample_tokens(logits, t, torch.full((4,), 1e-6), torch.zeros(4, dtype=torch.long))
    assert torch.equal(tokens_p, logits.argmax(-1))
    # temperature 0: greedy, log-prob from the untempered distribution
    tokens_g, lp_g = sample_tokens(logits, torch.zeros(4), torch.ones(4), torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(lp_g, torch.log_softmax(logits, -1).gather(1, tokens_g[:, None]).squeeze(1))
