"""The whole run as typed msgspec Structs: one section per component, every field typed, with a default.

Invariants:
- Every field has a type and a default that makes sense; unknown keys are refused (forbid_unknown_fields).
- Nested dict fields (engine kwargs) stay plain dicts all the way into the engines.
- Nothing here imports another package of this project (config/ is the ground floor), nor Ray.
"""
from __future__ import annotations

from typing import Any, Literal, get_args

import msgspec

# Attention implementations by name (the learner registers VARLEN and FLEX with transformers).
FLASH_ATTENTION_IMPLS = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn",
                         "kernels-community/flash-attn3")
VARLEN = "varlen"  # actors/learner/attention.py registers it with transformers' AttentionInterface
FLEX = "prefix_flex"  # actors/learner/attention_flex.py registers it (FlexAttention, segment + branch block mask)
SEGMENTS = "segments"  # actors/learner/attention_segments.py registers it (sdpa per attention segment: the CPU path)


def expresses_shared_prefix(attn_implementation: str) -> bool:
    """Whether the implementation can run policies/prefix.py's shared rows (branch ids): flex and the
    dense mask can; flash / varlen cut a row into segments only."""
    return attn_implementation not in FLASH_ATTENTION_IMPLS and attn_implementation != VARLEN


# The weight-sync transports, listed once: coordinator.weight_sync takes one of them (or auto), and
# weights.strategy.REGISTRY holds one transport per kind (it refuses to import otherwise).
WeightSyncKind = Literal["object_store", "cuda_ipc", "nccl"]
WEIGHT_SYNC_KINDS: tuple[str, ...] = get_args(WeightSyncKind)


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
    # Each database stores its place and category values in a form of its own that the prompt does not show
    # (needs sample_values=0) and one query reveals (tasks/synthetic_forms.py): "suffix" (Oslo / Oslo-1 /
    # Oslo-2) or "case" (Oslo / OSLO / oslo); "" off
    synthetic_value_forms: Literal["", "suffix", "case"] = ""
    synthetic_domains: int = 4  # databases cycle through the first this many of tasks.synthetic.DOMAINS (1-4)
    # n > 0: each database names its places (n) and categories (8) with made-up words of its own, so no two
    # databases share a value and no held-out value is ever trained on (tasks/synthetic_pool.py); 0: the
    # domains' own word lists
    synthetic_value_pool: int = 0
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
    # generator.max_turns > 1: the share of warm-start examples that are error-then-fix episodes
    # (a misspelt query, its error as an observation, then the answer; tasks/synthetic_episodes.py).
    tiny_sft_episodes: float = 0.0
    # Of those episodes, the share whose first query misspells a quoted value instead of a name: it runs
    # and shows no rows (or a 0 / NULL aggregate) before the answer fixes it.
    tiny_sft_value_slips: float = 0.0
    # Of those episodes, the share that are look-then-fix episodes (taking precedence over the two kinds
    # above): the first query is the one-shot draw (the template's slip with probability tiny_sft_slip,
    # else the gold SQL), its real rows the observation, and the answer always the gold SQL.
    tiny_sft_revise: float = 0.0
    # Of those episodes, the share that are look-then-answer episodes (taking precedence over the kinds
    # above; data.synthetic_value_forms): a query that shows the stored form of the question's value
    # (tasks.synthetic_episodes.probe), its real rows, then the one-shot draw's answer in that form.
    tiny_sft_look: float = 0.0


class LoraConfig(_Section):
    """LoRA (peft) on the learner's model: rank 0 is off (full fine-tuning). On, only the adapter trains, is in
    the optimizer, is checkpointed and travels in each weight sync (actors/lora.py)."""

    rank: int = 0  # 0: off
    alpha: float = 16.0  # the adapter's scale is alpha / rank
    # > 0 breaks the first update's ratio of 1 (the learner trains with dropout, the engine samples without)
    dropout: float = 0.0
    # names of the Linear modules that get an adapter ("all-linear": every Linear but lm_head, as peft says)
    target_modules: list[str] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


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
    # transformers engine: and at most this many rows (a prompt's n samples each) in it, the first prompt always
    # taken; 0: no row cap. A held-out evaluation's prompts (1 greedy row, or eval_samples rows) then fill a batch
    # as a training step's prompts x n_samples do, instead of max_batch_prompts prompts of one row each.
    max_batch_rows: int = 0
    # Async mode: at a weight update engines interrupt in-flight requests, load the new weights and
    # continue them from their tokens (a sample's tokens may span versions). false: the boundary waits
    # for every in-flight request, as colocated mode always does.
    partial_rollouts: bool = True
    pause_timeout_s: float = 600.0  # a pause (sleep, weight update) waits at most this long for in-flight
    # requests, then aborts them: they are published as failed groups, never hang the run
    engine_kwargs: dict[str, Any] = {}  # passed to the engine as a plain (deep-converted) dict
    num_cpus: float = 1.0  # Ray CPU request per generator actor
    # Multi-turn episodes (policies/episode.py): > 1 lets the model run queries and revise before it
    # answers; 1 is the one-shot protocol exactly.
    max_turns: int = 1
    max_observation_tokens: int = 128  # one observation block, tags included
    tool_workers: int = 2  # the generator's own query processes (tasks/executor.py)
    tool_timeout_s: float = 0.0  # per query; 0: the scorer's timeout_s (resolved in validation)
    tool_max_rows: int = 0  # 0: the scorer's max_rows (resolved in validation)
    # Not a user key: validate() copies learner.lora here (the engine wraps its model in the same adapter).
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)


class ScorerConfig(_Section):
    num_scorers: int = 1
    workers: int = 8  # processes in each scorer's pool
    timeout_s: float = 30.0  # per query, enforced inside SQLite
    max_rows: int = 100_000  # a result over this is the verdict "too_many_rows"
    memory_mb: int = 2048  # address-space limit per worker process
    temp_store_mb: int = 256  # in-memory temp storage cap per connection
    gold_cache_size: int = 4096
    # Partial reward terms (policies/sql_reward.shaped_reward), each a weight in [0, 1]; 0 (default): off.
    reward_syntax: float = 0.0  # the SQL parsed and ran (any result)
    reward_schema_linking: float = 0.0  # F1 of the names it uses against the gold SQL's
    reward_format: float = 0.0  # the answer sits in a ```sql block
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
    # Overlong samples (policies/overlong.py, DAPO): "none" as scored, "soft_penalty" DAPO's length penalty
    # over the last overlong_buffer tokens before max_tokens (0: a quarter of max_tokens), "filter" truncated
    # samples cut from the batch (their group's advantages unchanged).
    overlong: Literal["none", "filter", "soft_penalty"] = "none"
    overlong_buffer: int = 0
    # Not a user key: validate() sets it from generator.max_tokens (DAPO's L_max).
    max_tokens: int = 0
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
    # The policy objective (policies/objectives.py): "ppo_clip" (PPO with clip-higher), "gspo" (the
    # sequence-level ratio, clipped; GSPO's ranges are ~3e-4/4e-4), "cispo" (REINFORCE under a clipped,
    # stop-gradient IS weight; clip_low=1 leaves it unbounded below).
    loss: Literal["ppo_clip", "gspo", "cispo"] = "ppo_clip"
    # "seq-mean-token-sum-norm" is Dr.GRPO's: each sample's token sum over the constant loss_norm_tokens
    # (pair it with assembler.normalize_std=false for Dr.GRPO's advantages).
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    loss_norm_tokens: int = 0  # the constant of seq-mean-token-sum-norm; 0: generator.max_tokens (validation)
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
    # Seconds any collective of the learner (its torch.distributed world and every group DeepSpeed makes
    # in it, and every weight-sync group: learner rank 0 + the generators) may wait for a peer. A peer that
    # died or hangs mid-collective fails it within this bound (on GPUs NCCL's watchdog ends the process),
    # and the launcher relaunches the run from its latest checkpoint (cluster.max_relaunches). Long enough
    # for the slowest rank of a healthy step to arrive (a checkpoint shard written, a ZeRO-3 load).
    collective_timeout_s: float = 600.0
    # LoRA RL (issue 39): adapters train, the base stays frozen; each weight sync moves the adapter alone.
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)


class CoordinatorConfig(_Section):
    mode: Literal["colocated", "async"] = "colocated"
    steps: int = 100
    prompts_per_step: int = 32
    # auto: what the placement implies (config/placement.py): cuda_ipc colocated on GPUs, nccl async on
    # GPUs, object_store on CPU; an explicit transport the placement cannot carry is a ConfigError
    weight_sync: Literal["auto"] | WeightSyncKind = "auto"
    weight_bucket_mb: int = 512
    checkpoint_every: int = 0  # 0: never (a final checkpoint is still written)
    keep_checkpoints: int = 3  # DeepSpeed checkpoints kept (newest, and always the latest; 0: all)
    keep_exports: int = 3  # HF exports under hf/ kept (the newest; 0: all): a 32B export is ~64 GB
    eval_every: int = 0  # 0: never
    resume: bool = False
    step_timeout_s: float = 3600.0
    # Every call the coordinator and the launcher make to an actor (a generator's sleep / wake / pause /
    # resume / set_version / weight-sync step, the learner's wake / sleep / save / load / export / weight-sync
    # step, each learner rank's part of them, the assembler's bookkeeping, a liveness ping of the coordinator)
    # returns within this, on top of the wait the call is given itself (a sleep's or pause's
    # generator.pause_timeout_s, a collect's or a training step's step_timeout_s). One that does not (a frozen
    # actor: alive to Ray, silent) fails like a death: the run relaunches from its latest checkpoint
    # (cluster.max_relaunches) or ends with one line naming the actor and the call. Long enough for the
    # slowest healthy call: a 32B checkpoint shard or HF export written.
    call_timeout_s: float = 1800.0
    # The generators' heartbeat (actors/coordinator/heartbeat.py): every heartbeat_s a ping of each generator,
    # bounded by heartbeat_timeout_s; heartbeat_misses in a row (after it has answered once) = frozen, restarted
    # in place. Noticed within ~heartbeat_s * heartbeat_misses + heartbeat_timeout_s. 0: no heartbeat.
    heartbeat_s: float = 4.0
    heartbeat_timeout_s: float = 3.0
    heartbeat_misses: int = 3
    time_budget_s: float = 0.0  # stop after this many seconds of training (0: no budget)
    num_cpus: float = 0.25


class ClusterConfig(_Section):
    ray_address: str = ""  # "" -> $RAY_ADDRESS, else a local cluster
    redis_url: str = ""  # "" -> $REDIS_URL, else an embedded redis-server
    num_nodes: int = 1
    gpus_per_node: int = 0
    gpu_memory_gib: float = 80.0  # per GPU, for the --dry-run memory plan
    # local cluster CPUs (0: the host's, or what a CPU recipe's actors ask for when that is more); when set, a CPU
    # recipe's actor asks are scaled down to fit it where they ask for more (config.placement.fit_cpu_asks)
    num_cpus: int = 0
    # Ray's dashboard on a cluster the launcher starts (a joined cluster keeps its own): its head, a
    # forkserver and 9 module processes, ~1.0 GB RSS on a tiny run (docs/perf/peers.md); false leaves
    # Ray's own minimal API server (no UI). The Ray version has no switch for fewer modules.
    dashboard: bool = True
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


