"""Causal grouped-query attention over packed rows, with a blockwise path whose cost follows the data.

Segment convention (shared with the planners): `segment_ids_bt` is int32 [B, T]; 0 marks padding, 1, 2, ...
number the sequences packed into a row, each occupying a contiguous run of columns. A query attends to the keys
of its own segment at columns <= its own. Padding queries attend to nothing and their output is exactly 0 (never
NaN), so their gradients are 0 as well.

Two implementations give the same result:
- `dense_attention`: the [T, T] masked reference (cost T^2 whatever the row holds).
- `blockwise_attention`: splits the row into blocks of `block_size`; for every query block it loops only over
  the key blocks that share a segment with it (found from per-block min/max segment ids, at run time), with an
  online softmax. A row of many short sequences therefore touches roughly sum(s_i^2) / block_size^2 block
  pairs instead of T^2 / 2. The backward pass is a hand-written blockwise pass over the same block pairs
  (`jax.custom_vjp`), because reverse-mode AD cannot go through a loop whose trip count is data.

Both are pure jnp/lax and work under jit, vjp, vmap and shard_map. Shapes: q [B, T, H, D], k and v
[B, T, KV, D] with H a multiple of KV (grouped-query attention). Scores, softmax and accumulation are fp32;
the output has q's dtype.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .attention_inputs import check_attention_inputs

_MASKED = -1e30  # finite "minus infinity": a fully masked row gives finite values, never NaN


def segment_mask(segment_q_bq: jax.Array, segment_k_bk: jax.Array, q_index_q: jax.Array, k_index_k: jax.Array):
    """Boolean [B, Q, K]: same non-zero segment and key column <= query column."""
    same_segment = segment_q_bq[:, :, None] == segment_k_bk[:, None, :]
    causal = k_index_k[None, None, :] <= q_index_q[None, :, None]
    valid_query = (segment_q_bq > 0)[:, :, None]
    return same_segment & causal & valid_query


def masked_attention(q_bqhd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array, mask_bqs: jax.Array) -> jax.Array:
    """Softmax attention with an explicit boolean mask [B, Q, S]; rows with no allowed key give 0.

    Used by the dense reference and by cached decoding (where queries and keys have different lengths).
    """
    b, q_len, h, d = q_bqhd.shape
    kv_heads = k_bskd.shape[2]
    q_bqkgd = q_bqhd.reshape(b, q_len, kv_heads, h // kv_heads, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q_bqkgd, k_bskd, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    mask = mask_bqs[:, None, None, :, :]
    probs = jax.nn.softmax(jnp.where(mask, scores, _MASKED), axis=-1)
    probs = jnp.where(mask, probs, 0.0)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v_bskd.dtype), v_bskd, preferred_element_type=jnp.float32)
    return out.reshape(b, q_len, h, d).astype(q_bqhd.dtype)


def dense_attention(q_bthd: jax.Array, k_btkd: jax.Array, v_btkd: jax.Array, segment_ids_bt: jax.Array) -> jax.Array:
    """Reference segment-aware causal attention with a full [T, T] mask (cost T^2 per row)."""
    check_attention_inputs(q_bthd, k_btkd, v_btkd, segment_ids_bt)
    index = jnp.arange(q_bthd.shape[1])
    mask = segment_mask(segment_ids_bt, segment_ids_bt, index, index)
    return masked_attention(q_bthd, k_btkd, v_btkd, mask)


#: The implementations `attention` selects by name; "auto" is "flash" on a GPU backend, "blockwise" elsewhere.
ATTENTION_IMPLS = ("auto", "blockwise", "dense", "flash")


def resolve_impl(impl: str) -> str:
    """The implementation "auto" stands for on the default backend (a fixed name passes through)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; expected one of {ATTENTION_IMPLS}")
    if impl == "auto":
        return "flash" if jax.default_backend() == "gpu" else "blockwise"
    return impl


def attention(q_bthd, k_btkd, v_btkd, segment_ids_bt, *, impl: str = "auto", block_size: int = 128):
    """Segment-aware causal attention by name: "blockwise" (skips the block pairs of different segments: the CPU
    path), "flash" (the fused Pallas kernel of flash_attention.py: the GPU path; interpret mode off a GPU), "dense"
    (the reference), or "auto" (flash on a GPU backend, else blockwise). `block_size` is the blockwise path's block; the
    flash kernel keeps its own tiles (flash_attention.FLASH_BLOCK)."""
    impl = resolve_impl(impl)
    if impl == "blockwise":
        return blockwise_attention(q_bthd, k_btkd, v_btkd, segment_ids_bt, block_size=block_size)
    if impl == "flash":
        from .flash_attention import flash_attention  # imports Pallas: only when it is used

        return flash_attention(q_bthd, k_btkd, v_btkd, segment_ids_bt)  # its own tiles: the kernel's
    return dense_attention(q_bthd, k_btkd, v_btkd, segment_ids_bt)


# ----------------------------------------------------------------------------------------------------------
# Blockwise attention
# ----------------------------------------------------------------------------------------------------------


def block_interactions(segment_ids_bt: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """Which (query block, key block) pairs can interact, from the segment ids (run time data).

    Returns `overlap_bij` bool [B, nb, nb] (key block j <= query block i and the ranges of non-zero segment ids
    of the two blocks intersect) and `first_key_block_bi` int32 [B, nb], the smallest such j (i + 1 when the
    query block holds only padding, i.e. nothing to do). With contiguous, increasing segment ids (the packing
    convention) every j in [first_key_block, i] overlaps, so the loop visits exactly the useful blocks;
    other layouts stay correct (non-overlapping blocks in that range are skipped one by one).
    `T` must be a multiple of `block_size`.
    """
    b, t = segment_ids_bt.shape
    nb = t // block_size
    seg = segment_ids_bt.reshape(b, nb, block_size)
    big = jnp.iinfo(jnp.int32).max
    seg_min = jnp.min(jnp.where(seg > 0, seg, big), axis=-1)  # [B, nb]; big when the block is all padding
    seg_max = jnp.max(seg, axis=-1)  # [B, nb]; 0 when the block is all padding
    overlap = (seg_min[:, :, None] <= seg_max[:, None, :]) & (seg_min[:, None, :] <= seg_max[:, :, None])
    causal = jnp.tril(jnp.ones((nb, nb), dtype=bool))
    overlap = overlap & causal[None]
    has_any = jnp.any(overlap, axis=-1)
    first = jnp.where(has_any, jnp.argmax(overlap, axis=-1), jnp.arange(nb)[None, :] + 1)
    return overlap, first.astype(jnp.int32)


def blockwise_attention(q_bthd, k_btkd, v_btkd, segment_ids_bt, *, block_size: int = 128) -> jax.Array:
    """Segment-aware causal attention that only computes block pairs sharing a segment.

    Same result as `dense_attention` (up to fp32 reassociation). T need not be a multiple of block_size: the
    row is padded with padding tokens (segment 0) internally; rows shorter than block_size use one block.
    """
    check_attention_inputs(q_bthd, k_btkd, v_btkd, segment_ids_bt)
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    b, t, h, d = q_bthd.shape
    block = min(block_size, t)
    padded_t = -(-t // block) * block
    seg = segment_ids_bt.astype(jnp.int32)
    if padded_t != t:
        pad = padded_t - t
        q_bthd = jnp.pad(q_bthd, ((0, 0), (0, pad), (0, 0), (0, 0)))
        k_btkd = jnp.pad(k_btkd, ((0, 0), (0, pad), (0, 0), (0, 0)))
        v_btkd = jnp.pad(v_btkd, ((0, 0), (0, pad), (0, 0), (0, 0)))
        seg = jnp.pad(seg, ((0, 0), (0, pad)))
    out = _blockwise_core(q_bthd, k_btkd, v_btkd, seg, block)
    return out[:, :t]


def _q_to_blocks(x_bthd, kv_heads, block):
    """[B, T, H, D] -> block-major [B, nb, KV, G, blk, D] (query heads grouped by their key/value head)."""
    b, t, h, d = x_bthd.shape
    return x_bthd.reshape(b, t // block, block, kv_heads, h // kv_heads, d).transpose(0, 1, 3, 4, 2, 5)


def _kv_to_blocks(x_btkd, block):
    """[B, T, KV, D] -> block-major [B, nb, KV, blk, D]."""
    b, t, kv, d = x_btkd.shape
    return x_btkd.reshape(b, t // block, block, kv, d).transpose(0, 1, 3, 2, 4)


def _to_blocks(q_bthd, k_btkd, v_btkd, seg_bt, block):
    """Block-major q, k, v and segment ids [B, nb, blk]."""
    kv = k_btkd.shape[2]
    b, t = seg_bt.shape
    return (_q_to_blocks(q_bthd, kv, block), _kv_to_blocks(k_btkd, block), _kv_to_blocks(v_btkd, block),
            seg_bt.reshape(b, t // block, block))


def _q_blocks_to_bthd(x_bnkgqd):
    """Inverse of the q block layout: [B, nb, KV, G, blk, D] -> [B, T, H, D]."""
    b, nb, kv, g, blk, d = x_bnkgqd.shape
    return x_bnkgqd.transpose(0, 1, 4, 2, 3, 5).reshape(b, nb * blk, kv * g, d)


def _kv_blocks_to_btkd(x_bnksd):
    """Inverse of the k/v block layout: [B, nb, KV, blk, D] -> [B, T, KV, D]."""
    b, nb, kv, blk, d = x_bnksd.shape
    return x_bnksd.transpose(0, 1, 3, 2, 4).reshape(b, nb * blk, kv, d)


def _varying_zero(*refs) -> jax.Array:
    """An fp32 scalar 0 that, inside shard_map, varies over the same mesh axes as `refs`.

    Loop carries must have one type across iterations; adding this to freshly created accumulators gives them
    the varying-ness their updates will have (outside shard_map it is just 0).
    """
    zero = jnp.zeros((), jnp.float32)
    for ref in refs:
        zero = zero + jnp.zeros_like(ref, dtype=jnp.float32, shape=())
    return zero


def _read_block(blocks, row, index):
    """blocks[row, index] with traced indices, as a dynamic slice (no gather)."""
    starts = (row, index) + (0,) * (blocks.ndim - 2)
    return jax.lax.dynamic_slice(blocks, starts, (1, 1) + blocks.shape[2:])[0, 0]


def _write_block(blocks, row, index, value):
    """blocks with blocks[row, index] = value, as an in-place dynamic update."""
    starts = (row, index) + (0,) * (blocks.ndim - 2)
    return jax.lax.dynamic_update_slice(blocks, value[None, None].astype(blocks.dtype), starts)


def _pair_mask(seg_q, seg_k, i, j, block, groups):
    """Mask [G*blk_q, blk_k] for query block i and key block j of one row, repeated for the G query heads
    that share a key/value head (rows are (group, query) pairs, group-major, like `_rows`)."""
    q_index = i * block + jnp.arange(block)
    k_index = j * block + jnp.arange(block)
    return jnp.tile(segment_mask(seg_q[None], seg_k[None], q_index, k_index)[0], (groups, 1))


def _rows(x_kgq):
    """Merge the (group, query) axes 1 and 2 into one row axis, so every block product is a batched GEMM
    with one contracting axis (fast on XLA:CPU; a two-axis contraction makes it transpose operands)."""
    return x_kgq.reshape(x_kgq.shape[0], x_kgq.shape[1] * x_kgq.shape[2], *x_kgq.shape[3:])


def _pair_scores(q_krd, k_ksd, mask_rs, scale):
    """Scaled fp32 scores [KV, rows, blk_k], masked entries set to a finite minimum."""
    scores = jnp.einsum("krd,ksd->krs", q_krd, k_ksd, preferred_element_type=jnp.float32) * scale
    return jnp.where(mask_rs[None], scores, _MASKED)


def _blockwise_forward(q_bthd, k_btkd, v_btkd, seg_bt, block):
    """Forward pass. Returns the output [B, T, H, D] and the per-query log-sum-exp [B, nb, KV, G, blk]."""
    q_blocks, k_blocks, v_blocks, seg_blocks = _to_blocks(q_bthd, k_btkd, v_btkd, seg_bt, block)
    b, nb, kv, g, _, d = q_blocks.shape
    scale = d**-0.5
    overlap, first_key_block = block_interactions(seg_bt, block)
    zero = _varying_zero(q_bthd, k_btkd, v_btkd, seg_bt)

    def one_query_block(index, state):
        out_blocks, lse_blocks = state
        row, i = index // nb, index % nb
        q_blk = _rows(_read_block(q_blocks, row, i))
        seg_q = _read_block(seg_blocks, row, i)

        def visit(j, m, l, acc):
            mask = _pair_mask(seg_q, _read_block(seg_blocks, row, j), i, j, block, g)
            scores = _pair_scores(q_blk, _read_block(k_blocks, row, j), mask, scale)
            m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
            probs = jnp.where(mask[None], jnp.exp(scores - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            l_new = l * correction + jnp.sum(probs, axis=-1)
            pv = jnp.einsum("krs,ksd->krd", probs.astype(v_blocks.dtype), _read_block(v_blocks, row, j),
                            preferred_element_type=jnp.float32)
            return m_new, l_new, acc * correction[..., None] + pv

        def body(carry):
            j, m, l, acc = carry
            m, l, acc = jax.lax.cond(overlap[row, i, j], visit, lambda j, m, l, acc: (m, l, acc), j, m, l, acc)
            return j + 1, m, l, acc

        init = (
            first_key_block[row, i],
            jnp.full((kv, g * block), _MASKED, jnp.float32) + zero,
            jnp.zeros((kv, g * block), jnp.float32) + zero,
            jnp.zeros((kv, g * block, d), jnp.float32) + zero,
        )
        _, m, l, acc = jax.lax.while_loop(lambda c: c[0] <= i, body, init)
        has_keys = l > 0
        out_blk = jnp.where(has_keys[..., None], acc / jnp.where(has_keys, l, 1.0)[..., None], 0.0)
        lse_blk = jnp.where(has_keys, m + jnp.log(jnp.where(has_keys, l, 1.0)), 0.0)
        return (_write_block(out_blocks, row, i, out_blk.reshape(kv, g, block, d)),
                _write_block(lse_blocks, row, i, lse_blk.reshape(kv, g, block)))

    out_blocks = (jnp.zeros(q_blocks.shape, jnp.float32) + zero).astype(q_bthd.dtype)
    lse_blocks = jnp.zeros((b, nb, kv, g, block), jnp.float32) + zero
    out_blocks, lse_blocks = jax.lax.fori_loop(0, b * nb, one_query_block, (out_blocks, lse_blocks))
    return _q_blocks_to_bthd(out_blocks), lse_blocks


def _blockwise_backward(q_bthd, k_btkd, v_btkd, seg_bt, block, out_bthd, lse_blocks, dout_bthd):
    """Backward pass over the same block pairs as the forward (FlashAttention-2 style recomputation)."""
    q_blocks, k_blocks, v_blocks, seg_blocks = _to_blocks(q_bthd, k_btkd, v_btkd, seg_bt, block)
    b, nb, kv, g, _, d = q_blocks.shape
    scale = d**-0.5
    overlap, first_key_block = block_interactions(seg_bt, block)
    dout_blocks = _q_to_blocks(dout_bthd, kv, block)
    out_blocks = _q_to_blocks(out_bthd, kv, block)
    # delta_i = rowsum(dO_i * O_i): the softmax-Jacobian correction term, one scalar per query.
    delta_blocks = jnp.sum(dout_blocks.astype(jnp.float32) * out_blocks.astype(jnp.float32), axis=-1)
    zero = _varying_zero(q_bthd, k_btkd, v_btkd, seg_bt, dout_bthd)

    def one_query_block(index, state):
        dq_blocks, dk_blocks, dv_blocks = state
        row, i = index // nb, index % nb
        q_blk = _rows(_read_block(q_blocks, row, i))
        dout_blk = _rows(_read_block(dout_blocks, row, i))
        lse_blk = _rows(_read_block(lse_blocks, row, i))
        delta_blk = _rows(_read_block(delta_blocks, row, i))
        seg_q = _read_block(seg_blocks, row, i)

        def visit(j, dq_acc, dk_blocks, dv_blocks):
            k_blk, v_blk = _read_block(k_blocks, row, j), _read_block(v_blocks, row, j)
            mask = _pair_mask(seg_q, _read_block(seg_blocks, row, j), i, j, block, g)
            scores = _pair_scores(q_blk, k_blk, mask, scale)
            probs = jnp.where(mask[None], jnp.exp(scores - lse_blk[..., None]), 0.0)
            dv_j = jnp.einsum("krs,krd->ksd", probs.astype(dout_blk.dtype), dout_blk,
                              preferred_element_type=jnp.float32)
            dprobs = jnp.einsum("krd,ksd->krs", dout_blk, v_blk, preferred_element_type=jnp.float32)
            dscores = (probs * (dprobs - delta_blk[..., None]) * scale).astype(q_blk.dtype)
            dq_acc = dq_acc + jnp.einsum("krs,ksd->krd", dscores, k_blk, preferred_element_type=jnp.float32)
            dk_j = jnp.einsum("krs,krd->ksd", dscores, q_blk, preferred_element_type=jnp.float32)
            dk_blocks = _write_block(dk_blocks, row, j, _read_block(dk_blocks, row, j) + dk_j)
            dv_blocks = _write_block(dv_blocks, row, j, _read_block(dv_blocks, row, j) + dv_j)
            return dq_acc, dk_blocks, dv_blocks

        def body(carry):
            j, dq_acc, dk_blocks, dv_blocks = carry
            dq_acc, dk_blocks, dv_blocks = jax.lax.cond(
                overlap[row, i, j], visit, lambda j, *acc: acc, j, dq_acc, dk_blocks, dv_blocks)
            return j + 1, dq_acc, dk_blocks, dv_blocks

        init = (first_key_block[row, i], jnp.zeros((kv, g * block, d), jnp.float32) + zero, dk_blocks, dv_blocks)
        _, dq_acc, dk_blocks, dv_blocks = jax.lax.while_loop(lambda c: c[0] <= i, body, init)
        return _write_block(dq_blocks, row, i, dq_acc.reshape(kv, g, block, d)), dk_blocks, dv_blocks

    dq_blocks = jnp.zeros(q_blocks.shape, jnp.float32) + zero
    dk_blocks = jnp.zeros(k_blocks.shape, jnp.float32) + zero
    dv_blocks = jnp.zeros(v_blocks.shape, jnp.float32) + zero
    dq_blocks, dk_blocks, dv_blocks = jax.lax.fori_loop(
        0, b * nb, one_query_block, (dq_blocks, dk_blocks, dv_blocks))
    return (
        _q_blocks_to_bthd(dq_blocks).astype(q_bthd.dtype),
        _kv_blocks_to_btkd(dk_blocks).astype(k_btkd.dtype),
        _kv_blocks_to_btkd(dv_blocks).astype(v_btkd.dtype),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blockwise_core(q_bthd, k_btkd, v_btkd, seg_bt, block):
    return _blockwise_forward(q_bthd, k_btkd, v_btkd, seg_bt, block)[0]


def _blockwise_core_fwd(q_bthd, k_btkd, v_btkd, seg_bt, block):
    out, lse = _blockwise_forward(q_bthd, k_btkd, v_btkd, seg_bt, block)
    return out, (q_bthd, k_btkd, v_btkd, seg_bt, out, lse)


def _blockwise_core_bwd(block, residuals, dout_bthd):
    q_bthd, k_btkd, v_btkd, seg_bt, out, lse = residuals
    dq, dk, dv = _blockwise_backward(q_bthd, k_btkd, v_btkd, seg_bt, block, out, lse, dout_bthd)
    return dq, dk, dv, None


_blockwise_core.defvjp(_blockwise_core_fwd, _blockwise_core_bwd)
