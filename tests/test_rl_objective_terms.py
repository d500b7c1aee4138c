"""The RL trainer's entropy bonus and KL in the reward: the bonus is `jodc.losses.entropy_bonus` added to the
policy loss (value and gradient); the shaped rewards are the scores minus beta times the per-token KL summed over
each response; the controller comes from the config; and a short run with an adaptive controller and an entropy
bonus, stopped and resumed, equals the uninterrupted one (the controller's beta is checkpointed)."""
import os
import shutil

import jax
import numpy as np
import pytest
from test_rl_loss import direct_kwargs, microbatch, objective

from jodc.losses import AdaptiveKLController, FixedKLController, entropy_bonus, kl_estimate
from jodc.train.core.config import ConfigError
from jodc.train.core.metrics import read_metrics
from jodc.train.rl.config import load_rl_config
from jodc.train.rl.loop import CHECKPOINT_DIR, run_rl
from jodc.train.rl.loss import build_advantages, build_kl_controller, kl_shaped_rewards, summarize_metrics


def test_entropy_bonus_is_added_to_the_policy_loss_with_its_gradient():
    logits, mb = microbatch(5)
    base = objective("--loss.name", "ppo")
    with_bonus = objective("--loss.name", "ppo", "--entropy_coeff", "0.3")
    assert "entropy_bonus_sum" in with_bonus.metric_names and "entropy_bonus_sum" not in base.metric_names
    bonus, _ = entropy_bonus(logits, mb["targets"], mb["loss_mask"], entropy_coeff=0.3, **direct_kwargs(mb))
    loss, metrics = with_bonus.head_loss(logits, mb)
    np.testing.assert_allclose(loss, base.head_loss(logits, mb)[0] + bonus, rtol=1e-6)
    got = jax.grad(lambda x: with_bonus.head_loss(x, mb)[0])(logits)
    want = jax.grad(lambda x: base.head_loss(x, mb)[0] + entropy_bonus(
        x, mb["targets"], mb["loss_mask"], entropy_coeff=0.3, **direct_kwargs(mb))[0])(logits)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    means = summarize_metrics({k: float(v) for k, v in metrics.items()}, with_bonus)
    assert means["entropy_bonus"] == pytest.approx(float(bonus), rel=1e-6) and means["entropy_bonus"] < 0


def test_kl_shaped_rewards_and_the_controller_from_the_config():
    rng = np.random.default_rng(0)
    lengths = [3, 1, 4]
    lp = [rng.normal(size=n).astype(np.float32) - 1 for n in lengths]
    ref = [x + rng.normal(size=x.shape).astype(np.float32) * 0.3 for x in lp]
    scores = np.array([1.0, 0.0, 0.5])
    shaped, kl = kl_shaped_rewards(scores, lp, ref, beta=0.2, estimator="k3")
    per_token = [np.asarray(kl_estimate(a, b, "k3")) for a, b in zip(lp, ref)]
    np.testing.assert_allclose(shaped, scores - 0.2 * np.array([k.sum() for k in per_token]), rtol=1e-5)
    np.testing.assert_allclose(kl, np.mean([k.mean() for k in per_token]), rtol=1e-5)
    shaped, _ = kl_shaped_rewards(scores, [np.zeros(0, np.float32)] * 3, [np.zeros(0, np.float32)] * 3,
                                  beta=0.2, estimator="k1")
    np.testing.assert_array_equal(shaped, scores)  # empty responses keep their scores
    loss = load_rl_config(None, ["--kl_in_reward_coef", "0.05"]).loss
    assert build_kl_controller(loss) == FixedKLController(0.05)
    loss = load_rl_config(None, ["--kl_in_reward_coef", "0.05", "--kl_in_reward_controller", "adaptive",
                                 "--kl_in_reward_target", "0.02", "--kl_in_reward_horizon", "500"]).loss
    assert build_kl_controller(loss) == AdaptiveKLController(0.05, 0.02, 500)
    assert build_kl_controller(load_rl_config(None, []).loss) is None
    with pytest.raises(ConfigError, match="adaptive needs an initial loss.kl_in_reward_coef"):
        load_rl_config(None, ["--kl_in_reward_controller", "adaptive"])
    with pytest.raises(ConfigError, match="loss.advantage='gae' needs a critic"):
        build_advantages(load_rl_config(None, ["--loss.advantage", "gae"]).loss)


STEPS = 3
EXACT = ("reward_mean", "loss", "grad_norm", "policy_kl", "entropy", "entropy_bonus", "kl_in_reward",
         "kl_in_reward_beta")


def short_run(out_dir):
    return load_rl_config(None, [
        "--preset", "tiny", "--attention_block_size", "16", "--token_cap", "64", "--prompt_bucket", "8",
        "--max_new_tokens", "4", "--max_digits", "1", "--max_terms", "2", "--prompts_per_step", "4",
        "--group_size", "4", "--updates_per_step", "2", "--learning_rate", "1e-3", "--steps", str(STEPS),
        "--devices", "2", "--deterministic", "--no-progress", "--save_every", "1", "--keep_checkpoints", "3",
        "--eval_every", "0", "--eval_problems", "4", "--loss.name", "ppo", "--entropy_coeff", "0.01",
        "--kl_in_reward_coef", "0.5", "--kl_in_reward_controller", "adaptive", "--kl_in_reward_target", "1e-4",
        "--kl_in_reward_horizon", "64", "--out_dir", str(out_dir)])


def test_a_resumed_run_continues_with_the_same_kl_controller(tmp_path):
    """One straight run; then a copy of its directory cut back to its step-2 checkpoint (as if preempted there)
    resumes and must redo step 3 exactly (two runs instead of three: CI time)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_rl(short_run(straight), log=lambda _: None)
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / CHECKPOINT_DIR / str(STEPS))
    metrics = resumed / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()[:STEPS - 1]))
    summary = run_rl(short_run(resumed), log=lambda _: None)
    assert summary["start_step"] == STEPS - 1
    want = read_metrics(os.path.join(straight, "metrics.jsonl"))
    got = read_metrics(str(metrics))
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for key in EXACT:
        assert [r[key] for r in got] == [r[key] for r in want], key
    betas = [r["kl_in_reward_beta"] for r in want]
    assert betas[0] == 0.5 and betas[-1] != betas[0]  # the controller moved beta, and the resume kept it
    assert abs(want[0]["kl_in_reward"]) < 1e-6 < abs(want[-1]["kl_in_reward"])  # the policy leaves the reference
