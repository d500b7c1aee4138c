"""Attention whose mask is read from per-token keys: a segment id and a causal order for every query and every key.

Query ``q`` may attend to key ``s`` iff ``segment(q) == segment(s) != 0`` and ``order(s) <= order(q)``. Queries and
keys are separate token sets (``T`` queries, ``S`` keys), which is what context parallelism needs: a device's own
queries against the keys of its whole group, where "causal" means by global position, not by column. With
``S == T``, the row's segment ids and ``order = column`` this is exactly `attention.dense_attention`'s mask.

Two implementations give the same result:
- `dense_keyed_attention`: the explicit [T, S] mask (the reference; cost T*S).
- `blockwise_keyed_attention`: queries and keys cut into blocks; each query block visits only the key blocks in its
  *visit list*, the block pairs that may hold an allowed (query, key) pair. The lists come from a bool
  ``block_pairs_bij`` [B, T/blk, S/blk] computed at run time from per-block ranges of the keys
  (`keyed_block_pairs`), or supplied by a caller that knows more about its layout (context_parallel.py separates
  the split sequence from a row's own sequences). Online softmax forward, FlashAttention-2 style recomputing
  backward over the same pairs (`jax.custom_vjp`: reverse-mode AD cannot go through loops whose trip counts are
  data). A pair in the list that holds no allowed entry costs time, never correctness.

Shapes: q [B, T, H, D], k and v [B, S, KV, D] with H a multiple of KV; segments and orders int32 [B, T] / [B, S].
Scores, softmax and accumulation in fp32; the output has q's dtype. A query with no allowed key outputs exactly 0.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .attention import (
    _MASKED,
    _kv_blocks_to_btkd,
    _kv_to_blocks,
    _q_blocks_to_bthd,
    _q_to_blocks,
    _read_block,
    _rows,
    _varying_zero,
    _write_block,
    masked_attention,
)

_INT_MAX = jnp.iinfo(jnp.int32).max
_INT_MIN = jnp.iinfo(jnp.int32).min


def pad_tokens(x, axis: int, pad: int):
    """x padded with `pad` zeros (padding tokens: segment 0) along `axis` (x itself for pad 0)."""
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def check_keyed_inputs(q_bthd, k_bskd, v_bskd, q_segment_bt, q_order_bt, k_segment_bs, k_order_bs):
    """Raise ValueError naming the problem if the operands of keyed attention do not fit together."""
    if q_bthd.ndim != 4 or k_bskd.ndim != 4 or v_bskd.ndim != 4:
        raise ValueError(f"keyed attention expects q [B,T,H,D], k and v [B,S,KV,D]; got {q_bthd.shape}, "
                         f"{k_bskd.shape}, {v_bskd.shape}")
    if k_bskd.shape != v_bskd.shape:
        raise ValueError(f"k {k_bskd.shape} and v {v_bskd.shape} must have the same shape")
    b, t, h, d = q_bthd.shape
    if k_bskd.shape[0] != b or k_bskd.shape[3] != d:
        raise ValueError(f"k {k_bskd.shape} does not match q {q_bthd.shape} in batch or head_dim")
    if h % k_bskd.shape[2]:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({k_bskd.shape[2]})")
    s = k_bskd.shape[1]
    for name, array, shape in (("q_segment", q_segment_bt, (b, t)), ("q_order", q_order_bt, (b, t)),
                               ("k_segment", k_segment_bs, (b, s)), ("k_order", k_order_bs, (b, s))):
        if tuple(array.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(array.shape)}, expected {shape}")
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise ValueError(f"{name} must be integers, got {array.dtype}")


def keyed_mask(q_segment_bt, q_order_bt, k_segment_bs, k_order_bs) -> jax.Array:
    """Boolean [B, T, S]: same non-zero segment and key order <= query order."""
    same = q_segment_bt[:, :, None] == k_segment_bs[:, None, :]
    causal = k_order_bs[:, None, :] <= q_order_bt[:, :, None]
    return same & causal & (q_segment_bt > 0)[:, :, None]


def dense_keyed_attention(q_bthd, k_bskd, v_bskd, q_segment_bt, q_order_bt, k_segment_bs, k_order_bs) -> jax.Array:
    """Reference keyed attention with the full [T, S] mask."""
    check_keyed_inputs(q_bthd, k_bskd, v_bskd, q_segment_bt, q_order_bt, k_segment_bs, k_order_bs)
    return masked_attention(q_bthd, k_bskd, v_bskd, keyed_mask(q_segment_bt, q_order_bt, k_segment_bs, k_order_bs))


# ----------------------------------------------------------------------------------------------------------
# Which block pairs to visit
# ----------------------------------------------------------------------------------------------------------


def block_ranges(segment_bt, order_bt, block: int, selected_bt=None):
    """Per-block ranges over the tokens a block holds (segment > 0, and `selected_bt` where given).

    Returns (segment_min, segment_max, order_min, order_max), each int32 [B, T/blk]. A block with no such token
    gets an empty range: segment_min = INT_MAX, segment_max = 0, order_min = INT_MAX, order_max = INT_MIN.
    """
    b, t = segment_bt.shape
    seg = segment_bt.reshape(b, t // block, block)
    order = order_bt.reshape(b, t // block, block)
    take = seg > 0
    if selected_bt is not None:
        take = take & selected_bt.reshape(b, t // block, block)
    return (jnp.min(jnp.where(take, seg, _INT_MAX), axis=-1), jnp.max(jnp.where(take, seg, 0), axis=-1),
            jnp.min(jnp.where(take, order, _INT_MAX), axis=-1), jnp.max(jnp.where(take, order, _INT_MIN), axis=-1))


def ranges_may_interact(q_ranges, k_ranges) -> jax.Array:
    """bool [B, nq, nk]: the query block's and the key block's segment ranges intersect and the key block's
    smallest order is <= the query block's largest (a necessary condition for an allowed pair)."""
    q_seg_min, q_seg_max, _, q_order_max = q_ranges
    k_seg_min, k_seg_max, k_order_min, _ = k_ranges
    overlap = (q_seg_min[:, :, None] <= k_seg_max[:, None, :]) & (k_seg_min[:, None, :] <= q_seg_max[:, :, None])
    return overlap & (k_order_min[:, None, :] <= q_order_max[:, :, None])


def keyed_block_pairs(q_segment_bt, q_order_bt, k_segment_bs, k_order_bs, block: int) -> jax.Array:
    """bool [B, T/blk, S/blk]: the block pairs whose segment ranges intersect and whose orders allow causality.

    Exact for rows whose segments are contiguous runs ordered by column; conservative (extra pairs) when a block
    mixes segments whose ids are far apart. T and S must be multiples of `block`.
    """
    return ranges_may_interact(block_ranges(q_segment_bt, q_order_bt, block),
                               block_ranges(k_segment_bs, k_order_bs, block))


def visit_lists(block_pairs_bij) -> tuple[jax.Array, jax.Array]:
    """For every query block, the key blocks to visit in increasing order and how many there are.

    Returns `visit_bin` int32 [B, nq, nk] (the first `count_bi` entries are the visited key blocks) and `count_bi`.
    """
    # a stable argsort of "not visited" puts the visited blocks first, each group in increasing index order
    visit = jnp.argsort(jnp.logical_not(block_pairs_bij).astype(jnp.int32), axis=-1, stable=True)
    return visit.astype(jnp.int32), jnp.sum(block_pairs_bij, axis=-1, dtype=jnp.int32)


# ----------------------------------------------------------------------------------------------------------
# Blockwise kernel
# ----------------------------------------------------------------------------------------------------------


def blockwise_keyed_attention(q_bthd, k_bskd, v_bskd, q_segment_bt, q_order_bt, k_segment_bs, k_order_bs, *,
                              block_size: int = 128, block_pairs_bij=None) -> jax.Array:
    """Keyed attention that computes only the block pairs that may interact (same result as
    `dense_keyed_attention` up to fp32 reassociation).

    The blocks hold `min(block_size, T)` tokens; T and S are padded with padding tokens (segment 0) internally.
    `block_pairs_bij` (bool [B, ceil(T/blk), ceil(S/blk)] for that block) replaces the range test of
    `keyed_block_pairs`: it must contain every pair holding an allowed (query, key) entry.
    """
    check_keyed_inputs(q_bthd, k_bskd, v_bskd, q_segment_bt, q_order_bt, k_segment_bs, k_order_bs)
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    t, s = q_bthd.shape[1], k_bskd.shape[1]
    block = min(block_size, t)
    q_pad, k_pad = -t % block, -s % block
    q_seg, q_order = q_segment_bt.astype(jnp.int32), q_order_bt.astype(jnp.int32)
    k_seg, k_order = k_segment_bs.astype(jnp.int32), k_order_bs.astype(jnp.int32)
    if q_pad:
        q_bthd = jnp.pad(q_bthd, ((0, 0), (0, q_pad), (0, 0), (0, 0)))
        q_seg, q_order = jnp.pad(q_seg, ((0, 0), (0, q_pad))), jnp.pad(q_order, ((0, 0), (0, q_pad)))
    if k_pad:
        k_bskd = jnp.pad(k_bskd, ((0, 0), (0, k_pad), (0, 0), (0, 0)))
        v_bskd = jnp.pad(v_bskd, ((0, 0), (0, k_pad), (0, 0), (0, 0)))
        k_seg, k_order = jnp.pad(k_seg, ((0, 0), (0, k_pad))), jnp.pad(k_order, ((0, 0), (0, k_pad)))
    if block_pairs_bij is None:
        block_pairs_bij = keyed_block_pairs(q_seg, q_order, k_seg, k_order, block)
    expected = (q_bthd.shape[0], q_bthd.shape[1] // block, k_bskd.shape[1] // block)
    if tuple(block_pairs_bij.shape) != expected:
        raise ValueError(f"block_pairs has shape {tuple(block_pairs_bij.shape)}, expected {expected} for blocks of "
                         f"{block} tokens")
    keys = (q_seg, q_order, k_seg, k_order)
    out = _keyed_core(q_bthd, k_bskd, v_bskd, keys, block_pairs_bij.astype(bool), block)
    return out[:, :t]


def _pair_mask(keys_blocks, row, i, j, groups):
    """Mask [G*blk_q, blk_k] for query block i and key block j of one row, repeated for the G query heads that
    share a key/value head (rows group-major, like attention._rows)."""
    q_seg, q_order, k_seg, k_order = keys_blocks
    mask = keyed_mask(_read_block(q_seg, row, i)[None], _read_block(q_order, row, i)[None],
                      _read_block(k_seg, row, j)[None], _read_block(k_order, row, j)[None])[0]
    return jnp.tile(mask, (groups, 1))


def _keys_to_blocks(keys, block):
    """(q_seg, q_order, k_seg, k_order) [B, T] / [B, S] -> [B, nq, blk] / [B, nk, blk]."""
    return tuple(x.reshape(x.shape[0], x.shape[1] // block, block) for x in keys)


def _scores(q_krd, k_ksd, mask_rs, scale):
    """Scaled fp32 scores [KV, rows, blk_k], masked entries set to a finite minimum."""
    scores = jnp.einsum("krd,ksd->krs", q_krd, k_ksd, preferred_element_type=jnp.float32) * scale
    return jnp.where(mask_rs[None], scores, _MASKED)


def _keyed_forward(q_bthd, k_bskd, v_bskd, keys, block_pairs_bij, block, *, part=False):
    """Forward pass: the output [B, T, H, D] and the per-query log-sum-exp [B, nq, KV, G, blk].

    part=False: the output in q's dtype, lse 0 for a query with no allowed key. part=True (one part of the keys, to
    be merged with others: `keyed_attention_part`): the output in fp32 and lse `_MASKED` for such a query."""
    kv = k_bskd.shape[2]
    q_blocks, k_blocks, v_blocks = _q_to_blocks(q_bthd, kv, block), _kv_to_blocks(k_bskd, block), _kv_to_blocks(
        v_bskd, block)
    keys_blocks = _keys_to_blocks(keys, block)
    b, nq, _, g, _, d = q_blocks.shape
    scale = d**-0.5
    visit, count = visit_lists(block_pairs_bij)
    zero = _varying_zero(q_bthd, k_bskd, v_bskd, *keys)

    def one_query_block(index, state):
        out_blocks, lse_blocks = state
        row, i = index // nq, index % nq
        q_blk = _rows(_read_block(q_blocks, row, i))

        def body(carry):
            n, m, l, acc = carry
            j = visit[row, i, n]
            mask = _pair_mask(keys_blocks, row, i, j, g)
            scores = _scores(q_blk, _read_block(k_blocks, row, j), mask, scale)
            m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
            probs = jnp.where(mask[None], jnp.exp(scores - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            l_new = l * correction + jnp.sum(probs, axis=-1)
            pv = jnp.einsum("krs,ksd->krd", probs.astype(v_blocks.dtype), _read_block(v_blocks, row, j),
                            preferred_element_type=jnp.float32)
            return n + 1, m_new, l_new, acc * correction[..., None] + pv

        init = (
            jnp.zeros((), jnp.int32),
            jnp.full((kv, g * block), _MASKED, jnp.float32) + zero,
            jnp.zeros((kv, g * block), jnp.float32) + zero,
            jnp.zeros((kv, g * block, d), jnp.float32) + zero,
        )
        _, m, l, acc = jax.lax.while_loop(lambda c: c[0] < count[row, i], body, init)
        has_keys = l > 0
        out_blk = jnp.where(has_keys[..., None], acc / jnp.where(has_keys, l, 1.0)[..., None], 0.0)
        lse_blk = jnp.where(has_keys, m + jnp.log(jnp.where(has_keys, l, 1.0)), _MASKED if part else 0.0)
        return (_write_block(out_blocks, row, i, out_blk.reshape(kv, g, block, d)),
                _write_block(lse_blocks, row, i, lse_blk.reshape(kv, g, block)))

    out_blocks = (jnp.zeros(q_blocks.shape, jnp.float32) + zero).astype(jnp.float32 if part else q_bthd.dtype)
    lse_blocks = jnp.zeros((b, nq, kv, g, block), jnp.float32) + zero
    out_blocks, lse_blocks = jax.lax.fori_loop(0, b * nq, one_query_block, (out_blocks, lse_blocks))
    return _q_blocks_to_bthd(out_blocks), lse_blocks


def _keyed_backward(q_bthd, k_bskd, v_bskd, keys, block_pairs_bij, block, out_bthd, lse_blocks, dout_bthd, *,
                    part=False):
    """Backward pass over the same block pairs as the forward (probabilities recomputed from the saved lse).
    part=True: the gradients stay fp32 (summed with other parts' by the caller)."""
    kv = k_bskd.shape[2]
    q_blocks, k_blocks, v_blocks = _q_to_blocks(q_bthd, kv, block), _kv_to_blocks(k_bskd, block), _kv_to_blocks(
        v_bskd, block)
    keys_blocks = _keys_to_blocks(keys, block)
    b, nq, _, g, _, d = q_blocks.shape
    scale = d**-0.5
    visit, count = visit_lists(block_pairs_bij)
    dout_blocks = _q_to_blocks(dout_bthd, kv, block)
    out_blocks = _q_to_blocks(out_bthd, kv, block)
    # delta = rowsum(dO * O): the softmax-Jacobian correction, one scalar per query
    delta_blocks = jnp.sum(dout_blocks.astype(jnp.float32) * out_blocks.astype(jnp.float32), axis=-1)
    zero = _varying_zero(q_bthd, k_bskd, v_bskd, *keys, dout_bthd)

    def one_query_block(index, state):
        dq_blocks, dk_blocks, dv_blocks = state
        row, i = index // nq, index % nq
        q_blk = _rows(_read_block(q_blocks, row, i))
        dout_blk = _rows(_read_block(dout_blocks, row, i))
        lse_blk = _rows(_read_block(lse_blocks, row, i))
        delta_blk = _rows(_read_block(delta_blocks, row, i))

        def body(carry):
            n, dq_acc, dk_blocks, dv_blocks = carry
            j = visit[row, i, n]
            k_blk, v_blk = _read_block(k_blocks, row, j), _read_block(v_blocks, row, j)
            mask = _pair_mask(keys_blocks, row, i, j, g)
            scores = _scores(q_blk, k_blk, mask, scale)
            probs = jnp.where(mask[None], jnp.exp(scores - lse_blk[..., None]), 0.0)
            dv_j = jnp.einsum("krs,krd->ksd", probs.astype(dout_blk.dtype), dout_blk,
                              preferred_element_type=jnp.float32)
            dprobs = jnp.einsum("krd,ksd->krs", dout_blk, v_blk, preferred_element_type=jnp.float32)
            dscores = (probs * (dprobs - delta_blk[..., None]) * scale).astype(q_blk.dtype)
            dq_acc = dq_acc + jnp.einsum("krs,ksd->krd", dscores, k_blk, preferred_element_type=jnp.float32)
            dk_j = jnp.einsum("krs,krd->ksd", dscores, q_blk, preferred_element_type=jnp.float32)
            dk_blocks = _write_block(dk_blocks, row, j, _read_block(dk_blocks, row, j) + dk_j)
            dv_blocks = _write_block(dv_blocks, row, j, _read_block(dv_blocks, row, j) + dv_j)
            return n + 1, dq_acc, dk_blocks, dv_blocks

        init = (jnp.zeros((), jnp.int32), jnp.zeros((kv, g * block, d), jnp.float32) + zero, dk_blocks, dv_blocks)
        _, dq_acc, dk_blocks, dv_blocks = jax.lax.while_loop(lambda c: c[0] < count[row, i], body, init)
        return _write_block(dq_blocks, row, i, dq_acc.reshape(kv, g, block, d)), dk_blocks, dv_blocks

    dq_blocks = jnp.zeros(q_blocks.shape, jnp.float32) + zero
    dk_blocks = jnp.zeros(k_blocks.shape, jnp.float32) + zero
    dv_blocks = jnp.zeros(v_blocks.shape, jnp.float32) + zero
    dq_blocks, dk_blocks, dv_blocks = jax.lax.fori_loop(0, b * nq, one_query_block, (dq_blocks, dk_blocks, dv_blocks))
    dq, dk, dv = _q_blocks_to_bthd(dq_blocks), _kv_blocks_to_btkd(dk_blocks), _kv_blocks_to_btkd(dv_blocks)
    if part:
        return dq, dk, dv
    return dq.astype(q_bthd.dtype), dk.astype(k_bskd.dtype), dv.astype(v_bskd.dtype)


# ----------------------------------------------------------------------------------------------------------
# One part of the keys at a time (context parallelism that holds one member's keys at once)
# ----------------------------------------------------------------------------------------------------------


def keyed_attention_part(q_bthd, k_bskd, v_bskd, keys, block_pairs_bij, block: int):
    """The attention of the queries against one part of the keys (no custom_vjp: the caller differentiates).

    Operands already padded to multiples of `block`; keys = (q_seg, q_order, k_seg, k_order) int32. Returns the
    part's output [B, T, H, D] in fp32 (0 for a query with no allowed key in the part) and its log-sum-exp
    [B, T/blk, KV, G, blk] (`_MASKED` there). Parts merge exactly with `merge_keyed_parts`."""
    return _keyed_forward(q_bthd, k_bskd, v_bskd, keys, block_pairs_bij, block, part=True)


def merge_keyed_parts(out_a, lse_a, out_b, lse_b):
    """The attention over the union of two parts of the keys from each part's (fp32 output [B, T, H, D],
    log-sum-exp [B, nq, KV, G, blk]): the outputs weighted by their share of the softmax mass. A query with no
    allowed key in either part keeps output 0 and an lse near `_MASKED`."""
    top = jnp.maximum(lse_a, lse_b)
    weight_a, weight_b = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
    total = weight_a + weight_b

    def as_rows(w):  # [B, nq, KV, G, blk] -> [B, T, H, 1] (the q block layout's inverse)
        return _q_blocks_to_bthd(w[..., None])

    return out_a * as_rows(weight_a / total) + out_b * as_rows(weight_b / total), top + jnp.log(total)


def keyed_attention_part_grads(q_bthd, k_bskd, v_bskd, keys, block_pairs_bij, block: int, out_bthd, lse_blocks,
                               dout_bthd):
    """fp32 (dq, dk, dv) of one part of the keys, given the merged output and log-sum-exp of all parts (so the
    probabilities are the whole softmax's): summed over the parts, dq is the whole attention's; dk, dv are this
    part's keys' own. Same operand conventions as `keyed_attention_part`."""
    return _keyed_backward(q_bthd, k_bskd, v_bskd, keys, block_pairs_bij, block, out_bthd, lse_blocks, dout_bthd,
                           part=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _keyed_core(q_bthd, k_bskd, v_bskd, keys, block_pairs_bij, block):
    return _keyed_forward(q_bthd, k_bskd, v_bskd, keys, block_pairs_bij, block)[0]


def _keyed_core_fwd(q_bthd, k_bskd, v_bskd, keys, block_pairs_bij, block):
    out, lse = _keyed_forward(q_bthd, k_bskd, v_bskd, keys, block_pairs_bij, block)
    return out, (q_bthd, k_bskd, v_bskd, keys, block_pairs_bij, out, lse)


def _keyed_core_bwd(block, residuals, dout_bthd):
    q_bthd, k_bskd, v_bskd, keys, block_pairs_bij, out, lse = residuals
    dq, dk, dv = _keyed_backward(q_bthd, k_bskd, v_bskd, keys, block_pairs_bij, block, out, lse, dout_bthd)
    return dq, dk, dv, (None,) * len(keys), None


_keyed_core.defvjp(_keyed_core_fwd, _keyed_core_bwd)
