"""The rest of verl's loss family: GPG, Clip-Cov, KL-Cov, GMPO (geo_mean), DRO, sequence-level TIS, token-sum, the
KL `abs` and straight-through `k1+` / `k3+` / `abs+` estimators and verl's aliases, rollout correction (IS weights,
rejection) and the advantage estimators (RLOO, REINFORCE++, ReMax, pass@k, GPG), each against a float64 numpy
reference written from the papers' / verl's formulas (values, and gradients by central finite differences)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_losses import (
    assert_matches_float64_reference,
    fd_batch,
    np_lp,
    np_ppo_tokens,
    np_seq_mean_token_mean,
    np_token_mean,
    numeric_grad,
)

from jodc.losses import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    REJECTION_CRITERIA,
    clip_cov_loss,
    dro_loss,
    geo_mean_loss,
    get_advantage_estimator,
    get_policy_loss,
    gpg_advantages,
    gpg_loss,
    kl_cov_loss,
    kl_estimate,
    kl_penalty,
    loss_normalizer,
    passk_advantages,
    ppo_loss,
    reinforce_pp_advantages,
    remax_advantages,
    rloo_advantages,
    rollout_is_weights,
    rollout_rejection_mask,
    tis_loss,
    token_logprobs,
)

# ------------------------------------------------------------------------------------------------------------
# float64 references (x: the differentiated logits, x0: where stop-gradient quantities are frozen)
# ------------------------------------------------------------------------------------------------------------


def np_covariance(lp0, f):
    m = f["mask"] > 0
    return (f["adv"] - f["adv"][m].mean()) * (lp0 - lp0[m].mean())


def np_clip_cov(x, x0, f, cov_low, cov_high):
    """All candidates removed (the tests pick clip_cov_ratio = 1, so the random draw takes every candidate)."""
    lp, lp0 = np_lp(x, f["tokens"]), np_lp(x0, f["tokens"])
    adv, r0 = f["adv"], np.exp(lp0 - f["anchor"])
    clipped0 = -adv * np.clip(r0, 0.8, 1.2) > -adv * r0
    cov = np_covariance(lp0, f)
    removed = (f["mask"] > 0) & ~clipped0 & (cov > cov_low) & (cov < cov_high)
    per_token = np_ppo_tokens(lp, f["anchor"], adv, 0.2, 0.2, None)
    return np_token_mean(np.where(removed, 0.0, per_token), f["mask"])


def np_kl_cov(x, x0, f, ratio, coef):
    lp, lp0 = np_lp(x, f["tokens"]), np_lp(x0, f["tokens"])
    lr = lp - f["anchor"]
    per_token = -f["adv"] * np.exp(lr)
    valid = np.flatnonzero(f["mask"] > 0)
    k = max(1, int(np.floor(ratio * valid.size)))
    top = valid[np.argsort(-np_covariance(lp0, f).reshape(-1)[valid], kind="stable")[:k]]
    flat = per_token.reshape(-1).copy()
    flat[top] += coef * np.abs(lr.reshape(-1)[top])
    return np_token_mean(flat.reshape(per_token.shape), f["mask"])


def np_geo_mean(x, x0, f, low=0.4, high=0.4):
    """verl's compute_policy_loss_geo_mean (sequence-mean advantages, clipped log-ratios, geometric mean), with the
    exact 1 / |y_i| and a mean over the sequences that have tokens."""
    lr = np_lp(x, f["tokens"]) - f["anchor"]
    adv, mask = f["adv"], f["mask"]
    sign = np.sign(adv)
    term = sign * np.minimum(sign * lr, sign * np.clip(lr, -low, high))
    n = mask.sum(1)
    rows = n > 0
    ratio = np.exp((term * mask).sum(1)[rows] / n[rows])
    return np.mean(-(adv * mask).sum(1)[rows] / n[rows] * ratio)


def np_dro(x, x0, f, beta, aggregate=np_token_mean):
    """Tinker's / verl's DRO: -(A log pi - beta / 2 (log pi - log q)^2) per token."""
    lp = np_lp(x, f["tokens"])
    return aggregate(-f["adv"] * lp + 0.5 * beta * (lp - f["anchor"]) ** 2, f["mask"])


def np_tis_sequence(x, x0, f):
    w = np.minimum(np.exp(((f["anchor"] - f["behaviour"]) * f["mask"]).sum(1, keepdims=True)), 2.0)
    return np_token_mean(w * np_ppo_tokens(np_lp(x, f["tokens"]), f["anchor"], f["adv"], 0.2, 0.2, 3.0), f["mask"])


def _loss(fn, anchor=True, **fixed):
    if anchor:
        return lambda x, f: fn(x, f["tokens"], f["anchor"], f["adv"], f["mask"], **fixed)
    return lambda x, f: fn(x, f["tokens"], f["adv"], f["mask"], **fixed)


FAMILY_CASES = {
    "gpg": (_loss(gpg_loss, anchor=False), lambda x, x0, f: np_token_mean(-f["adv"] * np_lp(x, f["tokens"]),
                                                                          f["mask"])),
    "gpg_registry_seq_mean": (_loss(get_policy_loss("gpg"), aggregation="seq-mean-token-mean"),
                              lambda x, x0, f: np_seq_mean_token_mean(-f["adv"] * np_lp(x, f["tokens"]), f["mask"])),
    "clip_cov": (_loss(clip_cov_loss, clip_cov_ratio=1.0, cov_low=0.0, cov_high=5.0),
                 lambda x, x0, f: np_clip_cov(x, x0, f, 0.0, 5.0)),
    "kl_cov": (_loss(kl_cov_loss, kl_cov_ratio=0.3, kl_coef=0.7), lambda x, x0, f: np_kl_cov(x, x0, f, 0.3, 0.7)),
    "geo_mean": (_loss(geo_mean_loss), np_geo_mean),
    "geo_mean_narrow_chunked": (_loss(geo_mean_loss, clip_low=0.1, clip_high=0.2, chunk_size=4),
                                lambda x, x0, f: np_geo_mean(x, x0, f, 0.1, 0.2)),
    "tis_sequence": (lambda x, f: tis_loss(x, f["tokens"], f["anchor"], f["adv"], f["mask"],
                                           rollout_logprobs=f["behaviour"], level="sequence"), np_tis_sequence),
    "dro": (_loss(dro_loss, dro_beta=0.7), lambda x, x0, f: np_dro(x, x0, f, 0.7)),
    "dro_registry_default_seq_mean": (_loss(get_policy_loss("dro"), aggregation="seq-mean-token-mean"),
                                      lambda x, x0, f: np_dro(x, x0, f, 0.1, np_seq_mean_token_mean)),
    "ppo_token_sum": (_loss(ppo_loss, aggregation="token-sum", normalizer=123.0), lambda x, x0, f: np.sum(
        np_ppo_tokens(np_lp(x, f["tokens"]), f["anchor"], f["adv"], 0.2, 0.2, 3.0) * f["mask"])),
}


@pytest.mark.parametrize("name", list(FAMILY_CASES))
def test_value_and_gradient_against_float64_reference(name):
    assert_matches_float64_reference(*FAMILY_CASES[name])


def test_geo_mean_matches_verls_epsilon_form_closely():
    """verl divides by |y_i| + 1e-8 and averages over every row; with no empty row that is the same to ~1e-8."""
    x0, f = fd_batch(2)
    lr = np_lp(x0, f["tokens"]) - f["anchor"]
    sign = np.sign(f["adv"])
    term = sign * np.minimum(sign * lr, sign * np.clip(lr, -0.4, 0.4))
    n = f["mask"].sum(1)
    verl = np.mean(-(f["adv"] * f["mask"]).sum(1) / (n + 1e-8) * np.exp((term * f["mask"]).sum(1) / (n + 1e-8)))
    with jax.enable_x64(True):
        loss, metrics = geo_mean_loss(x0, f["tokens"], f["anchor"], f["adv"], f["mask"])
    np.testing.assert_allclose(loss, verl, rtol=1e-7)
    assert 0 < metrics["clip_high_fraction"] + metrics["clip_low_fraction"] < 1


def test_dro_is_reinforce_on_policy_and_penalises_zero_advantage_tokens_off_policy():
    """On policy the quadratic term's gradient beta (log pi - log q) d log pi vanishes: DRO's gradient is GPG's
    (REINFORCE), whatever beta. Off policy a token with A = 0 still carries the penalty (only the mask removes it)."""
    x0, f = _on_policy(9)
    args = (f["tokens"], f["anchor"], f["adv"], f["mask"])
    with jax.enable_x64(True):
        x = jnp.asarray(x0)
        reinforce = jax.grad(lambda x: gpg_loss(x, f["tokens"], f["adv"], f["mask"])[0])(x)
        for beta in (0.1, 5.0):
            np.testing.assert_allclose(jax.grad(lambda x: dro_loss(x, *args, dro_beta=beta)[0])(x), reinforce,
                                       rtol=1e-12, atol=1e-15)
        x1, g = fd_batch(9)
        zero_adv = np.zeros_like(g["adv"])
        loss, metrics = dro_loss(jnp.asarray(x1), g["tokens"], g["anchor"], zero_adv, g["mask"], dro_beta=2.0)
    half_square = 0.5 * (np_lp(x1, g["tokens"]) - g["anchor"]) ** 2
    np.testing.assert_allclose(loss, 2.0 * np_token_mean(half_square, g["mask"]), rtol=1e-12)
    np.testing.assert_allclose(metrics["quadratic_penalty"], np_token_mean(half_square, g["mask"]), rtol=1e-12)
    assert get_policy_loss("dro").anchor == "old_logprobs" and get_policy_loss("dro").needs_trainer_logprobs
    with pytest.raises(ValueError, match="dro_beta must be a finite number >= 0"):
        dro_loss(x0, *args, dro_beta=-0.1)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        dro_loss(x0, *args, beta=0.1)


def test_clip_cov_removes_a_random_subset_of_the_candidates():
    x0, f = fd_batch(3, b=4, t=8, v=6)
    lp0 = np_lp(x0, f["tokens"])
    args = (x0.astype(np.float32), f["tokens"], f["anchor"], f["adv"], f["mask"])
    r0 = np.exp(lp0 - f["anchor"])
    candidates = ((f["mask"] > 0) & ~(-f["adv"] * np.clip(r0, 0.8, 1.2) > -f["adv"] * r0)
                  & (np_covariance(lp0, f) > -1.0) & (np_covariance(lp0, f) < 5.0))
    assert candidates.sum() > 4
    ratio = 2.5 / f["mask"].sum()  # floor(ratio * N) = 2 tokens
    draws = set()
    for seed in range(6):
        loss, m = clip_cov_loss(*args, clip_cov_ratio=ratio, cov_low=-1.0, key=jax.random.PRNGKey(seed),
                                aggregation="token-sum")
        assert round(float(m["cov_clip_fraction"]) * f["mask"].sum()) == 2
        draws.add(round(float(loss), 5))  # the loss tells which two tokens were removed
    assert len(draws) > 1  # different keys draw different subsets
    # a tiny ratio still removes one token (max(1, floor(ratio * N))), none when there is no candidate
    assert clip_cov_loss(*args, clip_cov_ratio=1e-9, cov_low=-1.0)[1]["cov_clip_fraction"] > 0
    assert clip_cov_loss(*args, cov_low=1e6, cov_high=2e6)[1]["cov_clip_fraction"] == 0


@pytest.mark.parametrize("estimator, value", [
    ("abs", "k1_abs"), ("k1+", "k1"), ("k3+", "k3"), ("k2+", "k2"), ("abs+", "k1_abs"),
    # verl's aliases, plain and straight-through
    ("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3"), ("kl+", "k1"), ("mse+", "k2"), ("low_var_kl+", "k3")])
def test_kl_abs_and_straight_through_estimators(estimator, value):
    x0, f = fd_batch(4)

    def np_value(x):
        k1 = np_lp(x, f["tokens"]) - f["anchor"]
        per_token = {"k1": k1, "k1_abs": np.abs(k1), "k2": 0.5 * k1 ** 2, "k3": np.exp(-k1) + k1 - 1}[value]
        return np_token_mean(per_token, f["mask"])

    gradient_of = np_value if not estimator.endswith("+") else lambda x: np_token_mean(
        0.5 * (np_lp(x, f["tokens"]) - f["anchor"]) ** 2, f["mask"])
    with jax.enable_x64(True):
        loss, grad = jax.value_and_grad(lambda x: kl_penalty(x, f["tokens"], f["anchor"], f["mask"],
                                                             estimator=estimator)[0])(jnp.asarray(x0))
    np.testing.assert_allclose(loss, np_value(x0), rtol=1e-12)
    np.testing.assert_allclose(grad, numeric_grad(gradient_of, x0), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(kl_estimate(np.log([0.5]), np.log([0.25]), "k3+"), [0.5 + np.log(2) - 1], rtol=1e-6)


def test_kl_names_cover_verls_and_unknown_ones_are_refused():
    """Every name verl's kl_penalty accepts (k1/kl, k2/mse, k3/low_var_kl, abs, each with a '+'), none else."""
    verl = {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"}
    assert set(KL_ESTIMATORS) == verl | {name + "+" for name in verl}
    lp, ref = np.log([0.5, 0.2]), np.log([0.25, 0.4])
    for alias, name in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
        for suffix in ("", "+"):
            np.testing.assert_array_equal(kl_estimate(lp, ref, alias + suffix), kl_estimate(lp, ref, name + suffix))
    with pytest.raises(ValueError, match="unknown estimator 'full'"):
        kl_estimate(lp, ref, "full")  # verl's 'full' (every vocabulary entry) is not implemented in verl either
    with pytest.raises(ValueError, match=r"unknown estimator 'k3\+\+'"):
        kl_penalty(np.zeros((1, 2, 3)), np.zeros((1, 2), np.int32), np.zeros((1, 2)), np.ones((1, 2)),
                   estimator="k3++")


def test_abs_plus_has_no_gradient_exactly_on_policy():
    """abs+ takes k2's gradient, (log pi - log ref) d log pi: 0 on policy, as |k1|'s zero subgradient."""
    x0, f = _on_policy(8)
    with jax.enable_x64(True):
        loss, grad = jax.value_and_grad(lambda x: kl_penalty(x, f["tokens"], f["anchor"], f["mask"],
                                                             estimator="abs+")[0])(jnp.asarray(x0))
    assert float(loss) == 0.0
    np.testing.assert_array_equal(grad, 0.0)


def test_token_sum_ignores_the_normalizer_and_sums_over_microbatches():
    x0, f = fd_batch(5, b=4)
    assert float(loss_normalizer(f["mask"], "token-sum")) == 1.0
    whole = ppo_loss(x0, f["tokens"], f["anchor"], f["adv"], f["mask"], aggregation="token-sum")[0]
    parts = sum(ppo_loss(x0[s], f["tokens"][s], f["anchor"][s], f["adv"][s], f["mask"][s], aggregation="token-sum",
                         normalizer=7.0)[0] for s in (slice(0, 1), slice(1, 4)))
    np.testing.assert_allclose(parts, whole, rtol=1e-6)


# ------------------------------------------------------------------------------------------------------------
# Rollout correction
# ------------------------------------------------------------------------------------------------------------


def _mismatch(seed=0, b=4, t=7):
    rng = np.random.default_rng(seed)
    lp = -rng.uniform(0.05, 3.0, (b, t))
    mu = lp + 0.5 * rng.standard_normal((b, t))
    mask = (rng.random((b, t)) < 0.8).astype(np.float64)
    mask[0, 0] = 1.0
    return lp, mu, mask


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("lower", [None, 0.5])
def test_rollout_is_weights_against_reference(level, lower):
    lp, mu, mask = _mismatch()
    lr = (lp - mu) * mask
    raw = np.exp(lr.sum(1, keepdims=True) if level == "sequence" else lr) * mask
    expected = np.minimum(raw, 1.5) if lower is None else np.where((raw >= lower) & (raw <= 1.5), raw, 0.0)
    with jax.enable_x64(True):
        weights, metrics = rollout_is_weights(lp, mu, mask, level=level, upper=1.5, lower=lower)
    np.testing.assert_allclose(weights, expected * mask, rtol=1e-13)
    np.testing.assert_allclose(metrics["is_weight_mean"], np.sum(expected * mask) / mask.sum(), rtol=1e-12)
    assert 0 < metrics["is_truncated_fraction"] < 1


def test_rollout_is_weights_follow_packed_segments():
    lp, mu, mask = _mismatch(1, b=2, t=6)
    segments = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]], np.int32)
    packed, _ = rollout_is_weights(lp, mu, mask, level="sequence", upper=100.0, segment_ids=segments)
    valid = (mask > 0) & (segments > 0)
    for row, cols in ((0, slice(0, 3)), (0, slice(3, 5)), (1, slice(0, 6))):
        w = np.exp(np.sum(((lp - mu) * valid)[row, cols]))
        np.testing.assert_allclose(np.asarray(packed)[row, cols][valid[row, cols]], w, rtol=1e-5)


def np_rejection_statistic(lp, mu, mask, criterion):
    lr = np.clip(lp - mu, -20, 20)
    stat = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": np.exp(lr) - 1 - lr}[criterion[-2:]] * mask
    if criterion.startswith("token"):
        return stat
    reduce = criterion.split("_")[1]
    if reduce == "max":
        seq = np.where(mask > 0, stat, -np.inf).max(1, keepdims=True)
    else:
        seq = stat.sum(1, keepdims=True) / (mask.sum(1, keepdims=True) if reduce == "mean" else 1)
    return np.broadcast_to(seq, stat.shape)


@pytest.mark.parametrize("criterion", REJECTION_CRITERIA)
def test_rollout_rejection_mask_against_reference(criterion):
    lp, mu, mask = _mismatch(2)
    stat = np_rejection_statistic(lp, mu, mask, criterion)
    middle = np.median(np.abs(stat[mask > 0]))  # a threshold that keeps some tokens and rejects others
    upper = np.exp(middle) if criterion.endswith("k1") else middle
    if criterion.endswith("k1"):
        keep = (stat >= -np.log(upper)) & (stat <= np.log(upper))
    else:
        keep = stat <= upper
    with jax.enable_x64(True):
        kept, metrics = rollout_rejection_mask(lp, mu, mask, criterion=criterion, upper=float(upper))
    np.testing.assert_array_equal(kept, mask * keep)
    assert 0 < metrics["rejected_fraction"] < 1, criterion
    np.testing.assert_allclose(metrics["statistic_mean"], np.sum(stat * mask) / mask.sum(), rtol=1e-12)


def test_rollout_correction_bad_input():
    lp, mu, mask = _mismatch()
    with pytest.raises(ValueError, match="unknown level 'batch'"):
        rollout_is_weights(lp, mu, mask, level="batch")
    with pytest.raises(ValueError, match="lower must be <= upper"):
        rollout_is_weights(lp, mu, mask, upper=1.0, lower=2.0)
    with pytest.raises(ValueError, match=r"rollout_logprobs has shape \(4, 6\)"):
        rollout_is_weights(lp, mu[:, :6], mask)
    with pytest.raises(ValueError, match="unknown criterion 'seq_max_k1'"):
        rollout_rejection_mask(lp, mu, mask, criterion="seq_max_k1", upper=1.0)
    with pytest.raises(ValueError, match="lower applies to the k1 criteria only"):
        rollout_rejection_mask(lp, mu, mask, criterion="token_k3", upper=1.0, lower=0.5)
    with pytest.raises(ValueError, match="upper must be a finite number > 0"):
        rollout_rejection_mask(lp, mu, mask, criterion="token_k2", upper=0.0)


# ------------------------------------------------------------------------------------------------------------
# Advantage estimators
# ------------------------------------------------------------------------------------------------------------

REWARDS = np.array([1.0, 0.0, 0.0, 0.5, 2.0, 2.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0])
K = 4


def np_masked_whiten(values, mask):
    """verl's masked_whiten: mean and unbiased variance over the valid tokens, then (v - mean) / sqrt(var + 1e-8)."""
    mean = np.sum(values * mask) / mask.sum()
    var = np.sum((values - mean) ** 2 * mask) / mask.sum() * mask.sum() / (mask.sum() - 1)
    return (values - mean) / np.sqrt(var + 1e-8)


def test_rloo_remax_gpg_and_passk_against_reference():
    groups = REWARDS.reshape(-1, K)
    loo = groups - (groups.sum(1, keepdims=True) - groups) / (K - 1)
    np.testing.assert_allclose(rloo_advantages(REWARDS, K), loo.reshape(-1), rtol=1e-6, atol=1e-7)
    greedy = np.array([0.5, 2.0, 0.0])
    np.testing.assert_allclose(remax_advantages(REWARDS, K, greedy_rewards=greedy),
                               (groups - greedy[:, None]).reshape(-1), rtol=1e-6)
    alpha = REWARDS.size / np.count_nonzero(REWARDS)
    np.testing.assert_allclose(gpg_advantages(REWARDS, K, f_norm=2.0),
                               (alpha * (groups - groups.mean(1, keepdims=True)) / 2.0).reshape(-1), rtol=1e-6,
                               atol=1e-7)
    expected = np.zeros_like(groups)
    for g, row in enumerate(groups):
        top = np.sort(row)[::-1]
        expected[g, np.argmax(row)] = (top[0] - top[1]) / (row.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(passk_advantages(REWARDS, K), expected.reshape(-1), rtol=1e-6)
    assert np.count_nonzero(np.asarray(passk_advantages(REWARDS, K, normalize_std=False))) == 1  # [2, 2, 1, -1]: tie


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_whitens_over_tokens_like_verl(baseline):
    lengths = np.array([3, 5, 1, 4, 2, 6, 6, 1, 2, 3, 0, 5])
    mask = (np.arange(6)[None, :] < lengths[:, None]).astype(np.float64)
    scores = REWARDS.reshape(-1, K)
    if baseline:
        scores = scores - scores.mean(1, keepdims=True)
    token_adv = np_masked_whiten(np.repeat(scores.reshape(-1, 1), 6, 1), mask) * mask
    with jax.enable_x64(True):
        adv = reinforce_pp_advantages(REWARDS, K, lengths=lengths, baseline=baseline)
    np.testing.assert_allclose(np.asarray(adv)[:, None] * mask, token_adv, rtol=1e-12, atol=1e-14)


def test_singleton_groups_get_no_advantage():
    r = np.array([1.0, 0.0, 3.0])
    for fn in (rloo_advantages, gpg_advantages):
        np.testing.assert_array_equal(fn(r, 1), 0.0)
    np.testing.assert_array_equal(reinforce_pp_advantages(r, 1, lengths=np.array([2, 2, 2])), 0.0)
    with pytest.raises(ValueError, match="group_size must be an int >= 2"):
        passk_advantages(r, 1)


def test_estimator_registry():
    assert {"grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax",
            "grpo_passk", "gpg"} <= set(ADVANTAGE_ESTIMATORS)
    assert get_advantage_estimator("remax").inputs == ("greedy_rewards",)
    assert get_advantage_estimator("reinforce_plus_plus").inputs == ("lengths",)
    np.testing.assert_allclose(get_advantage_estimator("dr_grpo")(REWARDS, K),
                               (REWARDS.reshape(-1, K) - REWARDS.reshape(-1, K).mean(1, keepdims=True)).reshape(-1),
                               rtol=1e-6, atol=1e-7)
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) \['normalize_std'\]"):
        get_advantage_estimator("rloo")(REWARDS, K, normalize_std=False)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        get_advantage_estimator("ppo")


# ------------------------------------------------------------------------------------------------------------
# |log r| penalties exactly on policy (issue 32, defect 1): jnp.abs has gradient 1 at 0, torch's abs 0
# ------------------------------------------------------------------------------------------------------------


def _on_policy(seed=7):
    """A batch whose anchor is the policy's own log-probs, bit for bit (the same computation, under x64)."""
    x0, f = fd_batch(seed)
    with jax.enable_x64(True):
        f["anchor"] = np.asarray(token_logprobs(jnp.asarray(x0), jnp.asarray(f["tokens"])))
    return x0, f


def test_kl_abs_penalty_has_no_gradient_exactly_on_policy():
    x0, f = _on_policy()
    with jax.enable_x64(True):
        loss, grad = jax.value_and_grad(lambda x: kl_penalty(x, f["tokens"], f["anchor"], f["mask"],
                                                             estimator="abs")[0])(jnp.asarray(x0))
    assert float(loss) == 0.0
    np.testing.assert_array_equal(grad, 0.0)  # jnp.abs: every valid token's d log pi
    # away from the anchor it is |k1|'s gradient, sign(k1) d log pi (checked against a float64 reference above)


def test_kl_cov_penalty_adds_no_gradient_exactly_on_policy():
    """On policy the penalty |log r| is 0 and so is its gradient: KL-Cov's gradient is the surrogate's alone, the same
    whatever kl_coef (with jnp.abs the penalised token got an extra kl_coef * d log pi)."""
    x0, f = _on_policy()
    with jax.enable_x64(True):
        grads = {coef: jax.grad(lambda x: kl_cov_loss(x, f["tokens"], f["anchor"], f["adv"], f["mask"],
                                                      kl_cov_ratio=0.3, kl_coef=coef)[0])(jnp.asarray(x0))
                 for coef in (0.1, 1.0, 5.0)}
        _, metrics = kl_cov_loss(jnp.asarray(x0), f["tokens"], f["anchor"], f["adv"], f["mask"], kl_cov_ratio=0.3)
    assert float(metrics["kl_cov_fraction"]) > 0 and float(metrics["abs_kl"]) == 0.0
    np.testing.assert_array_equal(grads[0.1], grads[1.0])
    np.testing.assert_array_equal(grads[0.1], grads[5.0])
    # = the float64 reference's central differences (which see |lr|'s zero slope at 0)
    np.testing.assert_allclose(grads[1.0], numeric_grad(lambda x: np_kl_cov(x, x0, f, 0.3, 1.0), x0),
                               rtol=1e-6, atol=1e-9)


def test_kl_cov_default_coefficient_is_verls():
    """verl's effective default (PolicyLossConfig.ppo_kl_coef) is 0.1."""
    x0, f = fd_batch(3)
    args = (x0, f["tokens"], f["anchor"], f["adv"], f["mask"])
    with jax.enable_x64(True):
        np.testing.assert_allclose(kl_cov_loss(*args, kl_cov_ratio=0.3)[0],
                                   np_kl_cov(x0, x0, f, 0.3, 0.1), rtol=1e-12)


# ------------------------------------------------------------------------------------------------------------
# several rejection criteria in one call (issue 32, defect 3)
# ------------------------------------------------------------------------------------------------------------


def test_several_rejection_criteria_are_each_taken_on_the_original_mask_and_anded():
    lp, mu, mask = _mismatch(5, b=6, t=9)
    specs = [("token_k2", 0.08, None), ("seq_mean_k3", 0.1, None), ("seq_sum_k1", 3.0, 0.5)]
    with jax.enable_x64(True):
        alone = [rollout_rejection_mask(lp, mu, mask, criterion=c, upper=u, lower=lo) for c, u, lo in specs]
        kept, metrics = rollout_rejection_mask(lp, mu, mask, criterion=[c for c, _, _ in specs],
                                               upper=[u for _, u, _ in specs], lower=[lo for _, _, lo in specs])
        chained = mask
        for c, u, lo in specs:
            chained = rollout_rejection_mask(lp, mu, chained, criterion=c, upper=u, lower=lo)[0]
    expected = mask * np.prod([np.asarray(k) > 0 for k, _ in alone], axis=0)
    np.testing.assert_array_equal(kept, expected)
    assert not np.array_equal(np.asarray(chained), expected), "the test must tell ANDing from chaining apart"
    valid = mask > 0
    np.testing.assert_allclose(metrics["rejected_fraction"], np.mean(expected[valid] == 0), rtol=1e-12)
    for (c, _, _), (_, m) in zip(specs, alone):
        np.testing.assert_allclose(metrics[f"{c}/rejected_fraction"], m["rejected_fraction"], rtol=1e-12)
        np.testing.assert_allclose(metrics[f"{c}/statistic_mean"], m["statistic_mean"], rtol=1e-12)
        assert 0 < float(m["rejected_fraction"]) < 1, c
    # upper as one number for several criteria, wrong lengths, repeated names: clear errors before any work
    with pytest.raises(ValueError, match=r"upper must be a sequence of 2 values \(one per criterion\)"):
        rollout_rejection_mask(lp, mu, mask, criterion=["token_k2", "token_k3"], upper=1.0)
    with pytest.raises(ValueError, match=r"lower must be a sequence of 2 values"):
        rollout_rejection_mask(lp, mu, mask, criterion=["token_k1", "token_k3"], upper=[2.0, 1.0], lower=[0.5])
    with pytest.raises(ValueError, match="distinct names"):
        rollout_rejection_mask(lp, mu, mask, criterion=["token_k2", "token_k2"], upper=[1.0, 2.0])
    with pytest.raises(ValueError, match="lower applies to the k1 criteria only"):
        rollout_rejection_mask(lp, mu, mask, criterion=["token_k1", "token_k3"], upper=[2.0, 1.0], lower=[0.5, 0.5])
    with pytest.raises(ValueError, match="upper must be a number for one criterion"):
        rollout_rejection_mask(lp, mu, mask, criterion="token_k2", upper=[1.0])
