"""Rotary position embeddings (the "rotate half" layout used by HF Llama / Qwen), with Llama 3 and linear
frequency scaling.

The inverse frequencies are a static numpy constant computed from the config (fp32, like the reference), so they
fold into the compiled program; cos/sin are computed from the integer positions at run time, which is what lets
packed rows restart positions at 0 for every sequence.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .config import DecoderConfig, RopeScaling


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """The head_dim // 2 inverse frequencies theta^(-2i/head_dim), fp32, optionally scaled."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(theta), exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate the band in between.
    old_context = float(scaling.original_max_position_embeddings)
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(scaling.factor), inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / np.float32(scaling.factor) + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(config: DecoderConfig, positions_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables [B, T, head_dim] for integer positions, in the compute dtype.

    Angles are computed in fp32 (positions * inv_freq), duplicated over the two halves of the head.
    """
    inv_freq = rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    angles_bth = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles_btd = jnp.concatenate([angles_bth, angles_bth], axis=-1)
    dtype = config.activation_dtype
    return jnp.cos(angles_btd).astype(dtype), jnp.sin(angles_btd).astype(dtype)


def apply_rope(x_bthd: jax.Array, cos_btd: jax.Array, sin_btd: jax.Array) -> jax.Array:
    """Rotate every head of x [B, T, heads, head_dim] by its token's angle: x*cos + rotate_half(x)*sin."""
    half = x_bthd.shape[-1] // 2
    rotated = jnp.concatenate([-x_bthd[..., half:], x_bthd[..., :half]], axis=-1)
    return x_bthd * cos_btd[:, :, None, :] + rotated * sin_btd[:, :, None, :]
