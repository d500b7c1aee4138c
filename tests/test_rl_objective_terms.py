"""The RL trainer's entropy bonus, KL in the reward and critic: the bonus is `jodc.losses.entropy_bonus` added to
the policy loss (value and gradient); the shaped rewards are the scores minus beta times the per-token KL summed
over each response; the controller comes from the config; critic PPO adds vf_coef times the clipped value loss of
the value head's predictions, whose values the staged decoder computes as `values_forward` does, and its
advantages are GAE over the rollout's token rewards; and a short critic-PPO run with an adaptive controller and an
entropy bonus, stopped and resumed, equals the uninterrupted one (value head, controller's beta)."""
import os
import shutil

import jax
import numpy as np
import pytest
from test_rl_loss import direct_kwargs, microbatch, objective

import jax.numpy as jnp
from conftest import compilations

from jodc.losses import (AdaptiveKLController, FixedKLController, clipped_value_loss, entropy_bonus, gae_advantages,
                         kl_estimate)
from jodc.train.core.config import ConfigError
from jodc.train.core.metrics import read_metrics
from jodc.train.rl.config import load_rl_config
from jodc.train.rl.advantages import critic_advantages, kl_shaped_rewards
from jodc.train.rl.loop import CHECKPOINT_DIR, run_rl
from jodc.train.rl.loss import build_advantages, build_kl_controller, summarize_metrics


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
    assert build_advantages(load_rl_config(None, ["--loss.advantage", "gae"]).loss) is None  # the critic's path
    with pytest.raises(ConfigError, match="synchronous rollouts only"):
        load_rl_config(None, ["--loss.advantage", "gae", "--max_staleness", "1"])


def test_critic_head_loss_adds_the_value_loss():
    logits, mb = microbatch(7)
    rng = np.random.default_rng(7)
    mb = {**mb, "returns": jnp.asarray(rng.normal(size=mb["targets"].shape), jnp.float32),
          "old_values": jnp.asarray(rng.normal(size=mb["targets"].shape), jnp.float32)}
    values = jnp.asarray(rng.normal(size=mb["targets"].shape), jnp.float32)
    base = objective("--loss.name", "ppo")
    critic = objective("--loss.name", "ppo", "--loss.advantage", "gae", "--critic_vf_coef", "0.25",
                       "--critic_value_clip", "0.2")
    assert critic.critic and {"returns", "old_values"} <= set(critic.extras)
    vloss, vm = clipped_value_loss(values, mb["returns"], mb["old_values"], mb["loss_mask"], clip_range=0.2,
                                   **direct_kwargs(mb))
    loss, metrics = critic.head_loss(logits, mb, values)
    np.testing.assert_allclose(loss, base.head_loss(logits, mb)[0] + 0.25 * vloss, rtol=1e-6)
    got = jax.grad(lambda v: critic.head_loss(logits, mb, v)[0])(values)
    want = jax.grad(lambda v: 0.25 * clipped_value_loss(v, mb["returns"], mb["old_values"], mb["loss_mask"],
                                                        clip_range=0.2, **direct_kwargs(mb))[0])(values)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)
    means = summarize_metrics({k: float(v) for k, v in metrics.items()}, critic)
    assert means["vf_loss"] == pytest.approx(float(vloss), rel=1e-6)
    assert means["vf_clipfrac"] == pytest.approx(float(vm["vf_clipfrac"]), rel=1e-6)


def test_the_staged_decoder_values_and_the_rollout_advantages():
    from jodc.train.core.staged_decoder import decoder_staged_model
    from jodc.models import VALUE_HEAD, values_forward
    from test_models import tiny_config

    config = tiny_config(num_layers=1, attention_impl="dense")  # eager stages: keep it small
    seen = {}

    def head_loss(logits, mb, values):
        seen["values"] = values
        return jnp.sum(values), {}

    model, groups = decoder_staged_model(config, seed=0, head_loss=head_loss, value_head=True)
    assert VALUE_HEAD in groups and float(jnp.abs(groups[VALUE_HEAD]["weight"]).sum()) == 0
    groups = {**groups, VALUE_HEAD: {"weight": jnp.linspace(-1, 1, config.hidden_size), "bias": jnp.ones(1)}}
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 8)), jnp.int32)
    segments = jnp.ones((2, 8), jnp.int32)
    h = None
    for stage in model.stages:
        params = tuple(groups[g] for g in stage.groups)
        h = stage.fn(params, h, {"tokens": tokens, "positions": jnp.tile(jnp.arange(8), (2, 1)),
                                 "segment_ids": segments})
    np.testing.assert_allclose(seen["values"], values_forward(config, groups, tokens, segments), rtol=1e-5,
                               atol=1e-6)
    # GAE over per-response arrays equals the library's on the padded batch
    values = [np.array([0.1, 0.2, 0.3], np.float32), np.array([0.5], np.float32)]
    adv, ret, kl = critic_advantages(np.array([1.0, 0.0]), values, gamma=1.0, lam=1.0)
    want_adv, want_ret = gae_advantages(np.array([[0, 0, 1.0], [0, 0, 0]]), np.array([[0.1, 0.2, 0.3], [0.5, 0, 0]]),
                                        np.array([[1, 1, 1], [1, 0, 0]]))
    np.testing.assert_allclose(np.concatenate(ret), [1.0, 1.0, 1.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(np.concatenate(adv), np.asarray(want_adv)[[0, 0, 0, 1], [0, 1, 2, 0]], rtol=1e-5)
    np.testing.assert_allclose(np.concatenate(ret), np.asarray(want_ret)[[0, 0, 0, 1], [0, 1, 2, 0]], rtol=1e-6)
    assert kl is None


def test_critic_advantages_compile_once_per_shape():
    """The RL loop calls GAE eagerly once per step: a second rollout of the same shapes (new scores, values and
    log-probs) compiles nothing. (An eager `lax.scan` over a fresh closure compiled again at every call: critic
    PPO paid a backend compilation every RL step.)"""

    rng = np.random.default_rng(0)

    def rollout():
        values = [rng.normal(size=n).astype(np.float32) for n in (3, 1, 4)]
        logprobs = [-rng.random(len(v)).astype(np.float32) for v in values]
        ref = [-rng.random(len(v)).astype(np.float32) for v in values]
        return rng.random(3), values, (logprobs, ref, 0.1, "k3")

    for kl in (False, True):
        scores, values, kl_args = rollout()
        critic_advantages(scores, values, gamma=0.99, lam=0.95, kl=kl_args if kl else None)  # compiles
        scores, values, kl_args = rollout()
        with compilations() as compiles:
            critic_advantages(scores, values, gamma=0.99, lam=0.95, kl=kl_args if kl else None)
        assert compiles == [], (kl, compiles)


STEPS = 3
EXACT = ("reward_mean", "loss", "grad_norm", "policy_kl", "entropy", "entropy_bonus", "kl_in_reward",
         "kl_in_reward_beta", "vf_loss", "vf_clipfrac", "vpred_mean")


def short_run(out_dir):
    return load_rl_config(None, [
        "--preset", "tiny", "--attention_block_size", "16", "--token_cap", "64", "--prompt_bucket", "8",
        "--max_new_tokens", "4", "--max_digits", "1", "--max_terms", "2", "--prompts_per_step", "4",
        "--group_size", "4", "--updates_per_step", "2", "--learning_rate", "1e-3", "--steps", str(STEPS),
        "--devices", "2", "--deterministic", "--no-progress", "--save_every", "1", "--keep_checkpoints", "3",
        "--eval_every", "0", "--eval_problems", "4", "--loss.name", "ppo", "--loss.advantage", "gae",
        "--critic_vf_coef", "1.0", "--entropy_coeff", "0.01",
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
