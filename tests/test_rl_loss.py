"""The RL objective: the loss name picks the `jodc.losses` function (same value and gradient as calling it
directly), options reach it, bad options are config errors, the KL penalty adds to it, the diagnostics measure
the policy's distance from the behaviour policy, and summed metrics turn back into token means."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jodc.losses import dppo_loss, kl_penalty, ppo_loss
from jodc.train.core.config import ConfigError
from jodc.train.rl.config import load_rl_config
from jodc.train.rl.loss import DIAGNOSTICS, build_objective, summarize_metrics

B, T, V, K = 2, 6, 11, 3


def objective(*overrides):
    cfg = load_rl_config(None, list(overrides))
    return build_objective(cfg.loss, cfg.rollout)


def microbatch(seed=0, shift=1.5):
    """A packed microbatch (row 0: two sequences, row 1: one and padding) whose behaviour log-probs come from
    logits that differ from the current ones by `shift`-scaled noise (an off-policy update)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(B, T, V)).astype(np.float32)
    behaviour_logits = logits + shift * rng.normal(size=logits.shape).astype(np.float32)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    behaviour = np.take_along_axis(jax.nn.log_softmax(behaviour_logits), targets[..., None], -1)[..., 0]
    segment_ids = np.array([[1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 0, 0]], np.int32)
    loss_mask = np.array([[0, 1, 1, 0, 1, 1], [0, 0, 1, 1, 0, 0]], np.float32)
    advantages = np.where(segment_ids == 2, -1.0, 0.7).astype(np.float32) * (segment_ids > 0)
    top_ids = np.argsort(-behaviour_logits, axis=-1)[..., :K].astype(np.int32)
    top_lps = np.take_along_axis(np.asarray(jax.nn.log_softmax(behaviour_logits)), top_ids, -1)
    mb = {"targets": targets, "loss_mask": loss_mask, "segment_ids": segment_ids,
          "normalizer": np.float32(loss_mask.sum()), "behaviour_logprobs": np.asarray(behaviour, np.float32),
          "advantages": advantages, "topk_ids": top_ids, "topk_logprobs": top_lps.astype(np.float32),
          "ref_logprobs": np.asarray(behaviour, np.float32) - 0.3}
    return jnp.asarray(logits), {k: jnp.asarray(v) for k, v in mb.items()}


def direct_kwargs(mb):
    return dict(normalizer=mb["normalizer"], segment_ids=mb["segment_ids"], aggregation="token-mean")


def test_the_loss_name_switches_the_loss():
    logits, mb = microbatch(4)
    args = (mb["targets"], mb["behaviour_logprobs"], mb["advantages"], mb["loss_mask"])
    want = {"dppo": dppo_loss(logits, *args, **direct_kwargs(mb))[0],
            "dppo_kl": dppo_loss(logits, *args, divergence="kl", **direct_kwargs(mb))[0],
            "dppo_topk": dppo_loss(logits, *args, approximation="topk", topk_ids=mb["topk_ids"],
                                   topk_logprobs=mb["topk_logprobs"], **direct_kwargs(mb))[0],
            "ppo": ppo_loss(logits, *args, **direct_kwargs(mb))[0]}
    got = {}
    for name in want:
        obj = objective("--loss.name", name)
        got[name], metrics = obj.head_loss(logits, mb)
        assert set(metrics) == set(obj.metric_names)
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, err_msg=name)
    assert len({round(float(v), 6) for v in got.values()}) == 4  # four different losses on this batch
    assert "masked_fraction" in objective("--loss.name", "dppo").loss_metric_names
    assert "clip_fraction" in objective("--loss.name", "ppo").loss_metric_names
    assert objective("--loss.name", "dppo_topk").extras == ("behaviour_logprobs", "advantages", "topk_ids",
                                                           "topk_logprobs")


def test_gradients_match_the_library_loss_and_options_reach_it():
    logits, mb = microbatch(1)
    args = (mb["targets"], mb["behaviour_logprobs"], mb["advantages"], mb["loss_mask"])
    obj = objective("--loss.name", "ppo", "--clip_low", "0.1", "--clip_high", "0.3", "--dual_clip", "0")
    got = jax.grad(lambda x: obj.head_loss(x, mb)[0])(logits)
    want = jax.grad(lambda x: ppo_loss(x, *args, clip_low=0.1, clip_high=0.3, dual_clip=None,
                                       **direct_kwargs(mb))[0])(logits)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    default = jax.grad(lambda x: ppo_loss(x, *args, **direct_kwargs(mb))[0])(logits)
    assert not np.allclose(got, default)  # the options changed the loss
    strict = objective("--loss.name", "dppo", "--delta_low", "0", "--delta_high", "0")
    loose = objective("--loss.name", "dppo")
    masked = [o.head_loss(logits, mb)[1]["masked_fraction_sum"] for o in (strict, loose)]
    assert masked[0] > masked[1]


def test_sequence_level_losses_get_their_own_aggregation_and_behaviour_arrays_are_filled():
    assert objective("--loss.name", "gspo").aggregation == "seq-mean-token-mean"
    assert objective("--loss.name", "gspo", "--aggregation", "token-mean").aggregation == "token-mean"
    obj = objective("--loss.name", "tis")
    assert obj.behaviour_arrays == ("rollout_logprobs",)
    logits, mb = microbatch(2)
    loss, _ = obj.head_loss(logits, mb)
    # trainer-side old log-probs == rollout log-probs (synchronous rollouts): the TIS weight is 1, loss = PPO's
    want = ppo_loss(logits, mb["targets"], mb["behaviour_logprobs"], mb["advantages"], mb["loss_mask"],
                    **direct_kwargs(mb))[0]
    np.testing.assert_allclose(loss, want, rtol=1e-6)


def test_kl_penalty_to_the_reference_is_added():
    logits, mb = microbatch(3)
    base = objective("--loss.name", "dppo")
    with_kl = objective("--loss.name", "dppo", "--kl_coef", "0.5", "--kl_estimator", "k2")
    assert "ref_kl_sum" in with_kl.metric_names and "ref_kl_sum" not in base.metric_names
    kl, _ = kl_penalty(logits, mb["targets"], mb["ref_logprobs"], mb["loss_mask"], estimator="k2",
                       **direct_kwargs(mb))
    np.testing.assert_allclose(with_kl.head_loss(logits, mb)[0], base.head_loss(logits, mb)[0] + 0.5 * kl, rtol=1e-6)


def test_bad_loss_settings_are_config_errors():
    with pytest.raises(ConfigError, match="loss.name: Cannot convert 'ppo2' into one of: dppo"):  # jodc.losses' names
        objective("--loss.name", "ppo2")
    with pytest.raises(ConfigError, match="loss 'dppo' rejects .*'clip_low': 0.2.*unexpected keyword"):
        objective("--loss.name", "dppo", "--clip_low", "0.2")
    with pytest.raises(ConfigError, match="loss 'ppo' rejects .*clip_low must be < 1"):
        objective("--loss.name", "ppo", "--clip_low", "1.5")


def test_diagnostics_are_zero_on_policy_and_grow_off_policy():
    obj = objective()
    logits, mb = microbatch(4, shift=0.0)
    _, on = obj.head_loss(logits, mb)
    tokens = float(mb["loss_mask"].sum())
    assert set(DIAGNOSTICS) <= set(on) and float(on["tokens"]) == tokens
    means = summarize_metrics({k: float(v) for k, v in on.items()}, obj)
    assert means["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and means["ratio_std"] < 1e-3
    assert means["policy_kl"] == pytest.approx(0.0, abs=1e-6) and means["policy_tv"] == pytest.approx(0, abs=1e-6)
    assert means["trust_region_fraction"] == 0.0 and means["entropy"] > 0
    logits, mb = microbatch(4, shift=2.0)
    strict = objective("--delta_low", "0", "--delta_high", "0")  # masks every token moving away from mu
    off = summarize_metrics({k: float(v) for k, v in strict.head_loss(logits, mb)[1].items()}, strict)
    assert off["policy_kl"] > 0.05 and off["ratio_std"] > 0.1 and off["trust_region_fraction"] > 0
    assert off["loss_masked_fraction"] == off["trust_region_fraction"]
    assert "trust_region_fraction" not in summarize_metrics(
        {k: float(v) for k, v in objective("--loss.name", "sapo").head_loss(logits, mb)[1].items()},
        objective("--loss.name", "sapo"))


@pytest.mark.parametrize("name, fn, options", [
    ("geo_mean", "geo_mean_loss", {}), ("gpg", "gpg_loss", {}), ("kl_cov", "kl_cov_loss", {}),
    ("clip_cov", "clip_cov_loss", {}), ("tis_seq", "tis_loss", {"level": "sequence"}), ("dro", "dro_loss", {})])
def test_the_rest_of_the_family_is_selectable_by_name(name, fn, options):
    from jodc import losses
    logits, mb = microbatch(5)
    library = getattr(losses, fn)
    obj = objective("--loss.name", name)
    assert obj.aggregation == library.default_aggregation
    arrays = {n: mb["behaviour_logprobs"] for n in library.extras}
    anchor = (mb["behaviour_logprobs"],) if library.anchor else ()
    want = library(logits, mb["targets"], *anchor, mb["advantages"], mb["loss_mask"], normalizer=mb["normalizer"],
                   segment_ids=mb["segment_ids"], **options, **arrays)[0]
    np.testing.assert_allclose(obj.head_loss(logits, mb)[0], want, rtol=1e-6)


def test_metadata_decides_the_arrays_and_the_advantage_estimator():
    from jodc.losses import reinforce_pp_advantages, rloo_advantages
    from jodc.train.rl.loss import build_advantages
    assert objective("--loss.name", "decoupled_ppo").behaviour_arrays == ("behaviour_logprobs",)
    assert objective("--loss.name", "dppo_topk").uses_topk and not objective("--loss.name", "dppo").uses_topk
    assert objective("--loss.name", "dppo", "--approximation", "topk").uses_topk
    assert not objective("--loss.name", "dppo_topk", "--approximation", "binary").uses_topk
    rewards, lengths = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.5]), np.array([3, 1, 4, 2, 2, 5])
    for name, want in (("rloo", rloo_advantages(rewards, 3)),
                       ("reinforce_plus_plus_baseline", reinforce_pp_advantages(rewards, 3, lengths=lengths))):
        cfg = load_rl_config(None, ["--loss.advantage", name])
        np.testing.assert_allclose(build_advantages(cfg.loss)(rewards, 3, lengths), want, rtol=1e-6)
    cfg = load_rl_config(None, ["--loss.advantage", "grpo", "--normalize_std", "false"])
    np.testing.assert_allclose(build_advantages(cfg.loss)(rewards, 3, lengths), [2 / 3, -1 / 3, -1 / 3, 1 / 6,
                                                                                 1 / 6, -1 / 3], rtol=1e-6)
    with pytest.raises(ConfigError, match="loss.advantage='remax' needs \\['greedy_rewards'\\]"):
        build_advantages(load_rl_config(None, ["--loss.advantage", "remax"]).loss)


def test_opo_is_selectable_and_estimators_the_trainer_cannot_feed_are_refused():
    """OPO needs only the response lengths, which the trainer has. GDPO needs several reward functions' rewards
    and the optimal token baseline per-token sum pi^2 (and gives per-token advantages): the trainer provides
    neither, so the config refuses them by name instead of running something else under their names."""
    from jodc.losses import opo_advantages
    from jodc.train.rl.loss import build_advantages
    rewards, lengths = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.5]), np.array([3, 1, 4, 2, 2, 5])
    opo = build_advantages(load_rl_config(None, ["--loss.advantage", "opo"]).loss)
    np.testing.assert_allclose(opo(rewards, 3, lengths), opo_advantages(rewards, 3, lengths=lengths), rtol=1e-6)
    np.testing.assert_allclose(opo(rewards, 3, lengths)[:3], [1 - 3 / 8, -3 / 8, -3 / 8], rtol=1e-6)
    with pytest.raises(ConfigError, match="loss.advantage='gdpo' normalises the rewards of several reward "
                                          "functions separately .*one reward function"):
        build_advantages(load_rl_config(None, ["--loss.advantage", "gdpo"]).loss)
    with pytest.raises(ConfigError, match="loss.advantage='optimal_token_baseline' needs \\['logprobs', "
                                          "'sum_pi_squared', 'mask'\\] and gives per-token advantages"):
        build_advantages(load_rl_config(None, ["--loss.advantage", "optimal_token_baseline"]).loss)


def test_dro_beta_reaches_the_loss_and_verls_kl_names_are_accepted():
    from jodc.losses import dro_loss
    logits, mb = microbatch(6)
    obj = objective("--loss.name", "dro", "--dro_beta", "0.5")
    assert obj.options == {"dro_beta": 0.5}
    want = dro_loss(logits, mb["targets"], mb["behaviour_logprobs"], mb["advantages"], mb["loss_mask"],
                    dro_beta=0.5, **direct_kwargs(mb))[0]
    np.testing.assert_allclose(obj.head_loss(logits, mb)[0], want, rtol=1e-6)
    with pytest.raises(ConfigError, match="loss 'ppo' rejects .*'dro_beta': 0.5.*unexpected keyword"):
        objective("--loss.name", "ppo", "--dro_beta", "0.5")
    base = objective("--loss.name", "dppo")
    for alias, name in (("low_var_kl", "k3"), ("mse", "k2"), ("abs+", "abs+")):
        with_kl = objective("--loss.name", "dppo", "--kl_coef", "0.5", "--kl_estimator", alias)
        kl, _ = kl_penalty(logits, mb["targets"], mb["ref_logprobs"], mb["loss_mask"], estimator=name,
                           **direct_kwargs(mb))
        np.testing.assert_allclose(with_kl.head_loss(logits, mb)[0], base.head_loss(logits, mb)[0] + 0.5 * kl,
                                   rtol=1e-6)
