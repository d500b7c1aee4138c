"""Log-probabilities (and entropy) of chosen token ids, computed from logits in fp32.

The policy losses only need ``log pi(a)`` at a handful of ids per position (the sampled token, and for DPPO Top-K
the behaviour policy's stored top-k ids), plus the softmax normaliser. Two paths compute them:

* unchunked (``chunk_size=None``): ``log_softmax`` over the whole [B, T, V] array, then a gather. Simple and fast
  for small vocabularies, but the fp32 log-softmax (and the fp32 copy of bf16 logits) are full [B, T, V] arrays,
  and autodiff keeps one alive for the backward pass.
* chunked (``chunk_size=C``): a loop over blocks of C token positions computes the log-sum-exp, the gathered
  values and the entropy block by block; a custom VJP recomputes each block's softmax in the backward pass and
  writes the gradient straight into the [B, T, V] output. No fp32 [B, T, V] temporary ever exists; the only
  full-size arrays are the logits themselves and their gradient (in the logits' dtype).

Both paths give the same values up to float rounding. Computation is in fp32 for bf16 / fp16 / fp32 logits and
in fp64 for fp64 logits (which the tests use for finite-difference checks).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jodc.losses._checks import check_bt, check_btk, check_chunk_size, check_logits, check_positive


def compute_dtype(dtype) -> jnp.dtype:
    """The float dtype losses compute in: fp64 for fp64 inputs, fp32 for everything else."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def _scaled(x: jax.Array, temperature: float) -> jax.Array:
    """Logits in the compute dtype, divided by the sampling temperature."""
    x = x.astype(compute_dtype(x.dtype))
    return x if temperature == 1.0 else x / temperature


def _as_storage(x_nv: jax.Array) -> jax.Array:
    """The array the chunk loops slice from: the logits themselves, except bf16 logits on the CPU backend, which
    are reinterpreted as uint16 (see ``_load_chunk``)."""
    if x_nv.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        return lax.bitcast_convert_type(x_nv, jnp.uint16)
    return x_nv


def _load_chunk(x_storage_nv: jax.Array, dtype, start, rows: int, temperature: float) -> jax.Array:
    """Rows [start, start + rows) of the logits, scaled, in the compute dtype.

    On CPU, bf16 logits travel through the loop as raw bits (``_as_storage``): XLA's CPU backend upcasts bf16
    loop state to fp32 and hoists that conversion out of the loop, which would materialise exactly the full fp32
    copy that chunking exists to avoid. (The reinterpretation itself costs one copy at bf16 width on CPU; GPU
    backends slice bf16 natively and skip it; fp16 is not affected.)"""
    chunk = lax.dynamic_slice_in_dim(x_storage_nv, start, rows, axis=0)
    if chunk.dtype != dtype:
        chunk = lax.bitcast_convert_type(chunk, dtype)
    return _scaled(chunk, temperature)


def _clip_ids(ids: jax.Array, vocab: int) -> jax.Array:
    """Ids clamped into the vocabulary, so padding ids (e.g. -100) never produce NaN that could leak into grads."""
    return jnp.clip(ids.astype(jnp.int32), 0, vocab - 1)


# --------------------------------------------------------------------------------------------------------------
# Unchunked reference path
# --------------------------------------------------------------------------------------------------------------


def _gather_unchunked(logits_btv, ids_btk, temperature):
    """(log pi at ids [B, T, K], entropy [B, T]) through a full log-softmax; autodiff does the backward pass."""
    logp_btv = jax.nn.log_softmax(_scaled(logits_btv, temperature), axis=-1)
    lp_btk = jnp.take_along_axis(logp_btv, ids_btk, axis=-1)
    p_btv = jnp.exp(logp_btv)
    # 0 * log 0 = 0 for tokens with -inf logits; the where on logp (not on the product) keeps gradients finite.
    safe_logp_btv = jnp.where(p_btv > 0, logp_btv, 0.0)
    entropy_bt = -jnp.sum(p_btv * safe_logp_btv, axis=-1)
    return lp_btk, entropy_bt


# --------------------------------------------------------------------------------------------------------------
# Chunked path with a custom VJP
# --------------------------------------------------------------------------------------------------------------


def _chunk_starts(n: int, chunk: int) -> tuple[int, int]:
    """(rows per chunk, number of chunks). The last chunk is shifted back to end at row n (it may overlap the
    previous one; overlapping rows are recomputed with identical values and simply overwritten)."""
    rows = min(chunk, n)
    return rows, -(-n // rows)


def _chunked_forward(x_nv, ids_nk, temperature, chunk):
    """Block loop computing log pi at ids [N, K], entropy [N] and the log-normaliser lse [N]."""
    n, _ = x_nv.shape
    cdt = compute_dtype(x_nv.dtype)
    rows, num_chunks = _chunk_starts(n, chunk)
    x_storage_nv = _as_storage(x_nv)

    def body(i, carry):
        lp_nk, entropy_n, lse_n = carry
        start = jnp.minimum(i * rows, n - rows)
        x_cv = _load_chunk(x_storage_nv, x_nv.dtype, start, rows, temperature)
        ids_ck = lax.dynamic_slice_in_dim(ids_nk, start, rows, axis=0)
        max_c1 = jnp.max(x_cv, axis=1, keepdims=True)
        max_c1 = jnp.where(jnp.isfinite(max_c1), max_c1, 0.0)
        shifted_cv = x_cv - max_c1
        e_cv = jnp.exp(shifted_cv)
        sum_c1 = jnp.sum(e_cv, axis=1, keepdims=True)
        log_sum_c1 = jnp.log(sum_c1)
        lp_ck = jnp.take_along_axis(shifted_cv, ids_ck, axis=1) - log_sum_c1
        weighted_c = jnp.sum(jnp.where(e_cv > 0, e_cv * shifted_cv, 0.0), axis=1)
        entropy_c = log_sum_c1[:, 0] - weighted_c / sum_c1[:, 0]
        lp_nk = lax.dynamic_update_slice_in_dim(lp_nk, lp_ck, start, axis=0)
        entropy_n = lax.dynamic_update_slice_in_dim(entropy_n, entropy_c, start, axis=0)
        lse_n = lax.dynamic_update_slice_in_dim(lse_n, (max_c1 + log_sum_c1)[:, 0], start, axis=0)
        return lp_nk, entropy_n, lse_n

    init = (
        jnp.zeros(ids_nk.shape, cdt),
        jnp.zeros((n,), cdt),
        jnp.zeros((n,), cdt),
    )
    return lax.fori_loop(0, num_chunks, body, init)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _gather_chunked(x_nv, ids_nk, temperature, chunk, entropy_has_grad):
    lp_nk, entropy_n, _ = _chunked_forward(x_nv, ids_nk, temperature, chunk)
    return lp_nk, entropy_n


def _gather_chunked_fwd(x_nv, ids_nk, temperature, chunk, entropy_has_grad):
    lp_nk, entropy_n, lse_n = _chunked_forward(x_nv, ids_nk, temperature, chunk)
    return (lp_nk, entropy_n), (x_nv, ids_nk, lse_n, entropy_n)


def _gather_chunked_bwd(temperature, chunk, entropy_has_grad, residuals, cotangents):
    """Recompute each block's softmax p and write d/dx = (onehot(ids) . g - p sum(g) - g_H p (log p + H)) / tau."""
    x_nv, ids_nk, lse_n, entropy_n = residuals
    g_lp_nk, g_entropy_n = cotangents
    n, _ = x_nv.shape
    rows, num_chunks = _chunk_starts(n, chunk)
    row_c1 = jnp.arange(rows)[:, None]
    x_storage_nv = _as_storage(x_nv)

    def body(i, grad_nv):
        start = jnp.minimum(i * rows, n - rows)
        x_cv = _load_chunk(x_storage_nv, x_nv.dtype, start, rows, temperature)
        ids_ck = lax.dynamic_slice_in_dim(ids_nk, start, rows, axis=0)
        g_ck = lax.dynamic_slice_in_dim(g_lp_nk, start, rows, axis=0)
        logp_cv = x_cv - lax.dynamic_slice_in_dim(lse_n, start, rows, axis=0)[:, None]
        p_cv = jnp.exp(logp_cv)
        gx_cv = -p_cv * jnp.sum(g_ck, axis=1, keepdims=True)
        gx_cv = gx_cv.at[row_c1, ids_ck].add(g_ck)
        if entropy_has_grad:
            g_h_c1 = lax.dynamic_slice_in_dim(g_entropy_n, start, rows, axis=0)[:, None]
            h_c1 = lax.dynamic_slice_in_dim(entropy_n, start, rows, axis=0)[:, None]
            safe_logp_cv = jnp.where(p_cv > 0, logp_cv, 0.0)
            gx_cv = gx_cv - g_h_c1 * p_cv * (safe_logp_cv + h_c1)
        if temperature != 1.0:
            gx_cv = gx_cv / temperature
        return lax.dynamic_update_slice_in_dim(grad_nv, gx_cv.astype(x_nv.dtype), start, axis=0)

    grad_nv = lax.fori_loop(0, num_chunks, body, jnp.zeros(x_nv.shape, x_nv.dtype))
    return grad_nv, None


_gather_chunked.defvjp(_gather_chunked_fwd, _gather_chunked_bwd)


# --------------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------------


def _gather(logits_btv, ids_btk, *, temperature, chunk_size, entropy_has_grad):
    """Shared body of the public gathers: (log pi at ids [B, T, K], entropy [B, T]) in the compute dtype."""
    b, t, v = logits_btv.shape
    ids_btk = _clip_ids(ids_btk, v)
    if chunk_size is None or b * t == 0:
        return _gather_unchunked(logits_btv, ids_btk, temperature)
    k = ids_btk.shape[-1]
    lp_nk, entropy_n = _gather_chunked(
        logits_btv.reshape(b * t, v), ids_btk.reshape(b * t, k), float(temperature), int(chunk_size),
        bool(entropy_has_grad),
    )
    return lp_nk.reshape(b, t, k), entropy_n.reshape(b, t)


def _checked(fn: str, logits, ids, *, per_position: bool, temperature, chunk_size) -> jax.Array:
    """The public gathers' argument checks; returns the logits as an array. ``ids`` are [B, T] tokens
    (``per_position``) or [B, T, K] ids."""
    check_logits(fn, logits)
    logits = jnp.asarray(logits)
    bt = tuple(logits.shape[:2])
    if per_position:
        check_bt(fn, "tokens", ids, bt, integer=True)
    else:
        check_btk(fn, "ids", ids, bt, integer=True)
    check_positive(fn, "temperature", temperature)
    check_chunk_size(fn, chunk_size)
    return logits


def gather_logprobs(logits, ids, *, temperature: float = 1.0, chunk_size: int | None = None) -> jax.Array:
    """log pi(i | s_t) for several ids per position: logits [B, T, V], ids [B, T, K] -> [B, T, K] (fp32).

    Used for DPPO Top-K (the current policy's log-probs at the behaviour policy's stored top-k ids). Ids outside
    [0, V) are clamped (so padding ids are harmless where the mask is 0).
    """
    logits = _checked("gather_logprobs", logits, ids, per_position=False, temperature=temperature,
                      chunk_size=chunk_size)
    lp_btk, _ = _gather(logits, ids, temperature=temperature, chunk_size=chunk_size, entropy_has_grad=False)
    return lp_btk


def token_logprobs(logits, tokens, *, temperature: float = 1.0, chunk_size: int | None = None) -> jax.Array:
    """log pi(a_t | s_t) of the given tokens: logits [B, T, V] (any float dtype), tokens [B, T] -> [B, T] fp32.

    ``logits / temperature`` is normalised with a log-softmax in fp32. With ``chunk_size=C`` the work runs over
    blocks of C token positions (of the flattened B*T axis) so that no fp32 [B, T, V] array is materialised, in
    the forward or the backward pass; ``chunk_size=None`` is the plain unchunked path. Values agree to float
    rounding.
    """
    logits = _checked("token_logprobs", logits, tokens, per_position=True, temperature=temperature,
                      chunk_size=chunk_size)
    lp_btk, _ = _gather(
        logits, tokens[..., None], temperature=temperature, chunk_size=chunk_size, entropy_has_grad=False
    )
    return lp_btk[..., 0]


def token_logprobs_and_entropy(
    logits, tokens, *, temperature: float = 1.0, chunk_size: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """(log pi(a_t | s_t) [B, T], entropy H(pi(. | s_t)) [B, T]) in one pass over the vocabulary.

    Both outputs are differentiable (an entropy bonus can be added to a loss). Chunking as in ``token_logprobs``.
    """
    logits = _checked("token_logprobs_and_entropy", logits, tokens, per_position=True, temperature=temperature,
                      chunk_size=chunk_size)
    lp_btk, entropy_bt = _gather(
        logits, tokens[..., None], temperature=temperature, chunk_size=chunk_size, entropy_has_grad=True
    )
    return lp_btk[..., 0], entropy_bt


def topk_logprobs(logits, tokens, k: int, *, temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """The behaviour policy's top-k at every position, as a rollout stores it for DPPO Top-K.

    Returns ``(ids [B, T, k] int32, logprobs [B, T, k] fp32)``: the k most likely ids of ``softmax(logits / T)``
    in decreasing order, except that when the sampled token ``tokens[b, t]`` is not among them it replaces the
    last slot (so there are always exactly k slots and the sampled token is always one of them). Ties are
    broken toward the lower id. No gradient is meant to flow (rollout data).
    """
    fn = "topk_logprobs"
    check_logits(fn, logits)
    logits = jnp.asarray(logits)
    b, t, v = logits.shape
    check_bt(fn, "tokens", tokens, (b, t), integer=True)
    check_positive(fn, "temperature", temperature)
    if not isinstance(k, (int,)) or not 1 <= k <= v:
        raise ValueError(f"{fn}: k must be an int in [1, V={v}], got {k!r}")
    x_btv = lax.stop_gradient(_scaled(logits, temperature))
    lse_bt1 = jax.nn.logsumexp(x_btv, axis=-1, keepdims=True)
    top_x_btk, ids_btk = lax.top_k(x_btv, k)
    tokens_bt1 = _clip_ids(tokens, v)[..., None]
    token_x_bt1 = jnp.take_along_axis(x_btv, tokens_bt1, axis=-1)
    present_bt1 = jnp.any(ids_btk == tokens_bt1, axis=-1, keepdims=True)
    last_k = jnp.arange(k) == k - 1
    replace_btk = jnp.logical_and(~present_bt1, last_k)
    ids_btk = jnp.where(replace_btk, tokens_bt1, ids_btk).astype(jnp.int32)
    top_x_btk = jnp.where(replace_btk, token_x_bt1, top_x_btk)
    return ids_btk, top_x_btk - lse_bt1


def _sum_pi_squared_rows(x_cv: jax.Array) -> jax.Array:
    """sum_i p_i^2 per row of scaled logits [C, V]: sum exp(2 s) / (sum exp(s))^2 with s = x - max x."""
    max_c1 = jnp.max(x_cv, axis=1, keepdims=True)
    e_cv = jnp.exp(x_cv - jnp.where(jnp.isfinite(max_c1), max_c1, 0.0))
    return jnp.sum(jnp.square(e_cv), axis=1) / jnp.square(jnp.sum(e_cv, axis=1))


def sum_pi_squared(logits, *, temperature: float = 1.0, chunk_size: int | None = None) -> jax.Array:
    """sum_i pi(i | s_t)^2 at every position: logits [B, T, V] -> [B, T] fp32 (fp64 for fp64 logits), no gradient.

    The collision probability of ``softmax(logits / temperature)``, which the optimal token baseline
    (``jodc.losses.optimal_token_baseline_advantages``) needs at each response token: the squared norm of the
    score function with respect to the logits is ||onehot(a) - pi||^2 = 1 - 2 pi(a) + sum_i pi_i^2. Chunking as in
    ``token_logprobs`` (no fp32 [B, T, V] array with ``chunk_size=C``)."""
    fn = "sum_pi_squared"
    check_logits(fn, logits)
    check_positive(fn, "temperature", temperature)
    check_chunk_size(fn, chunk_size)
    logits = lax.stop_gradient(jnp.asarray(logits))
    b, t, v = logits.shape
    if chunk_size is None or b * t == 0:
        return _sum_pi_squared_rows(_scaled(logits.reshape(b * t, v), temperature)).reshape(b, t)
    x_nv = logits.reshape(b * t, v)
    rows, num_chunks = _chunk_starts(b * t, int(chunk_size))
    x_storage_nv = _as_storage(x_nv)

    def body(i, out_n):
        start = jnp.minimum(i * rows, b * t - rows)
        x_cv = _load_chunk(x_storage_nv, x_nv.dtype, start, rows, float(temperature))
        return lax.dynamic_update_slice_in_dim(out_n, _sum_pi_squared_rows(x_cv), start, axis=0)

    out_n = lax.fori_loop(0, num_chunks, body, jnp.zeros((b * t,), compute_dtype(logits.dtype)))
    return out_n.reshape(b, t)
