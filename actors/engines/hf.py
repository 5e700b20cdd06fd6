"""TransformersEngine: the engine interface over a transformers causal LM (CPU or GPU).

Used by `tiny`, the tests and any machine without vLLM.

Invariants:
- Concurrent `generate` calls are batched: a background loop takes what is pending (up to
  `max_batch_prompts` prompts, and with `max_batch_rows` as many as fit that many rows), prefills each prompt once (left-padded, explicit position ids),
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
- A row ends as actors/engines/hf_rows.py says ("stop" on eos/pad or a stop string, "length" at max_tokens or
  the model's last position, "abort" after `abort()`); that module holds the requests, their rows and the
  groups they become.
- Sleep: level 1 keeps a CPU copy of every weight and frees the device tensors; level 2 frees
  them with no copy, so after `wake(["weights"])` the parameters are allocated but empty and
  `generate` refuses (EngineAsleep) until `load_weights` has filled every tensor and
  `finish_weight_update` was called. There is no persistent KV cache here: "kv_cache" is
  accepted and is a no-op. Parameters keep their identity across sleep (only `.data` is
  swapped), so tied embeddings stay tied.
- Weights only change between decode steps (one lock guards the model).
- LoRA: with generator.lora the model carries the learner's adapter (actors/lora.py, the same peft layers), so
  it computes as the learner does; adapter tensors load under their PEFT names, a warm base's under its Hugging
  Face names. A LoRA export (a PEFT adapter directory) is served as its base with the adapter in it.
- Partial rollouts: `interrupt()` parks every running request at its next decode step (its rows
  keep their tokens, log-probs and per-token versions; the KV cache is dropped) and starts no new
  batch; it returns once nothing decodes, so weights can be loaded. `continue_interrupted()` puts
  the parked requests first in the queue: each unfinished row is prefilled again from prompt +
  its tokens under the current weights and decodes on. Every token records the engine version
  whose weights produced it (`Sample.versions`, empty when all equal the group's version); the
  group's `policy_version` stays the version its first token was sampled at.
"""
from __future__ import annotations

import asyncio
import inspect
import time

import torch

from actors import lora
from actors.dtypes import torch_dtype
from actors.engines.base import (
    Engine,
    EngineAsleep,
    TaskError,
    prompt_ids,
    resolve_sampling,
)
from actors.engines.hf_decode import prefill, sample_tokens  # noqa: F401 - sample_tokens is this module's API too
from actors.engines.hf_rows import Request, Row, row_ended, to_group
from actors.engines.hf_weights import WeightsMixin
from config import GeneratorConfig, ModelConfig
from queues.messages import PromptTask, RolloutGroup


def resolve_device(device: str) -> torch.device:
    if device in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class TransformersEngine(WeightsMixin, Engine):
    def __init__(self, generator_cfg: GeneratorConfig, model_cfg: ModelConfig, model_path: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = generator_cfg
        self.device = resolve_device(generator_cfg.device)
        self.dtype = torch_dtype(model_cfg.dtype)
        trust, local_only = model_cfg.trust_remote_code, not model_cfg.allow_download
        self.tokenizer = AutoTokenizer.from_pretrained(model_cfg.tokenizer or model_path, trust_remote_code=trust,
                                                       local_files_only=local_only)
        load_kw = dict(dtype=self.dtype, attn_implementation=model_cfg.attn_implementation, trust_remote_code=trust,
                       local_files_only=local_only)
        if lora.is_adapter_dir(model_path):  # a LoRA export: its base with the adapter in it (eval, serve)
            self.model = lora.load_adapter_model(model_path, **load_kw)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_path, **load_kw)
            if lora.enabled(generator_cfg.lora):  # LoRA RL: the learner's adapter, synced alone
                lora.inject(self.model, generator_cfg.lora)
        self.model = self.model.to(self.device).eval()
        conf = self.model.config
        self.max_model_len = int(getattr(conf, "max_position_embeddings", 1 << 30))
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.eos_ids = self._eos_ids()
        # transformers 5.x renamed the forward's `past_key_values` to `cache` (old name deprecated).
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward_params else "past_key_values"
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.version = 0
        self.max_batch_prompts = max(1, generator_cfg.max_batch_prompts)
        self.max_batch_rows = max(0, generator_cfg.max_batch_rows)
        self._torch_gen = torch.Generator(device=self.device)
        self._torch_gen.manual_seed(generator_cfg.seed)
        # Unique parameters by canonical name; every alias (tied weights) maps to the same one.
        self._params: dict[str, torch.nn.Parameter] = dict(self.model.named_parameters())
        self._aliases: dict[str, str] = {}
        by_id = {id(p): n for n, p in self._params.items()}
        for n, p in self.model.named_parameters(remove_duplicate=False):
            self._aliases[n] = by_id[id(p)]
        # LoRA: adapter tensors arrive under their PEFT names (actors/lora.py); every update must bring all of them
        self._adapter = {lora.adapter_key(n): n for n in self._params if lora.adapter_key(n) is not None}
        self._aliases.update(self._adapter)
        self._aliases.update({lora.base_hf_name(n): n for n in self._params if ".base_layer." in n})  # a warm base
        self._adapter_loaded: set[str] = set()
        self._shapes = {n: tuple(p.shape) for n, p in self._params.items()}
        self._offloaded: dict[str, torch.Tensor] = {}
        self._sleep_level = 0
        self._weights_present = True
        self._unloaded: set[str] = set()  # after a level-2 wake: tensors load_weights still owes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[Request] = []
        self._active: list[Request] = []
        self._abort_requested = False
        self._interrupting = False
        self._parked: list[Request] = []
        self._counters = {"interrupted_requests": 0, "requests": 0, "groups_done": 0, "tokens_generated": 0, "batches": 0,
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
            self._idle = asyncio.Event()  # set while no batch is decoding
            self._pending = []
            self._active = []
            self._parked = []
            self._interrupting = False
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
        req = Request(task=task, params=params, ids=ids, future=self._loop.create_future(), submitted_at=time.time())
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
            if self._interrupting or not self._pending:
                self._idle.set()
                self._has_work.clear()
                await self._has_work.wait()
                continue
            self._idle.clear()
            batch = self._pending[: self._batch_size()]
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
            if not self._pending and not self._parked:
                self._abort_requested = False

    def _batch_size(self) -> int:
        """How many pending requests the next batch takes: at most max_batch_prompts, and (max_batch_rows > 0)
        as many as fit its rows (n each), the first one always."""
        if not self.max_batch_rows:
            return self.max_batch_prompts
        taken, rows = 0, 0
        for req in self._pending[: self.max_batch_prompts]:
            if taken and rows + req.params.n > self.max_batch_rows:
                break
            taken, rows = taken + 1, rows + req.params.n
        return max(1, taken)

    def _resolve(self, req: Request, abort: bool = False) -> None:
        if req.future.done():
            return
        group = to_group(req, self.tokenizer, abort)
        self._counters["groups_done"] += 1
        req.future.set_result(group)

    async def _run_batch(self, batch: list[Request]) -> None:
        t0 = time.perf_counter()
        now = time.time()
        resumed = any(req.rows for req in batch)
        for req in batch:
            if not req.rows:  # a new request (a continued one keeps its rows, start and version)
                req.started_at, req.version = now, self.version
                req.rows = [Row(req=req) for _ in range(req.params.n)]
        rows = [row for req in batch for row in req.rows if not row.finish_reason]
        async with self._model_lock():
            self._check_awake()
            prefill = self._prefill_rows if resumed else self._prefill
            logits, cache, attn, pos = await asyncio.to_thread(prefill, batch if not resumed else rows)
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
            touched: list[Request] = []
            for i, row in enumerate(rows):
                if row.req.future.done():  # the caller went away (cancelled)
                    continue
                row.tokens.append(tok_list[i])
                row.logprobs.append(lp_list[i])
                row.versions.append(self.version)
                self._counters["tokens_generated"] += 1
                if row_ended(row, int(pos[i]) + 1, self.eos_ids, self.max_model_len, self.tokenizer):
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
            if self._interrupting:  # park the unfinished requests; the KV cache goes with this batch
                for req in batch:
                    if not req.future.done():
                        req.interrupted += 1
                        self._counters["interrupted_requests"] += 1
                        self._parked.append(req)
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
        for req in batch:  # defensive: nothing may be left unresolved (except what is parked)
            if req not in self._parked:
                self._resolve(req)
        self._counters["busy_s"] += time.perf_counter() - t0

    def _prefill(self, batch: list[Request]):
        """One prefill per prompt; each of its n rows starts from a copy of its cache."""
        expand = [i for i, r in enumerate(batch) for _ in range(r.params.n)]
        return self._prefill_seqs([r.ids for r in batch], expand)

    def _prefill_rows(self, rows: list[Row]):
        """Continued rows: each prefilled from its own prompt + tokens so far, nothing shared."""
        return self._prefill_seqs([row.req.ids + row.tokens for row in rows], None)

    def _prefill_seqs(self, seqs: list[list[int]], expand: list[int] | None):
        logits, cache, attn, pos = prefill(self.model, seqs, self.pad_id, self.device, self._cache_kw, expand)
        self._counters["prefill_tokens"] += sum(len(x) for x in seqs)
        return logits, cache, attn, pos

    @torch.no_grad()
    def _decode_step(self, tokens: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:
        out = self.model(input_ids=tokens[:, None], attention_mask=attn, position_ids=pos[:, None],
                         use_cache=True, **{self._cache_kw: cache})
        return out.logits[:, -1, :].float()

    # -- partial rollouts ---------------------------------------------------------------------

    supports_partial = True

    async def interrupt(self, timeout_s: float = 60.0) -> int:
        """Parks the running requests (module invariant); returns how many are parked."""
        self._bind_loop()
        self._interrupting = True
        self._has_work.set()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(f"interrupt: a decode step did not end within {timeout_s} s") from None
        return len(self._parked)

    def continue_interrupted(self) -> int:
        """Continues every parked request under the current weights; returns how many."""
        parked, self._parked = [r for r in self._parked if not r.future.done()], []
        self._pending[:0] = parked
        self._interrupting = False
        if self._loop is not None:
            self._has_work.set()
        return len(parked)

    def abort(self) -> None:
        """Ends every in-flight, queued and parked request at the next decode step ("abort")."""
        for req in self._parked:
            self._resolve(req, abort=True)
        self._parked = []
        if self._active or self._pending:
            self._abort_requested = True
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._has_work.set)

    # -- weights: actors/engines/hf_weights.py -----------------------------------------------

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
            "engine_interrupted_requests": float(c["interrupted_requests"]),
            "engine_parked_requests": float(len(self._parked)),
            "engine_asleep": float(not self._weights_present),
            "policy_version": float(self.version),
            "simulated": 0.0,
        }

    async def memory(self) -> dict[str, float]:
        from actors.device_memory import memory_stats

        return memory_stats(self.device, reset_peak=True)

    async def close(self) -> None:
        self.abort()
        if self._task is not None and not self._task.done():
            self._task.cancel()
