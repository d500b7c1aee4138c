"""IS-weight batch normalisation (verl's `rollout_is_batch_normalize`) and DeepSeek-V3.2's off-policy sequence mask
(OPSM, TRL's `off_policy_mask_threshold`), against float64 numpy references written from verl's
`compute_rollout_correction_weights` and TRL's `get_off_policy_mask`; the batch-wide mean from per-microbatch
totals; neither carries a gradient, and a PPO loss using both matches its float64 reference in value and gradient
(central finite differences)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_losses import fd_batch, np_lp, np_ppo_tokens, np_token_mean, numeric_grad
from test_losses_family import _mismatch

from jodc.losses import (
    is_weight_totals,
    normalize_is_weights,
    off_policy_sequence_mask,
    ppo_loss,
    rollout_is_weights,
    token_logprobs,
)

# ------------------------------------------------------------------------------------------------------------
# IS-weight batch normalisation
# ------------------------------------------------------------------------------------------------------------


def np_is_weights(lp, mu, mask, level, upper):
    lr = (lp - mu) * mask
    raw = np.exp(lr.sum(1, keepdims=True) if level == "sequence" else lr) * mask
    return np.minimum(raw, upper) * mask


def np_batch_normalize(w, mask, level):
    """verl: token level, mean over valid tokens; sequence level, mean over sequences of each one's mean weight."""
    if level == "token":
        mean = np.sum(w * mask) / mask.sum()
    else:
        rows = mask.sum(1) > 0
        mean = np.mean((w * mask).sum(1)[rows] / mask.sum(1)[rows])
    return (w / mean if mean > 1e-8 else w), mean


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalised_weights_against_reference(level):
    lp, mu, mask = _mismatch(3, b=5, t=7)
    mask[4] = 0.0  # an empty row is not a sequence
    raw = np_is_weights(lp, mu, mask, level, 1.5)
    want, factor = np_batch_normalize(raw, mask, level)
    with jax.enable_x64(True):
        weights, metrics = rollout_is_weights(lp, mu, mask, level=level, upper=1.5, batch_normalize=True)
        plain, _ = rollout_is_weights(lp, mu, mask, level=level, upper=1.5)
        again, again_factor = normalize_is_weights(plain, mask, level=level)
    np.testing.assert_allclose(weights, want, rtol=1e-13)
    np.testing.assert_allclose(again, want, rtol=1e-13)
    np.testing.assert_allclose(metrics["is_batch_norm_factor"], factor, rtol=1e-13)
    np.testing.assert_allclose(again_factor, factor, rtol=1e-13)
    assert abs(factor - 1.0) > 0.05  # the test data needs rescaling
    if level == "token":
        np.testing.assert_allclose(np.sum(np.asarray(weights) * mask) / mask.sum(), 1.0, rtol=1e-13)
    else:
        rows = mask.sum(1) > 0
        np.testing.assert_allclose(np.mean(np.asarray(weights)[rows].max(1)), 1.0, rtol=1e-13)  # one weight a row
    np.testing.assert_allclose(metrics["is_weight_mean"], np.sum(want * mask) / mask.sum(), rtol=1e-13)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_mean_from_the_totals_of_microbatches(level):
    """Split over microbatches (devices), each normalises with the summed totals: the weights equal the whole
    batch's; normalising each microbatch by its own mean does not."""
    lp, mu, mask = _mismatch(4, b=6, t=5)
    with jax.enable_x64(True):
        whole, _ = rollout_is_weights(lp, mu, mask, level=level, upper=3.0, batch_normalize=True)
        parts = [slice(0, 2), slice(2, 6)]
        raw = [rollout_is_weights(lp[s], mu[s], mask[s], level=level, upper=3.0)[0] for s in parts]
        sums = [is_weight_totals(w, mask[s], level=level) for w, s in zip(raw, parts)]
        totals = (sum(t[0] for t in sums), sum(t[1] for t in sums))
        split = np.concatenate([normalize_is_weights(w, mask[s], level=level, totals=totals)[0]
                                for w, s in zip(raw, parts)])
        local = np.concatenate([normalize_is_weights(w, mask[s], level=level)[0] for w, s in zip(raw, parts)])
    np.testing.assert_allclose(split, whole, rtol=1e-13)
    assert not np.allclose(local, whole)
    assert float(totals[1]) == (mask.sum() if level == "token" else np.sum(mask.sum(1) > 0))


def test_batch_normalisation_with_packed_sequences():
    lp, mu, mask = _mismatch(5, b=2, t=6)
    mask[:] = 1.0
    segments = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]], np.int32)
    with jax.enable_x64(True):
        w, _ = rollout_is_weights(lp, mu, mask, level="sequence", upper=100.0, segment_ids=segments)
        s, n = is_weight_totals(w, mask, level="sequence", segment_ids=segments)
        normed, factor = normalize_is_weights(w, mask, level="sequence", segment_ids=segments)
    seq_w = [np.asarray(w)[0, 0], np.asarray(w)[0, 3], np.asarray(w)[1, 0]]  # three sequences
    assert float(n) == 3.0
    np.testing.assert_allclose(s, sum(seq_w), rtol=1e-13)
    np.testing.assert_allclose(factor, np.mean(seq_w), rtol=1e-13)
    np.testing.assert_allclose(np.asarray(normed)[0, 5], 0.0)  # padding stays 0


def test_batch_normalisation_leaves_all_zero_weights_alone_and_has_no_gradient():
    """IcePop can zero every weight: a mean <= 1e-8 leaves the weights as they are (factor 1), as verl."""
    lp, mu, mask = _mismatch(6)
    w, metrics = rollout_is_weights(lp, mu, mask, upper=1e-3, lower=1e-4, batch_normalize=True)
    assert float(metrics["is_batch_norm_factor"]) == 1.0 and np.all(np.asarray(w) == 0.0)
    grad = jax.grad(lambda lp: jnp.sum(normalize_is_weights(
        rollout_is_weights(lp, mu, mask, upper=5.0)[0], mask)[0]))(jnp.asarray(lp, jnp.float32))
    np.testing.assert_array_equal(grad, 0.0)


def test_batch_normalisation_bad_input():
    lp, mu, mask = _mismatch()
    w, _ = rollout_is_weights(lp, mu, mask)
    with pytest.raises(ValueError, match=r"totals must be a pair of scalars \(weight sum, count\)"):
        normalize_is_weights(w, mask, totals=3.0)
    with pytest.raises(ValueError, match=r"totals must be a pair of scalars"):
        normalize_is_weights(w, mask, totals=(np.ones(2), 2.0))
    with pytest.raises(ValueError, match="unknown level 'batch'"):
        normalize_is_weights(w, mask, level="batch")
    with pytest.raises(ValueError, match=r"weights must have shape \[B, T\]"):
        is_weight_totals(np.asarray(w)[None], mask)
    with pytest.raises(ValueError, match=r"is_weight_totals: mask has shape \(4, 6\)"):
        is_weight_totals(w, mask[:, :6])


# ------------------------------------------------------------------------------------------------------------
# Off-policy sequence mask
# ------------------------------------------------------------------------------------------------------------


def np_opsm(lp, mu, adv_seq, mask, threshold):
    """TRL's get_off_policy_mask: (B, 1) keep = (A >= 0) | (mean over valid tokens of (log mu - log pi) <= delta)."""
    kl = ((mu - lp) * mask).sum(1, keepdims=True) / np.maximum(mask.sum(1, keepdims=True), 1.0)
    return ((adv_seq[:, None] >= 0) | (kl <= threshold)).astype(np.float64), kl


def test_off_policy_sequence_mask_against_trl():
    lp, mu, mask = _mismatch(7, b=8, t=6)
    adv_seq = np.array([1.0, -1.0, -0.5, 2.0, -2.0, -1.0, 0.0, -0.1])
    keep, kl = np_opsm(lp, mu, adv_seq, mask, 0.05)
    with jax.enable_x64(True):
        kept, metrics = off_policy_sequence_mask(lp, mu, np.repeat(adv_seq[:, None], 6, 1), mask, threshold=0.05)
    np.testing.assert_array_equal(kept, mask * keep)
    dropped = (mask > 0) & (keep == 0)
    assert 0 < dropped.sum() < ((mask > 0) & (adv_seq[:, None] < 0)).sum()  # some negative sequences, not all
    np.testing.assert_allclose(metrics["masked_fraction"], dropped.sum() / mask.sum(), rtol=1e-13)
    np.testing.assert_allclose(metrics["sequence_log_ratio_mean"], np.sum(np.broadcast_to(kl, mask.shape) * mask)
                               / mask.sum(), rtol=1e-12)


def test_off_policy_sequence_mask_sign_convention():
    """A negative sample the policy already finds less likely than the sampler did (log mu > log pi) is dropped;
    the mirror image (the policy moved toward it) is kept; a positive sample is never dropped; on policy nothing
    is dropped even at threshold 0 (the statistic must exceed it)."""
    mu = np.log(np.full((4, 3), 0.5))
    lp = mu + np.array([[-0.3], [0.3], [-0.3], [0.0]])
    adv = np.array([[-1.0], [-1.0], [1.0], [-1.0]]) * np.ones((4, 3))
    kept, _ = off_policy_sequence_mask(lp, mu, adv, np.ones((4, 3)), threshold=0.1)
    np.testing.assert_array_equal(np.asarray(kept)[:, 0], [0.0, 1.0, 1.0, 1.0])
    kept, _ = off_policy_sequence_mask(lp[3:], mu[3:], adv[3:], np.ones((1, 3)), threshold=0.0)
    np.testing.assert_array_equal(kept, 1.0)


def test_off_policy_sequence_mask_follows_packed_segments_and_token_advantages():
    lp = np.log(np.full((1, 6), 0.4))
    mu = lp + np.array([[0.5, 0.5, 0.0, 0.0, 0.0, 9.0]])  # the padding's garbage must not count
    segments = np.array([[1, 1, 2, 2, 2, 0]], np.int32)
    adv = np.array([[-1.0, 1.0, -1.0, -1.0, -1.0, -1.0]])  # per-token advantages: DeepSeek's M_{i,t}
    kept, _ = off_policy_sequence_mask(lp, mu, adv, np.ones((1, 6)), threshold=0.2, segment_ids=segments)
    np.testing.assert_array_equal(kept, [[0.0, 1.0, 1.0, 1.0, 1.0, 1.0]])


def test_off_policy_sequence_mask_bad_input():
    lp, mu, mask = _mismatch()
    adv = np.ones_like(mask)
    with pytest.raises(ValueError, match="threshold must be a finite number >= 0"):
        off_policy_sequence_mask(lp, mu, adv, mask, threshold=-0.1)
    with pytest.raises(ValueError, match="threshold must be a finite number >= 0"):
        off_policy_sequence_mask(lp, mu, adv, mask, threshold=float("inf"))
    with pytest.raises(ValueError, match=r"advantages has shape \(4,\) but logits imply"):
        off_policy_sequence_mask(lp, mu, adv[:, 0], mask, threshold=0.5)
    with pytest.raises(ValueError, match=r"rollout_logprobs has shape \(4, 6\)"):
        off_policy_sequence_mask(lp, mu[:, :6], adv, mask, threshold=0.5)


# ------------------------------------------------------------------------------------------------------------
# Composition: PPO with batch-normalised IS weights on the advantages and OPSM on the mask
# ------------------------------------------------------------------------------------------------------------


def test_ppo_with_normalised_is_weights_and_opsm_matches_reference_value_and_gradient():
    x0, f = fd_batch(11, b=3, t=4)
    f["adv"] = np.repeat(f["adv"][:, :1], 4, axis=1)  # one advantage per response
    mu = f["behaviour"]

    def jax_loss(x):
        lp = jax.lax.stop_gradient(token_logprobs(x, f["tokens"]))
        w, _ = rollout_is_weights(lp, mu, f["mask"], upper=2.0, batch_normalize=True)
        kept, _ = off_policy_sequence_mask(lp, mu, f["adv"], f["mask"], threshold=0.05)
        return ppo_loss(x, f["tokens"], f["anchor"], f["adv"] * w, kept)[0]

    def np_loss(x, x0=x0):
        lp0 = np_lp(x0, f["tokens"])  # weights and mask are computed at x0 and carry no gradient
        w = np_batch_normalize(np_is_weights(lp0, mu, f["mask"], "token", 2.0), f["mask"], "token")[0]
        keep, _ = np_opsm(lp0, mu, f["adv"][:, 0], f["mask"], 0.05)
        kept = f["mask"] * keep
        return np_token_mean(np_ppo_tokens(np_lp(x, f["tokens"]), f["anchor"], f["adv"] * w, 0.2, 0.2, 3.0), kept)

    with jax.enable_x64(True):
        loss, grad = jax.value_and_grad(jax_loss)(jnp.asarray(x0))
    lp0 = np_lp(x0, f["tokens"])
    assert 0 < np.sum(np_opsm(lp0, mu, f["adv"][:, 0], f["mask"], 0.05)[0] == 0) < 3  # OPSM drops a sequence
    np.testing.assert_allclose(loss, np_loss(x0), rtol=1e-10)
    np.testing.assert_allclose(grad, numeric_grad(np_loss, x0), rtol=1e-6, atol=1e-9)
