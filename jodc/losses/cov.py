"""Clip-Cov and KL-Cov: act on the few tokens whose covariance drives entropy collapse.

Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models" (arXiv 2505.22617).
Under a policy gradient, the change of the policy's entropy is driven by the covariance between a token's
log-probability and its advantage. Both losses compute, over the valid tokens of the call,

    cov_t = (A_t - mean(A)) * (log pi(a_t) - mean(log pi))

and touch only a small fraction of tokens with a large covariance (verl's ``clip_cov`` / ``kl_cov``):

* ``clip_cov_loss``: PPO's clipped surrogate (no dual clip); among the tokens not already clipped whose
  covariance lies in (cov_low, cov_high), ``max(1, floor(ratio * N_valid))`` chosen at random lose their
  gradient (their loss is 0).
* ``kl_cov_loss``: the unclipped surrogate -A r; the ``max(1, floor(ratio * N_valid))`` tokens of largest
  covariance get a penalty ``kl_coef * |log r|`` added (``kl_coef`` 0.1 by default, verl's ``ppo_kl_coef``; the
  gradient of |log r| is 0 where r = 1 exactly, as torch's).

The selection is per call (per microbatch), as verl's is per micro-batch. The random choice of Clip-Cov uses
``key`` (default: a fixed key; pass a fresh one per step for a new draw, as verl's ``torch.randperm`` does).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jodc.losses._checks import check_positive
from jodc.losses._policy import TokenBatch, abs_zero_subgradient, clamped_exp
from jodc.losses.aggregation import masked_mean
from jodc.losses.ppo import _check_clip, _clipped_surrogate
from jodc.losses.spec import policy_loss


def _covariance(t: TokenBatch) -> jax.Array:
    """Per token (A - mean A)(log pi - mean log pi) over the valid tokens (no gradient)."""
    adv, logprobs = t.fields["advantages"], lax.stop_gradient(t.logprobs)
    return (adv - masked_mean(adv, t.valid)) * (logprobs - masked_mean(logprobs, t.valid))


def _first_k(scores: jax.Array, eligible: jax.Array, k: jax.Array) -> jax.Array:
    """Boolean mask of the ``k`` eligible positions with the smallest score (ties: lower flat index first)."""
    flat = jnp.where(eligible, scores, jnp.inf).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.size))
    return (rank < k).reshape(scores.shape) & eligible


def _count(ratio: float, valid: jax.Array) -> jax.Array:
    """max(1, floor(ratio * number of valid tokens))."""
    return jnp.maximum(jnp.floor(ratio * jnp.sum(valid)).astype(jnp.int32), 1)


@policy_loss("clip_cov_loss", anchor="old_logprobs")
def clip_cov_loss(
    t: TokenBatch,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
    key=None,
):
    """Clip-Cov loss from logits (arguments as ``ppo_loss``; ``key`` a ``jax.random`` key for the draw).

    Returns (loss, metrics): clip_fraction (tokens clipped by the ratio), cov_clip_fraction (tokens whose
    gradient Clip-Cov removed), ratio_mean, approx_kl, entropy."""
    fn = "clip_cov_loss"
    _check_clip(fn, clip_low, clip_high, None)
    check_positive(fn, "clip_cov_ratio", clip_cov_ratio)
    per_token, metrics = _clipped_surrogate(t.logprobs, t.fields["old_logprobs"], t.fields["advantages"],
                                            clip_low, clip_high, None)
    metrics.pop("dual_clip_fraction")
    cov = _covariance(t)
    candidates = t.valid & ~metrics["clip_fraction"] & (cov > cov_low) & (cov < cov_high)
    draw = jax.random.uniform(jax.random.PRNGKey(0) if key is None else key, cov.shape)
    removed = _first_k(draw, candidates, _count(clip_cov_ratio, t.valid))
    return jnp.where(removed, 0.0, per_token), dict(metrics, cov_clip_fraction=removed)


@policy_loss("kl_cov_loss", anchor="old_logprobs")
def kl_cov_loss(t: TokenBatch, *, kl_cov_ratio: float = 2e-4, kl_coef: float = 0.1):
    """KL-Cov loss from logits (arguments as ``ppo_loss``).

    Returns (loss, metrics): kl_cov_fraction (tokens penalised), abs_kl (mean |log r|), ratio_mean, entropy."""
    fn = "kl_cov_loss"
    check_positive(fn, "kl_cov_ratio", kl_cov_ratio)
    check_positive(fn, "kl_coef", kl_coef)
    log_ratio = t.logprobs - t.fields["old_logprobs"]
    ratio = clamped_exp(log_ratio)
    per_token = -t.fields["advantages"] * ratio
    penalised = _first_k(-_covariance(t), t.valid, _count(kl_cov_ratio, t.valid))
    abs_kl = abs_zero_subgradient(log_ratio)  # no gradient where the policy equals the anchor exactly
    per_token = jnp.where(penalised, per_token + kl_coef * abs_kl, per_token)
    return per_token, {"kl_cov_fraction": penalised, "abs_kl": abs_kl, "ratio_mean": ratio}
