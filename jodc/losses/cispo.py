"""CISPO: clip the importance-sampling weight, never the token's gradient.

MiniMax-M1 technical report (arXiv 2506.13585). PPO's clip zeroes the gradient of tokens whose ratio left the
clip range, which in LLM RL are often rare "fork" tokens. CISPO keeps every token and bounds its weight instead:

    loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t log pi(a_t)

Here the value reported is -A_t clip(r_t) (the same gradient; see ``straight_through``). MiniMax-M1 leaves the
lower side unbounded (``clip_low=None``) and tunes only the upper bound; the default upper truncation
1 + clip_high = 5 is jodc's choice of a loose cap, not a published constant.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jodc.losses._checks import check_nonnegative
from jodc.losses._policy import TokenBatch, clamped_exp, straight_through
from jodc.losses.spec import policy_loss


@policy_loss("cispo_loss", anchor="old_logprobs")
def cispo_loss(t: TokenBatch, *, clip_low: float | None = None, clip_high: float | None = 4.0):
    """CISPO loss from logits (arguments as ``ppo_loss``; None disables a bound).

    Returns (loss, metrics): clip_fraction (weights truncated on either side), ratio_mean, entropy."""
    for name, bound in (("clip_low", clip_low), ("clip_high", clip_high)):
        if bound is not None:
            check_nonnegative("cispo_loss", name, bound)
    ratio = clamped_exp(jax.lax.stop_gradient(t.logprobs) - t.fields["old_logprobs"])
    low = -jnp.inf if clip_low is None else 1.0 - clip_low
    high = jnp.inf if clip_high is None else 1.0 + clip_high
    weight = jnp.clip(ratio, low, high)
    per_token = -t.fields["advantages"] * straight_through(weight, t.logprobs)
    return per_token, {"clip_fraction": (ratio < low) | (ratio > high), "ratio_mean": ratio}
