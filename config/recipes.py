"""Named recipes: each a function returning a complete RunConfig.

`tiny` runs anywhere on CPU with nothing downloaded. `bird_1p7b` and `bird_32b` are the GPU
recipes; the user passes `model.path=` and `data.bird_dir=`. `gpu1_0p6b` is the one-GPU recipe: tiny's
held-out synthetic task and a Qwen3-0.6B-shaped model built on the spot, nothing downloaded;
`gpu1_0p6b_async` the same in async mode with the engine and the learner both resident on the card.
"""
from __future__ import annotations

from typing import Callable

from config.schema import (
    AssemblerConfig,
    ClusterConfig,
    CoordinatorConfig,
    DataConfig,
    GeneratorConfig,
    LearnerConfig,
    LoraConfig,
    ModelConfig,
    RunConfig,
    ScorerConfig,
)

# tasks.synthetic.TINY_TEMPLATES (config/ imports nothing of ours; tests/unit/test_tiny_task.py keeps them equal)
TINY_TEMPLATES = (0, 1, 3, 4, 5, 6, 8)
# tiny_forms' and tiny_look's: tiny's templates whose gold compares a place or category value (0, 1, 4, 5)
FORMS_TEMPLATES = (0, 1, 4, 5)
# gpu1_0p6b's: tiny's and the two it leaves out for their length or their two-word values (2, 7)
GPU1_TEMPLATES = (0, 1, 2, 3, 4, 5, 6, 7, 8)

RECIPES: dict[str, Callable[[], RunConfig]] = {}


def recipe(fn: Callable[[], RunConfig]) -> Callable[[], RunConfig]:
    RECIPES[fn.__name__] = fn
    return fn


@recipe
def tiny() -> RunConfig:
    """CPU, embedded Redis + local Ray, a synthetic SQL task and a model built on the spot.

    The warm start learns from targets of which 60 % are their template's slip (a wrong operator,
    column, aggregate or order), so the warm policy mostly answers with the slip and samples the gold
    query only some of the time; GRPO then finds the reward the slips leave. Held-out prompts are
    asked on three databases of their own, and none of their texts is a training question.
    ~2.5 minutes on 2 cores (docs/perf/tiny.md).

    The engine batches by rows (generator.max_batch_rows=128, a training step's 16 prompts x 8 samples): a
    held-out evaluation's 74 greedy and 74 x 4 sampled prompts go in 3 batches, not 10 of 16 prompts.

    No Ray dashboard (cluster.dashboard=false): on a laptop-sized CPU run its head and 9 module
    processes were ~1.0 GB of the run's ~3.8 GB, more than the learner and the generator together;
    `cluster.dashboard=true` brings it back (http://127.0.0.1:8265). The GPU recipes keep it on."""
    return RunConfig(
        name="tiny",
        data=DataConfig(synthetic=True, synthetic_databases=3, synthetic_questions=1200, max_prompt_tokens=256,
                        synthetic_templates=list(TINY_TEMPLATES), synthetic_held_out_databases=3,
                        synthetic_dev_fraction=0.4, eval_size=0, eval_samples=4, sample_values=0),
        model=ModelConfig(source="tiny", dtype="float32", tiny_hidden_size=128, tiny_layers=2, tiny_heads=4,
                          tiny_kv_heads=2, tiny_intermediate_size=256, tiny_vocab_size=2048, tiny_sft_steps=300,
                          tiny_sft_lr=3e-3, tiny_sft_slip=0.6),
        generator=GeneratorConfig(engine="transformers", device="cpu", n_samples=8, temperature=1.0,
                                  max_tokens=48, max_inflight_prompts=128, max_batch_prompts=128, max_batch_rows=128,
                                  num_cpus=0.5),
        scorer=ScorerConfig(workers=1, timeout_s=5.0, memory_mb=1024, num_cpus=0.25),
        assembler=AssemblerConfig(micro_batch_tokens=4096, filter_zero_variance=True, num_cpus=0.25),
        learner=LearnerConfig(zero_stage=0, dtype="float32", lr=3e-4, betas=[0.9, 0.99], grad_clip=1.0,
                              update_epochs=1, clip_low=0.2, clip_high=0.28, device="cpu", num_cpus=0.5),
        coordinator=CoordinatorConfig(mode="colocated", steps=60, prompts_per_step=16, eval_every=10,
                                      checkpoint_every=30, weight_sync="object_store", num_cpus=0.25),
        cluster=ClusterConfig(num_cpus=2, gpus_per_node=0, dashboard=False),
    )


@recipe
def tiny_mt() -> RunConfig:
    """tiny as multi-turn episodes (issue 24): the model may run up to 2 queries and see their rows or
    error before it answers (generator.max_turns=3). Half of its warm start's examples are look-then-fix
    episodes (model.tiny_sft_episodes=0.5, model.tiny_sft_revise=1): the first query is the one-shot
    warm start's own draw (the template's slip 60 % of the time, else the gold SQL), its real rows the
    observation, the gold SQL the answer; the other half are direct answers with tiny's gold/slip
    mixture. The answer budget grows to fit a query and its observation before the answer. Compare with
    tiny (one turn) at the same steps: `python -m bench.learning.tiny_turns`."""
    cfg = _three_turns(tiny(), "tiny_mt")
    cfg.model.tiny_sft_revise = 1.0
    return cfg


@recipe
def tiny_lora() -> RunConfig:
    """tiny with LoRA RL (issue 39): a rank-16 adapter (alpha 32) on every attention and MLP projection is all
    that RL trains; the base stays frozen, and each weight sync moves the adapter alone into the engine. The
    warm start is tiny's own, bit for bit (300 steps on the base: the stand-in for the pretraining a real base
    had; actors/learner/lora_base.py), so both recipes start RL from the same policy; its base then travels once,
    in the first sync, and is saved over the
    run's model directory, which the adapter's exports name as their base. LoRA's updates are low-rank and
    scaled by alpha / rank, so its RL rate is above tiny's (1e-3 against 3e-4). `tiny learner.lora.rank=R` is
    LoRA at tiny's rate. Compared with tiny in docs/perf/lora.md."""
    cfg = tiny()
    cfg.name = "tiny_lora"
    cfg.learner.lora = LoraConfig(rank=16, alpha=32.0)
    cfg.learner.lr = 1e-3
    return cfg


def _three_turns(cfg: RunConfig, name: str) -> RunConfig:
    """`cfg` as 3-turn episodes: an answer budget that fits a query and its observation before the answer,
    half of the warm start's examples episodes (of the kind the caller sets)."""
    cfg.name = name
    cfg.generator.max_turns = 3
    cfg.generator.max_tokens = 160
    cfg.generator.max_observation_tokens = 32
    cfg.model.tiny_sft_episodes = 0.5
    cfg.assembler.micro_batch_tokens = 8192
    return cfg


@recipe
def tiny_forms() -> RunConfig:
    """tiny on the value-form task (data.synthetic_value_forms=suffix, issue 24 point 9), one turn: each database
    stores its place and category values in a form of its own (`Oslo`, `Oslo-1` or `Oslo-2`,
    tasks/synthetic_forms.py) that neither the prompt nor the evidence shows. Nine training databases (three
    instances of each of tiny's three domains: their prompts are identical, their forms differ, so no form
    can be learnt by heart) and six held-out ones (each form on a third of their columns). The one-turn
    baseline of tiny_look; its warm start is tiny's (gold SQL in the stored form, 60 % slips)."""
    cfg = tiny()
    cfg.name = "tiny_forms"
    cfg.data.synthetic_value_forms = "suffix"
    cfg.data.synthetic_templates = list(FORMS_TEMPLATES)
    cfg.data.synthetic_domains = 3
    cfg.data.synthetic_databases = 9
    cfg.data.synthetic_held_out_databases = 6
    return cfg


@recipe
def tiny_look() -> RunConfig:
    """tiny_forms as multi-turn episodes (generator.max_turns=3): the model may look up how the question's value
    is stored, or see its first query fail, before it answers. Half of its warm start's examples are episodes
    (model.tiny_sft_episodes=0.5), the rest tiny's direct answers. Of the episodes, 80 % are look-then-answer
    (model.tiny_sft_look=0.8): `SELECT DISTINCT city FROM customers WHERE city LIKE 'Oslo%'`, its real rows
    (`Oslo-2`), then the one-shot draw's answer in the stored form; 20 % are error-then-fix: a query with a
    misspelt identifier, its real error, then the same answer. Every episode ends on the answer a direct one
    would give (gold or slip), so only looking and retrying differ from tiny_forms. Compare with tiny_forms
    (one turn) at the same steps: `python -m bench.learning.tiny_turns`. Measured 2026-12-04 (docs/perf/tiny.md, 20
    steps, seeds 0-2): held-out greedy 0.183 -> 0.413, 0.000 -> 0.520, 0.095 -> 0.460 against tiny_forms'
    0.106 -> 0.192, 0.140 -> 0.170, 0.111 -> 0.167 (gaps +0.22, +0.35, +0.29); it looks or queries in 53-73 %
    of training episodes. With look-only episodes (tiny_sft_look=1): gaps +0.51, +0.26, +0.15."""
    cfg = _three_turns(tiny_forms(), "tiny_look")
    cfg.model.tiny_sft_look = 0.8
    return cfg


def _bird_base(name: str, model: str) -> RunConfig:
    return RunConfig(
        name=name,
        data=DataConfig(bird_dir="", max_prompt_tokens=8192, sample_values=3, eval_size=0),
        # sdpa: on CUDA the learner picks FlexAttention for its shared-prompt rows (learner.share_prompt,
        # actors/learner/attention_flex.py); with learner.share_prompt=false, its varlen path (actors/learner/attention.py)
        model=ModelConfig(path=model, dtype="bfloat16", attn_implementation="sdpa"),
        generator=GeneratorConfig(engine="vllm", n_samples=16, temperature=1.0, top_p=1.0, max_tokens=4096,
                                  gpu_memory_utilization=0.5, enable_prefix_caching=True, sleep_level=2,
                                  max_inflight_prompts=128),
        scorer=ScorerConfig(num_scorers=2, workers=8, timeout_s=30.0),
        assembler=AssemblerConfig(micro_batch_tokens=32_768, filter_zero_variance=True),
        learner=LearnerConfig(dtype="bfloat16", lr=1e-6, warmup_ratio=0.05, lr_schedule="constant",
                              betas=[0.9, 0.95], weight_decay=0.0, grad_clip=1.0, kl_coef=0.0,
                              clip_low=0.2, clip_high=0.28, use_liger=True, gradient_checkpointing=True,
                              device="cuda", num_gpus=1.0),
        coordinator=CoordinatorConfig(mode="colocated", steps=300, checkpoint_every=25, eval_every=25),
    )


@recipe
def bird_1p7b() -> RunConfig:
    """Qwen3-1.7B on BIRD, one node of 8 GPUs, colocated, vLLM TP 1 x 8 engines, ZeRO-2."""
    cfg = _bird_base("bird_1p7b", "Qwen/Qwen3-1.7B")
    cfg.generator.num_engines, cfg.generator.tensor_parallel_size = 8, 1
    cfg.learner.zero_stage = 2
    cfg.coordinator.prompts_per_step = 64
    cfg.cluster = ClusterConfig(num_nodes=1, gpus_per_node=8, gpu_memory_gib=80.0)
    return cfg


@recipe
def bird_32b() -> RunConfig:
    """Qwen3-32B on BIRD, 4 nodes x 8 GPUs, colocated, vLLM TP 4 x 8 engines, ZeRO-3 + liger."""
    cfg = _bird_base("bird_32b", "Qwen/Qwen3-32B")
    cfg.generator.num_engines, cfg.generator.tensor_parallel_size = 8, 4
    cfg.learner.zero_stage = 3
    cfg.learner.lr = 2e-6
    cfg.coordinator.prompts_per_step = 128
    cfg.cluster = ClusterConfig(num_nodes=4, gpus_per_node=8, gpu_memory_gib=80.0)
    return cfg


@recipe
def gpu1_0p6b() -> RunConfig:
    """One GPU, colocated: vLLM + the DeepSpeed learner + the scorer on tiny's held-out task, widened, a Qwen3-0.6B-shaped model.

    What runs: tiny's synthetic task widened (templates 0-8: tiny's seven plus the item-name lookup and the
    three-table join; 8 training databases, 4,000 questions: 2,400 training prompts of 336 distinct texts;
    186 held-out questions on three databases of their own, no held-out text ever trained on; every held-out
    prompt evaluated, greedy and 8 samples at T=1, before training and every 10 steps), a decoder of
    Qwen3-0.6B's shape built on the spot (hidden 1024, 28 layers, 16/8 heads, FFN 3072; head_dim 64 and the
    task's 2,048-token vocabulary: 354M parameters), a slip warm start (500 steps at lr 1e-3, 30 % of
    targets slipped), then 40 GRPO steps of 16 prompts x 8 samples at lr 2e-4: vLLM (CUDA graphs, sleep level 2),
    one learner rank (ZeRO-0, bf16, liger, gradient checkpointing, optimizer offload), the CUDA-IPC weight
    sync every step, TIS at 2.

    Why these numbers (measured on one H200, 2026-12-04; docs/perf/vllm_sync.md):
    - The task is widened because tiny's own (720 training prompts of 115 distinct texts) is memorised by a
      354M model: after the warm start it answered 82 % of the training prompts (98 % by step 20) while
      held-out greedy moved 0.311 -> 0.392 and back, most groups dropped as zero-variance.
    - The warm start, from `bench.gpu.warm_start` on this task (lr 1e-3, 30 % slips): held-out greedy 0.134
      after 400 steps, 0.522 after 600, 0.613 after 800 (training greedy 0.53 / 0.75 / 0.77): the model
      learns to carry values to new databases between 400 and 600 steps; 500 sits inside that transition
      (0.177 held-out greedy in the run), leaving GRPO the rest of it.
    - RL lr 2e-4 (the warm start's / 5, between tiny's /3 CI climb and its recipe's /10): Adam moves each
      weight by about lr per step and the sampler gets bf16 weights, whose spacing at magnitude ~0.02 is
      6e-5 to 1.2e-4, so anything much below 1e-4 leaves the sampled policy unchanged for several steps
      (the old 1e-5 barely learned: +0.01-0.02 greedy in 120 steps). A warm-up of 10 % of the steps
      softens the first steps.
    - 40 steps: the run takes 424 s of the 8-minute bound (start-up ~2 min, the warm start 2.7 min at
      0.33 s a step through the learner with its optimizer offloaded, 40 steps at 2.1 s, four evaluations).
    - Measured (seed 0): held-out reward 0.216 -> 0.283 (step 20) -> 0.268 and greedy 0.177 -> 0.285 (30) ->
      0.247, while the training reward climbed 0.43 -> 0.85-0.92: the target (+0.15 on both) is still
      missed, and what holds it back is still that training improves texts the warm start has seen ~24
      times each (336 distinct texts in 8,000 drawn pairs), not the held-out skill.
    - CUDA graphs (enforce_eager off): on one H200, 40 steps after a 200-step warm start, back to back
      (2026-12-06, docs/perf/lora.md): 1.24 s a step (generation 0.27 s) against 1.91 s (1.00 s) eager,
      54.5 samples/s against 39.0 (1.40x), the whole run 284 s against 298 s with the graphs' capture in it,
      the same device memory (44.9 against 44.7 GiB). The figures above were measured eager.
    - filter_zero_variance as tiny: a group with one reward has no gradient and would only dilute the
      token-mean loss.
    - max_inflight_prompts 128: an evaluation publishes ~190 greedy + ~190 sampled groups at once.
    """
    cfg = tiny()
    cfg.name = "gpu1_0p6b"
    cfg.data.eval_samples = 8  # 8 samples per held-out prompt (vLLM: ~1-2 s per eval)
    # tiny's task widened so a 354M model cannot memorise it: two more templates (the item-name lookup and
    # the three-table join), 8 training databases, 4,000 questions (115 -> 336 distinct training texts, 74 -> 189 held out)
    cfg.data.synthetic_templates = list(GPU1_TEMPLATES)
    cfg.data.synthetic_databases = 8
    cfg.data.synthetic_questions = 4000
    cfg.model = ModelConfig(source="tiny", dtype="bfloat16", attn_implementation="sdpa", tiny_hidden_size=1024,
                            tiny_layers=28, tiny_heads=16, tiny_kv_heads=8, tiny_intermediate_size=3072,
                            tiny_vocab_size=2048, tiny_sft_steps=500, tiny_sft_lr=1e-3, tiny_sft_slip=0.3)
    cfg.generator = GeneratorConfig(engine="vllm", n_samples=8, temperature=1.0, max_tokens=64,
                                    gpu_memory_utilization=0.3, enforce_eager=False, sleep_level=2,
                                    max_inflight_prompts=128, num_cpus=1.0)
    cfg.scorer = ScorerConfig(workers=4, timeout_s=5.0, memory_mb=1024, num_cpus=0.5)
    cfg.assembler = AssemblerConfig(micro_batch_tokens=16_384, filter_zero_variance=True, num_cpus=0.25)
    cfg.learner = LearnerConfig(zero_stage=0, dtype="bfloat16", lr=2e-4, warmup_ratio=0.1, betas=[0.9, 0.99],
                                grad_clip=1.0, update_epochs=1, clip_low=0.2, clip_high=0.28, use_liger=True,
                                gradient_checkpointing=True, offload_optimizer=True, correction="tis",
                                correction_cap=2.0, device="cuda", num_gpus=1.0, num_cpus=1.0)
    cfg.coordinator = CoordinatorConfig(mode="colocated", steps=40, prompts_per_step=16, eval_every=10,
                                        checkpoint_every=0, weight_sync="cuda_ipc", num_cpus=0.25)
    cfg.cluster = ClusterConfig(num_nodes=1, gpus_per_node=1, gpu_memory_gib=141.0, num_cpus=8)
    return cfg


@recipe
def gpu1_0p6b_async() -> RunConfig:
    """gpu1_0p6b in async mode on its one GPU: the vLLM engine and the learner both resident, no sleep.

    The same as `python -m launch.cluster gpu1_0p6b coordinator.mode=async assembler.max_staleness=1`:
    the placement shares the card (config/placement.py, "async on shared GPUs": the engine and the learner
    rank each take 0.5 of its bundle), the engine keeps its weights and its 0.3 x 141 GiB of KV cache, the
    learner its optimizer state and activations (together ~51 GiB planned; `--dry-run` states each
    process's budget and a setting that cannot fit is refused naming the fields). Generation runs one
    version ahead (max_staleness 1: step s+1's prompts generate while step s trains), at each weight update
    the engine parks its in-flight requests and continues them under the new weights (partial rollouts),
    the weights go over CUDA IPC on the card (the colocated path's transport), and the loss corrects for
    the behaviour policy with TIS at 2 (as gpu1_0p6b). Its warm start runs beside the resident engine.
    Compare with gpu1_0p6b in one device call: `python -m bench.gpu.recipe_async`. vLLM runs CUDA graphs, as
    gpu1_0p6b's. Measured on one H100 80GB (2026-12-07, seed 0, 40 steps, `cluster.gpu_memory_gib=79`;
    docs/perf/gpu_h100.md): 161.5 samples/s a whole step against colocated's 70.7 (2.28x), 0.40 s a step
    (generation wholly hidden behind training), held-out reward 0.214 -> 0.271 and greedy 0.177 -> 0.237
    (colocated 0.273 / 0.269), 34.1 GiB resident against 26.8, 239 s the whole run. Eager, async only matched
    colocated with graphs (97.9 against 97.6 samples/s in the 12-step form): eager decoding costs what the
    overlap saves. With graphs no request was parked at an update in that run (generation ended first); parking
    and continuing ran on the card eager (4 requests a step, exit 0) and is tested on CPU."""
    cfg = gpu1_0p6b()
    cfg.name = "gpu1_0p6b_async"
    cfg.coordinator.mode = "async"
    cfg.assembler.max_staleness = 1
    cfg.generator.partial_rollouts = True
    return cfg


@recipe
def gpu1_0p6b_lora() -> RunConfig:
    """gpu1_0p6b with LoRA RL (issue 39): a rank-16 adapter (alpha 32) on every attention and MLP projection
    trains; the base is frozen. The same warm start trains the base (its own AdamW, not planned with RL's),
    which reaches the engine once, in the first sync; after it every sync moves the adapter alone (16.6 MiB
    against the base's 0.66 GiB) through the Ray object store into vLLM as a new LoRA adapter id. vLLM sleeps
    at level 1 (it keeps the frozen base across sleeps: no sync brings it back). RL's rate is 5x gpu1_0p6b's,
    as tiny_lora's is above tiny's (low-rank updates scaled by alpha / rank). Compared with gpu1_0p6b in one
    device call: `MODES="lora colocated" python -m bench.gpu.recipe_async` (docs/perf/lora.md).
    vLLM runs with CUDA graphs, as gpu1_0p6b's (under an adapter, eager generation took 1.96 s a step against
    0.24 s with graphs: one H100, 2026-12-05, 6-step runs)."""
    cfg = gpu1_0p6b()
    cfg.name = "gpu1_0p6b_lora"
    cfg.learner.lora = LoraConfig(rank=16, alpha=32.0)
    cfg.learner.lr = 1e-3
    cfg.coordinator.weight_sync = "auto"  # the adapter goes by the object store (cuda_ipc moves whole models)
    return cfg


def get_recipe(name: str) -> RunConfig:
    import difflib

    from config.schema import ConfigError

    if name not in RECIPES:
        close = difflib.get_close_matches(name, list(RECIPES), n=3, cutoff=0.4)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(RECIPES)}"
        raise ConfigError(f"unknown recipe {name!r}{hint}")
    return RECIPES[name]()
