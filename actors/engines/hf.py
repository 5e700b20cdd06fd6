"""TransformersEngine: the engine interface over a transformers causal LM (CPU or GPU).

Used by `tiny`, the tests and any machine without vLLM.

Invariants:
- Concurrent `generate` calls are batched: a background loop takes what is pending (up to
  `max_batch_prompts` prompts), prefills each prompt once (left-padded, explicit position ids),
  copies its KV cache to its n rows, and decodes with its own sampling loop over the KV cache.
  A prompt's group is handed back the moment all n of ITS rows end; finished rows leave the
  batch (the cache is shrunk), so later steps only pay for live rows. New prompts join at the
  next batch.
- Log-probs use the learner's temperature handling: the log-prob of a sampled token is
  `log_softmax(logits / temperature)[token]` over the FULL vocabulary (temperature 0: greedy
  argmax, log-prob from `log_softmax(logits)`). top_p / top_k only restrict what may be
  sampled; they never renormalise the reported log-prob. So a teacher-forced forward of the
  same weights at the same temperature reproduces these numbers and the PPO ratio is exactly
  1 at the first update.
- A row ends with "stop" on an eos/pad token (the token is kept in `tokens`, as vLLM does) or
  when a configured stop string appears in its decoded text (tokens kept up to and including
  the one completing the string; the text is cut before the string), and with "length" at
  max_tokens or at the model's max_position_embeddings. "abort" after `abort()`.
- Sleep: level 1 keeps a CPU copy of every weight and frees the device tensors; level 2 frees
  them with no copy, so after `wake(["weights"])` the parameters are allocated but empty and
  `generate` refuses (EngineAsleep) until `load_weights` has filled every tensor and
  `finish_weight_update` was called. There is no persistent KV cache here: "kv_cache" is
  accepted and is a no-op. Parameters keep their identity across sleep (only `.data` is
  swapped), so tied embeddings stay tied.
- Weights only change between decode steps (one lock guards the model).
"""
from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from actors.engines.base import (
    Engine, EngineAsleep, SamplingSettings, TaskError, check_wake_tags, prompt_ids, resolve_sampling,
)
from queues.messages import PromptTask, RolloutGroup, Sample, pack_floats, pack_ids

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row, and its log-prob under the tempered full distribution.

    logits (R, V) float32; temperature, top_p (R,) float; top_k (R,) long (<= 0: off).
    Rows with temperature 0 take the argmax and report log_softmax(logits)[argmax].
    """
    greedy = temperature <= 0
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits / safe_t[:, None], dim=-1)
    vocab = logits.shape[-1]
    filtered = logp
    use_k = (top_k > 0) & (top_k < vocab) & ~greedy
    use_p = (top_p < 1) & ~greedy
    if bool(use_k.any()) or bool(use_p.any()):
        sorted_lp, order = torch.sort(logp, dim=-1, descending=True)
        remove = torch.zeros_like(sorted_lp, dtype=torch.bool)
        if bool(use_k.any()):
            ranks = torch.arange(vocab, device=logits.device)[None, :]
            remove |= use_k[:, None] & (ranks >= top_k.clamp(min=1)[:, None])
        if bool(use_p.any()):
            probs = sorted_lp.exp()
            before = probs.cumsum(-1) - probs  # mass strictly before each token
            remove |= use_p[:, None] & (before >= top_p[:, None])
        remove[:, 0] = False  # the most likely token always stays
        mask = torch.zeros_like(remove).scatter(1, order, remove)
        filtered = logp.masked_fill(mask, float("-inf"))
    probs = torch.softmax(filtered, dim=-1)
    sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


@dataclass(eq=False)
class _Request:
    task: PromptTask
    params: SamplingSettings
    ids: list[int]
    future: asyncio.Future
    submitted_at: float
    started_at: float = 0.0
    version: int = 0
    rows: list["_Row"] = field(default_factory=list)


@dataclass(eq=False)
class _Row:
    req: _Request
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    text: str | None = None  # set when a stop string cut the text


class TransformersEngine(Engine):
    def __init__(self, generator_cfg: Any, model_cfg: Any, model_path: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = generator_cfg
        self.device = resolve_device(getattr(generator_cfg, "device", "auto"))
        self.dtype = _DTYPES[model_cfg.dtype]
        trust = bool(getattr(model_cfg, "trust_remote_code", False))
        local_only = not bool(getattr(model_cfg, "allow_download", False))
        self.tokenizer = AutoTokenizer.from_pretrained(model_cfg.tokenizer or model_path, trust_remote_code=trust,
                                                       local_files_only=local_only)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=self.dtype, attn_implementation=model_cfg.attn_implementation,
            trust_remote_code=trust, local_files_only=local_only,
        ).to(self.device).eval()
        conf = self.model.config
        self.max_model_len = int(getattr(conf, "max_position_embeddings", 1 << 30))
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.eos_ids = self._eos_ids()
        # transformers 5.x renamed the forward's `past_key_values` to `cache` (old name deprecated).
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward_params else "past_key_values"
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.version = 0
        self.max_batch_prompts = max(1, int(getattr(generator_cfg, "max_batch_prompts", 16)))
        self._torch_gen = torch.Generator(device=self.device)
        self._torch_gen.manual_seed(int(getattr(generator_cfg, "seed", 0)))
        # Unique parameters by canonical name; every alias (tied weights) maps to the same one.
        self._params: dict[str, torch.nn.Parameter] = dict(self.model.named_parameters())
        self._aliases: dict[str, str] = {}
        by_id = {id(p): n for n, p in self._params.items()}
        for n, p in self.model.named_parameters(remove_duplicate=False):
            self._aliases[n] = by_id[id(p)]
        self._shapes = {n: tuple(p.shape) for n, p in self._params.items()}
        self._offloaded: dict[str, torch.Tensor] = {}
        self._sleep_level = 0
        self._weights_present = True
        self._unloaded: set[str] = set()  # after a level-2 wake: tensors load_weights still owes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[_Request] = []
        self._active: list[_Request] = []
        self._abort_requested = False
        self._counters = {"requests": 0, "groups_done": 0, "tokens_generated": 0, "batches": 0,
                          "decode_steps": 0, "row_steps": 0, "busy_s": 0.0, "prefill_tokens": 0}

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None),
                    getattr(self.model.config, "eos_token_id", None)):
            if src is None:
                continue
            ids.update([src] if isinstance(src, int) else list(src))
        if self.tokenizer.pad_token_id is not None:
            ids.add(self.tokenizer.pad_token_id)
        return ids

    # -- event-loop plumbing -----------------------------------------------------------------

    def _bind_loop(self) -> None:
        """The batching loop and its primitives belong to the running event loop; a new loop
        (e.g. a new test) gets fresh ones."""
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._task is not None and not self._task.done():
            return
        if self._loop is not loop:
            self._lock = asyncio.Lock()
            self._has_work = asyncio.Event()
            self._pending = []
            self._active = []
        self._loop = loop
        self._task = loop.create_task(self._batch_loop(), name="hf-engine-batch-loop")

    _task: asyncio.Task | None = None
    _lock: asyncio.Lock
    _has_work: asyncio.Event

    def _model_lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._bind_loop()
        return self._lock

    # -- requests ----------------------------------------------------------------------------

    async def generate(self, task: PromptTask) -> RolloutGroup:
        params = resolve_sampling(self.cfg, task)
        ids = prompt_ids(task, self.max_model_len, self.vocab_size)
        self._check_awake()
        self._bind_loop()
        req = _Request(task=task, params=params, ids=ids, future=self._loop.create_future(), submitted_at=time.time())
        self._pending.append(req)
        self._counters["requests"] += 1
        self._has_work.set()
        return await req.future

    def _check_awake(self) -> None:
        if not self._weights_present:
            raise EngineAsleep(f"engine is asleep (level {self._sleep_level}): call wake() first")
        if self._unloaded:
            raise EngineAsleep(f"weights discarded by sleep(level=2) are not reloaded yet: {len(self._unloaded)} "
                               f"tensors missing (e.g. {sorted(self._unloaded)[0]}); call load_weights + finish_weight_update")

    async def _batch_loop(self) -> None:
        while True:
            if not self._pending:
                self._has_work.clear()
                await self._has_work.wait()
            batch = self._pending[: self.max_batch_prompts]
            del self._pending[: len(batch)]
            batch = [r for r in batch if not r.future.done()]
            if not batch:
                continue
            if self._abort_requested:
                for r in batch:
                    self._resolve(r, abort=True)
                continue
            self._active = batch
            try:
                await self._run_batch(batch)
            except Exception as e:  # a decode error fails this batch's requests, not the engine
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(TaskError(f"task {r.task.task_id}: decode failed: {type(e).__name__}: {e}"))
            finally:
                self._active = []
            if not self._pending:
                self._abort_requested = False

    def _resolve(self, req: _Request, abort: bool = False) -> None:
        if req.future.done():
            return
        samples = []
        rows = req.rows or [_Row(req=req) for _ in range(req.params.n)]
        for row in rows:
            reason = row.finish_reason or ("abort" if abort else "length")
            text = row.text if row.text is not None else self.tokenizer.decode(row.tokens, skip_special_tokens=True)
            samples.append(Sample(tokens=pack_ids(row.tokens), logprobs=pack_floats(row.logprobs),
                                  finish_reason=reason, text=text))
        now = time.time()
        group = RolloutGroup(task=req.task, samples=samples, policy_version=req.version,
                             started_at=req.started_at or now, finished_at=now)
        self._counters["groups_done"] += 1
        req.future.set_result(group)

    async def _run_batch(self, batch: list[_Request]) -> None:
        t0 = time.perf_counter()
        now = time.time()
        for req in batch:
            req.started_at, req.version = now, self.version
            req.rows = [_Row(req=req) for _ in range(req.params.n)]
        async with self._model_lock():
            self._check_awake()
            logits, cache, attn, pos = await asyncio.to_thread(self._prefill, batch)
        rows = [row for req in batch for row in req.rows]
        dev = self.device
        temperature = torch.tensor([r.req.params.temperature for r in rows], dtype=torch.float32, device=dev)
        top_p = torch.tensor([r.req.params.top_p for r in rows], dtype=torch.float32, device=dev)
        top_k = torch.tensor([r.req.params.top_k for r in rows], dtype=torch.long, device=dev)
        self._counters["batches"] += 1
        while rows:
            tokens, logprobs = sample_tokens(logits, temperature, top_p, top_k, self._torch_gen)
            self._counters["decode_steps"] += 1
            self._counters["row_steps"] += len(rows)
            tok_list, lp_list = tokens.tolist(), logprobs.tolist()
            keep: list[int] = []
            touched: list[_Request] = []
            for i, row in enumerate(rows):
                if row.req.future.done():  # the caller went away (cancelled)
                    continue
                row.tokens.append(tok_list[i])
                row.logprobs.append(lp_list[i])
                self._counters["tokens_generated"] += 1
                if self._finished(row, pos_next=int(pos[i]) + 1):
                    touched.append(row.req)
                else:
                    keep.append(i)
            if self._abort_requested:
                for req in batch:
                    self._resolve(req, abort=True)
                break
            for req in dict.fromkeys(touched):
                if all(r.finish_reason for r in req.rows):
                    self._resolve(req)
            if not keep:
                break
            if len(keep) < len(rows):
                idx = torch.tensor(keep, device=dev)
                cache.batch_select_indices(idx)
                attn, pos = attn[idx], pos[idx]
                temperature, top_p, top_k = temperature[idx], top_p[idx], top_k[idx]
                tokens = tokens[idx]
                rows = [rows[i] for i in keep]
            attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=1)
            pos = pos + 1
            async with self._model_lock():
                self._check_awake()
                logits = await asyncio.to_thread(self._decode_step, tokens, attn, pos, cache)
        for req in batch:  # defensive: nothing may be left unresolved
            self._resolve(req)
        self._counters["busy_s"] += time.perf_counter() - t0

    def _finished(self, row: _Row, pos_next: int) -> bool:
        p = row.req.params
        tok = row.tokens[-1]
        if tok in self.eos_ids:
            row.finish_reason = "stop"
        elif p.stop and self._hit_stop(row):
            row.finish_reason = "stop"
        elif len(row.tokens) >= p.max_tokens or pos_next + 1 >= self.max_model_len:
            row.finish_reason = "length"
        return bool(row.finish_reason)

    def _hit_stop(self, row: _Row) -> bool:
        stops = row.req.params.stop
        window = max(len(s) for s in stops) + 2  # a byte-level token is at least one byte
        tail = self.tokenizer.decode(row.tokens[-window:], skip_special_tokens=True)
        if not any(s in tail for s in stops):
            return False
        text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        if cut < 0:
            return False
        row.text = text[:cut]
        return True

    @torch.no_grad()
    def _prefill(self, batch: list[_Request]):
        from transformers import DynamicCache

        width = max(len(r.ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.ids):] = torch.tensor(r.ids)
            attn[i, width - len(r.ids):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{self._cache_kw: cache})
        self._counters["prefill_tokens"] += int(attn.sum())
        # One prefill per prompt; each of its n rows starts from a copy of its cache.
        expand = torch.tensor([i for i, r in enumerate(batch) for _ in range(r.params.n)], device=self.device)
        cache.batch_select_indices(expand)
        logits = out.logits[:, -1, :].float()[expand]
        attn = attn[expand]
        return logits, cache, attn, pos[expand, -1]

    @torch.no_grad()
    def _decode_step(self, tokens: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:
        out = self.model(input_ids=tokens[:, None], attention_mask=attn, position_ids=pos[:, None],
                         use_cache=True, **{self._cache_kw: cache})
        return out.logits[:, -1, :].float()

    def abort(self) -> None:
        """Ends every in-flight and queued request at the next decode step ("abort")."""
        if self._active or self._pending:
            self._abort_requested = True
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._has_work.set)

    # -- weights -----------------------------------------------------------------------------

    def _busy(self) -> int:
        return sum(1 for r in self._active + self._pending if not r.future.done())

    async def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._busy():
            raise RuntimeError(f"sleep({level}) with {self._busy()} requests in flight: pause the generator first")
        async with self._model_lock():
            if not self._weights_present:
                self._sleep_level = max(self._sleep_level, level)
                if level == 2:
                    self._offloaded.clear()
                return
            for name, p in self._params.items():
                if level == 1:
                    self._offloaded[name] = p.data if p.device.type == "cpu" else p.data.to("cpu")
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._weights_present = False
            self._sleep_level = level
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    async def wake(self, tags: list[str] | None = None) -> None:
        tags = check_wake_tags(tags)
        if "weights" not in tags or self._weights_present:
            return  # "kv_cache": allocated per batch here, nothing to restore
        async with self._model_lock():
            for name, p in self._params.items():
                if name in self._offloaded:
                    p.data = self._offloaded.pop(name).to(self.device)
                else:
                    p.data = torch.empty(self._shapes[name], dtype=p.dtype, device=self.device)
                    self._unloaded.add(name)
            self._weights_present = True
            self._sleep_level = 0

    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        async with self._model_lock():
            if not self._weights_present:
                raise EngineAsleep("load_weights on a sleeping engine: call wake(['weights']) first")
            for name, tensor in named_tensors:
                canonical = self._aliases.get(name)
                if canonical is None:
                    raise KeyError(f"load_weights: {name!r} is not a parameter of this model "
                                   f"(e.g. {next(iter(self._params))!r})")
                param = self._params[canonical]
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the model's is {tuple(param.shape)}")
                with torch.no_grad():
                    param.data.copy_(tensor.to(device=param.device, dtype=param.dtype))
                self._unloaded.discard(canonical)

    async def finish_weight_update(self, version: int) -> None:
        if self._unloaded:
            raise RuntimeError(f"finish_weight_update({version}): {len(self._unloaded)} tensors were never loaded "
                               f"since the level-2 wake (e.g. {sorted(self._unloaded)[0]})")
        self.version = int(version)

    def stats(self) -> dict[str, float]:
        c = self._counters
        return {
            "engine_tokens_generated": float(c["tokens_generated"]),
            "engine_tokens_per_s": c["tokens_generated"] / c["busy_s"] if c["busy_s"] else 0.0,
            "engine_batches": float(c["batches"]),
            "engine_mean_batch_rows": c["row_steps"] / c["decode_steps"] if c["decode_steps"] else 0.0,
            "engine_pending_prompts": float(sum(1 for r in self._pending if not r.future.done())),
            "engine_active_prompts": float(sum(1 for r in self._active if not r.future.done())),
            "engine_prefill_tokens": float(c["prefill_tokens"]),
            "engine_groups_done": float(c["groups_done"]),
            "engine_asleep": float(not self._weights_present),
            "policy_version": float(self.version),
            "simulated": 0.0,
        }

    async def close(self) -> None:
        self.abort()
        if self._task is not None and not self._task.done():
            self._task.cancel()
