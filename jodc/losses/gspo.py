"""GSPO: PPO clipping applied to a length-normalised sequence-level ratio.

Zheng et al., "Group Sequence Policy Optimization" (arXiv 2507.18071). For a sequence y_i,

    s_i = (pi(y_i) / pi_old(y_i)) ^ (1 / |y_i|) = exp(mean_t (log pi(a_t) - log pi_old(a_t)))
    loss_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high)),   eps_low = 3e-4, eps_high = 4e-4

implemented in the paper's token form ("GSPO-token"): token t carries the ratio s_i in value and
s_i * grad log pi(a_t) in gradient, so per-token advantages are allowed and, with equal advantages over a
sequence and seq-mean-token-mean aggregation (the default here, as in the paper), the gradient equals that of
sequence-level GSPO. A sequence is a row, or a (row, segment) pair when ``segment_ids`` is given (packing).
"""
from __future__ import annotations

from jax import lax

from jodc.losses._policy import TokenBatch
from jodc.losses.aggregation import broadcast_sequence_mean
from jodc.losses.ppo import _check_clip, _clipped_surrogate
from jodc.losses.spec import policy_loss


@policy_loss("gspo_loss", anchor="old_logprobs", aggregation="seq-mean-token-mean")
def gspo_loss(t: TokenBatch, *, clip_low: float = 3e-4, clip_high: float = 4e-4):
    """GSPO loss from logits (arguments as ``ppo_loss``; the clip bounds apply to the sequence ratio).

    Returns (loss, metrics): clip_fraction (tokens whose sequence ratio is clipped), ratio_mean (token mean of
    the sequence ratio), approx_kl, entropy."""
    _check_clip("gspo_loss", clip_low, clip_high, None)
    logprobs = t.logprobs
    token_log_ratio = lax.stop_gradient(logprobs - t.fields["old_logprobs"])
    seq_log_ratio = broadcast_sequence_mean(token_log_ratio, t.valid, segment_ids=t.segment_ids)
    # Anchor chosen so that logprobs - anchor = sg(seq_log_ratio) + logprobs - sg(logprobs).
    anchor = lax.stop_gradient(logprobs - seq_log_ratio)
    per_token, metrics = _clipped_surrogate(logprobs, anchor, t.fields["advantages"], clip_low, clip_high, None)
    metrics.pop("dual_clip_fraction")
    return per_token, metrics
