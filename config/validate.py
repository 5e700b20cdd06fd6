"""Validation: a RunConfig checked once at start, cross-field rules, and every `auto` resolved.

Invariants:
- A type error is a one-line ConfigError naming the user's dotted key.
- Off-policy correction is on unless a user turned it off: `validate` replaces
  `learner.correction="auto"` by what the run needs (`resolve_correction`), so the config a run
  prints and saves says which correction the learner applies. An explicit "off" where generation
  can be off-policy (async with max_staleness > 0, or an engine other than the learner's numerics)
  is accepted with a logged warning.
- Every `auto` is resolved here and nowhere else: the correction (`resolve_correction`), Dr.GRPO's
  `learner.loss_norm_tokens=0` (the generator's max_tokens), `assembler.overlong_buffer=0` (a quarter of
  it; assembler.max_tokens is always the generator's), the weight
  transport, the learner's world size and a CPU recipe's CPU asks sized to a set cluster.num_cpus
  (`resolve_placement`, through the pure config.placement.make_placement and fit_cpu_asks), so the config.json a run saves holds no `auto` and loads back
  to the same config.
"""
from __future__ import annotations

import logging
from typing import Any

import msgspec

from config.placement import fit_cpu_asks, make_placement
from config.schema import ConfigError, RunConfig, expresses_shared_prefix

log = logging.getLogger("config")


def _got(data: dict, key: str) -> str:
    """' (value <value>)' for the value at a dotted key, to echo the bad input ('' when not found)."""
    node = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return ""
        node = node[part]
    return f" (value {node!r})"[:200]


def validate(data: dict) -> RunConfig:
    """Builtins -> RunConfig, with a one-line error naming the bad key."""
    try:
        cfg = msgspec.convert(data, RunConfig, strict=False)
    except msgspec.ValidationError as e:
        msg = str(e)
        # msgspec says "... - at `$.learner.lr`"; turn the path into the user's dotted key.
        if "- at `$." in msg:
            text, path = msg.rsplit("- at `$.", 1)
            key = path.rstrip("`")
            raise ConfigError(f"config key {key!r}: {text.strip()}{_got(data, key)}") from None
        raise ConfigError(f"config: {msg}") from None
    check(cfg)
    cfg.learner.correction, cfg.learner.correction_cap = resolve_correction(cfg)
    cfg.assembler.share_prompt = cfg.learner.share_prompt
    if cfg.learner.loss_agg == "seq-mean-token-sum-norm" and cfg.learner.loss_norm_tokens == 0:
        cfg.learner.loss_norm_tokens = cfg.generator.max_tokens  # Dr.GRPO's constant: the longest answer
    cfg.assembler.max_tokens = cfg.generator.max_tokens  # DAPO's L_max: not a user key
    resolve_lora(cfg)
    if cfg.assembler.overlong_buffer == 0:
        cfg.assembler.overlong_buffer = max(1, cfg.generator.max_tokens // 4)
    resolve_placement(cfg)
    return cfg


def resolve_lora(cfg: RunConfig) -> None:
    """learner.lora on: the engines wrap their model in the same adapter (generator.lora, not a user key) and
    keep the frozen base across sleeps (generator.sleep_level 1: no sync ever brings the base back)."""
    cfg.generator.lora = msgspec.structs.replace(cfg.learner.lora, target_modules=list(cfg.learner.lora.target_modules))
    if cfg.learner.lora.rank > 0:
        cfg.generator.sleep_level = 1


def resolve_placement(cfg: RunConfig) -> None:
    """The placement's answers written into the config, once (and the generator's query limits: 0 is the
    scorer's): `device="auto"` (generator, learner) becomes
    "cuda" on a GPU recipe and "cpu" otherwise, `coordinator.weight_sync="auto"` becomes
    the transport the placement implies and `learner.num_ranks` the learner's world size (on GPUs the
    placement decides it); a CPU recipe whose actors ask for more CPUs than a set cluster.num_cpus gets
    every role's num_cpus scaled down to fit (config.placement.fit_cpu_asks). A placement that cannot be built (too few GPUs for the engines) leaves both
    as given: the launcher, --dry-run and --preflight report its errors."""
    if not cfg.generator.tool_timeout_s:
        cfg.generator.tool_timeout_s = cfg.scorer.timeout_s
    if not cfg.generator.tool_max_rows:
        cfg.generator.tool_max_rows = cfg.scorer.max_rows
    gpu = cfg.cluster.gpus_per_node > 0
    for section in (cfg.generator, cfg.learner):
        if section.device in ("", "auto"):
            section.device = "cuda" if gpu else "cpu"
    placement = make_placement(cfg)
    if placement.errors:
        return
    cfg.coordinator.weight_sync = placement.weight_sync
    cfg.learner.num_ranks = placement.learner_world_size
    sized = fit_cpu_asks(placement, cfg.cluster.num_cpus)
    if sized:
        log.info("CPU asks sized to cluster.num_cpus=%s: %s", cfg.cluster.num_cpus,
                 ", ".join(f"{role}.num_cpus {getattr(cfg, role).num_cpus:g} -> {ask:g}" for role, ask in sized.items()))
        for role, ask in sized.items():
            getattr(cfg, role).num_cpus = ask


def may_be_off_policy(cfg: RunConfig) -> str:
    """Why the sampler's log-probs can differ from the learner's proximal ones ("" if they cannot)."""
    if cfg.coordinator.mode == "async" and cfg.assembler.max_staleness > 0:
        return f"async with assembler.max_staleness={cfg.assembler.max_staleness}"
    if cfg.generator.engine != "transformers":
        return f"generator.engine={cfg.generator.engine!r} samples with other kernels than the learner"
    if cfg.model.dtype != cfg.learner.dtype:
        return f"the engine runs {cfg.model.dtype}, the learner {cfg.learner.dtype}"
    return ""


def resolve_correction(cfg: RunConfig) -> tuple[str, float]:
    """(mode, cap) the learner applies: an explicit learner.correction as given; "auto" is the legacy
    tis_cap when set, else "tis" at correction_cap whenever may_be_off_policy, else "off"."""
    lc = cfg.learner
    if lc.correction != "auto":
        return lc.correction, lc.correction_cap
    if lc.tis_cap > 0:
        return "tis", lc.tis_cap
    return ("tis" if may_be_off_policy(cfg) else "off"), lc.correction_cap


def check(cfg: RunConfig) -> None:
    """Cross-field rules that types alone cannot express."""
    def need(cond: bool, key: str, why: str) -> None:
        if not cond:
            raise ConfigError(f"config key {key!r}: {why}")

    need(cfg.generator.n_samples >= 1, "generator.n_samples", "must be >= 1")
    need(cfg.generator.temperature >= 0, "generator.temperature", "must be >= 0")
    need(0 < cfg.generator.top_p <= 1, "generator.top_p", "must be in (0, 1]")
    need(cfg.generator.max_tokens >= 1, "generator.max_tokens", "must be >= 1")
    need(cfg.generator.max_batch_rows >= 0, "generator.max_batch_rows", "must be >= 0 (0: no row cap)")
    need(cfg.generator.sleep_level in (1, 2), "generator.sleep_level", "must be 1 or 2")
    need(cfg.learner.zero_stage in (0, 1, 2, 3), "learner.zero_stage", "must be 0, 1, 2 or 3")
    need(len(cfg.learner.betas) == 2, "learner.betas", "needs two values, e.g. 0.9,0.95")
    need(cfg.learner.update_epochs >= 1, "learner.update_epochs", "must be >= 1")
    need(cfg.learner.lr > 0, "learner.lr", "must be > 0")
    need(cfg.learner.checkpoint_layers >= -1, "learner.checkpoint_layers", "must be -1 (every layer) or >= 0")
    need(0 <= cfg.learner.warmup_ratio < 1, "learner.warmup_ratio", "must be in [0, 1)")
    need(cfg.learner.num_ranks >= 1, "learner.num_ranks", "must be >= 1")
    lora = cfg.learner.lora
    need(lora.rank >= 0, "learner.lora.rank", "must be >= 0 (0: off, full fine-tuning)")
    need(lora.alpha > 0, "learner.lora.alpha", "must be > 0")
    need(0 <= lora.dropout < 1, "learner.lora.dropout", "must be in [0, 1)")
    need(lora.rank == 0 or bool(lora.target_modules), "learner.lora.target_modules",
         "must name at least one module (e.g. q_proj,v_proj, or all-linear)")
    need(cfg.learner.collective_timeout_s > 0, "learner.collective_timeout_s",
         "must be > 0 (seconds a collective may wait for a peer before the run is relaunched)")
    need(cfg.generator.max_turns >= 1, "generator.max_turns", "must be >= 1 (1: one-shot answers)")
    need(0 <= cfg.model.tiny_sft_episodes <= 1, "model.tiny_sft_episodes", "must be in [0, 1]")
    need(0 <= cfg.model.tiny_sft_value_slips <= 1, "model.tiny_sft_value_slips", "must be in [0, 1]")
    need(0 <= cfg.model.tiny_sft_revise <= 1, "model.tiny_sft_revise", "must be in [0, 1]")
    need(0 <= cfg.model.tiny_sft_look <= 1, "model.tiny_sft_look", "must be in [0, 1]")
    need(not cfg.data.synthetic_value_forms or cfg.data.sample_values == 0, "data.sample_values",
         "must be 0 with data.synthetic_value_forms (sample values would show the stored form of the values)")
    need(1 <= cfg.data.synthetic_domains <= 4, "data.synthetic_domains", "must be in 1..4")
    need(cfg.data.synthetic_value_pool == 0 or cfg.data.synthetic_value_pool >= 2, "data.synthetic_value_pool",
         "must be 0 (off) or at least 2 places per database")
    need(not (cfg.data.synthetic_value_pool and cfg.data.synthetic_value_forms), "data.synthetic_value_pool",
         "cannot be combined with data.synthetic_value_forms")
    need(cfg.generator.max_observation_tokens >= 8, "generator.max_observation_tokens", "must be >= 8")
    need(cfg.generator.tool_workers >= 1, "generator.tool_workers", "must be >= 1")
    need(cfg.generator.tool_timeout_s >= 0, "generator.tool_timeout_s", "must be >= 0 (0: the scorer's timeout_s)")
    need(cfg.generator.tool_max_rows >= 0, "generator.tool_max_rows", "must be >= 0 (0: the scorer's max_rows)")
    need(cfg.coordinator.prompts_per_step >= 1, "coordinator.prompts_per_step", "must be >= 1")
    need(cfg.coordinator.steps >= 0, "coordinator.steps", "must be >= 0")
    need(cfg.coordinator.step_timeout_s > 0, "coordinator.step_timeout_s", "must be > 0")
    need(cfg.coordinator.call_timeout_s > 0, "coordinator.call_timeout_s",
         "must be > 0 (seconds a call to an actor may take before the actor counts as frozen)")
    need(cfg.coordinator.heartbeat_s >= 0, "coordinator.heartbeat_s", "must be >= 0 (0: no heartbeat)")
    need(cfg.coordinator.heartbeat_timeout_s > 0, "coordinator.heartbeat_timeout_s", "must be > 0")
    need(cfg.coordinator.heartbeat_misses >= 1, "coordinator.heartbeat_misses", "must be >= 1")
    need(cfg.coordinator.keep_checkpoints >= 0, "coordinator.keep_checkpoints", "must be >= 0 (0 keeps all)")
    need(cfg.coordinator.keep_exports >= 0, "coordinator.keep_exports", "must be >= 0 (0 keeps all)")
    need(cfg.assembler.max_staleness >= 0, "assembler.max_staleness", "must be >= 0")
    need(cfg.assembler.micro_batch_tokens >= 16, "assembler.micro_batch_tokens", "must be >= 16")
    need(cfg.assembler.minibatches_per_step >= 1, "assembler.minibatches_per_step", "must be >= 1")
    need(cfg.scorer.workers >= 1, "scorer.workers", "must be >= 1")
    need(cfg.cluster.max_relaunches >= 0, "cluster.max_relaunches", "must be >= 0")
    for term in ("reward_syntax", "reward_schema_linking", "reward_format"):
        need(0 <= getattr(cfg.scorer, term) <= 1, f"scorer.{term}", "must be in [0, 1] (0: off)")
    need(cfg.scorer.timeout_s > 0, "scorer.timeout_s", "must be > 0")
    need(cfg.generator.pause_timeout_s > 0, "generator.pause_timeout_s", "must be > 0")
    if cfg.learner.correction in ("mis", "mis_seq"):
        need(cfg.learner.correction_cap > 1, "learner.correction_cap", "must be > 1 for masked correction "
             "(tokens with ratios in [1/cap, cap] are kept)")
    need(cfg.learner.correction_cap > 0, "learner.correction_cap", "must be > 0")
    need(cfg.learner.tis_cap >= 0, "learner.tis_cap", "must be >= 0")
    need(0 <= cfg.learner.clip_low <= 1, "learner.clip_low", "must be in [0, 1]")
    need(cfg.learner.clip_high >= 0, "learner.clip_high", "must be >= 0")
    need(0 <= cfg.assembler.overlong_buffer < cfg.generator.max_tokens, "assembler.overlong_buffer",
         f"must be in [0, generator.max_tokens={cfg.generator.max_tokens}) (0: a quarter of max_tokens)")
    need(cfg.learner.loss_norm_tokens >= 0, "learner.loss_norm_tokens", "must be >= 0 (0: generator.max_tokens)")
    need(cfg.learner.tis_cap == 0 or cfg.learner.correction in ("auto", "tis"), "learner.tis_cap",
         f"is the legacy switch for correction='tis'; with learner.correction={cfg.learner.correction!r} leave it 0 "
         "and set learner.correction_cap")
    why = may_be_off_policy(cfg)
    if cfg.learner.correction == "off" and why:
        log.warning("learner.correction='off' although generation is off-policy (%s): the loss is not "
                    "corrected for the behaviour policy", why)
    if cfg.learner.share_prompt:
        need(expresses_shared_prefix(cfg.model.attn_implementation), "model.attn_implementation",
             f"{cfg.model.attn_implementation!r} cannot express learner.share_prompt's mask (responses sharing a "
             "prompt); use sdpa or auto (flex on CUDA, the dense mask on CPU), or learner.share_prompt=false")
    need(cfg.coordinator.mode == "async" or cfg.assembler.max_staleness == 0,
         "assembler.max_staleness", "must be 0 in colocated mode (generation is on-policy)")


def check_inputs(cfg: RunConfig) -> None:
    """What a real run needs beyond a valid config (not needed by --dry-run or --print-config)."""
    if cfg.model.source != "tiny" and not cfg.model.path:
        raise ConfigError("config key 'model.path': is required (a local directory or a hub id)")
    if cfg.generator.engine == "simulated":
        raise ConfigError("config key 'generator.engine': 'simulated' is for benchmarks only (random tokens, no "
                          "model); a training run needs 'vllm' or 'transformers'")
    if not cfg.data.synthetic and not cfg.data.bird_dir:
        raise ConfigError("config key 'data.bird_dir': is required (the directory holding train.json / dev.json)")
    check_attention(cfg)
    check_multi_node(cfg)
    check_shared_gpu_budget(cfg)


def check_shared_gpu_budget(cfg: RunConfig) -> None:
    """Async on shared GPUs keeps vLLM and the awake learner resident on one GPU: a setting whose two
    budgets (config.memory.shared_async_budget) do not fit is refused in one line naming the fields."""
    from config.memory import shared_async_check

    why = shared_async_check(cfg)
    if why:
        raise ConfigError(why)


def check_multi_node(cfg: RunConfig) -> None:
    """Several nodes need one Redis every node reaches: the embedded redis-server is a unix socket."""
    import os

    if cfg.cluster.num_nodes > 1 and not (cfg.cluster.redis_url or os.environ.get("REDIS_URL")):
        raise ConfigError(f"config key 'cluster.redis_url': cluster.num_nodes={cfg.cluster.num_nodes} needs a Redis "
                          "every node reaches (set REDIS_URL=redis://host:port or cluster.redis_url); the embedded "
                          "redis-server listens on a unix socket of this machine only")


def check_attention(cfg: RunConfig) -> None:
    """flash_attention_2 only where flash-attn imports (the learner's varlen path needs nothing)."""
    import importlib.util

    if cfg.model.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ConfigError("config key 'model.attn_implementation': flash_attention_2 needs the flash-attn package, "
                          "which does not import here; use sdpa (the learner's varlen path on CUDA) or varlen")


def to_dict(cfg: Any) -> dict:
    """A config section as plain builtins (what engines receive)."""
    return msgspec.to_builtins(cfg)
