"""The whole run as typed msgspec Structs, validated once at start.

Invariants:
- Every field has a type and a default that makes sense; unknown keys are refused.
- Overrides (`section.key=value`) are converted to the field's type; a bad key or value is a
  one-line ConfigError naming the key and, for unknown keys, the closest valid ones.
- Nested dict fields (engine kwargs) stay plain dicts all the way into the engines.
- Off-policy correction is on unless a user turned it off: `validate` replaces
  `learner.correction="auto"` by what the run needs (`resolve_correction`), so the config a run
  prints and saves says which correction the learner applies. An explicit "off" where generation
  can be off-policy (async with max_staleness > 0, or an engine other than the learner's numerics)
  is accepted with a logged warning.
"""
from __future__ import annotations

import difflib
import json
import logging
from typing import Any, Literal

import msgspec

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A one-line, user-facing configuration error."""


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class DataConfig(_Section):
    bird_dir: str = ""  # BIRD layout: train.json / dev.json + <split>_databases/
    train_split: str = "train"
    eval_split: str = "dev"
    synthetic: bool = False  # build a synthetic BIRD-like task under the run dir (tiny)
    synthetic_databases: int = 4
    synthetic_questions: int = 400
    synthetic_seed: int = 0
    synthetic_templates: list[int] = []  # tasks.synthetic.TEMPLATES indices to draw from ([]: all)
    # >0: the dev split is asked on this many databases of its own (held out: never trained on)
    synthetic_held_out_databases: int = 0
    synthetic_dev_fraction: float = 0.2  # share of questions (of question texts, when held out) for dev
    max_prompt_tokens: int = 4096  # prompts over this budget are dropped at load time (counted)
    sample_values: int = 3  # sample values per column shown in the schema
    eval_size: int = 64  # held-out prompts per periodic eval (0: the whole eval split)
    eval_samples: int = 0  # >0: also sample this many per held-out prompt at the training temperature
    shuffle_seed: int = 1234
    limit: int = 0  # use only the first N training questions (0: all)


class ModelConfig(_Section):
    path: str = ""  # local directory or hub id; "" with source="tiny" builds one
    source: Literal["path", "tiny"] = "path"
    tokenizer: str = ""  # defaults to path
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    allow_download: bool = False  # nothing is downloaded unless the user allows it
    # Shape of the model built when source="tiny".
    tiny_hidden_size: int = 64
    tiny_layers: int = 2
    tiny_heads: int = 4
    tiny_kv_heads: int = 2
    tiny_intermediate_size: int = 128
    tiny_vocab_size: int = 512
    tiny_sft_steps: int = 0  # supervised warm-start on gold SQL before RL (tiny only)
    tiny_sft_lr: float = 3e-3
    tiny_sft_batch: int = 16  # pairs per warm-start step
    # Share of warm-start targets replaced by their template's slip (tasks.synthetic.SLIPS), drawn anew
    # each time a pair is drawn: the warm policy then samples the gold answer only part of the time
    tiny_sft_slip: float = 0.0


class GeneratorConfig(_Section):
    engine: Literal["vllm", "transformers", "simulated"] = "vllm"
    num_engines: int = 1
    tensor_parallel_size: int = 1
    n_samples: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 4096
    stop: list[str] = []
    max_inflight_prompts: int = 64
    gpu_memory_utilization: float = 0.5
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    sleep_level: int = 2  # 2 releases weights and KV cache (required at 32B colocated)
    seed: int = 0
    device: str = "auto"  # transformers engine: "cpu", "cuda" or "auto"
    max_batch_prompts: int = 16  # transformers engine: prompts batched into one generate
    # Async mode: at a weight update engines interrupt in-flight requests, load the new weights and
    # continue them from their tokens (a sample's tokens may span versions). false: the boundary waits
    # for every in-flight request, as colocated mode always does.
    partial_rollouts: bool = True
    pause_timeout_s: float = 600.0  # a pause (sleep, weight update) waits at most this long for in-flight
    # requests, then aborts them: they are published as failed groups, never hang the run
    engine_kwargs: dict[str, Any] = {}  # passed to the engine as a plain (deep-converted) dict
    num_cpus: float = 1.0  # Ray CPU request per generator actor


class ScorerConfig(_Section):
    num_scorers: int = 1
    workers: int = 8  # processes in each scorer's pool
    timeout_s: float = 30.0  # per query, enforced inside SQLite
    max_rows: int = 100_000  # a result over this is the verdict "too_many_rows"
    memory_mb: int = 2048  # address-space limit per worker process
    temp_store_mb: int = 256  # in-memory temp storage cap per connection
    gold_cache_size: int = 4096
    num_cpus: float = 0.25


class AssemblerConfig(_Section):
    normalize_std: bool = True  # divide advantages by the group std (+eps)
    filter_zero_variance: bool = True  # drop groups whose rewards are all equal
    replace_filtered: bool = False  # ask the coordinator for replacement prompts
    max_staleness: int = 0  # admit groups at most this many versions old
    micro_batch_tokens: int = 16_384  # token budget of one packed micro-batch
    minibatches_per_step: int = 1  # optimizer steps per update epoch
    # Plan micro-batches with each group's prompt counted once (policies/prefix.py). Not a user key:
    # validate() sets it from learner.share_prompt, the one source of truth.
    share_prompt: bool = False
    num_cpus: float = 0.25


class LearnerConfig(_Section):
    zero_stage: int = 0
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    lr: float = 1e-6
    warmup_ratio: float = 0.0
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    betas: list[float] = msgspec.field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    update_epochs: int = 1
    clip_low: float = 0.2
    clip_high: float = 0.2
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    tis_cap: float = 0.0  # legacy: >0 is correction="tis" with this cap
    # Importance weight from the learner's proximal log-probs to the sampler's (policies/offpolicy.py):
    # "tis" truncated at correction_cap, "mis" tokens outside [1/cap, cap] masked, "mis_seq" whole
    # samples masked by their geometric-mean ratio, "off" no weight. "auto": see resolve_correction.
    correction: Literal["auto", "tis", "mis", "mis_seq", "off"] = "auto"
    correction_cap: float = 2.0
    use_liger: bool = False  # CUDA: liger's fused linear-CE log-prob head (logits never materialised)
    # Each (part of a) group's prompt computed once per packed row, its responses after it, exact
    # log-probs (policies/prefix.py); attention: flex on CUDA, the dense mask on CPU. Measured 2.34x the
    # samples/s of the unshared varlen path on the H200 (1.7B, BIRD shapes), 3.3x on CPU at tiny's
    # (docs/perf/h200.md, docs/perf/learner.md). false: one prompt copy per sample (varlen / flash allowed).
    share_prompt: bool = True
    liger_kernels: bool = True  # with use_liger: also liger's RoPE / RMSNorm / SwiGLU kernels in the model
    gradient_checkpointing: bool = False
    # With gradient_checkpointing: how many decoder layers (the first N) recompute their activations
    # in backward; the rest keep them. -1: every layer. Trades memory for speed between the two ends.
    checkpoint_layers: int = -1
    offload_optimizer: bool = False
    device: str = "auto"
    ds_config: dict[str, Any] = {}  # merged over the generated DeepSpeed config
    num_cpus: float = 1.0  # Ray CPU request per learner rank
    num_gpus: float = 0.0
    # Learner ranks (one process each, one torch.distributed world, DeepSpeed data parallel). On CPU
    # this many processes over gloo; on GPU recipes the placement's world size decides.
    num_ranks: int = 1


class CoordinatorConfig(_Section):
    mode: Literal["colocated", "async"] = "colocated"
    steps: int = 100
    prompts_per_step: int = 32
    # auto: what the placement implies (launch/placement.py): cuda_ipc colocated on GPUs, nccl async on
    # GPUs, object_store on CPU; an explicit transport the placement cannot carry is a ConfigError
    weight_sync: Literal["auto", "object_store", "cuda_ipc", "nccl"] = "auto"
    weight_bucket_mb: int = 512
    checkpoint_every: int = 0  # 0: never (a final checkpoint is still written)
    keep_checkpoints: int = 3  # DeepSpeed checkpoints kept (newest, and always the latest; 0: all)
    keep_exports: int = 3  # HF exports under hf/ kept (the newest; 0: all): a 32B export is ~64 GB
    eval_every: int = 0  # 0: never
    resume: bool = False
    step_timeout_s: float = 3600.0
    time_budget_s: float = 0.0  # stop after this many seconds of training (0: no budget)
    num_cpus: float = 0.25


class ClusterConfig(_Section):
    ray_address: str = ""  # "" -> $RAY_ADDRESS, else a local cluster
    redis_url: str = ""  # "" -> $REDIS_URL, else an embedded redis-server
    num_nodes: int = 1
    gpus_per_node: int = 0
    gpu_memory_gib: float = 80.0  # per GPU, for the --dry-run memory plan
    num_cpus: int = 0  # local cluster CPUs (0: all)
    dashboard_host: str = "127.0.0.1"
    ray_loopback: bool = True  # a local cluster's own servers (GCS, raylet, workers, agents) on loopback only;
    # false: Ray's default (the host's address, all interfaces), e.g. to let other nodes join it
    redis_persistence: bool = False  # embedded Redis with AOF (survives restarts)
    placement_timeout_s: float = 120.0  # the run's placement groups must be ready within this (else one line)
    stream_high_water: int = 4096  # publish waits while a stage's backlog is above this
    reclaim_idle_s: float = 30.0  # messages pending this long on a consumer are reclaimed
    # The learner or coordinator died (Ray restarts the other actors itself): tear the run's actors
    # down and start them again from the latest checkpoint, as coordinator.resume=true would, at
    # most this many times per launch. 0: the launch fails and a relaunch with resume is manual.
    max_relaunches: int = 2


class LoggingConfig(_Section):
    level: str = "info"
    console: bool = True
    wandb: bool = False
    wandb_project: str = "arctic-rl"
    wandb_entity: str = ""


class RunConfig(_Section):
    name: str = "run"
    run_id: str = ""  # "" -> "<name>-<timestamp>"; streams are keyed arl:<run_id>:<stage>
    run_root: str = "runs"
    seed: int = 0  # the model's init and warm start; `seed=S` given as an override also sets data.synthetic_seed and generator.seed (unless they are given)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    generator: GeneratorConfig = msgspec.field(default_factory=GeneratorConfig)
    scorer: ScorerConfig = msgspec.field(default_factory=ScorerConfig)
    assembler: AssemblerConfig = msgspec.field(default_factory=AssemblerConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    coordinator: CoordinatorConfig = msgspec.field(default_factory=CoordinatorConfig)
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)


# ---------------------------------------------------------------------------------------------
# Overrides


def _fields(struct_type: type) -> dict[str, Any]:
    info = msgspec.inspect.type_info(struct_type)
    return {f.name: f for f in info.fields}


def _all_keys(struct_type: type, prefix: str = "") -> list[str]:
    keys = []
    for name, f in _fields(struct_type).items():
        full = f"{prefix}{name}"
        keys.append(full)
        if isinstance(f.type, msgspec.inspect.StructType):
            keys.extend(_all_keys(f.type.cls, full + "."))
    return keys


def _parse_value(raw: str) -> Any:
    """A CLI value: JSON where it parses (numbers, bools, lists, dicts), else the plain string."""
    try:
        return json.loads(raw)
    except ValueError:
        low = raw.lower()
        if low in ("true", "false"):
            return low == "true"
        if low in ("none", "null"):
            return None
        return raw


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Returns a new config with `a.b=value` overrides applied and validated."""
    data = msgspec.to_builtins(cfg)
    valid = _all_keys(RunConfig)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if key == "assembler.share_prompt":
            raise ConfigError("config key 'assembler.share_prompt': set learner.share_prompt (the assembler follows it)")
        parts = key.split(".")
        node_type: type = RunConfig
        node = data
        for i, part in enumerate(parts):
            fields = _fields(node_type)
            if part not in fields:
                close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
                hint = f"; closest: {', '.join(close)}" if close else ""
                raise ConfigError(f"unknown config key {key!r}{hint}")
            ftype = fields[part].type
            if i < len(parts) - 1:
                if isinstance(ftype, msgspec.inspect.StructType):
                    node_type, node = ftype.cls, node[part]
                    continue
                if isinstance(ftype, msgspec.inspect.DictType):
                    # engine_kwargs.compilation_config.level=3 -> nested plain dicts
                    sub = node.setdefault(part, {})
                    for p in parts[i + 1 : -1]:
                        sub = sub.setdefault(p, {})
                    sub[parts[-1]] = _parse_value(raw)
                    break
                raise ConfigError(f"config key {'.'.join(parts[: i + 1])!r} is a value, not a section (in {key!r})")
            if isinstance(ftype, msgspec.inspect.StructType):
                raise ConfigError(f"config key {key!r} is a section; set one of its fields, e.g. {key}.{next(iter(_fields(ftype.cls)))}")
            value = _parse_value(raw)
            if isinstance(ftype, msgspec.inspect.StrType) and not isinstance(value, str):
                value = raw  # "name=123" stays the string "123"
            if isinstance(ftype, msgspec.inspect.ListType):
                if isinstance(value, str):
                    value = [_parse_value(v) for v in value.split(",") if v]
                elif not isinstance(value, list):
                    value = [value]
            node[part] = value
    keys = {item.split("=", 1)[0].strip() for item in overrides}
    if "seed" in keys:  # `seed=S` seeds the data and the sampling too, unless they are given themselves
        for section, field in (("data", "synthetic_seed"), ("generator", "seed")):
            if f"{section}.{field}" not in keys:
                data[section][field] = data["seed"]
    return validate(data)


def validate(data: dict) -> RunConfig:
    """Builtins -> RunConfig, with a one-line error naming the bad key."""
    try:
        cfg = msgspec.convert(data, RunConfig, strict=False)
    except msgspec.ValidationError as e:
        msg = str(e)
        # msgspec says "... - at `$.learner.lr`"; turn the path into the user's dotted key.
        if "- at `$." in msg:
            text, path = msg.rsplit("- at `$.", 1)
            raise ConfigError(f"config key {path.rstrip('`')!r}: {text.strip()}") from None
        raise ConfigError(f"config: {msg}") from None
    check(cfg)
    cfg.learner.correction, cfg.learner.correction_cap = resolve_correction(cfg)
    cfg.assembler.share_prompt = cfg.learner.share_prompt
    return cfg


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
    need(cfg.generator.sleep_level in (1, 2), "generator.sleep_level", "must be 1 or 2")
    need(cfg.learner.zero_stage in (0, 1, 2, 3), "learner.zero_stage", "must be 0, 1, 2 or 3")
    need(len(cfg.learner.betas) == 2, "learner.betas", "needs two values, e.g. 0.9,0.95")
    need(cfg.learner.update_epochs >= 1, "learner.update_epochs", "must be >= 1")
    need(cfg.learner.lr > 0, "learner.lr", "must be > 0")
    need(cfg.learner.checkpoint_layers >= -1, "learner.checkpoint_layers", "must be -1 (every layer) or >= 0")
    need(0 <= cfg.learner.warmup_ratio < 1, "learner.warmup_ratio", "must be in [0, 1)")
    need(cfg.learner.num_ranks >= 1, "learner.num_ranks", "must be >= 1")
    need(cfg.coordinator.prompts_per_step >= 1, "coordinator.prompts_per_step", "must be >= 1")
    need(cfg.coordinator.steps >= 0, "coordinator.steps", "must be >= 0")
    need(cfg.coordinator.keep_checkpoints >= 0, "coordinator.keep_checkpoints", "must be >= 0 (0 keeps all)")
    need(cfg.coordinator.keep_exports >= 0, "coordinator.keep_exports", "must be >= 0 (0 keeps all)")
    need(cfg.assembler.max_staleness >= 0, "assembler.max_staleness", "must be >= 0")
    need(cfg.assembler.micro_batch_tokens >= 16, "assembler.micro_batch_tokens", "must be >= 16")
    need(cfg.assembler.minibatches_per_step >= 1, "assembler.minibatches_per_step", "must be >= 1")
    need(cfg.scorer.workers >= 1, "scorer.workers", "must be >= 1")
    need(cfg.cluster.max_relaunches >= 0, "cluster.max_relaunches", "must be >= 0")
    need(cfg.scorer.timeout_s > 0, "scorer.timeout_s", "must be > 0")
    need(cfg.generator.pause_timeout_s > 0, "generator.pause_timeout_s", "must be > 0")
    if cfg.learner.correction in ("mis", "mis_seq"):
        need(cfg.learner.correction_cap > 1, "learner.correction_cap", "must be > 1 for masked correction "
             "(tokens with ratios in [1/cap, cap] are kept)")
    need(cfg.learner.correction_cap > 0, "learner.correction_cap", "must be > 0")
    need(cfg.learner.tis_cap >= 0, "learner.tis_cap", "must be >= 0")
    need(cfg.learner.tis_cap == 0 or cfg.learner.correction in ("auto", "tis"), "learner.tis_cap",
         f"is the legacy switch for correction='tis'; with learner.correction={cfg.learner.correction!r} leave it 0 "
         "and set learner.correction_cap")
    why = may_be_off_policy(cfg)
    if cfg.learner.correction == "off" and why:
        log.warning("learner.correction='off' although generation is off-policy (%s): the loss is not "
                    "corrected for the behaviour policy", why)
    if cfg.learner.share_prompt:
        from policies.packing import expresses_shared_prefix

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
