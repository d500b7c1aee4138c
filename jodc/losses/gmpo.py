"""GMPO: the geometric mean of the token ratios instead of their arithmetic mean.

Zhao et al., "Geometric-Mean Policy Optimization" (arXiv 2507.20673); verl's ``geo_mean`` loss. A sequence's
objective is its (sequence-mean) advantage times the geometric mean of its clipped token ratios:

    l_t  = sign(A_t) min(sign(A_t) lr_t, sign(A_t) clip(lr_t, -clip_low, clip_high)),   lr_t = log pi - log pi_old
    loss_i = -Abar_i exp(mean_{t in i} l_t),     Abar_i = mean_{t in i} A_t

The clip acts in log space at token level and is wide: the paper's range is (e^-0.4, e^0.4), the defaults here.
The geometric mean is less sensitive to outlier token ratios than the arithmetic mean, so training is steadier.
Every token of sequence i carries loss_i, so the default ``seq-mean-token-mean`` aggregation gives the paper's
mean over sequences (and the gradient flows through the sequence mean as in the sequence-level objective).
"""
from __future__ import annotations

import jax.numpy as jnp

from jodc.losses._policy import TokenBatch, clamped_exp
from jodc.losses.aggregation import broadcast_sequence_mean
from jodc.losses.ppo import _check_clip
from jodc.losses.spec import policy_loss


@policy_loss("geo_mean_loss", anchor="old_logprobs", aggregation="seq-mean-token-mean")
def geo_mean_loss(t: TokenBatch, *, clip_low: float = 0.4, clip_high: float = 0.4):
    """GMPO loss from logits (arguments as ``ppo_loss``; the clip bounds are on the token log-ratio).

    Returns (loss, metrics): clip_high_fraction (log-ratio clipped, A > 0), clip_low_fraction (clipped, A < 0),
    ratio_mean (token mean of the sequence's geometric-mean ratio), approx_kl (mean of -lr), entropy."""
    _check_clip("geo_mean_loss", clip_low, clip_high, None)
    adv = t.fields["advantages"]
    log_ratio = t.logprobs - t.fields["old_logprobs"]
    sign = jnp.sign(adv)
    clamped = jnp.clip(log_ratio, -clip_low, clip_high)
    token_term = sign * jnp.minimum(sign * log_ratio, sign * clamped)
    seq_ratio = clamped_exp(broadcast_sequence_mean(token_term, t.valid, segment_ids=t.segment_ids))
    seq_adv = broadcast_sequence_mean(adv, t.valid, segment_ids=t.segment_ids)
    clipped = log_ratio != clamped
    return -seq_adv * seq_ratio, {"clip_high_fraction": clipped & (adv > 0), "clip_low_fraction": clipped & (adv < 0),
                                  "ratio_mean": seq_ratio, "approx_kl": -log_ratio}
