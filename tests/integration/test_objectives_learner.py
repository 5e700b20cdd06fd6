"""One learner step per objective (policies/objectives.py) and Dr.GRPO's aggregation, on the tiny model:
the config value reaches the loss, an on-policy first epoch is the same update for every objective, and
the second (off-policy) epoch is where they differ."""
import math

import pytest

from tests.learners import assert_params_close, make_batch, make_learner, params

pytestmark = pytest.mark.usefixtures("learner_process_env")  # it builds Learners in this process

OBJECTIVES = [("ppo_clip", "token-mean"), ("gspo", "seq-mean-token-mean"), ("cispo", "token-mean"),
              ("ppo_clip", "seq-mean-token-sum-norm")]


@pytest.fixture(scope="module")
def stepped(model_dir):  # noqa: F811
    """(params after one single-epoch step, params after a two-epoch step, metrics) per objective."""
    out = {}
    for loss, agg in OBJECTIVES:
        row = []
        for epochs in (1, 2):
            learner = make_learner(model_dir, loss=loss, loss_agg=agg, loss_norm_tokens=16, update_epochs=epochs,
                                   clip_low=0.0003 if loss == "gspo" else 0.2,
                                   clip_high=0.0004 if loss == "gspo" else 0.28)
            m = learner.train_step(make_batch(seed=7))
            row += [params(learner), m]
        out[(loss, agg)] = row
    return out


@pytest.mark.parametrize("key", OBJECTIVES, ids=["-".join(k) for k in OBJECTIVES])
def test_each_objective_trains_one_step(stepped, key):
    _, m1, _, m2 = stepped[key]
    for m in (m1, m2):
        assert all(math.isfinite(v) for v in m.values())
        assert m["grad_norm"] > 0
    assert m1["clipfrac"] == 0.0 and m1["ppo_kl"] == 0.0  # the first epoch is on-policy
    assert m2["epoch1/ppo_kl"] != 0.0  # the second one is not


def test_on_policy_step_is_the_same_update_for_ppo_clip_and_cispo(stepped):
    """On-policy, PPO-clip and CISPO have the same gradient (exp(lp - sg(lp)) vs exp(lp - old) at lp = old)."""
    assert_params_close(stepped[("ppo_clip", "token-mean")][0], stepped[("cispo", "token-mean")][0], atol=1e-6)


def test_objectives_differ_once_off_policy_and_dr_grpo_differs_from_token_mean(stepped):
    def worst(a, b):
        return max(float((a[k] - b[k]).abs().max()) for k in a)
    ppo, cispo, gspo = (stepped[k][2] for k in OBJECTIVES[:3])
    assert worst(ppo, cispo) > 1e-6 and worst(ppo, gspo) > 1e-6
    assert worst(stepped[("ppo_clip", "token-mean")][0], stepped[("ppo_clip", "seq-mean-token-sum-norm")][0]) > 1e-6
    assert stepped[("gspo", "seq-mean-token-mean")][3]["epoch1/clipfrac"] > 0  # GSPO's narrow range clips
