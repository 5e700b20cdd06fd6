"""A FAKE of vLLM's offline `LLM` for the CPU tests of bench/peers' TRL side (tests/integration/test_peers_gpu.py): TRL's
GRPOTrainer in vllm_mode="colocate" drives it exactly as it drives vLLM (build, sleep/wake, load_weights
through llm_engine.model_executor.driver_worker.model_runner.model, reset_prefix_cache, generate with token-id
prompts), while a transformers model on the CPU samples. vLLM itself needs a GPU, which the tests do not have.

Every call is appended to $FAKE_VLLM_LOG (JSON lines) so a test can check what the driver did. Never on the
device: bench/peers/gpu.py runs the real vLLM there.
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

from vllm.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: F401 - vLLM's names

__version__ = "0.26.0"
FAKE = True


def _log(**event) -> None:
    path = os.environ.get("FAKE_VLLM_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


class Logprob:
    def __init__(self, logprob: float, rank: int = 1):
        self.logprob, self.rank, self.decoded_token = logprob, rank, None


class CompletionOutput:
    def __init__(self, token_ids: list[int], logprobs):
        self.index, self.token_ids, self.logprobs = 0, token_ids, logprobs
        self.finish_reason = "stop"


class RequestOutput:
    def __init__(self, prompt_token_ids: list[int], outputs: list[CompletionOutput]):
        self.prompt_token_ids, self.outputs, self.prompt = prompt_token_ids, outputs, None


class _Weights:
    """model_runner.model: load_weights([(name, tensor)]) copies into the sampling model by HF name."""

    def __init__(self, llm: "LLM"):
        self.llm = llm

    def load_weights(self, weights) -> None:
        import torch

        params = dict(self.llm.model.named_parameters())
        n = 0
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor.to(params[name].dtype))
                n += 1
        self.llm.loaded += n


class LLM:
    def __init__(self, model: str, **kwargs):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.eos = AutoTokenizer.from_pretrained(model).eos_token_id
        self.loaded = 0
        self.asleep: set[str] = set()
        runner = SimpleNamespace(model=_Weights(self))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)))
        _log(call="init", model=model, **{k: v for k, v in kwargs.items() if isinstance(v, (str, int, float, bool, type(None)))},
             rank=os.environ.get("RANK"), world_size=os.environ.get("WORLD_SIZE"))

    def sleep(self, level: int = 1) -> None:
        self.asleep = {"weights", "kv_cache"}
        _log(call="sleep", level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.asleep -= set(tags or ["weights", "kv_cache"])
        _log(call="wake_up", tags=tags, loaded=self.loaded)
        self.loaded = 0

    def reset_prefix_cache(self) -> bool:
        _log(call="reset_prefix_cache")
        return True

    def generate(self, prompts, sampling_params: SamplingParams, use_tqdm: bool = False) -> list[RequestOutput]:
        import torch

        if self.asleep:
            raise RuntimeError(f"fake vLLM: generate while asleep ({sorted(self.asleep)})")
        sp = sampling_params
        out = []
        with torch.no_grad():
            for p in prompts:
                ids = list(p["prompt_token_ids"])
                samples = []
                for _ in range(sp.n):
                    seq, lps = list(ids), []
                    for _ in range(sp.max_tokens):
                        logits = self.model(torch.tensor([seq])).logits[0, -1].float() / max(sp.temperature, 1e-6)
                        logp = torch.log_softmax(logits, -1)
                        tok = int(torch.multinomial(logp.exp(), 1))
                        seq.append(tok)
                        lps.append({tok: Logprob(float(logp[tok]))})
                        if tok == self.eos:
                            break
                    samples.append(CompletionOutput(seq[len(ids):], lps if sp.logprobs is not None else None))
                out.append(RequestOutput(ids, samples))
        _log(call="generate", prompts=len(prompts), n=sp.n, max_tokens=sp.max_tokens, temperature=sp.temperature,
             logprobs=sp.logprobs)
        return out
