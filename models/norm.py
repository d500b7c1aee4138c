"""RMSNorm as used by Llama and Qwen: statistics in fp32, result in the input dtype, then the learned scale."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """Normalise the last axis of `x` by its root mean square, then multiply by `scale`.

    The mean of squares is taken in fp32 whatever x's dtype (bf16 sums lose too much); the normalised value
    is cast back to x's dtype before the scale (also cast to x's dtype) is applied, matching the HF order of
    rounding so bf16 results agree too.
    """
    if scale.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: scale shape {scale.shape} does not match the last axis of x {x.shape}")
    x32 = x.astype(jnp.float32)
    mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    normed = (x32 * jax.lax.rsqrt(mean_square + eps)).astype(x.dtype)
    return scale.astype(x.dtype) * normed
