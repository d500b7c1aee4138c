"""Log-probs, entropy, top-k extraction and the DPPO divergence approximations, against float64 numpy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_losses import numeric_grad

from jodc.losses import (
    binary_kl,
    binary_tv,
    gather_logprobs,
    token_logprobs,
    token_logprobs_and_entropy,
    topk_kl,
    topk_logprobs,
    topk_tv,
)

# ------------------------------------------------------------------------------------------------------------
# float64 numpy references
# ------------------------------------------------------------------------------------------------------------


def np_log_softmax(x, temperature=1.0):
    x = np.asarray(x, np.float64) / temperature
    s = x - x.max(-1, keepdims=True)
    return s - np.log(np.exp(s).sum(-1, keepdims=True))


def np_gather(logits, ids, temperature=1.0):
    return np.take_along_axis(np_log_softmax(logits, temperature), np.asarray(ids), axis=-1)


def np_entropy(logits, temperature=1.0):
    logp = np_log_softmax(logits, temperature)
    return -(np.exp(logp) * logp).sum(-1)


def np_tv(p, q):
    return 0.5 * np.abs(np.asarray(p, np.float64) - np.asarray(q, np.float64)).sum(-1)


def np_kl(p, q):
    p = np.asarray(p, np.float64)
    q = np.asarray(q, np.float64)
    return np.sum(np.where(p > 0, p * (np.log(np.where(p > 0, p, 1)) - np.log(q)), 0.0), -1)


def _batch(seed, b=2, t=5, v=11, scale=2.0):
    rng = np.random.default_rng(seed)
    logits = (scale * rng.standard_normal((b, t, v))).astype(np.float32)
    tokens = rng.integers(0, v, (b, t)).astype(np.int32)
    return logits, tokens


# ------------------------------------------------------------------------------------------------------------
# token_logprobs / gather_logprobs / entropy
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_numpy(temperature):
    logits, tokens = _batch(0)
    expected = np_gather(logits, tokens[..., None], temperature)[..., 0]
    got = token_logprobs(logits, tokens, temperature=temperature)
    assert got.dtype == jnp.float32 and got.shape == tokens.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 10, 64])
def test_chunked_equals_unchunked_values_and_grads(chunk_size):
    # chunk sizes that divide B*T = 10, that do not (3, 4: the last chunk overlaps), and that exceed it (64).
    logits, tokens = _batch(1)
    weights = np.random.default_rng(2).standard_normal(tokens.shape).astype(np.float32)

    def objective(x, chunk):
        lp, ent = token_logprobs_and_entropy(x, tokens, temperature=0.8, chunk_size=chunk)
        return jnp.sum(weights * lp) + 0.3 * jnp.sum(ent)

    lp_ref = token_logprobs(logits, tokens, temperature=0.8)
    lp_chunk = token_logprobs(logits, tokens, temperature=0.8, chunk_size=chunk_size)
    np.testing.assert_allclose(lp_chunk, lp_ref, rtol=1e-6, atol=1e-6)
    g_ref = jax.grad(objective)(jnp.asarray(logits), None)
    g_chunk = jax.grad(objective)(jnp.asarray(logits), chunk_size)
    np.testing.assert_allclose(g_chunk, g_ref, rtol=1e-5, atol=1e-6)


def test_token_logprobs_and_entropy_against_numpy_and_finite_differences():
    logits, tokens = _batch(3, b=2, t=3, v=5)
    weights = np.random.default_rng(4).standard_normal(tokens.shape)
    with jax.enable_x64(True):
        for chunk in (None, 2):
            lp, ent = token_logprobs_and_entropy(jnp.asarray(logits, jnp.float64), tokens, temperature=1.3,
                                                 chunk_size=chunk)
            assert lp.dtype == jnp.float64
            np.testing.assert_allclose(lp, np_gather(logits, tokens[..., None], 1.3)[..., 0], rtol=1e-12)
            np.testing.assert_allclose(ent, np_entropy(logits, 1.3), rtol=1e-12)

            def jax_objective(x):
                lp, ent = token_logprobs_and_entropy(x, tokens, temperature=1.3, chunk_size=chunk)
                return jnp.sum(weights * lp) - 0.7 * jnp.sum(ent)

            def np_objective(x):
                return np.sum(weights * np_gather(x, tokens[..., None], 1.3)[..., 0]) - 0.7 * np.sum(
                    np_entropy(x, 1.3))

            got = jax.grad(jax_objective)(jnp.asarray(logits, jnp.float64))
            np.testing.assert_allclose(got, numeric_grad(np_objective, logits), rtol=1e-6, atol=1e-8)


def test_gather_logprobs_matches_numpy_and_chunked():
    logits, _ = _batch(5)
    ids = np.random.default_rng(6).integers(0, logits.shape[-1], logits.shape[:2] + (4,)).astype(np.int32)
    expected = np_gather(logits, ids)
    np.testing.assert_allclose(gather_logprobs(logits, ids), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gather_logprobs(logits, ids, chunk_size=3), expected, rtol=1e-5, atol=1e-5)


def test_bf16_logits_are_computed_in_fp32():
    logits, tokens = _batch(7)
    logits_bf16 = jnp.asarray(logits, jnp.bfloat16)
    expected = np_gather(np.asarray(logits_bf16.astype(jnp.float32)), tokens[..., None])[..., 0]
    for chunk in (None, 4):
        got = token_logprobs(logits_bf16, tokens, chunk_size=chunk)
        assert got.dtype == jnp.float32
        # fp32 math on the bf16 values: as accurate as fp32, not as coarse as bf16.
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        grad = jax.grad(lambda x: jnp.sum(token_logprobs(x, tokens, chunk_size=chunk)))(logits_bf16)
        assert grad.dtype == jnp.bfloat16


def test_masked_vocabulary_entries_and_padding_ids_stay_finite():
    logits, tokens = _batch(8)
    logits[..., -3:] = -np.inf  # e.g. padded vocabulary entries, never sampled
    tokens = tokens % (logits.shape[-1] - 3)
    tokens[0, 0] = -100  # a padding id
    for chunk in (None, 3):
        lp, ent = token_logprobs_and_entropy(logits, tokens, chunk_size=chunk)
        grad = jax.grad(lambda x: jnp.sum(token_logprobs_and_entropy(x, tokens, chunk_size=chunk)[1]))(logits)
        assert np.isfinite(lp).all() and np.isfinite(ent).all() and np.isfinite(grad).all()
        np.testing.assert_allclose(ent, np_entropy(logits[..., :-3]), rtol=1e-5, atol=1e-5)


def test_logprobs_under_jit_and_vmap():
    logits, tokens = _batch(9, b=2, t=4, v=7)
    stacked_logits = np.stack([logits, logits[::-1]])
    stacked_tokens = np.stack([tokens, tokens[::-1]])
    weights = np.random.default_rng(10).standard_normal(tokens.shape).astype(np.float32)

    def value_and_grad(x, y, chunk):
        return jax.value_and_grad(lambda z: jnp.sum(weights * token_logprobs(z, y, chunk_size=chunk)))(x)

    fn = jax.jit(jax.vmap(lambda x, y: (token_logprobs(x, y, chunk_size=3), value_and_grad(x, y, 3))))
    lps, (_, grads) = fn(stacked_logits, stacked_tokens)
    for i in range(2):
        np.testing.assert_allclose(lps[i], np_gather(stacked_logits[i], stacked_tokens[i][..., None])[..., 0],
                                   rtol=1e-5, atol=1e-5)
        _, grad_ref = value_and_grad(stacked_logits[i], stacked_tokens[i], None)
        np.testing.assert_allclose(grads[i], grad_ref, rtol=1e-5, atol=1e-6)


def test_logprob_argument_errors():
    logits, tokens = _batch(10)
    with pytest.raises(ValueError, match=r"tokens has shape \(2, 4\)"):
        token_logprobs(logits, tokens[:, :4])
    with pytest.raises(ValueError, match=r"logits must have shape \[B, T, V\], got shape \(2, 5\)"):
        token_logprobs(logits[..., 0], tokens)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(logits, tokens, chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, tokens, temperature=0.0)
    with pytest.raises(ValueError, match="integer"):
        token_logprobs(logits, tokens.astype(np.float32))
    with pytest.raises(ValueError, match=r"ids has shape \(2, 5\)"):
        gather_logprobs(logits, tokens)
    with pytest.raises(ValueError, match="k must be"):
        topk_logprobs(logits, tokens, logits.shape[-1] + 1)


# ------------------------------------------------------------------------------------------------------------
# topk_logprobs
# ------------------------------------------------------------------------------------------------------------


def test_topk_logprobs_hand_case():
    # probabilities of ids 0..4: 0.4, 0.3, 0.15, 0.1, 0.05
    probs = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = np.log(probs)[None, None, :].repeat(3, axis=1).astype(np.float32)
    tokens = np.array([[1, 4, 3]], np.int32)  # in the top-3; not in it (forced in); not in it (forced in)
    ids, lps = topk_logprobs(logits, tokens, 3)
    np.testing.assert_array_equal(ids[0], [[0, 1, 2], [0, 1, 4], [0, 1, 3]])
    np.testing.assert_allclose(np.exp(lps[0]), [[0.4, 0.3, 0.15], [0.4, 0.3, 0.05], [0.4, 0.3, 0.1]], rtol=1e-5)


@pytest.mark.parametrize("k", [1, 3, 11])
def test_topk_logprobs_properties(k):
    logits, tokens = _batch(11, v=11)
    ids, lps = topk_logprobs(logits, tokens, k, temperature=0.9)
    ids, lps = np.asarray(ids), np.asarray(lps)
    assert ids.shape == lps.shape == tokens.shape + (k,)
    np.testing.assert_allclose(lps, np_gather(logits, ids, 0.9), rtol=1e-5, atol=1e-5)
    logp = np_log_softmax(logits, 0.9)
    for b, t in np.ndindex(tokens.shape):
        assert tokens[b, t] in ids[b, t]
        assert len(set(ids[b, t])) == k
        top = np.argsort(-logp[b, t], kind="stable")[:k]
        if tokens[b, t] in top:
            np.testing.assert_array_equal(ids[b, t], top)
        else:
            np.testing.assert_array_equal(ids[b, t, :-1], top[:-1])
            assert ids[b, t, -1] == tokens[b, t]


# ------------------------------------------------------------------------------------------------------------
# divergences
# ------------------------------------------------------------------------------------------------------------


def test_binary_divergences_hand_values():
    mu = np.log(np.array([0.3, 0.6, 1.0]))
    pi = np.log(np.array([0.6, 0.3, 0.5]))
    np.testing.assert_allclose(binary_tv(mu, pi), [0.3, 0.3, 0.5], rtol=1e-6)
    expected_kl = [
        0.3 * np.log(0.3 / 0.6) + 0.7 * np.log(0.7 / 0.4),
        0.6 * np.log(0.6 / 0.3) + 0.4 * np.log(0.4 / 0.7),
        np.log(1.0 / 0.5),  # mu puts all mass on a_t: the "rest" term is 0, not NaN
    ]
    np.testing.assert_allclose(binary_kl(mu, pi), expected_kl, rtol=1e-5)


def test_topk_divergences_hand_values():
    mu_k = np.log(np.array([[0.5, 0.2]]))  # other bucket 0.3
    pi_k = np.log(np.array([[0.4, 0.4]]))  # other bucket 0.2
    np.testing.assert_allclose(topk_tv(mu_k, pi_k), [0.5 * (0.1 + 0.2 + 0.1)], rtol=1e-5)
    expected = 0.5 * np.log(0.5 / 0.4) + 0.2 * np.log(0.2 / 0.4) + 0.3 * np.log(0.3 / 0.2)
    np.testing.assert_allclose(topk_kl(mu_k, pi_k), [expected], rtol=1e-5)


def test_divergences_are_finite_at_degenerate_distributions():
    zero = np.zeros(3)
    neg_inf = np.full(3, -np.inf)
    for fn in (binary_tv, binary_kl):
        assert np.isfinite(fn(zero, zero)).all() and np.isfinite(fn(neg_inf, zero)).all()
        np.testing.assert_allclose(fn(zero, zero), 0.0, atol=1e-6)
    full = np.log(np.array([[0.5, 0.5]]))
    np.testing.assert_allclose(topk_kl(full, full), [0.0], atol=1e-6)
    np.testing.assert_allclose(topk_tv(full, full), [0.0], atol=1e-6)


def _divergences_impl(mu_logits, pi_logits, tokens, k):
    """(binary TV, top-k TV, binary KL, top-k KL) of mu and pi at the tokens, with top-k from mu."""
    ids, mu_k = topk_logprobs(mu_logits, tokens, k)
    pi_k = gather_logprobs(pi_logits, ids)
    mu_a = token_logprobs(mu_logits, tokens)
    pi_a = token_logprobs(pi_logits, tokens)
    return binary_tv(mu_a, pi_a), topk_tv(mu_k, pi_k), binary_kl(mu_a, pi_a), topk_kl(mu_k, pi_k)


_divergences = jax.jit(_divergences_impl, static_argnums=3)


@pytest.mark.parametrize("v", [2, 33])
def test_topk_with_k_equal_vocab_minus_one_is_exact(v):
    rng = np.random.default_rng(v)
    mu_logits = 2 * rng.standard_normal((2, 4, v))
    pi_logits = mu_logits + rng.standard_normal((2, 4, v))
    tokens = rng.integers(0, v, (2, 4)).astype(np.int32)
    p, q = np.exp(np_log_softmax(mu_logits)), np.exp(np_log_softmax(pi_logits))
    with jax.enable_x64(True):
        _, tv, _, kl = _divergences(jnp.asarray(mu_logits), jnp.asarray(pi_logits), tokens, v - 1)
        np.testing.assert_allclose(tv, np_tv(p, q), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(kl, np_kl(p, q), rtol=1e-9, atol=1e-12)
    # fp32 as used in training: the same up to fp32 rounding of the "other" bucket.
    _, tv, _, kl = _divergences(mu_logits.astype(np.float32), pi_logits.astype(np.float32), tokens, v - 1)
    np.testing.assert_allclose(tv, np_tv(p, q), atol=2e-6)
    np.testing.assert_allclose(kl, np_kl(p, q), rtol=1e-4, atol=2e-6)


_logit_vectors = hnp.arrays(np.float64, (9,), elements=st.floats(-6, 6, allow_nan=False))


@settings(max_examples=40, deadline=None)
@given(mu_logits=_logit_vectors, pi_logits=_logit_vectors, k=st.sampled_from([1, 2, 5, 8]),
       token=st.integers(0, 8))
def test_approximations_lower_bound_the_exact_divergence(mu_logits, pi_logits, k, token):
    """Bucketing can only lose information: binary <= top-k <= exact, for TV and KL (data processing)."""
    p, q = np.exp(np_log_softmax(mu_logits)), np.exp(np_log_softmax(pi_logits))
    with jax.enable_x64(True):
        tv_bin, tv_top, kl_bin, kl_top = (
            float(d[0, 0])
            for d in _divergences(mu_logits[None, None], pi_logits[None, None], np.array([[token]], np.int32), k)
        )
    tol = 1e-9
    # top-k's buckets refine {a_t, rest} because a_t is always one of the k ids
    assert tv_bin <= tv_top + tol and tv_top <= np_tv(p, q) + tol
    assert kl_bin <= kl_top + tol and kl_top <= np_kl(p, q) + tol


def test_sft_loss_from_logits_is_the_normalised_cross_entropy_of_trained_tokens():
    from jodc.losses import sft_loss_from_logits

    rng = np.random.default_rng(7)
    logits = rng.standard_normal((2, 5, 11))
    targets = rng.integers(0, 11, (2, 5))
    mask = (rng.random((2, 5)) < 0.7).astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    normalizer = 9.0  # the minibatch's trained tokens, of which this microbatch holds mask.sum()
    want = -(picked * mask).sum() / normalizer
    mb = {"targets": jnp.asarray(targets), "loss_mask": jnp.asarray(mask, jnp.float32),
          "normalizer": jnp.float32(normalizer)}
    for chunk in (None, 2):
        got = sft_loss_from_logits(jnp.asarray(logits, jnp.float32), mb, chunk_size=chunk)
        np.testing.assert_allclose(float(got), want, rtol=1e-5)
    grad = jax.grad(lambda x: sft_loss_from_logits(x, mb))(jnp.asarray(logits, jnp.float32))
    onehot = np.eye(11)[targets]
    np.testing.assert_allclose(grad, -(onehot - np.exp(logp)) * mask[..., None] / normalizer, rtol=1e-4, atol=1e-6)
