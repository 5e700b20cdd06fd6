"""FAKE vLLM (tests only): SamplingParams and StructuredOutputsParams as TRL builds them."""
from __future__ import annotations


class StructuredOutputsParams:
    def __init__(self, **kw):
        self.kw = kw


class SamplingParams:
    def __init__(self, n: int = 1, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
                 max_tokens: int = 16, logprobs: int | None = None, repetition_penalty: float = 1.0, **kw):
        self.n, self.temperature, self.top_p, self.top_k, self.min_p = n, temperature, top_p, top_k, min_p
        self.max_tokens, self.logprobs, self.repetition_penalty, self.extra = max_tokens, logprobs, repetition_penalty, kw
