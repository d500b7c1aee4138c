"""Policy losses, KL penalty, GRPO advantages and the loss registry.

Every loss is checked three ways: a hand-computed case, its value and gradient against a float64 numpy reference
(gradients by central finite differences), and the invariants its paper states.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jodc.losses import (
    DEFAULT_DELTA,
    POLICY_LOSSES,
    cispo_loss,
    decoupled_ppo_loss,
    dg_loss,
    dppo_loss,
    get_policy_loss,
    grpo_advantages,
    gspo_loss,
    kl_estimate,
    kl_penalty,
    ppo_loss,
    sapo_loss,
    tis_loss,
    token_logprobs,
    topk_logprobs,
)

# ------------------------------------------------------------------------------------------------------------
# Hand-computed cases. Vocabulary of 4, the sampled token is id 0 and pi(token 0) is set directly through
# logits = log([p, (1 - p) / 3, (1 - p) / 3, (1 - p) / 3]).
# ------------------------------------------------------------------------------------------------------------


def logits_for(p_token):
    p = np.asarray(p_token, np.float64)[..., None]
    return np.log(np.concatenate([p, np.repeat((1 - p) / 3, 3, axis=-1)], axis=-1)).astype(np.float32)


def hand_case(pi, anchor, adv):
    pi = np.atleast_2d(pi)
    return (logits_for(pi), np.zeros(pi.shape, np.int32), np.log(np.atleast_2d(anchor)).astype(np.float32),
            np.atleast_2d(adv).astype(np.float32), np.ones(pi.shape, np.float32))


# pi, old, A: ratios 1.25 (clipped above), 0.5 with A < 0 (clipped below), 4 with A < 0 (dual-clipped at 3), 1.
PPO_CASE = hand_case([0.5, 0.1, 0.8, 0.25], [0.4, 0.2, 0.2, 0.25], [1, -1, -1, 2])


def test_ppo_hand_case():
    loss, metrics = ppo_loss(*PPO_CASE)
    np.testing.assert_allclose(loss, (-1.2 + 0.8 + 3.0 - 2.0) / 4, rtol=1e-6)
    np.testing.assert_allclose(metrics["clip_fraction"], 2 / 4)
    np.testing.assert_allclose(metrics["dual_clip_fraction"], 1 / 4)
    np.testing.assert_allclose(metrics["ratio_mean"], (1.25 + 0.5 + 4 + 1) / 4, rtol=1e-6)
    np.testing.assert_allclose(metrics["approx_kl"],
                               np.mean([r - 1 - np.log(r) for r in (1.25, 0.5, 4.0, 1.0)]), rtol=1e-5)
    loss, _ = ppo_loss(*PPO_CASE, dual_clip=None)
    np.testing.assert_allclose(loss, (-1.2 + 0.8 + 4.0 - 2.0) / 4, rtol=1e-6)
    # DAPO clip-higher: 1.25 < 1.28 is no longer clipped; DAPO has no dual clip
    loss, _ = get_policy_loss("dapo")(*PPO_CASE)
    np.testing.assert_allclose(loss, (-1.25 + 0.8 + 4.0 - 2.0) / 4, rtol=1e-6)


# mu, pi, A: masked (A > 0 moving up, D = 0.3); kept (A > 0, pi < mu: back toward mu); masked (A < 0 moving
# down); kept (A < 0, pi > mu); inside the region (D = 0.05); ratio 30 truncated to 20 (A < 0, moving back).
DPPO_MU = [0.3, 0.6, 0.6, 0.3, 0.5, 0.01]
DPPO_PI = [0.6, 0.3, 0.3, 0.6, 0.55, 0.3]
DPPO_ADV = [1, 1, -1, -1, 1, -1]
DPPO_TOKEN_LOSS = np.array([0.0, -0.5, 0.0, 2.0, -1.1, 20.0])


@pytest.mark.parametrize("divergence", ["tv", "kl"])
@pytest.mark.parametrize("approximation", ["binary", "topk"])
def test_dppo_hand_case(divergence, approximation):
    logits, tokens, mu, adv, mask = hand_case(DPPO_PI, DPPO_MU, DPPO_ADV)
    kwargs = {}
    if approximation == "topk":  # k = V - 1 = 3: mu's top-3 ids, its true log-probs
        ids, lps = topk_logprobs(logits_for([DPPO_MU]), tokens, 3)
        kwargs = dict(topk_ids=ids, topk_logprobs=lps)
    loss_fn = lambda x: dppo_loss(x, tokens, mu, adv, mask, divergence=divergence,  # noqa: E731
                                  approximation=approximation, **kwargs)
    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logits)
    np.testing.assert_allclose(loss, DPPO_TOKEN_LOSS.mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["masked_fraction"], 2 / 6)
    np.testing.assert_allclose(metrics["masked_high_fraction"], 1 / 6)
    np.testing.assert_allclose(metrics["masked_low_fraction"], 1 / 6)
    np.testing.assert_allclose(metrics["truncated_fraction"], 1 / 6)
    np.testing.assert_allclose(metrics["ratio_mean"], np.mean(np.divide(DPPO_PI, DPPO_MU)), rtol=1e-5)
    mu_np, pi_np = np.array(DPPO_MU), np.array(DPPO_PI)
    if divergence == "tv":  # with 3 equal "rest" tokens the exact TV equals the binary one
        expected_div = np.abs(mu_np - pi_np)
    else:
        expected_div = mu_np * np.log(mu_np / pi_np) + (1 - mu_np) * np.log((1 - mu_np) / (1 - pi_np))
    np.testing.assert_allclose(metrics["divergence_mean"], expected_div.mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["divergence_max"], expected_div.max(), rtol=1e-5)
    # d loss / d log pi(a_t) = -A M min(r, C) / N; d log pi(a_t) / d logits = onehot(a_t) - pi
    coef = DPPO_TOKEN_LOSS / 6
    pi_full = np.exp(logits[0].astype(np.float64))
    expected_grad = coef[:, None] * (np.eye(4)[0][None, :] - pi_full)
    np.testing.assert_allclose(grad[0], expected_grad, rtol=1e-5, atol=1e-7)


def test_dppo_default_deltas_are_the_published_ones():
    assert DEFAULT_DELTA == {"tv": 0.15, "kl": 0.05}
    # D = 0.1 TV: inside the 0.15 default, outside an explicit 0.05
    case = hand_case([0.6], [0.5], [1.0])
    assert float(dppo_loss(*case)[1]["masked_fraction"]) == 0.0
    assert float(dppo_loss(*case, delta_high=0.05)[1]["masked_fraction"]) == 1.0
    assert float(dppo_loss(*case, delta_low=0.05)[1]["masked_fraction"]) == 0.0  # A > 0 uses delta_high


def test_gspo_hand_case():
    # row 0: token ratios 2 and 0.5 -> s = 1, A = 1 -> -1; row 1: ratios 2 and 2 -> s = 2, A = 1 -> clipped 1.2
    case = hand_case([[0.5, 0.25], [0.4, 0.6]], [[0.25, 0.5], [0.2, 0.3]], [[1, 1], [1, 1]])
    loss, metrics = gspo_loss(*case, clip_low=0.2, clip_high=0.2)
    np.testing.assert_allclose(loss, (-1.0 - 1.2) / 2, rtol=1e-5)
    np.testing.assert_allclose(metrics["clip_fraction"], 0.5)
    np.testing.assert_allclose(metrics["ratio_mean"], (1 + 1 + 2 + 2) / 4, rtol=1e-5)


def test_sapo_hand_case():
    # r = 1 with A = 1: gate sigmoid(0) * 4 / 1 = 2; r = 2 with A = -1: tau_neg = 1.05
    case = hand_case([[0.5, 0.5]], [[0.5, 0.25]], [[1, -1]])
    loss, metrics = sapo_loss(*case)
    sig = 1 / (1 + np.exp(-1.05))
    np.testing.assert_allclose(loss, (-2.0 + sig * 4 / 1.05) / 2, rtol=1e-5)
    np.testing.assert_allclose(metrics["gate_weight_mean"], (1.0 + 4 * sig * (1 - sig)) / 2, rtol=1e-5)


def test_cispo_hand_case():
    # ratios 2 (A = 1), 8 (A = -1, weight truncated to 1 + 4 = 5), 0.1 (A = 1, no lower bound)
    case = hand_case([[0.4, 0.8, 0.05]], [[0.2, 0.1, 0.5]], [[1, -1, 1]])
    loss, metrics = cispo_loss(*case)
    np.testing.assert_allclose(loss, (-2.0 + 5.0 - 0.1) / 3, rtol=1e-5)
    np.testing.assert_allclose(metrics["clip_fraction"], 1 / 3)
    loss, _ = cispo_loss(*case, clip_low=0.2, clip_high=0.2)
    np.testing.assert_allclose(loss, (-1.2 + 1.2 - 0.8) / 3, rtol=1e-5)


def test_dg_hand_case():
    # pi = 0.5: surprisal ln 2, gate sigmoid(+-ln 2) = 2/3 (A = 1) or 1/3 (A = -1)
    logits, tokens, _, adv, mask = hand_case([[0.5, 0.5]], [[0.5, 0.5]], [[1, -1]])
    loss, metrics = dg_loss(logits, tokens, adv, mask)
    np.testing.assert_allclose(loss, ((2 / 3) * np.log(2) - (1 / 3) * np.log(2)) / 2, rtol=1e-5)
    np.testing.assert_allclose(metrics["gate_mean"], 0.5, rtol=1e-5)
    np.testing.assert_allclose(metrics["surprisal_mean"], np.log(2), rtol=1e-5)


def test_decoupled_ppo_hand_case():
    # token 0: r = 0.5 / 0.4 = 1.25 -> PPO -1.2, behaviour weight 0.4 / 0.2 = 2; token 1: on-policy, weight 1
    logits, tokens, prox, adv, mask = hand_case([[0.5, 0.3]], [[0.4, 0.3]], [[1, 1]])
    behaviour = np.log([[0.2, 0.3]]).astype(np.float32)
    loss, metrics = decoupled_ppo_loss(logits, tokens, prox, adv, mask, behaviour_logprobs=behaviour)
    np.testing.assert_allclose(loss, (-2.4 - 1.0) / 2, rtol=1e-5)
    np.testing.assert_allclose(metrics["behaviour_weight_mean"], 1.5, rtol=1e-5)
    loss, metrics = decoupled_ppo_loss(logits, tokens, prox, adv, mask, behaviour_logprobs=behaviour,
                                       behaviour_weight_cap=1.5)
    np.testing.assert_allclose(loss, (0.0 - 1.0) / 2, rtol=1e-5)  # token 0 dropped, still in the denominator
    np.testing.assert_allclose(metrics["behaviour_capped_fraction"], 0.5)


def test_tis_hand_case():
    # weights min(0.4 / 0.1, 2) = 2 and 1; PPO terms -1.2 and -1
    logits, tokens, old, adv, mask = hand_case([[0.5, 0.3]], [[0.4, 0.3]], [[1, 1]])
    rollout = np.log([[0.1, 0.3]]).astype(np.float32)
    loss, metrics = tis_loss(logits, tokens, old, adv, mask, rollout_logprobs=rollout)
    np.testing.assert_allclose(loss, (-2.4 - 1.0) / 2, rtol=1e-5)
    np.testing.assert_allclose(metrics["tis_truncated_fraction"], 0.5)
    np.testing.assert_allclose(metrics["tis_weight_mean"], 1.5, rtol=1e-5)


@pytest.mark.parametrize("estimator, expected", [
    ("k1", np.log(2)), ("k2", 0.5 * np.log(2) ** 2), ("k3", 0.5 + np.log(2) - 1),
])
def test_kl_hand_case(estimator, expected):
    logits, tokens, ref, _, mask = hand_case([[0.5]], [[0.25]], [[0.0]])
    loss, metrics = kl_penalty(logits, tokens, ref, mask, estimator=estimator)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    np.testing.assert_allclose(metrics["kl_mean"], expected, rtol=1e-5)
    np.testing.assert_allclose(kl_estimate(np.log([0.5]), np.log([0.25]), estimator), [expected], rtol=1e-5)


def test_grpo_advantages_hand_case_and_reference():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], np.float32)
    # group 1: mean 1/3, unbiased std sqrt(1/3); group 2: all equal -> 0
    np.testing.assert_allclose(grpo_advantages(rewards, 3),
                               [2 / 3 / np.sqrt(1 / 3), -1 / 3 / np.sqrt(1 / 3), -1 / 3 / np.sqrt(1 / 3), 0, 0, 0],
                               rtol=1e-5)
    np.testing.assert_allclose(grpo_advantages(rewards, 3, normalize_std=False),
                               [2 / 3, -1 / 3, -1 / 3, 0, 0, 0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grpo_advantages(rewards, 1), np.zeros(6))
    r = np.random.default_rng(0).standard_normal(24)
    groups = r.reshape(4, 6)
    expected = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, ddof=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(grpo_advantages(r.astype(np.float32), 6), expected.reshape(-1), rtol=1e-5)


# ------------------------------------------------------------------------------------------------------------
# float64 numpy references: value and gradient of every loss. Each reference takes the logits twice: `x` (what
# is differentiated) and `x0` (the point where every stop-gradient quantity is frozen). Finite differences in x
# at x = x0 therefore give exactly the gradient the loss is meant to have.
# ------------------------------------------------------------------------------------------------------------


def np_lp(x, tokens):
    x = np.asarray(x, np.float64)
    s = x - x.max(-1, keepdims=True)
    logp = s - np.log(np.exp(s).sum(-1, keepdims=True))
    return np.take_along_axis(logp, tokens[..., None], -1)[..., 0]


def np_token_mean(values, mask):
    return np.sum(values * mask) / np.sum(mask)


def np_seq_mean_token_mean(values, mask):
    rows = mask.sum(1) > 0
    return np.mean((values * mask).sum(1)[rows] / mask.sum(1)[rows])


def np_ppo_tokens(lp, anchor, adv, low, high, dual):
    r = np.exp(lp - anchor)
    loss = np.maximum(-adv * r, -adv * np.clip(r, 1 - low, 1 + high))
    return np.where((adv < 0) & (dual is not None), np.minimum(loss, -adv * (dual or 0)), loss)


def np_dppo(x, x0, f, divergence="tv", approximation="binary", delta=0.1, cap=20.0):
    lp, lp0 = np_lp(x, f["tokens"]), np_lp(x0, f["tokens"])
    mu, adv = f["anchor"], f["adv"]
    if approximation == "binary":
        m, p = np.exp(mu), np.exp(lp0)
        mb, pb = np.stack([m, 1 - m], -1), np.stack([p, 1 - p], -1)
    else:
        m = np.exp(f["topk_logprobs"])
        x0 = np.asarray(x0, np.float64)
        p_full = np.exp(x0 - x0.max(-1, keepdims=True))
        p_full /= p_full.sum(-1, keepdims=True)
        p = np.take_along_axis(p_full, f["topk_ids"], -1)
        mb = np.concatenate([m, 1 - m.sum(-1, keepdims=True)], -1)
        pb = np.concatenate([p, 1 - p.sum(-1, keepdims=True)], -1)
    if divergence == "tv":
        d = 0.5 * np.abs(mb - pb).sum(-1)
    else:
        d = np.sum(mb * np.log(mb / pb), -1)
    r0 = np.exp(lp0 - mu)
    masked = ((adv > 0) & (r0 > 1) & (d > delta)) | ((adv < 0) & (r0 < 1) & (d > delta))
    per_token = -adv * np.where(masked, 0.0, np.minimum(r0, cap) * np.exp(lp - lp0))
    return np_token_mean(per_token, f["mask"])


def np_gspo_token_form(x, x0, f, low=0.2, high=0.2):
    lp, lp0 = np_lp(x, f["tokens"]), np_lp(x0, f["tokens"])
    mask = f["mask"]
    seq_lr = ((lp0 - f["anchor"]) * mask).sum(1, keepdims=True) / mask.sum(1, keepdims=True)
    per_token = np_ppo_tokens(lp, lp0 - seq_lr, f["adv"], low, high, None)
    return np_seq_mean_token_mean(per_token, mask)


def np_cispo(x, x0, f):
    lp, lp0 = np_lp(x, f["tokens"]), np_lp(x0, f["tokens"])
    w = np.minimum(np.exp(lp0 - f["anchor"]), 5.0)
    return np_token_mean(-f["adv"] * w * np.exp(lp - lp0), f["mask"])


def np_dg(x, x0, f):
    lp, lp0 = np_lp(x, f["tokens"]), np_lp(x0, f["tokens"])
    gate = 1 / (1 + np.exp(-f["adv"] * -lp0))
    return np_token_mean(-gate * f["adv"] * lp, f["mask"])


def np_sapo(x, x0, f):
    r = np.exp(np_lp(x, f["tokens"]) - f["anchor"])
    tau = np.where(f["adv"] > 0, 1.0, 1.05)
    return np_seq_mean_token_mean(-f["adv"] * 4 / tau / (1 + np.exp(-tau * (r - 1))), f["mask"])


def np_decoupled(x, x0, f):
    w = np.exp(f["anchor"] - f["behaviour"])
    return np_token_mean(w * np_ppo_tokens(np_lp(x, f["tokens"]), f["anchor"], f["adv"], 0.2, 0.2, None),
                         f["mask"])


def np_tis(x, x0, f):
    w = np.minimum(np.exp(f["anchor"] - f["behaviour"]), 2.0)
    return np_token_mean(w * np_ppo_tokens(np_lp(x, f["tokens"]), f["anchor"], f["adv"], 0.2, 0.2, 3.0),
                         f["mask"])


def np_kl(x, x0, f, estimator):
    k1 = np_lp(x, f["tokens"]) - f["anchor"]
    per_token = {"k1": k1, "k2": 0.5 * k1 ** 2, "k3": np.exp(-k1) + k1 - 1}[estimator]
    return np_token_mean(per_token, f["mask"])


def fd_batch(seed=0, b=2, t=3, v=5):
    rng = np.random.default_rng(seed)
    x = 1.5 * rng.standard_normal((b, t, v))
    tokens = rng.integers(0, v, (b, t)).astype(np.int32)
    lp = np_lp(x, tokens)
    mask = np.ones((b, t))
    mask[1, 2] = 0.0
    ids, topk = topk_logprobs(jnp.asarray(x + 0.3 * rng.standard_normal(x.shape), jnp.float32), tokens, 3)
    return x, dict(
        tokens=tokens,
        anchor=lp + 0.4 * rng.standard_normal((b, t)),  # ratios spread over both sides of every clip
        behaviour=lp + 0.4 * rng.standard_normal((b, t)),
        adv=rng.choice([-1.0, 1.0], (b, t)) * rng.uniform(0.5, 1.5, (b, t)),
        mask=mask,
        topk_ids=np.asarray(ids),
        topk_logprobs=np.asarray(topk, np.float64),
    )


def _call(fn, **fixed):
    return lambda x, f: fn(x, f["tokens"], f["anchor"], f["adv"], f["mask"], **fixed)


FD_CASES = {
    "ppo": (_call(ppo_loss), lambda x, x0, f: np_token_mean(
        np_ppo_tokens(np_lp(x, f["tokens"]), f["anchor"], f["adv"], 0.2, 0.2, 3.0), f["mask"])),
    "ppo_seq_mean": (_call(ppo_loss, aggregation="seq-mean-token-mean", clip_high=0.28), lambda x, x0, f:
                     np_seq_mean_token_mean(np_ppo_tokens(np_lp(x, f["tokens"]), f["anchor"], f["adv"],
                                                          0.2, 0.28, 3.0), f["mask"])),
    "dppo_tv_binary": (_call(dppo_loss, delta_low=0.1, delta_high=0.1), np_dppo),
    "dppo_kl_binary": (_call(dppo_loss, divergence="kl", delta_low=0.1, delta_high=0.1),
                       lambda x, x0, f: np_dppo(x, x0, f, "kl")),
    "dppo_tv_topk": (lambda x, f: dppo_loss(x, f["tokens"], f["anchor"], f["adv"], f["mask"], approximation="topk",
                                            topk_ids=f["topk_ids"], topk_logprobs=f["topk_logprobs"],
                                            delta_low=0.1, delta_high=0.1),
                     lambda x, x0, f: np_dppo(x, x0, f, "tv", "topk")),
    "dppo_kl_topk_chunked": (lambda x, f: dppo_loss(x, f["tokens"], f["anchor"], f["adv"], f["mask"],
                                                    divergence="kl", approximation="topk", topk_ids=f["topk_ids"],
                                                    topk_logprobs=f["topk_logprobs"], delta_low=0.1,
                                                    delta_high=0.1, chunk_size=4),
                             lambda x, x0, f: np_dppo(x, x0, f, "kl", "topk")),
    "gspo": (_call(gspo_loss, clip_low=0.2, clip_high=0.2), np_gspo_token_form),
    "sapo": (_call(sapo_loss), np_sapo),
    "cispo": (_call(cispo_loss), np_cispo),
    "dg": (lambda x, f: dg_loss(x, f["tokens"], f["adv"], f["mask"]), np_dg),
    "decoupled_ppo": (lambda x, f: decoupled_ppo_loss(x, f["tokens"], f["anchor"], f["adv"], f["mask"],
                                                      behaviour_logprobs=f["behaviour"]), np_decoupled),
    "tis": (lambda x, f: tis_loss(x, f["tokens"], f["anchor"], f["adv"], f["mask"],
                                  rollout_logprobs=f["behaviour"]), np_tis),
    "kl_k1": (lambda x, f: kl_penalty(x, f["tokens"], f["anchor"], f["mask"], estimator="k1"),
              lambda x, x0, f: np_kl(x, x0, f, "k1")),
    "kl_k2": (lambda x, f: kl_penalty(x, f["tokens"], f["anchor"], f["mask"], estimator="k2"),
              lambda x, x0, f: np_kl(x, x0, f, "k2")),
    "kl_k3": (lambda x, f: kl_penalty(x, f["tokens"], f["anchor"], f["mask"], estimator="k3", chunk_size=2),
              lambda x, x0, f: np_kl(x, x0, f, "k3")),
}


def numeric_grad(f, x, eps=1e-6):
    """Central finite differences of a scalar numpy function, in float64."""
    x = np.array(x, np.float64)
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[idx] += eps
        minus[idx] -= eps
        grad[idx] = (f(plus) - f(minus)) / (2 * eps)
    return grad


def assert_matches_float64_reference(jax_fn, np_fn):
    """Loss value and gradient of `jax_fn(x, fields)` (x64) against `np_fn(x, x0, fields)` and its central finite
    differences, at the logits of `fd_batch()`."""
    x0, fields = fd_batch()
    with jax.enable_x64(True):
        (loss, metrics), grad = jax.jit(jax.value_and_grad(lambda x: jax_fn(x, fields), has_aux=True))(
            jnp.asarray(x0))
        assert loss.dtype == jnp.float64 and grad.dtype == jnp.float64
    np.testing.assert_allclose(loss, np_fn(x0, x0, fields), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grad, numeric_grad(lambda x: np_fn(x, x0, fields), x0), rtol=1e-6, atol=1e-9)
    assert all(np.shape(v) == () and np.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", list(FD_CASES))
def test_value_and_gradient_against_float64_reference(name):
    assert_matches_float64_reference(*FD_CASES[name])


def test_gspo_gradient_equals_sequence_level_objective():
    """GSPO-token with per-sequence advantages and seq-mean-token-mean has the gradient of sequence-level GSPO,
    where s_i = exp(mean_t log-ratio) itself is differentiated."""
    x0, f = fd_batch(1)
    f["adv"] = np.repeat(f["adv"][:, :1], f["adv"].shape[1], axis=1)
    f["anchor"] = np_lp(x0, f["tokens"]) + np.array([[0.05, -0.1, 0.02], [0.3, 0.2, 0.0]])  # s: ~1 and ~1.28

    def sequence_objective(x):
        lr = (np_lp(x, f["tokens"]) - f["anchor"]) * f["mask"]
        s = np.exp(lr.sum(1) / f["mask"].sum(1))
        adv = f["adv"][:, 0]
        return np.mean(np.maximum(-adv * s, -adv * np.clip(s, 0.8, 1.2)))

    with jax.enable_x64(True):
        grad = jax.jit(jax.grad(lambda x: gspo_loss(x, f["tokens"], f["anchor"], f["adv"], f["mask"],
                                                    clip_low=0.2, clip_high=0.2)[0]))(jnp.asarray(x0))
    np.testing.assert_allclose(grad, numeric_grad(sequence_objective, x0), rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------------------------------------------------
# DPPO invariants
# ------------------------------------------------------------------------------------------------------------


def _random_policy_batch(seed, b=3, t=6, v=16):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((b, t, v)).astype(np.float32)
    tokens = rng.integers(0, v, (b, t)).astype(np.int32)
    lp = np.asarray(token_logprobs(logits, tokens))
    mu = (lp + 0.5 * rng.standard_normal((b, t))).astype(np.float32)
    adv = rng.standard_normal((b, t)).astype(np.float32)
    mask = (rng.random((b, t)) < 0.85).astype(np.float32)
    return logits, tokens, mu, adv, mask


@pytest.mark.parametrize("divergence, approximation", [("tv", "binary"), ("kl", "topk")])
def test_dppo_inside_trust_region_is_importance_weighted_policy_gradient(divergence, approximation):
    logits, tokens, mu, adv, mask = _random_policy_batch(0)
    ids, lps = topk_logprobs(logits + 0.1, tokens, 4)

    def dppo(x):
        return dppo_loss(x, tokens, mu, adv, mask, divergence=divergence, approximation=approximation,
                         topk_ids=ids, topk_logprobs=lps, delta_low=1e3, delta_high=1e3, ratio_cap=None)[0]

    def importance_weighted_pg(x):
        ratio = jnp.exp(token_logprobs(x, tokens) - mu)
        return -jnp.sum(adv * ratio * mask) / jnp.sum(mask)

    both = jax.jit(lambda x: (jax.value_and_grad(dppo)(x), jax.value_and_grad(importance_weighted_pg)(x)))
    (loss, grad), (loss_pg, grad_pg) = both(logits)
    np.testing.assert_allclose(loss, loss_pg, rtol=1e-5)
    np.testing.assert_allclose(grad, grad_pg, rtol=1e-5, atol=1e-7)


_adv_values = st.one_of(st.floats(-3, -0.1), st.floats(0.1, 3))


@settings(max_examples=30, deadline=None)
@given(shift=hnp.arrays(np.float32, (8,), elements=st.floats(-2, 2, width=32)),
       adv=hnp.arrays(np.float32, (8,), elements=_adv_values),
       divergence=st.sampled_from(["tv", "kl"]))
@example(shift=np.array([0, -6.1035156e-05, 0, 0, 0, 0, 0, 0], np.float32), adv=np.ones(8, np.float32),
         divergence="kl")  # a shift too small for float32 KL: found by hypothesis on CI
def test_dppo_never_masks_a_move_toward_mu(shift, adv, divergence):
    """With delta = 0 every move away from mu is masked and every move toward it is kept."""
    logits = np.linspace(-2, 2, 8 * 6, dtype=np.float32).reshape(1, 8, 6)
    tokens = np.arange(8, dtype=np.int32)[None] % 6
    lp = np.asarray(token_logprobs(logits, tokens))[0]
    mu = np.minimum(lp + shift, -1e-3)[None].astype(np.float32)
    grad = _dppo_grad(logits, tokens, mu, adv[None], np.ones((1, 8), np.float32), divergence)
    kept = np.abs(grad[0]).sum(-1) > 0
    # a shift below float32 resolution of the divergence (e.g. 6e-5 in log space) rounds KL to 0: only moves
    # large enough to register count as "away" or "toward"
    gap = 1e-3
    pi_above_mu = lp > mu[0] + gap
    pi_below_mu = lp < mu[0] - gap
    toward_mu = ((adv > 0) & pi_below_mu) | ((adv < 0) & pi_above_mu)
    away_from_mu = ((adv > 0) & pi_above_mu) | ((adv < 0) & pi_below_mu)
    assert kept[toward_mu].all()
    assert not kept[away_from_mu].any()


@jax.jit
def _dppo_grad_tv(logits, tokens, mu, adv, mask):
    return jax.grad(lambda x: dppo_loss(x, tokens, mu, adv, mask, delta_low=0.0, delta_high=0.0)[0])(logits)


@jax.jit
def _dppo_grad_kl(logits, tokens, mu, adv, mask):
    return jax.grad(lambda x: dppo_loss(x, tokens, mu, adv, mask, divergence="kl", delta_low=0.0,
                                        delta_high=0.0)[0])(logits)


def _dppo_grad(logits, tokens, mu, adv, mask, divergence):
    return np.asarray({"tv": _dppo_grad_tv, "kl": _dppo_grad_kl}[divergence](logits, tokens, mu, adv, mask))


def test_dppo_delta_sides_are_independent():
    # A > 0 moving up by TV 0.3 and A < 0 moving down by TV 0.3
    case = hand_case([0.6, 0.3], [0.3, 0.6], [1, -1])
    m = dppo_loss(*case, delta_low=0.5, delta_high=0.1)[1]
    np.testing.assert_allclose([m["masked_high_fraction"], m["masked_low_fraction"]], [0.5, 0.0])
    m = dppo_loss(*case, delta_low=0.1, delta_high=0.5)[1]
    np.testing.assert_allclose([m["masked_high_fraction"], m["masked_low_fraction"]], [0.0, 0.5])


# ------------------------------------------------------------------------------------------------------------
# Every registered loss: uniform calling convention, bf16, chunking, jit and vmap
# ------------------------------------------------------------------------------------------------------------


def _registry_options(name, batch):
    """The per-token arrays the registered loss needs besides the uniform five (from its metadata)."""
    logits, tokens, mu, adv, mask = batch
    loss = get_policy_loss(name)
    options = {array: mu - 0.1 for array in loss.extras}  # decoupled_ppo's behaviour, tis's rollout log-probs
    if "topk_ids" in loss.required_arrays():
        ids, lps = topk_logprobs(logits + 0.2, tokens, 5)
        options.update(topk_ids=ids, topk_logprobs=lps)
    return options


def test_registry_lists_the_required_losses():
    assert {"dppo", "ppo", "gspo", "sapo", "cispo", "dg", "decoupled_ppo", "tis", "dapo", "grpo"} <= set(
        POLICY_LOSSES)
    assert get_policy_loss("ppo") is ppo_loss
    with pytest.raises(ValueError, match=r"unknown policy loss 'reinforce'.*'dppo'"):
        get_policy_loss("reinforce")


# Aliases that only pre-set options run the same code as their base loss (checked in the test below).
_DISTINCT_LOSSES = sorted(set(POLICY_LOSSES) - {"grpo", "dppo_tv"})


def test_registry_aliases_preset_options():
    batch = _random_policy_batch(4)
    assert get_policy_loss("grpo") is ppo_loss
    np.testing.assert_allclose(get_policy_loss("dppo_tv")(*batch, delta_low=0.01)[0],
                               dppo_loss(*batch, divergence="tv", delta_low=0.01)[0])
    np.testing.assert_allclose(get_policy_loss("dppo_kl")(*batch)[0], dppo_loss(*batch, divergence="kl")[0])
    np.testing.assert_allclose(get_policy_loss("dapo")(*batch, clip_high=0.5)[0],
                               ppo_loss(*batch, clip_high=0.5, dual_clip=None)[0])


@pytest.mark.parametrize("name", _DISTINCT_LOSSES)
def test_registered_losses_bf16_chunked_and_vmapped(name):
    batch = _random_policy_batch(1)
    logits, tokens, mu, adv, mask = batch
    fn = get_policy_loss(name)
    options = _registry_options(name, batch)
    anchor = None if name == "dg" else mu
    stacked = [np.stack([a, a[::-1]]) for a in (logits, tokens, mu, adv, mask)]
    stacked_options = {k: np.stack([np.asarray(v), np.asarray(v)[::-1]]) for k, v in options.items()}

    @jax.jit
    def run(x):
        def value_and_grad(y, **extra):
            return jax.value_and_grad(lambda z: fn(z, tokens, anchor, adv, mask, **options, **extra),
                                      has_aux=True)(y)

        x_bf16 = x.astype(jnp.bfloat16)
        vmapped = jax.vmap(lambda x, t, m, a, k, o: fn(x, t, None if name == "dg" else m, a, k, **o)[0])(
            *stacked, stacked_options)
        second = fn(*(s[1] for s in stacked[:2]), None if name == "dg" else stacked[2][1], stacked[3][1],
                    stacked[4][1], **{k: v[1] for k, v in stacked_options.items()})[0]
        return dict(
            fp32=value_and_grad(x),
            chunked=value_and_grad(x, chunk_size=5),
            bf16=value_and_grad(x_bf16),
            bf16_as_fp32=value_and_grad(x_bf16.astype(jnp.float32)),
            vmapped=vmapped,
            second=second,
        )

    out = run(logits)
    (loss32, metrics32), grad32 = out["fp32"]
    assert np.isfinite(loss32) and np.isfinite(grad32).all()
    assert all(np.shape(v) == () for v in metrics32.values()) and "entropy" in metrics32

    # chunked log-softmax: same loss and gradient
    (loss_c, _), grad_c = out["chunked"]
    np.testing.assert_allclose(loss_c, loss32, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad_c, grad32, rtol=1e-4, atol=1e-6)

    # bf16 logits are accepted, computed in fp32 (same loss as fp32 math on the rounded values), and the
    # gradient comes back in bf16
    (loss16, _), grad16 = out["bf16"]
    (loss_ref, _), grad_ref = out["bf16_as_fp32"]
    assert loss16.dtype == jnp.float32 and grad16.dtype == jnp.bfloat16
    np.testing.assert_allclose(loss16, loss_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad16.astype(jnp.float32), grad_ref, rtol=1e-2, atol=1e-3)

    # vmap over a leading microbatch axis equals a loop over microbatches
    np.testing.assert_allclose(out["vmapped"][0], loss32, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["vmapped"][1], out["second"], rtol=1e-5, atol=1e-6)


def test_padding_positions_may_hold_garbage():
    logits, tokens, mu, adv, mask = _random_policy_batch(2)
    mask[0, :3] = 0.0
    clean = dppo_loss(logits, tokens, mu, adv, mask)
    mu_bad, adv_bad, tokens_bad = mu.copy(), adv.copy(), tokens.copy()
    mu_bad[0, :3], adv_bad[0, :3], tokens_bad[0, :3] = -np.inf, np.nan, -100
    (loss, metrics), grad = jax.value_and_grad(
        lambda x: dppo_loss(x, tokens_bad, mu_bad, adv_bad, mask), has_aux=True)(logits)
    assert np.isfinite(grad).all()
    np.testing.assert_allclose(loss, clean[0], rtol=1e-6)
    np.testing.assert_allclose(metrics["ratio_mean"], clean[1]["ratio_mean"], rtol=1e-6)


# ------------------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------------------


def test_bad_input_raises_value_error_with_names_and_shapes():
    logits, tokens, mu, adv, mask = _random_policy_batch(3)
    with pytest.raises(ValueError, match=r"dppo_loss: tokens has shape \(3, 5\) but logits imply "
                                         r"\[B, T\] = \(3, 6\)"):
        dppo_loss(logits, tokens[:, :5], mu, adv, mask)
    with pytest.raises(ValueError, match=r"advantages has shape \(6,\)"):
        ppo_loss(logits, tokens, mu, adv[0], mask)
    with pytest.raises(ValueError, match=r"behaviour_logprobs has shape \(3, 5\)"):
        dppo_loss(logits, tokens, mu[:, :5], adv, mask)
    with pytest.raises(ValueError, match=r"approximation='topk' needs topk_ids and topk_logprobs.*"
                                         r"topk_ids=None"):
        dppo_loss(logits, tokens, mu, adv, mask, approximation="topk")
    ids, lps = topk_logprobs(logits, tokens, 4)
    with pytest.raises(ValueError, match=r"topk_ids has shape \(3, 6, 4\) but topk_logprobs has shape "
                                         r"\(3, 6, 3\)"):
        dppo_loss(logits, tokens, mu, adv, mask, approximation="topk", topk_ids=ids, topk_logprobs=lps[..., :3])
    with pytest.raises(ValueError, match=r"topk_logprobs has shape \(3, 4\)"):
        dppo_loss(logits, tokens, mu, adv, mask, approximation="topk", topk_ids=ids, topk_logprobs=lps[:, :4, 0])
    with pytest.raises(ValueError, match="unknown divergence 'js'"):
        dppo_loss(logits, tokens, mu, adv, mask, divergence="js")
    with pytest.raises(ValueError, match="unknown approximation 'full'"):
        dppo_loss(logits, tokens, mu, adv, mask, approximation="full")
    with pytest.raises(ValueError, match="unknown aggregation 'sum'"):
        ppo_loss(logits, tokens, mu, adv, mask, aggregation="sum")
    with pytest.raises(ValueError, match="delta_low must be a finite number >= 0, got -0.1"):
        dppo_loss(logits, tokens, mu, adv, mask, delta_low=-0.1)
    with pytest.raises(ValueError, match="delta_high"):
        dppo_loss(logits, tokens, mu, adv, mask, delta_high=-1.0)
    with pytest.raises(ValueError, match="clip_low must be < 1"):
        ppo_loss(logits, tokens, mu, adv, mask, clip_low=1.0)
    with pytest.raises(ValueError, match="dual_clip must be None or > 1"):
        ppo_loss(logits, tokens, mu, adv, mask, dual_clip=1.0)
    with pytest.raises(ValueError, match=r"segment_ids has shape \(3,\)"):
        gspo_loss(logits, tokens, mu, adv, mask, segment_ids=tokens[0, :3])
    with pytest.raises(ValueError, match="unknown estimator 'k4'"):
        kl_penalty(logits, tokens, mu, mask, estimator="k4")
    with pytest.raises(ValueError, match="eta"):
        dg_loss(logits, tokens, adv, mask, eta=0.0)
    with pytest.raises(ValueError, match="tau_neg"):
        sapo_loss(logits, tokens, mu, adv, mask, tau_neg=-1.0)
    with pytest.raises(ValueError, match=r"rewards has shape \(7,\), not a multiple of group_size=3"):
        grpo_advantages(np.zeros(7), 3)
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(np.zeros(6), 0)
