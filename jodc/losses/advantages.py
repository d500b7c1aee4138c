"""Group-relative advantages (GRPO and Dr.GRPO).

GRPO (Shao et al. 2024, arXiv 2402.03300) samples ``group_size`` responses per prompt and uses the reward's
deviation from its group mean, divided by the group's (unbiased) standard deviation:

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)

Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783) drops the division by the
standard deviation (``normalize_std=False``), which biases updates toward too-easy / too-hard prompts, and pairs it
with ``seq-mean-token-sum-norm`` aggregation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jodc.losses.logprobs import compute_dtype


def grpo_advantages(rewards, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6) -> jax.Array:
    """Per-response advantages from rewards [N] laid out group after group (N = num_prompts * group_size).

    Returns [N] in fp32 (fp64 for fp64 rewards). The standard deviation is the unbiased one (ddof = 1); a group
    of one response, or whose rewards are all equal, has advantage 0 when ``normalize_std``.
    Broadcast to tokens with ``advantages[:, None] * mask`` (or per segment for packed rows)."""
    fn = "grpo_advantages"
    shape = jnp.shape(rewards)
    if len(shape) != 1:
        raise ValueError(f"{fn}: rewards must have shape [N], got shape {shape}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{fn}: group_size must be a positive int, got {group_size!r}")
    if shape[0] % group_size != 0:
        raise ValueError(f"{fn}: rewards has shape {shape}, not a multiple of group_size={group_size}")
    if not eps >= 0:
        raise ValueError(f"{fn}: eps must be >= 0, got {eps!r}")
    rewards = jnp.asarray(rewards)
    dtype = compute_dtype(rewards.dtype) if jnp.issubdtype(rewards.dtype, jnp.floating) else jnp.float32
    r_gk = rewards.astype(dtype).reshape(-1, group_size)
    centered_gk = r_gk - jnp.mean(r_gk, axis=1, keepdims=True)
    if normalize_std:
        if group_size == 1:
            return jnp.zeros(shape, dtype)
        std_g1 = jnp.sqrt(jnp.sum(jnp.square(centered_gk), axis=1, keepdims=True) / (group_size - 1))
        # A group whose rewards are all equal carries no signal: advantage 0 (also when eps = 0).
        centered_gk = jnp.where(std_g1 > 0, centered_gk / (std_g1 + eps), 0.0)
    return centered_gk.reshape(shape)
