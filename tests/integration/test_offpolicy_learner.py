"""Off-policy correction through the real DeepSpeed learner (ZeRO-0, CPU): the behaviour log-probs reach the loss
always, and the correction's metrics say what it did."""
import pytest

from tests.learners import make_batch, make_learner

pytestmark = pytest.mark.usefixtures("learner_process_env")  # it builds Learners in this process


def test_learner_hands_behaviour_logprobs_to_the_loss_always_and_reports_the_correction(model_dir):
    """Real DeepSpeed (ZeRO-0, CPU) learner: mismatch_kl with the correction off; masked IS drops tokens."""
    off = make_learner(model_dir, correction="off").train_step(make_batch(seed=4, gen_logprob=-30.0))
    assert off["mismatch_kl"] > 1.0 and "is_weight_mean" not in off
    m = make_learner(model_dir, correction="mis", correction_cap=2.0).train_step(make_batch(seed=4, gen_logprob=-30.0))
    # The sampler's -30 is far below the policy's ~-6 on every token: every ratio leaves [1/2, 2].
    assert m["is_masked_frac"] == 1.0 and m["is_weight_mean"] == 0.0 and m["is_weight_max"] == 0.0
    assert m["pg_loss"] == 0.0 and m["mismatch_kl"] == pytest.approx(off["mismatch_kl"])
    t = make_learner(model_dir, correction="tis", correction_cap=2.0).train_step(make_batch(seed=4, gen_logprob=-30.0))
    assert t["is_weight_max"] == 2.0 and t["is_truncated_frac"] == 1.0

