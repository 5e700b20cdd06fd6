"""The warm start's batching (launch/warm_start.py, Learner.sft_steps): N steps in one learner call are the
N steps of N calls — same draws, same losses, same weights — on CPU with the tiny model (a real Learner,
a real synthetic task; the group is a plain in-process stand-in for the Ray shell's async fan-out)."""
import pytest
import structlog
import torch

from actors.learner.learner import Learner
from config import apply_overrides
from config.recipes import get_recipe
from launch import warm_start as ws
from tasks.bird import build_prompts, load_split
from tasks.synthetic import TINY_TEMPLATES, texts_for_tokenizer, write_dataset
from tasks.tiny_model import build_tiny

pytestmark = pytest.mark.usefixtures("learner_process_env")  # it builds Learners in this process


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("warm_batch")
    cfg = apply_overrides(get_recipe("tiny"), ["model.tiny_sft_steps=7", "model.tiny_sft_batch=4", "seed=3"])
    bird = write_dataset(root / "syn", num_databases=2, num_questions=40, seed=4, templates=list(TINY_TEMPLATES))
    model = build_tiny(str(root / "model"), texts_for_tokenizer(bird), seed=0, model_cfg=cfg.model)
    items, _ = build_prompts(load_split(bird, "train"), AutoTokenizer.from_pretrained(model), 256, style="compact",
                             sample_values=0)
    return cfg, items, model


class InProcessGroup:
    """The LearnerGroup's two warm-start verbs over one in-process Learner, counting the calls."""

    def __init__(self, learner: Learner):
        self.learner, self.calls = learner, 0

    async def sft_step(self, pairs, lr=None) -> float:
        self.calls += 1
        return self.learner.sft_step(pairs, lr)

    async def sft_steps(self, chunks, lr=None) -> dict:
        self.calls += 1
        return self.learner.sft_steps(chunks, lr)


def learner_of(cfg, model) -> Learner:
    torch.manual_seed(0)
    return Learner(cfg.learner, cfg.model, model, total_steps=10, micro_batch_tokens=cfg.assembler.micro_batch_tokens)


def weights(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in learner.state_dict_hf().items()}


def test_batched_warm_start_equals_one_call_a_step(task):
    cfg, items, model = task
    log = structlog.get_logger("test")
    one, many = InProcessGroup(learner_of(cfg, model)), InProcessGroup(learner_of(cfg, model))
    a = ws.warm_start(cfg, one, items, model, log, steps_per_call=1)
    b = ws.warm_start(cfg, many, items, model, log, steps_per_call=3)  # 3 + 3 + 1: a short last call
    assert (one.calls, many.calls) == (7, 3) and (a["sft_calls"], b["sft_calls"]) == (7.0, 3.0)
    for key in ("sft_loss_first", "sft_loss_last", "sft_slipped_share"):
        assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), key
    wa, wb = weights(one.learner), weights(many.learner)
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert worst <= 1e-6, f"weights differ by {worst}"
    # The steps moved the weights: the comparison above could fail.
    w0 = weights(learner_of(cfg, model))
    assert max(float((wa[k] - w0[k]).abs().max()) for k in wa) > 1e-3
    assert 0 < b["time_sft_learner"] <= b["time_sft"]


def test_sft_steps_is_sft_step_in_a_loop(task):
    cfg, _, model = task
    chunks = [[([1, 2, 3, 4], [5, 6, 7]), ([9, 8], [7, 6, 5, 4])], [([3, 3, 3], [4, 5])], [([7, 1], [2, 2, 2, 2])]]
    looped, batched = learner_of(cfg, model), learner_of(cfg, model)
    losses = [looped.sft_step(c, 1e-2) for c in chunks]
    out = batched.sft_steps(chunks, 1e-2)
    assert out["losses"] == pytest.approx(losses, rel=1e-6) and out["seconds"] > 0
    wa, wb = weights(looped), weights(batched)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-6
