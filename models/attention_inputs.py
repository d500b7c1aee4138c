"""The operands every attention implementation takes, checked in one place: `attention.py`'s dense and blockwise
paths and `flash_attention.py`'s fused kernel (which attention.py imports only when it is used) both call
`check_attention_inputs`, so neither imports the other for it."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def check_attention_inputs(q_bthd: jax.Array, k_btkd: jax.Array, v_btkd: jax.Array, segment_ids_bt: jax.Array):
    """Raise ValueError naming the problem if the attention operands do not fit together."""
    if q_bthd.ndim != 4 or k_btkd.ndim != 4 or v_btkd.ndim != 4:
        raise ValueError(
            f"attention expects q [B,T,H,D], k and v [B,T,KV,D]; got {q_bthd.shape}, {k_btkd.shape}, {v_btkd.shape}"
        )
    if k_btkd.shape != v_btkd.shape:
        raise ValueError(f"k {k_btkd.shape} and v {v_btkd.shape} must have the same shape")
    b, t, h, d = q_bthd.shape
    if k_btkd.shape[:2] != (b, t) or k_btkd.shape[3] != d:
        raise ValueError(f"k {k_btkd.shape} does not match q {q_bthd.shape} in batch, length or head_dim")
    if h % k_btkd.shape[2]:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({k_btkd.shape[2]})")
    if segment_ids_bt.shape != (b, t):
        raise ValueError(f"segment_ids shape {segment_ids_bt.shape} must be [B, T] = {(b, t)}")
    if not jnp.issubdtype(segment_ids_bt.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be integers, got {segment_ids_bt.dtype}")
