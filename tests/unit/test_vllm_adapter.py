"""The vLLM adapter: its one list of vLLM calls is complete and, where vLLM is installed, matches
the installed signatures; engine kwargs are passed through deep-converted, unknown ones refused."""
import collections.abc
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from actors.engines import vllm_engine
from actors.engines.vllm_engine import VLLM_API, build_engine_args, plain, resolve_symbol, sample_from_completion
from config import GeneratorConfig, ModelConfig
from queues.messages import unpack_floats, unpack_ids

SOURCE = Path(vllm_engine.__file__).read_text()


def vllm_or_skip():
    try:
        import vllm  # noqa: F401
    except ImportError:
        pytest.skip("vLLM not installed (no CPU wheel)")


def test_every_vllm_symbol_and_parameter_the_adapter_uses_exists_in_installed_vllm():
    vllm_or_skip()
    for path, params in VLLM_API:
        obj = resolve_symbol(path)
        if not params:
            continue
        if dataclasses.is_dataclass(obj):
            names = {f.name for f in dataclasses.fields(obj)}
        elif hasattr(obj, "__required_keys__"):  # a TypedDict (TokensPrompt) has no signature
            names = set(obj.__required_keys__) | set(obj.__optional_keys__)
        else:
            sig = inspect.signature(obj)
            if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()) and path.endswith("SamplingParams"):
                names = set(getattr(obj, "__struct_fields__", ())) | set(sig.parameters)
            else:
                names = set(sig.parameters)
        missing = [p for p in params if p not in names]
        assert not missing, f"{path} has no parameter(s) {missing} in the installed vLLM"


def test_the_adapter_calls_only_what_VLLM_API_lists():
    """So the signature test above checks exactly what the adapter calls."""
    listed = {path for path, _ in VLLM_API}
    used = set(re.findall(r'_sym\("([^"]+)"\)', SOURCE))
    assert used and used <= listed, f"used but not in VLLM_API: {sorted(used - listed)}"
    llm_methods = set(re.findall(r"self\.llm\.(\w+)\(", SOURCE))
    listed_methods = {p.rsplit(".", 1)[1] for p in listed if ".AsyncLLM." in p}
    assert llm_methods and llm_methods <= listed_methods, f"AsyncLLM methods not in VLLM_API: {sorted(llm_methods - listed_methods)}"


class _ConfigMappingStandIn(collections.abc.Mapping):
    """Behaves like OmegaConf's DictConfig: a Mapping that is not a dict."""

    def __init__(self, data):
        self._d = data

    def __getitem__(self, k):
        return self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


STAND_IN_FIELDS = {"model", "tokenizer", "dtype", "tensor_parallel_size", "gpu_memory_utilization",
                   "enable_prefix_caching", "enforce_eager", "enable_sleep_mode", "seed", "trust_remote_code",
                   "worker_extension_cls", "logprobs_mode", "compilation_config", "speculative_config",
                   "max_num_batched_tokens"}


def test_engine_kwargs_are_deep_converted_and_passed_through_with_a_stand_in_field_list():
    nested = _ConfigMappingStandIn({"level": 3, "cudagraph_capture_sizes": (1, 2, 4),
                                    "pass_config": _ConfigMappingStandIn({"fuse_allreduce_rms": False})})
    cfg = GeneratorConfig(engine_kwargs={"compilation_config": nested, "max_num_batched_tokens": 40960})
    args = build_engine_args(cfg, ModelConfig(path="/m"), "/m", STAND_IN_FIELDS)
    cc = args["compilation_config"]
    assert type(cc) is dict and type(cc["pass_config"]) is dict and type(cc["cudagraph_capture_sizes"]) is list
    assert cc == {"level": 3, "cudagraph_capture_sizes": [1, 2, 4], "pass_config": {"fuse_allreduce_rms": False}}
    assert args["max_num_batched_tokens"] == 40960
    assert args["enable_sleep_mode"] is True and args["logprobs_mode"] == "processed_logprobs"
    assert args["worker_extension_cls"] == "actors.engines.vllm_worker.WeightLoaderExtension"
    assert resolve_symbol(args["worker_extension_cls"]).arl_weights


def test_unknown_engine_kwargs_are_refused_by_name_with_a_stand_in_field_list():
    cfg = GeneratorConfig(engine_kwargs={"compilaton_config": {"level": 3}})
    with pytest.raises(ValueError, match=r"'compilaton_config' \(did you mean 'compilation_config'\?\)"):
        build_engine_args(cfg, ModelConfig(path="/m"), "/m", STAND_IN_FIELDS)
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        build_engine_args(GeneratorConfig(engine_kwargs={"enable_sleep_mode": False}), ModelConfig(path="/m"), "/m",
                          STAND_IN_FIELDS)


def test_plain_converts_tuples_and_mappings_but_keeps_scalars():
    assert plain({"a": (1, {"b": "x"}), "c": 2.5, "d": None}) == {"a": [1, {"b": "x"}], "c": 2.5, "d": None}


class _FakeLogprob:
    def __init__(self, logprob):
        self.logprob = logprob


class _FakeCompletionOutput:
    """Shaped like vLLM's CompletionOutput (token_ids, logprobs per position, finish_reason, text)."""

    def __init__(self, token_ids, lps, finish_reason, text):
        self.token_ids = token_ids
        self.logprobs = [{t: _FakeLogprob(lp), 999: _FakeLogprob(-0.01)} for t, lp in zip(token_ids, lps)]
        self.finish_reason = finish_reason
        self.text = text


def test_fake_vllm_completion_output_becomes_a_sample_with_the_sampled_tokens_logprobs():
    s = sample_from_completion(_FakeCompletionOutput([5, 7, 0], [-1.5, -0.25, -3.0], "stop", "ab"))
    assert unpack_ids(s.tokens).tolist() == [5, 7, 0]
    assert unpack_floats(s.logprobs).tolist() == [-1.5, -0.25, -3.0]
    assert (s.finish_reason, s.text) == ("stop", "ab")
    broken = _FakeCompletionOutput([5, 7], [-1.0, -1.0], None, "")
    broken.logprobs = broken.logprobs[:1]
    with pytest.raises(ValueError, match="1 log-probs for 2 tokens"):
        sample_from_completion(broken)


def test_typed_dict_keys_are_read_from_required_and_optional_keys():
    """What the signature test does for vLLM's TokensPrompt, checked on a TypedDict of our own."""
    from typing import NotRequired, TypedDict

    class PromptLike(TypedDict):
        prompt_token_ids: list[int]
        cache_salt: NotRequired[str]

    assert set(PromptLike.__required_keys__) | set(PromptLike.__optional_keys__) == {"prompt_token_ids", "cache_salt"}
    with pytest.raises((TypeError, ValueError)):
        inspect.signature(PromptLike)  # why the test reads the keys instead


def test_every_worker_method_the_engine_calls_exists_on_the_extension_and_no_tensor_crosses_the_rpc():
    from actors.engines.vllm_worker import WeightLoaderExtension

    called = set(re.findall(r'self\._rpc\("(\w+)"', SOURCE))
    assert {"arl_weights", "arl_finish"} <= called  # every transport's worker steps go through arl_weights
    assert all(callable(getattr(WeightLoaderExtension, m, None)) for m in called), called
    assert "collective_rpc(method=method" in SOURCE and SOURCE.count("collective_rpc(") == 1  # only through _rpc


def test_flashinfer_sampler_is_turned_off_only_when_flashinfer_is_missing(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer" else real(name, *a))
    env: dict[str, str] = {}
    assert vllm_engine.ensure_sampler_env(env) and env == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    user = {"VLLM_USE_FLASHINFER_SAMPLER": "1"}
    assert not vllm_engine.ensure_sampler_env(user) and user["VLLM_USE_FLASHINFER_SAMPLER"] == "1"  # the user's choice
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    env = {}
    assert not vllm_engine.ensure_sampler_env(env) and env == {}


def test_the_engine_core_is_spawned_unless_the_user_chose():
    env: dict[str, str] = {}
    assert vllm_engine.ensure_spawn_env(env) and env == {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    user = {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}
    assert not vllm_engine.ensure_spawn_env(user) and user["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
