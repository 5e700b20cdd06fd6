"""The vLLM engine's LoRA path (actors/engines/vllm_lora.py) over a FAKE AsyncLLM (vLLM needs a GPU): each
adapter-only weight update becomes a new LoRARequest (a new id per version, written as a PEFT directory holding
exactly the synced tensors), the old adapter is removed, every request runs under the current one, and an
update that brought no adapter tensor fails before vLLM is touched. A LoRA export is served as its adapter
over the base it names. The engine is built by its own __init__ with vLLM's symbols stood in for."""
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from actors import lora
from actors.engines import vllm_engine
from actors.engines.vllm_engine import VLLMEngine
from config import GeneratorConfig, LoraConfig, ModelConfig
from queues.messages import PromptTask, pack_ids

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])


@dataclass
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class _Logprob:
    logprob: float


class FakeAsyncLLM:
    """Records add_lora / remove_lora and the lora_request each generate() ran under."""

    def __init__(self, args):
        self.args, self.loaded, self.calls, self.generated = args, {}, [], []
        self.model_config = SimpleNamespace(max_model_len=512, hf_config=SimpleNamespace(vocab_size=2048))

    async def add_lora(self, lora_request):
        self.calls.append(("add", lora_request.lora_int_id))
        self.loaded[lora_request.lora_int_id] = lora.read_adapter(lora_request.lora_path)[1]
        return True

    async def remove_lora(self, lora_id):
        self.calls.append(("remove", lora_id))
        return self.loaded.pop(lora_id, None) is not None

    async def collective_rpc(self, method, timeout=None, args=()):
        self.calls.append(("rpc", method, args[:2]))
        return [1] if method == "arl_weights" else [{}]  # a worker reports the tensors it loaded

    async def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    async def generate(self, prompt, sampling_params, request_id, lora_request=None):
        self.generated.append(lora_request)
        yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[3], logprobs=[{3: _Logprob(-0.5)}], text="x",
                                                       finish_reason="stop")], num_cached_tokens=0)


FAKE_SYMS = {"vllm.AsyncEngineArgs": lambda **kw: kw, "vllm.SamplingParams": lambda **kw: kw,
             "vllm.inputs.TokensPrompt": lambda **kw: kw, "vllm.lora.request.LoRARequest": FakeLoRARequest,
             "vllm.sampling_params.RequestOutputKind.FINAL_ONLY": "final",
             "vllm.v1.engine.async_llm.AsyncLLM.from_engine_args": FakeAsyncLLM}


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.setattr(vllm_engine, "_sym", FAKE_SYMS.__getitem__)
    monkeypatch.setattr(VLLMEngine, "_sym_fn", staticmethod(FAKE_SYMS.__getitem__))
    monkeypatch.setattr(vllm_engine, "engine_arg_fields", lambda: set(vllm_engine.VLLM_API[0][1]))


def make_engine(model_path, lora_cfg=LORA, tmp_path=None):
    eng = VLLMEngine(GeneratorConfig(engine="vllm", max_tokens=4, temperature=0.0, lora=lora_cfg),
                     ModelConfig(path=str(model_path)), str(model_path))
    if tmp_path is not None and eng._adapter is not None:
        eng._adapter._workdir = str(tmp_path / "adapters")
    return eng


def adapter_tensors(tiny_dir, seed):
    """A real adapter's tensors (wire names) on the tiny model, B made non-zero."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = lora.inject(AutoModelForCausalLM.from_pretrained(tiny_dir), LORA)
    return [(k, torch.randn_like(p)) for k, p in lora.adapter_params(model).items()]


def _task():
    return PromptTask(task_id="0:0:0", prompt_id="q", step=0, policy_version=0, prompt_tokens=pack_ids([5, 6, 7]), n=1)


async def test_fake_vllm_each_version_is_a_new_adapter_and_the_old_one_is_removed(fake_vllm, tiny_dir, tmp_path):
    eng = make_engine(tiny_dir, tmp_path=tmp_path)
    args = eng.llm.args
    assert args["enable_lora"] is True and args["max_lora_rank"] == 8 and args["max_loras"] == 1
    assert args["model"] == str(tiny_dir) and eng.loads_in_workers is False  # adapters arrive here, whole
    await eng.generate(_task())
    assert eng.llm.generated == [None]  # before the first sync: the base alone
    v1, v2 = adapter_tensors(tiny_dir, 1), adapter_tensors(tiny_dir, 2)
    for version, tensors in ((1, v1), (2, v2)):
        await eng.load_weights(tensors[:3], version)  # two buckets, as the transport hands them
        await eng.load_weights(tensors[3:], version)
        await eng.finish_weight_update(version)
        assert eng.version == version
        loaded = eng.llm.loaded[version]  # ids 1, 2: one per version
        assert loaded.keys() == dict(tensors).keys() and all(torch.equal(loaded[k], t) for k, t in tensors)
        await eng.generate(_task())
        assert eng.llm.generated[-1].lora_int_id == version
    assert eng.llm.calls == [("add", 1), ("reset_prefix_cache",), ("add", 2), ("remove", 1), ("reset_prefix_cache",)]
    assert list(eng.llm.loaded) == [2]
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["v2-id2"]  # the old directory is gone


async def test_fake_vllm_an_update_without_adapter_tensors_fails_and_keeps_the_adapter(fake_vllm, tiny_dir, tmp_path):
    eng = make_engine(tiny_dir, tmp_path=tmp_path)
    v1 = adapter_tensors(tiny_dir, 1)
    await eng.load_weights(v1, 1)
    await eng.finish_weight_update(1)
    calls = list(eng.llm.calls)
    with pytest.raises(RuntimeError, match="brought no LoRA adapter tensor"):  # verl #7495
        await eng.finish_weight_update(2)
    await eng.load_weights(v1[:-1], 2)
    with pytest.raises(RuntimeError, match="adapter tensors, the adapter has"):
        await eng.finish_weight_update(2)
    with pytest.raises(KeyError, match="not a LoRA adapter tensor"):
        await eng.load_weights([("base_model.model.model.norm.weight", torch.zeros(2))], 2)
    assert eng.version == 1 and eng.llm.calls == calls and eng._adapter.request.lora_int_id == 1


async def test_fake_vllm_serves_a_lora_export_over_its_base(fake_vllm, tiny_dir, tmp_path):
    export = lora.save_adapter(tmp_path / "export", adapter_tensors(tiny_dir, 3), LORA, str(tiny_dir))
    eng = make_engine(export, lora_cfg=LoraConfig())
    assert eng.llm.args["model"] == str(tiny_dir) and eng.llm.args["tokenizer"] == str(export)
    assert eng.llm.args["enable_lora"] is True
    await eng.generate(_task())
    await eng.generate(_task())
    assert [(r.lora_int_id, r.lora_path) for r in eng.llm.generated] == [(1, str(export))] * 2
    with pytest.raises(RuntimeError, match="adapter is fixed"):
        await eng.load_weights(adapter_tensors(tiny_dir, 4), 1)


async def test_fake_vllm_a_warm_base_loads_in_the_workers_once_beside_the_adapter(fake_vllm, tiny_dir, tmp_path):
    eng = make_engine(tiny_dir, tmp_path=tmp_path)
    base = [("model.norm.weight", torch.ones(64))]  # a LoRA warm start's base travels under its HF name
    await eng.load_weights(base + adapter_tensors(tiny_dir, 1), 1)
    await eng.finish_weight_update(1)
    rpc, method, (transport, step) = eng.llm.calls[0]
    assert (rpc, method, transport, step["type"]) == ("rpc", "arl_weights", "object_store", "LoadFlat")
    assert ("rpc", "arl_finish", ()) in eng.llm.calls and ("add", 1) in eng.llm.calls
    await eng.load_weights(adapter_tensors(tiny_dir, 2), 2)
    await eng.finish_weight_update(2)
    assert sum(c[0] == "rpc" for c in eng.llm.calls) == 2  # the adapter alone after that


def test_fake_vllm_lora_rank_rounds_up_to_a_rank_vllm_serves():
    assert [vllm_engine.vllm_lora_rank(r) for r in (1, 8, 9, 64, 65)] == [8, 8, 16, 64, 128]
    with pytest.raises(ValueError, match="learner.lora.rank"):
        vllm_engine.vllm_lora_rank(1000)
