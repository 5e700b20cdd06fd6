"""VLLMEngine: the engine interface over vLLM's v1 AsyncLLM (vLLM 0.26 on torch 2.11, 0.27-0.32 on 2.13).

Invariants:
- One `generate(task)` is one vLLM request: SamplingParams(n=..., logprobs=0) over the prompt's
  token ids (TokensPrompt), FINAL_ONLY output; the group comes back when its n samples end.
- Log-probs: the engine is built with logprobs_mode="processed_logprobs", so the reported
  log-prob of a sampled token is taken after temperature scaling, the learner's definition
  (vLLM's default, "raw_logprobs", is pre-temperature). With top_p < 1 or top_k > 0 vLLM's
  processed log-probs are renormalised over the kept tokens, which the transformers engine
  does not do; the PPO ratio is then not exactly 1 at the first update. A warning says so.
- Sleep mode is always on (enable_sleep_mode=True): sleep(1|2) / wake(tags) map to vLLM's
  sleep / wake_up; the prefix cache is reset after every weight update.
- Weights reach EVERY worker (tensor-parallel ranks included) through the worker extension
  (actors/engines/vllm_worker.py), never as tensors through collective_rpc (its msgpack turns a
  tensor into a list): `in_workers(key, step)` runs a weight-sync transport's worker step in
  each worker with plain arguments (the transports in weights/ say what they send: CUDA IPC handles
  as pickled bytes, a broadcast group each worker joins, or the plan plus raw bytes per dtype, which
  `load_weights` also uses after flattening its tensors). Every worker must report the bucket's
  tensor count, else the load is an error. `finish_weight_update(version)` empties the workers'
  allocator caches, resets the prefix cache and only then sets the version.
- Without flashinfer, vLLM 0.26's default sampler fails at start-up: the engine sets
  VLLM_USE_FLASHINFER_SAMPLER=0 itself when flashinfer is not importable (and logs it once), unless
  the user set the variable.
- vLLM's engine-core process is spawned, never forked (VLLM_WORKER_MULTIPROC_METHOD=spawn unless the
  user set it): a process that has asked CUDA anything, even `torch.cuda.is_available()`, cannot fork
  a CUDA child, and vLLM only detects an initialised CUDA context (seen on the H200, 2026-12-03).
- The user's `engine_kwargs` are deep-converted to plain dicts/lists and passed through;
  a key that is not an AsyncEngineArgs field is an error naming it, never silently dropped.
- Partial rollouts (async mode): after `enable_partial()` a group is n streaming requests that a
  weight update interrupts and resubmits with their tokens appended (actors/engines/vllm_partial.py).
- LoRA (actors/engines/vllm_lora.py): with generator.lora the engine serves the learner's adapter over the
  base (enable_lora): each weight update stages the adapter's tensors in this process, writes them as a PEFT
  directory and swaps in a new LoRARequest (a new adapter id per version, the old one removed); every request
  carries the current one. A LoRA export is served the same way, its adapter over the base it names.
- vLLM is imported lazily; `VLLM_API` below lists every vLLM symbol and parameter this file
  uses, and tests/unit/test_vllm_adapter.py checks exactly that list against the installed vLLM.
"""
from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.util
import itertools
import logging
import os
import time
from typing import Any, Iterable, Mapping

from actors.engines.base import Engine, check_wake_tags, prompt_ids, resolve_sampling
from actors.engines.vllm_lora import VLLMAdapter
from actors.engines.vllm_partial import PartialRequests
from config import GeneratorConfig, ModelConfig
from queues.messages import PromptTask, RolloutGroup, Sample, pack_floats, pack_ids

log = logging.getLogger(__name__)

# Every vLLM symbol the adapter touches: (dotted path, parameter / field names it passes).
VLLM_API: list[tuple[str, tuple[str, ...]]] = [
    ("vllm.AsyncEngineArgs", ("model", "tokenizer", "dtype", "tensor_parallel_size", "gpu_memory_utilization",
                              "enable_prefix_caching", "enforce_eager", "enable_sleep_mode", "seed",
                              "trust_remote_code", "worker_extension_cls", "logprobs_mode", "enable_lora",
                              "max_lora_rank", "max_loras")),
    ("vllm.SamplingParams", ("n", "temperature", "top_p", "top_k", "max_tokens", "stop", "logprobs", "seed",
                             "skip_special_tokens", "output_kind")),
    ("vllm.inputs.TokensPrompt", ("prompt_token_ids",)),
    ("vllm.sampling_params.RequestOutputKind.FINAL_ONLY", ()),
    ("vllm.sampling_params.RequestOutputKind.DELTA", ()),
    ("vllm.v1.engine.async_llm.AsyncLLM.from_engine_args", ("engine_args",)),
    ("vllm.v1.engine.async_llm.AsyncLLM.generate", ("prompt", "sampling_params", "request_id", "lora_request")),
    ("vllm.lora.request.LoRARequest", ("lora_name", "lora_int_id", "lora_path")),
    ("vllm.v1.engine.async_llm.AsyncLLM.add_lora", ("lora_request",)),
    ("vllm.v1.engine.async_llm.AsyncLLM.remove_lora", ("lora_id",)),
    ("vllm.v1.engine.async_llm.AsyncLLM.abort", ("request_id",)),
    ("vllm.v1.engine.async_llm.AsyncLLM.sleep", ("level",)),
    ("vllm.v1.engine.async_llm.AsyncLLM.wake_up", ("tags",)),
    ("vllm.v1.engine.async_llm.AsyncLLM.collective_rpc", ("method", "timeout", "args")),
    ("vllm.v1.engine.async_llm.AsyncLLM.reset_prefix_cache", ()),
    ("vllm.v1.engine.async_llm.AsyncLLM.shutdown", ()),
    ("vllm.v1.engine.async_llm.AsyncLLM.errored", ()),
]


def resolve_symbol(dotted: str) -> Any:
    """'pkg.mod.Class.attr' -> the object (imports the longest importable module prefix)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"cannot import {dotted}")


def _sym(name: str) -> Any:
    assert any(path == name for path, _ in VLLM_API), f"{name} missing from VLLM_API"
    return resolve_symbol(name)


def plain(value: Any) -> Any:
    """Deep-converts mappings / sequences (OmegaConf, msgspec, tuples) to dicts and lists."""
    if isinstance(value, Mapping) or (hasattr(value, "keys") and hasattr(value, "__getitem__")):
        return {str(k): plain(value[k]) for k in value.keys()}
    if hasattr(value, "__struct_fields__"):
        return {f: plain(getattr(value, f)) for f in value.__struct_fields__}
    if isinstance(value, (list, tuple)) or (hasattr(value, "__iter__") and not isinstance(value, (str, bytes))):
        return [plain(v) for v in value]
    return value


def engine_arg_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(_sym("vllm.AsyncEngineArgs"))}


# vLLM's accepted max_lora_rank values (a LoRA of rank r is served by the smallest one >= r)
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"learner.lora.rank={rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")
    return fits[0]


def build_engine_args(generator_cfg: GeneratorConfig, model_cfg: ModelConfig, model_path: str, known_fields: set[str],
                      lora_rank: int = 0) -> dict[str, Any]:
    """The AsyncEngineArgs keyword dict: ours, then the user's engine_kwargs over them. With `lora_rank` > 0
    the engine serves LoRA adapters (one at a time) of up to that rank.
    Raises ValueError naming any key vLLM's AsyncEngineArgs does not have."""
    args: dict[str, Any] = {
        "model": model_path,
        "tokenizer": model_cfg.tokenizer or model_path,
        "dtype": model_cfg.dtype,
        "tensor_parallel_size": generator_cfg.tensor_parallel_size,
        "gpu_memory_utilization": generator_cfg.gpu_memory_utilization,
        "enable_prefix_caching": generator_cfg.enable_prefix_caching,
        "enforce_eager": generator_cfg.enforce_eager,
        "enable_sleep_mode": True,
        "seed": generator_cfg.seed,
        "trust_remote_code": model_cfg.trust_remote_code,
        "worker_extension_cls": "actors.engines.vllm_worker.WeightLoaderExtension",
        "logprobs_mode": "processed_logprobs",
    }
    if lora_rank > 0:
        args.update(enable_lora=True, max_lora_rank=vllm_lora_rank(lora_rank), max_loras=1)
    user = plain(generator_cfg.engine_kwargs or {})
    if not isinstance(user, dict):
        raise ValueError(f"generator.engine_kwargs must be a mapping, got {type(generator_cfg.engine_kwargs).__name__}")
    args.update(user)
    unknown = sorted(set(args) - known_fields)
    if unknown:
        import difflib

        hints = {k: difflib.get_close_matches(k, sorted(known_fields), n=1) for k in unknown}
        detail = ", ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items())
        raise ValueError(f"generator.engine_kwargs: not vLLM AsyncEngineArgs field(s): {detail}")
    if not args["enable_sleep_mode"]:
        raise ValueError("generator.engine_kwargs.enable_sleep_mode must stay true (sleep/wake needs it)")
    return args


def sample_from_completion(completion: Any) -> Sample:
    """A vLLM CompletionOutput -> Sample. Its `logprobs` is one entry per generated token,
    each a mapping token id -> Logprob (or a FlatLogprobs sequence of such mappings)."""
    tokens = list(completion.token_ids)
    lps = []
    for tok, entry in zip(tokens, completion.logprobs or []):
        lp = entry[tok]
        lps.append(float(getattr(lp, "logprob", lp)))
    if len(lps) != len(tokens):
        raise ValueError(f"vLLM returned {len(lps)} log-probs for {len(tokens)} tokens (logprobs=0 not honoured?)")
    reason = completion.finish_reason or "abort"
    if reason not in ("stop", "length", "abort"):
        reason = "error"
    return Sample(tokens=pack_ids(tokens), logprobs=pack_floats(lps), finish_reason=reason, text=completion.text)


_FLASHINFER_LOGGED = False


def ensure_sampler_env(environ: dict | None = None) -> bool:
    """Sets VLLM_USE_FLASHINFER_SAMPLER=0 when flashinfer is not importable and the user did not
    set it (vLLM 0.26's default sampler imports flashinfer unguarded). Returns whether it set it."""
    global _FLASHINFER_LOGGED
    env = os.environ if environ is None else environ
    if "VLLM_USE_FLASHINFER_SAMPLER" in env or importlib.util.find_spec("flashinfer") is not None:
        return False
    env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    if not _FLASHINFER_LOGGED:
        _FLASHINFER_LOGGED = True
        log.warning("flashinfer is not importable: VLLM_USE_FLASHINFER_SAMPLER=0 (vLLM's PyTorch sampler)")
    return True


def ensure_spawn_env(environ: dict | None = None) -> bool:
    """VLLM_WORKER_MULTIPROC_METHOD=spawn unless the user chose; returns whether it set it."""
    env = os.environ if environ is None else environ
    if "VLLM_WORKER_MULTIPROC_METHOD" in env:
        return False
    env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    return True


class VLLMEngine(PartialRequests, Engine):
    loads_in_workers = True
    _adapter: VLLMAdapter | None = None  # LoRA: the learner's adapter or an export's (set in __init__)
    _sym_fn = staticmethod(_sym)
    _sample_fn = staticmethod(sample_from_completion)

    def __init__(self, generator_cfg: GeneratorConfig, model_cfg: ModelConfig, model_path: str):
        self.cfg = generator_cfg
        self.version = 0
        ensure_sampler_env()
        ensure_spawn_env()
        self._adapter = VLLMAdapter.for_engine(generator_cfg, model_path)
        base = self._adapter.base_model if self._adapter is not None else model_path
        args = build_engine_args(generator_cfg, model_cfg, base, engine_arg_fields(),
                                 lora_rank=self._adapter.rank if self._adapter is not None else 0)
        if self._adapter is not None and self._adapter.export and not model_cfg.tokenizer:
            args["tokenizer"] = model_path  # the export holds the run's tokenizer files
        if self._adapter is not None and not self._adapter.export:
            self.loads_in_workers = False  # LoRA RL: adapters arrive here whole, by LoRARequest (VLLMAdapter)
        AsyncEngineArgs = _sym("vllm.AsyncEngineArgs")
        self.llm = _sym("vllm.v1.engine.async_llm.AsyncLLM.from_engine_args")(AsyncEngineArgs(**args))
        hf_config = getattr(getattr(self.llm, "model_config", None), "hf_config", None)
        self.max_model_len = int(getattr(getattr(self.llm, "model_config", None), "max_model_len", 0)
                                 or getattr(hf_config, "max_position_embeddings", 1 << 30))
        self.vocab_size = getattr(hf_config, "vocab_size", None)
        self._tokenizer_path = args["tokenizer"]
        self._tokenizer = None
        if generator_cfg.top_p < 1 or generator_cfg.top_k > 0:
            log.warning("vLLM processed log-probs are renormalised by top_p/top_k; the first PPO ratio will not be 1")
        self._ids = itertools.count()
        self._inflight: set[str] = set()
        self._m = {"requests": 0, "tokens": 0, "busy_s": 0.0, "prompt_tokens": 0, "cached_tokens": 0}
        self._load_s = 0.0
        self.worker_memory: list[dict[str, float]] = []  # each worker's, after the last weight update

    @property
    def tokenizer(self):
        """The model's Hugging Face tokenizer (loaded on first use: multi-turn episodes tokenize their
        observations with it, alone, as policies/episode.py says)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
        return self._tokenizer

    async def generate(self, task: PromptTask) -> RolloutGroup:
        s = resolve_sampling(self.cfg, task)
        ids = prompt_ids(task, self.max_model_len, self.vocab_size)
        if self._partial:  # async mode with partial rollouts: actors/engines/vllm_partial.py
            return await self._generate_partial(task, s, ids, min(s.max_tokens, self.max_model_len - len(ids)))
        params = _sym("vllm.SamplingParams")(
            n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else -1,
            max_tokens=min(s.max_tokens, self.max_model_len - len(ids)), stop=s.stop or None, logprobs=0,
            seed=s.seed, skip_special_tokens=True, output_kind=_sym("vllm.sampling_params.RequestOutputKind.FINAL_ONLY"),
        )
        prompt = _sym("vllm.inputs.TokensPrompt")(prompt_token_ids=ids)
        request_id = f"{task.task_id}#{next(self._ids)}"
        started, version = time.time(), self.version
        self._inflight.add(request_id)
        self._m["requests"] += 1
        final = None
        try:
            async for out in self.llm.generate(prompt=prompt, sampling_params=params, request_id=request_id,
                                               **self._lora_kw()):
                final = out
        finally:
            self._inflight.discard(request_id)
        samples = [sample_from_completion(c) for c in (final.outputs if final is not None else [])]
        finished = time.time()
        self._m["tokens"] += sum(len(x.tokens) // 4 for x in samples)
        self._m["busy_s"] += finished - started
        self._m["prompt_tokens"] += len(ids)  # prefix caching: how much of each prompt vLLM found cached
        self._m["cached_tokens"] += int(getattr(final, "num_cached_tokens", 0) or 0) if final is not None else 0
        return RolloutGroup(task=task, samples=samples, policy_version=version, started_at=started, finished_at=finished)

    async def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        await self.llm.sleep(level=level)

    async def wake(self, tags: list[str] | None = None) -> None:
        await self.llm.wake_up(tags=check_wake_tags(tags))

    # -- weight updates: every one runs in vLLM's workers (actors/engines/vllm_worker.py) ----------

    async def _rpc(self, method: str, *args: Any, timeout: float | None = 600.0, timed: bool = True) -> list:
        """A worker extension method in every worker; `timed`: its seconds count as weight loading."""
        started = time.perf_counter()
        results = await self.llm.collective_rpc(method=method, timeout=timeout, args=args)
        if timed:
            self._load_s += time.perf_counter() - started
        return results

    async def in_workers(self, key: Any, step: dict, timeout: float | None = 600.0) -> list:
        """A weight-sync transport's step (plain builtins) in every worker (the extension's `arl_weights`)."""
        return await self._rpc("arl_weights", key.kind, step, timeout=timeout)

    def num_workers(self) -> int:
        """One per tensor-parallel rank: each takes its own rank in a broadcast group."""
        return int(self.cfg.tensor_parallel_size)

    def _lora_kw(self) -> dict[str, Any]:
        """generate()'s adapter: the current version's (LoRA RL) or the export's; {} without LoRA."""
        adapter = self._adapter
        if adapter is not None and adapter.export:
            adapter.first_request(self._sym_fn("vllm.lora.request.LoRARequest"))
        request = adapter.request if adapter is not None else None
        return {"lora_request": request} if request is not None else {}

    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Plain bytes: the bucket flattened on the CPU, its plan, one raw buffer per dtype (the object
        store transport's worker step, which rebuilds them on each worker's device). LoRA RL: the adapter's
        tensors are staged for finish_weight_update (VLLMAdapter)."""
        if self._adapter is not None:
            # adapter tensors are staged; a base tensor (a LoRA warm start's base, once) loads in the workers
            named_tensors = self._adapter.stage(named_tensors)
            if not named_tensors:
                return
        from weights.store import load_in_workers
        from weights.wire import flatten_bucket

        named = [(n, t.detach().cpu()) for n, t in named_tensors]
        plan, buffers = flatten_bucket(named, int(version), 0, device="cpu")
        del named
        await load_in_workers(self, plan, buffers)

    async def finish_weight_update(self, version: int) -> None:
        if self._adapter is not None:  # LoRA RL: the staged adapter as a new LoRARequest
            if self._adapter.take_base_loaded():
                self.worker_memory = await self._rpc("arl_finish")
            await self._adapter.switch(self.llm, int(version), self._sym_fn("vllm.lora.request.LoRARequest"))
            await self.llm.reset_prefix_cache()  # cached prefixes hold the old adapter's KV
            self.version = int(version)
            return
        self.worker_memory = await self._rpc("arl_finish")  # the loads' temporaries back to the device
        await self.llm.reset_prefix_cache()  # cached prefixes hold the old weights' KV
        self.version = int(version)

    def abort(self) -> None:
        if self._partial:
            self._abort_partial()
        ids = list(self._inflight)
        if ids:
            asyncio.get_running_loop().create_task(self.llm.abort(request_id=ids))

    def stats(self) -> dict[str, float]:
        m = self._m
        return {"engine_requests": float(m["requests"]), "engine_tokens_generated": float(m["tokens"]),
                "engine_inflight_requests": float(len(self._inflight)), "policy_version": float(self.version),
                "engine_weight_load_s": float(self._load_s), "simulated": 0.0,
                "engine_prompt_tokens": float(m["prompt_tokens"]), "engine_cached_prompt_tokens": float(m["cached_tokens"]),
                "engine_prefix_cache_hit_rate": m["cached_tokens"] / m["prompt_tokens"] if m["prompt_tokens"] else 0.0}

    async def memory(self) -> dict[str, float]:
        """Its first worker's view (actors/device_memory.py; the device's use is the whole GPU's)."""
        stats = await self._rpc("arl_memory", True, timeout=60.0, timed=False)
        return dict(stats[0]) if stats else {}

    def dead(self) -> str | None:
        """AsyncLLM.errored: its engine core process died (or its output handler ended); every request
        after that fails at once with EngineDeadError."""
        try:
            errored = bool(self.llm.errored)
        except Exception as e:  # noqa: BLE001 - a client torn down under us is as dead
            return f"vLLM engine: AsyncLLM.errored raised {type(e).__name__}: {str(e)[:200]}"
        return "vLLM engine: its engine core died (AsyncLLM.errored)" if errored else None

    async def close(self) -> None:
        self.llm.shutdown()
