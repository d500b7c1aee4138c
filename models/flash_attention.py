"""Segment-aware causal attention on a fused GPU kernel: jax's Pallas flash attention (Triton backend).

On a GPU the blockwise attention of attention.py is the wrong shape: a data-dependent loop of small `jnp` blocks
cannot keep tensor cores busy. jax ships a fused flash-attention kernel written in Pallas
(`jax.experimental.pallas.ops.gpu.attention.mha`) that takes per-token `segment_ids` and a causal flag, with a
fused backward pass, which is exactly the packed-row convention of this package: a query attends to the keys of
its own segment at columns <= its own. This module adapts it to that convention:

- grouped-query attention: k and v are repeated per query head group (the kernel wants equal head counts; the
  repeat's transpose sums the groups' key / value gradients);
- padding (segment 0): the kernel lets padding queries attend to padding keys like any segment; their outputs
  are set to exactly 0 here, as `dense_attention` defines them, so nothing flows back from them;
- T that is not a multiple of the block: the row is padded with padding tokens and cut back.

Scale 1/sqrt(head_dim), fp32 softmax statistics and accumulation inside the kernel, output in q's dtype. Cost is
that of causal dense attention at fused-kernel speed (blocks of other segments are masked, not skipped): the
blockwise path stays the CPU implementation and the reference.

Off a GPU the kernel runs in Pallas' interpret mode (the same kernel code, executed op by op: slow, for tests).
jax marks this module deprecated in favour of the separate `tokamax` package from jax 0.11 on; it is what the
GPU image ships, so it is used here, with the warning silenced at import.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from .attention_inputs import check_attention_inputs

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import attention as _pallas_attention

#: The kernel's tiles must be powers of two of at least 16 rows (Triton's matrix-multiply minimum).
MIN_BLOCK = 16
#: The forward tile (jax's default for this kernel); independent of the blockwise path's `attention_block_size`.
FLASH_BLOCK = 128
#: Tiles of the backward kernels (jax's defaults; tuned on the GPU, see docs/models.md).
BACKWARD_BLOCK = 32


def flash_block(t: int, block_size: int) -> int:
    """The kernel's query / key tile for a row of `t` tokens: `block_size` (a power of two >= 16), or the
    smallest power of two >= 16 that holds the whole row when that is smaller."""
    if not isinstance(block_size, int) or block_size < MIN_BLOCK or block_size & (block_size - 1):
        raise ValueError(f"flash attention's block_size must be a power of two >= {MIN_BLOCK}, got {block_size!r}")
    whole_row = max(MIN_BLOCK, 1 << max(t - 1, 0).bit_length())
    return min(block_size, whole_row)


def flash_attention(q_bthd: jax.Array, k_btkd: jax.Array, v_btkd: jax.Array, segment_ids_bt: jax.Array, *,
                    block_size: int = FLASH_BLOCK, interpret: bool | None = None) -> jax.Array:
    """Segment-aware causal attention (the result of `dense_attention`) with the fused Pallas kernel.

    q [B, T, H, D], k and v [B, T, KV, D] with H a multiple of KV, `segment_ids_bt` int [B, T] (0 = padding).
    `interpret`: None runs the compiled kernel on a GPU backend and interpret mode elsewhere.
    """
    check_attention_inputs(q_bthd, k_btkd, v_btkd, segment_ids_bt)
    b, t, h, d = q_bthd.shape
    block = flash_block(t, block_size)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    padded_t = -(-t // block) * block
    seg_bt = segment_ids_bt.astype(jnp.int32)
    if padded_t != t:
        pad = ((0, 0), (0, padded_t - t), (0, 0), (0, 0))
        q_bthd, k_btkd, v_btkd = jnp.pad(q_bthd, pad), jnp.pad(k_btkd, pad), jnp.pad(v_btkd, pad)
        seg_bt = jnp.pad(seg_bt, ((0, 0), (0, padded_t - t)))
    groups = h // k_btkd.shape[2]
    if groups > 1:
        k_btkd, v_btkd = jnp.repeat(k_btkd, groups, axis=2), jnp.repeat(v_btkd, groups, axis=2)
    backward = min(BACKWARD_BLOCK, block)
    sizes = _pallas_attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=backward,
                                         block_kv_dkv=backward, block_q_dq=backward, block_kv_dq=backward)
    out_bthd = _pallas_attention.mha(q_bthd, k_btkd, v_btkd, seg_bt, sm_scale=d**-0.5, causal=True,
                                     block_sizes=sizes, interpret=interpret)
    out_bthd = jnp.where((seg_bt > 0)[:, :, None, None], out_bthd, jnp.zeros((), out_bthd.dtype))
    return out_bthd[:, :t]
