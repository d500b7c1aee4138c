"""GAE, REINFORCE++'s discounted form, the clipped value loss, KL in the reward (and its controllers) and the
entropy bonus, each against a float64 numpy reference written from verl's definitions
(`compute_gae_advantage_return`, `compute_reinforce_plus_plus_outcome_advantage`, `compute_value_loss`,
`apply_kl_penalty`, `AdaptiveKLController`, `entropy_coeff * agg_loss(entropy)`), with gradient checks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_losses import numeric_grad

from jodc.losses import (
    ADVANTAGE_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    aggregate,
    clipped_value_loss,
    discounted_returns,
    entropy_bonus,
    gae_advantages,
    get_advantage_estimator,
    kl_controller,
    kl_controller_from_state,
    kl_estimate,
    kl_reward,
    last_token_rewards,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_token_advantages,
)

RNG = np.random.default_rng(7)
# rows: full, padded at the end, a hole in the middle (a token not trained on), one token, empty
MASK = np.array([[1, 1, 1, 1, 1, 1],
                 [1, 1, 1, 0, 0, 0],
                 [1, 1, 0, 1, 1, 0],
                 [0, 0, 1, 0, 0, 0],
                 [0, 0, 0, 0, 0, 0]], np.float64)
REWARDS = RNG.normal(size=MASK.shape)
VALUES = RNG.normal(size=MASK.shape)


def x64(fn, *args, **kwargs):
    with jax.enable_x64(True):
        out = fn(*args, **kwargs)
        return jax.tree.map(np.asarray, out)


def np_whiten(x, mask):
    m = mask != 0
    mean = x[m].mean()
    var = ((x[m] - mean) ** 2).sum() / (m.sum() - 1)
    return np.where(m, (x - mean) / np.sqrt(var + 1e-8), 0.0)


def np_gae(r, v, mask, gamma, lam):
    """verl's loop: skip values and TD errors on invalid tokens (the carries pass through them)."""
    n, t = r.shape
    adv = np.zeros_like(r)
    next_value, last = np.zeros(n), np.zeros(n)
    for j in reversed(range(t)):
        delta = r[:, j] + gamma * next_value - v[:, j]
        last_new = delta + gamma * lam * last
        next_value = v[:, j] * mask[:, j] + (1 - mask[:, j]) * next_value
        last = last_new * mask[:, j] + (1 - mask[:, j]) * last
        adv[:, j] = last
    returns = np.where(mask != 0, adv + v, 0.0)
    return np_whiten(adv, mask), returns


def np_discounted(r, mask, gamma):
    out, running = np.zeros_like(r), np.zeros(r.shape[0])
    for j in reversed(range(r.shape[1])):
        running = np.where(mask[:, j] != 0, r[:, j] + gamma * running, running)
        out[:, j] = np.where(mask[:, j] != 0, running, 0.0)
    return out


# ---------------------------------------------------------------------------------------------------- GAE
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_against_reference(gamma, lam):
    adv, ret = x64(gae_advantages, REWARDS, VALUES, MASK, gamma=gamma, lam=lam)
    ref_adv, ref_ret = np_gae(REWARDS, VALUES, MASK, gamma, lam)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(ret, ref_ret, rtol=1e-12, atol=1e-13)


def test_gae_ignores_padding_and_special_cases():
    garbage_r = np.where(MASK != 0, REWARDS, np.nan)
    garbage_v = np.where(MASK != 0, VALUES, np.inf)
    adv, ret = x64(gae_advantages, garbage_r, garbage_v, MASK, gamma=0.99, lam=0.95)
    ref_adv, ref_ret = np_gae(REWARDS, VALUES, MASK, 0.99, 0.95)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(ret, ref_ret, rtol=1e-12, atol=1e-13)
    # lam = 1, gamma = 1, zero values: the return is the sum of the rewards still to come
    _, ret = x64(gae_advantages, REWARDS, np.zeros_like(VALUES), MASK)
    np.testing.assert_allclose(ret, np_discounted(REWARDS, MASK, 1.0), rtol=1e-12, atol=1e-13)
    # lam = 0: one-step TD errors
    raw, _ = x64(gae_advantages, REWARDS[:1], VALUES[:1], MASK[:1], gamma=0.5, lam=0.0, whiten=False)
    td = REWARDS[0] + 0.5 * np.append(VALUES[0, 1:], 0.0) - VALUES[0]
    np.testing.assert_allclose(raw[0], td, rtol=1e-12)
    with pytest.raises(ValueError, match="lam must be in \\[0, 1\\]"):
        gae_advantages(REWARDS, VALUES, MASK, lam=1.5)
    with pytest.raises(ValueError, match="values has shape"):
        gae_advantages(REWARDS, VALUES[:, :3], MASK)


def test_gae_returns_gradient_matches_finite_differences():
    w = RNG.normal(size=MASK.shape)

    def ref(v):
        return np.sum(w * np_gae(REWARDS, v, MASK, 0.9, 0.8)[1])

    with jax.enable_x64(True):
        grad = np.asarray(jax.grad(lambda v: jnp.sum(w * gae_advantages(REWARDS, v, MASK, gamma=0.9, lam=0.8)[1]))(
            jnp.asarray(VALUES)))
    fd = numeric_grad(ref, VALUES)
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8)


def test_gae_registered_as_verl_name():
    est = get_advantage_estimator("gae")
    assert est.per_token and est.token_rewards and est.inputs == ("values", "mask")
    adv = x64(est, REWARDS, 1, values=VALUES, mask=MASK, gamma=0.99, lam=0.95)
    np.testing.assert_allclose(adv, np_gae(REWARDS, VALUES, MASK, 0.99, 0.95)[0], rtol=1e-12, atol=1e-13)
    assert not any(e.token_rewards for n, e in ADVANTAGE_ESTIMATORS.items() if n != "gae")


# ------------------------------------------------------------------------------------------------ REINFORCE++
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_token_form_against_reference(gamma):
    np.testing.assert_allclose(x64(discounted_returns, REWARDS, MASK, gamma=gamma),
                               np_discounted(REWARDS, MASK, gamma), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(x64(reinforce_pp_token_advantages, REWARDS, MASK, gamma=gamma),
                               np_whiten(np_discounted(REWARDS, MASK, gamma), MASK), rtol=1e-12, atol=1e-13)


def test_reinforce_pp_token_form_equals_outcome_form_at_gamma_one():
    scores = np.array([1.0, 0.0, 0.5, 2.0, 3.0])
    token = x64(reinforce_pp_token_advantages, x64(last_token_rewards, scores, MASK), MASK)
    outcome = x64(reinforce_pp_advantages, scores, 1, lengths=MASK.sum(1), baseline=False)
    np.testing.assert_allclose(token, outcome[:, None] * MASK, rtol=1e-12, atol=1e-13)


def test_masked_whiten_reference_and_gradient():
    np.testing.assert_allclose(x64(masked_whiten, REWARDS, MASK), np_whiten(REWARDS, MASK), rtol=1e-12)
    w = RNG.normal(size=MASK.shape)
    with jax.enable_x64(True):
        grad = np.asarray(jax.grad(lambda x: jnp.sum(w * masked_whiten(x, MASK)))(jnp.asarray(REWARDS)))
    fd = numeric_grad(lambda x: np.sum(w * np_whiten(x, MASK)), REWARDS)
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8)


# --------------------------------------------------------------------------------------------------- value loss
def np_value_loss(v, ret, old, mask, clip, mode):
    clipped = np.clip(v, old - clip, old + clip)
    l1, l2 = (v - ret) ** 2, (clipped - ret) ** 2
    per = np.maximum(l1, l2)
    m = mask != 0
    if mode == "token-mean":
        agg = per[m].sum() / m.sum()
    else:  # seq-mean-token-mean
        rows = [per[i][m[i]].mean() for i in range(len(m)) if m[i].any()]
        agg = np.mean(rows)
    return 0.5 * agg, (l2 > l1)[m].mean()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_against_reference_and_gradient(mode):
    v, ret, old = VALUES, REWARDS, VALUES + RNG.normal(scale=0.6, size=MASK.shape)
    loss, metrics = x64(clipped_value_loss, v, ret, old, MASK, clip_range=0.2, aggregation=mode)
    ref, clipfrac = np_value_loss(v, ret, old, MASK, 0.2, mode)
    np.testing.assert_allclose(loss, ref, rtol=1e-12)
    np.testing.assert_allclose(metrics["vf_clipfrac"], clipfrac, rtol=1e-12)
    assert 0 < clipfrac < 1
    with jax.enable_x64(True):
        grad = np.asarray(jax.grad(lambda x: clipped_value_loss(x, ret, old, MASK, clip_range=0.2,
                                                                aggregation=mode)[0])(jnp.asarray(v)))
    fd = numeric_grad(lambda x: np_value_loss(x, ret, old, MASK, 0.2, mode)[0], v, eps=1e-7)
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9)


def test_value_loss_without_clip_padding_and_errors():
    garbage = np.where(MASK != 0, VALUES, np.nan)
    loss, metrics = x64(clipped_value_loss, garbage, REWARDS, garbage, MASK, clip_range=None)
    m = MASK != 0
    np.testing.assert_allclose(loss, 0.5 * np.mean((VALUES[m] - REWARDS[m]) ** 2), rtol=1e-12)
    assert metrics["vf_clipfrac"] == 0
    with pytest.raises(ValueError, match="old_values has shape"):
        clipped_value_loss(VALUES, REWARDS, VALUES[:2], MASK)
    with pytest.raises(ValueError, match="clip_range must be"):
        clipped_value_loss(VALUES, REWARDS, VALUES, MASK, clip_range=-1.0)


# ------------------------------------------------------------------------------------------------- KL in reward
@pytest.mark.parametrize("estimator", ["k1", "k3", "abs"])
def test_kl_reward_against_reference(estimator):
    scores = np.array([1.0, -0.5, 2.0, 0.25, 7.0])
    lp, ref = RNG.normal(size=MASK.shape) - 2, RNG.normal(size=MASK.shape) - 2
    rewards, current = x64(kl_reward, scores, lp, ref, MASK, beta=0.1, estimator=estimator)
    m = MASK != 0
    log_ratio = lp - ref
    kl = {"k1": log_ratio, "k3": np.exp(-log_ratio) + log_ratio - 1, "abs": np.abs(log_ratio)}[estimator]
    kl = np.where(m, kl, 0.0)
    expected = -0.1 * kl
    for i, last in ((0, 5), (1, 2), (2, 4), (3, 2)):
        expected[i, last] += scores[i]
    np.testing.assert_allclose(rewards, expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(current, np.mean([kl[i][m[i]].mean() for i in range(4)]), rtol=1e-12)
    # the rewards are data: no gradient reaches the log-probs
    with jax.enable_x64(True):
        g = jax.grad(lambda x: jnp.sum(kl_reward(scores, x, ref, MASK, beta=0.1, estimator=estimator)[0]))(lp)
    np.testing.assert_array_equal(np.asarray(g), 0.0)


def test_kl_reward_with_beta_zero_is_the_outcome_reward_and_checks():
    scores = np.arange(5.0)
    rewards, _ = x64(kl_reward, scores, VALUES, REWARDS, MASK, beta=0.0)
    np.testing.assert_array_equal(rewards.sum(1), [0.0, 1.0, 2.0, 3.0, 0.0])  # the empty row carries nothing
    with pytest.raises(ValueError, match="ref_logprobs has shape"):
        kl_reward(scores, VALUES, REWARDS[:, :2], MASK, beta=0.1)
    with pytest.raises(ValueError, match="unknown estimator"):
        kl_reward(scores, VALUES, REWARDS, MASK, beta=0.1, estimator="k9")
    np.testing.assert_allclose(x64(kl_estimate, VALUES, REWARDS, "k1"), VALUES - REWARDS)


def test_kl_controllers_follow_verl_and_round_trip():
    fixed = kl_controller("fixed", 0.05)
    assert fixed.update(3.0, 64) == fixed == FixedKLController(0.05)
    ctl = kl_controller("adaptive", 0.1, target=0.02, horizon=1000)
    beta, value = [], 0.1
    for kl in (0.05, 0.021, 0.0, 0.019):
        ctl = ctl.update(kl, 32)
        value *= 1 + np.clip(kl / 0.02 - 1, -0.2, 0.2) * 32 / 1000
        beta.append(ctl.value)
        np.testing.assert_allclose(ctl.value, value, rtol=1e-15)
    assert beta[0] > 0.1 and beta[2] < beta[1]
    assert kl_controller_from_state(ctl.state()) == ctl
    assert kl_controller_from_state(fixed.state()) == fixed
    assert isinstance(ctl, AdaptiveKLController)
    with pytest.raises(ValueError, match="needs target and horizon"):
        kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="unknown kind"):
        kl_controller("pid", 0.1)


def test_current_kl_averages_over_responses_with_tokens_unlike_verl():
    """The documented difference (docs/losses.md, "KL in the reward"): an empty response has no KL to report, so
    `current_kl` is the mean over the rows with a valid token; verl's `apply_kl_penalty` takes each row's
    masked mean (0 for an empty row) and averages over every row. The numbers docs/losses.md quotes: per-token KL
    0.05 beside an empty response gives 0.05 here, 0.025 in verl; 12 adaptive updates (beta 0.05, target 0.04,
    horizon 100, 2 rows each) end at beta 0.0525 vs 0.0477."""
    lp = np.array([[-1.0, -1.0], [0.0, 0.0]])
    mask = np.array([[1.0, 1.0], [0.0, 0.0]])
    _, current = kl_reward(np.array([1.0, 0.0]), lp, lp - 0.05, mask, beta=0.1)
    kl_nt = 0.05 * mask  # k1 per token
    verl = np.mean((kl_nt * mask).sum(-1) / (mask.sum(-1) + 1e-8))  # masked_mean over tokens, mean over rows
    np.testing.assert_allclose([float(current), verl], [0.05, 0.025], rtol=1e-5)
    betas = []
    for kl in (float(current), verl):
        ctl = AdaptiveKLController(0.05, 0.04, 100)
        for _ in range(12):
            ctl = ctl.update(kl, 2)
        betas.append(ctl.value)
    np.testing.assert_allclose(betas, [0.0525, 0.0477], atol=5e-5)


# ----------------------------------------------------------------------------------------------- entropy bonus
def np_entropy(logits):
    z = logits - logits.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    return -(p * np.log(p)).sum(-1)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_entropy_bonus_against_reference_and_gradient(chunk_size):
    logits = RNG.normal(size=(5, 6, 7)) * 2
    tokens = RNG.integers(0, 7, size=(5, 6)).astype(np.int32)

    def ref(x):
        h, m = np_entropy(x), MASK != 0
        return -0.01 * h[m].sum() / m.sum()

    loss, metrics = x64(entropy_bonus, logits, tokens, MASK, entropy_coeff=0.01, chunk_size=chunk_size)
    np.testing.assert_allclose(loss, ref(logits), rtol=1e-12)
    np.testing.assert_allclose(metrics["entropy"], -ref(logits) / 0.01, rtol=1e-12)
    with jax.enable_x64(True):
        grad = np.asarray(jax.grad(lambda x: entropy_bonus(x, tokens, MASK, entropy_coeff=0.01,
                                                           chunk_size=chunk_size)[0])(jnp.asarray(logits)))
    fd = numeric_grad(ref, logits)
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-10)
    assert np.abs(grad[MASK == 0]).max() == 0  # padding gets no gradient


def test_entropy_bonus_aggregation_and_checks():
    logits = RNG.normal(size=(5, 6, 7))
    tokens = np.zeros((5, 6), np.int32)
    loss, _ = x64(entropy_bonus, logits, tokens, MASK, entropy_coeff=0.5, aggregation="seq-mean-token-mean",
                  normalizer=10.0)
    np.testing.assert_allclose(loss, -0.5 * x64(aggregate, np_entropy(logits), MASK, "seq-mean-token-mean",
                                                normalizer=10.0), rtol=1e-12)
    with pytest.raises(ValueError, match="entropy_coeff must be"):
        entropy_bonus(logits, tokens, MASK, entropy_coeff=-1.0)
    with pytest.raises(ValueError, match="mask has shape"):
        entropy_bonus(logits, tokens, MASK[:, :2], entropy_coeff=0.1)
