"""PPO's clipped surrogate and the variants that reweight it per token.

* ``ppo_loss``: clipped ratio (Schulman et al. 2017, arXiv 1707.06347), optional dual clip for A < 0
  (Ye et al. 2020, arXiv 1912.09729), asymmetric "clip-higher" bounds (DAPO, Yu et al. 2025, arXiv 2503.14476:
  clip_high = 0.28 with token-mean aggregation). GRPO (Shao et al. 2024, arXiv 2402.03300) is this loss with
  group-normalised advantages.
* ``decoupled_ppo_loss``: AReaL's decoupled objective (Fu et al. 2025, arXiv 2505.24298). The ratio is taken
  against a *proximal* policy (the recomputed policy at the start of the step) and every term is weighted by
  proximal / behaviour (the rollout engine's policy), so stale rollouts are corrected.
* ``tis_loss``: truncated importance sampling for the mismatch between the rollout engine and the trainer
  (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"): the PPO loss
  weighted by min(pi_old_trainer / pi_rollout, C), C = 2.

All three share the calling convention of every policy loss in jodc (``jodc.losses.spec``): the third
positional argument is the log-probs the clipped ratio is taken against.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jodc.losses._checks import check_choice, check_nonnegative
from jodc.losses._policy import TokenBatch, clamped_exp
from jodc.losses.aggregation import broadcast_sequence_sum
from jodc.losses.spec import policy_loss

IS_LEVELS = ("token", "sequence")


def _check_clip(fn: str, clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    check_nonnegative(fn, "clip_low", clip_low)
    check_nonnegative(fn, "clip_high", clip_high)
    if clip_low >= 1:
        raise ValueError(f"{fn}: clip_low must be < 1 (the lower bound is 1 - clip_low), got {clip_low!r}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"{fn}: dual_clip must be None or > 1, got {dual_clip!r}")


def _clipped_surrogate(logprobs, anchor_logprobs, advantages, clip_low, clip_high, dual_clip):
    """Per-token PPO loss and its per-token diagnostics.

    loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)); with dual clip, for A < 0 the loss is further
    capped at -A * dual_clip (so a huge ratio on a bad token cannot produce an unbounded push)."""
    ratio = clamped_exp(logprobs - anchor_logprobs)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = jnp.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    if dual_clip is None:
        dual_clipped = jnp.zeros_like(clipped)
    else:
        cap = -advantages * dual_clip
        dual_clipped = jnp.logical_and(advantages < 0, per_token > cap)
        per_token = jnp.where(dual_clipped, cap, per_token)
    ratio_sg = lax.stop_gradient(ratio)
    log_ratio_sg = lax.stop_gradient(jnp.log(ratio))
    metrics = {
        "clip_fraction": clipped,
        "dual_clip_fraction": dual_clipped,
        "ratio_mean": ratio_sg,
        # k3 estimate of KL(anchor || pi) from samples of the anchor: r - 1 - log r.
        "approx_kl": ratio_sg - 1.0 - log_ratio_sg,
    }
    return per_token, metrics


@policy_loss("ppo_loss", anchor="old_logprobs")
def ppo_loss(
    t: TokenBatch,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = 3.0,
):
    """PPO clipped-surrogate loss from logits:
    ``ppo_loss(logits, tokens, old_logprobs, advantages, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=3.0)``.

    Args:
      logits: [B, T, V] any float dtype (computed in fp32). ``logits[b, t]`` scores ``tokens[b, t]``.
      tokens: [B, T] int, the sampled tokens.
      old_logprobs: [B, T] log pi_old(a_t) (the policy the ratio is taken against).
      advantages: [B, T].
      mask: [B, T], nonzero where the token is trained on.
      clip_low, clip_high: ratio bounds 1 - clip_low, 1 + clip_high (0.2 / 0.2; DAPO: 0.2 / 0.28).
      dual_clip: c > 1 for dual-clip PPO (default 3.0), or None.
      aggregation, normalizer, segment_ids, norm_length, temperature, chunk_size: shared by every policy loss
        (``jodc.losses.PolicyInputs``).

    Returns:
      (loss, metrics) with metrics clip_fraction, dual_clip_fraction, ratio_mean, approx_kl, entropy.
    """
    _check_clip("ppo_loss", clip_low, clip_high, dual_clip)
    return _clipped_surrogate(t.logprobs, t.fields["old_logprobs"], t.fields["advantages"], clip_low, clip_high,
                              dual_clip)


@policy_loss("decoupled_ppo_loss", anchor="proximal_logprobs", extras=("behaviour_logprobs",))
def decoupled_ppo_loss(
    t: TokenBatch,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    behaviour_weight_cap: float | None = None,
):
    """AReaL's decoupled PPO: w_t * PPO(pi / pi_prox), w_t = pi_prox(a_t) / mu(a_t) (no gradient):
    ``decoupled_ppo_loss(logits, tokens, proximal_logprobs, advantages, mask, *, behaviour_logprobs, ...)``.

    ``proximal_logprobs`` [B, T] anchor the clipped ratio; ``behaviour_logprobs`` [B, T] are the rollout
    engine's. With ``behaviour_weight_cap`` set, tokens whose weight exceeds it are dropped (weight 0), as in
    AReaL; they still count in the denominator. Metrics add behaviour_weight_mean and behaviour_capped_fraction.
    """
    fn = "decoupled_ppo_loss"
    _check_clip(fn, clip_low, clip_high, dual_clip)
    if behaviour_weight_cap is not None:
        check_nonnegative(fn, "behaviour_weight_cap", behaviour_weight_cap)
    proximal = t.fields["proximal_logprobs"]
    per_token, metrics = _clipped_surrogate(t.logprobs, proximal, t.fields["advantages"], clip_low, clip_high,
                                            dual_clip)
    weight = clamped_exp(proximal - t.fields["behaviour_logprobs"])
    if behaviour_weight_cap is None:
        capped = jnp.zeros_like(t.valid)
    else:
        capped = weight > behaviour_weight_cap
        weight = jnp.where(capped, 0.0, weight)
    per_token = lax.stop_gradient(weight) * per_token
    return per_token, dict(metrics, behaviour_weight_mean=weight, behaviour_capped_fraction=capped)


@policy_loss("tis_loss", anchor="old_logprobs", extras=("rollout_logprobs",))
def tis_loss(
    t: TokenBatch,
    *,
    tis_cap: float = 2.0,
    level: str = "token",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = 3.0,
):
    """PPO with truncated importance sampling for rollout / trainer mismatch (Yao et al. 2025):
    ``tis_loss(logits, tokens, old_logprobs, advantages, mask, *, rollout_logprobs, tis_cap=2.0, ...)``.

    ``old_logprobs`` [B, T] are the trainer's recomputed log-probs of the rollout policy (anchor of the clipped
    ratio); ``rollout_logprobs`` [B, T] are the rollout engine's. Each token's PPO loss is multiplied by
    min(exp(old - rollout), tis_cap) without gradient; ``level="sequence"`` uses the sequence's weight
    min(exp(sum_t (old - rollout)), tis_cap) for each of its tokens (see ``rollout_is_weights``). Metrics add
    tis_weight_mean and tis_truncated_fraction.
    """
    fn = "tis_loss"
    _check_clip(fn, clip_low, clip_high, dual_clip)
    check_nonnegative(fn, "tis_cap", tis_cap)
    check_choice(fn, "level", level, IS_LEVELS)
    old = t.fields["old_logprobs"]
    per_token, metrics = _clipped_surrogate(t.logprobs, old, t.fields["advantages"], clip_low, clip_high, dual_clip)
    log_weight = old - t.fields["rollout_logprobs"]
    if level == "sequence":
        log_weight = broadcast_sequence_sum(log_weight, t.valid, segment_ids=t.segment_ids)
    raw_weight = clamped_exp(log_weight)
    weight = jnp.minimum(raw_weight, tis_cap)
    per_token = lax.stop_gradient(weight) * per_token
    return per_token, dict(metrics, tis_weight_mean=weight, tis_truncated_fraction=raw_weight > tis_cap)
