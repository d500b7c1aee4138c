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

All three share the calling convention of every policy loss in jodc (see ``jodc.losses.registry``): the third
positional argument is the log-probs the clipped ratio is taken against.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jodc.losses._checks import check_nonnegative
from jodc.losses._policy import clamped_exp, finish, prepare


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


def ppo_loss(
    logits,
    tokens,
    old_logprobs,
    advantages,
    mask,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = 3.0,
    aggregation: str = "token-mean",
    normalizer=None,
    segment_ids=None,
    norm_length: int | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped-surrogate loss from logits.

    Args:
      logits: [B, T, V] any float dtype (computed in fp32). ``logits[b, t]`` scores ``tokens[b, t]``.
      tokens: [B, T] int, the sampled tokens.
      old_logprobs: [B, T] log pi_old(a_t) (the policy the ratio is taken against).
      advantages: [B, T].
      mask: [B, T], nonzero where the token is trained on.
      clip_low, clip_high: ratio bounds 1 - clip_low, 1 + clip_high (0.2 / 0.2; DAPO: 0.2 / 0.28).
      dual_clip: c > 1 for dual-clip PPO (default 3.0), or None.
      aggregation, normalizer, segment_ids, norm_length: see ``jodc.losses.aggregation.aggregate``.
      temperature: sampling temperature (logits are divided by it).
      chunk_size: token-chunking of the log-softmax (see ``token_logprobs``).

    Returns:
      (loss, metrics) with metrics clip_fraction, dual_clip_fraction, ratio_mean, approx_kl, entropy.
    """
    fn = "ppo_loss"
    _check_clip(fn, clip_low, clip_high, dual_clip)
    batch = prepare(
        fn, logits, tokens, mask, {"old_logprobs": old_logprobs, "advantages": advantages},
        temperature=temperature, chunk_size=chunk_size, aggregation=aggregation, segment_ids=segment_ids,
    )
    per_token, metrics = _clipped_surrogate(
        batch.logprobs, batch.fields["old_logprobs"], batch.fields["advantages"], clip_low, clip_high, dual_clip
    )
    return finish(per_token, batch, metrics, aggregation=aggregation, normalizer=normalizer,
                  segment_ids=segment_ids, norm_length=norm_length)


def decoupled_ppo_loss(
    logits,
    tokens,
    proximal_logprobs,
    advantages,
    mask,
    *,
    behaviour_logprobs,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    behaviour_weight_cap: float | None = None,
    aggregation: str = "token-mean",
    normalizer=None,
    segment_ids=None,
    norm_length: int | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """AReaL's decoupled PPO: w_t * PPO(pi / pi_prox), w_t = pi_prox(a_t) / mu(a_t) (no gradient).

    ``proximal_logprobs`` [B, T] anchor the clipped ratio; ``behaviour_logprobs`` [B, T] are the rollout
    engine's. With ``behaviour_weight_cap`` set, tokens whose weight exceeds it are dropped (weight 0), as in
    AReaL; they still count in the denominator. Metrics add behaviour_weight_mean and behaviour_capped_fraction.
    """
    fn = "decoupled_ppo_loss"
    _check_clip(fn, clip_low, clip_high, dual_clip)
    if behaviour_weight_cap is not None:
        check_nonnegative(fn, "behaviour_weight_cap", behaviour_weight_cap)
    batch = prepare(
        fn, logits, tokens, mask,
        {"proximal_logprobs": proximal_logprobs, "advantages": advantages, "behaviour_logprobs": behaviour_logprobs},
        temperature=temperature, chunk_size=chunk_size, aggregation=aggregation, segment_ids=segment_ids,
    )
    proximal = batch.fields["proximal_logprobs"]
    per_token, metrics = _clipped_surrogate(
        batch.logprobs, proximal, batch.fields["advantages"], clip_low, clip_high, dual_clip
    )
    weight = clamped_exp(proximal - batch.fields["behaviour_logprobs"])
    if behaviour_weight_cap is None:
        capped = jnp.zeros_like(batch.valid)
    else:
        capped = weight > behaviour_weight_cap
        weight = jnp.where(capped, 0.0, weight)
    per_token = lax.stop_gradient(weight) * per_token
    metrics = dict(metrics, behaviour_weight_mean=weight, behaviour_capped_fraction=capped)
    return finish(per_token, batch, metrics, aggregation=aggregation, normalizer=normalizer,
                  segment_ids=segment_ids, norm_length=norm_length)


def tis_loss(
    logits,
    tokens,
    old_logprobs,
    advantages,
    mask,
    *,
    rollout_logprobs,
    tis_cap: float = 2.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = 3.0,
    aggregation: str = "token-mean",
    normalizer=None,
    segment_ids=None,
    norm_length: int | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO with truncated importance sampling for rollout / trainer mismatch (Yao et al. 2025).

    ``old_logprobs`` [B, T] are the trainer's recomputed log-probs of the rollout policy (anchor of the clipped
    ratio); ``rollout_logprobs`` [B, T] are the rollout engine's. Each token's PPO loss is multiplied by
    min(exp(old - rollout), tis_cap) without gradient. Metrics add tis_weight_mean and tis_truncated_fraction.
    """
    fn = "tis_loss"
    _check_clip(fn, clip_low, clip_high, dual_clip)
    check_nonnegative(fn, "tis_cap", tis_cap)
    batch = prepare(
        fn, logits, tokens, mask,
        {"old_logprobs": old_logprobs, "advantages": advantages, "rollout_logprobs": rollout_logprobs},
        temperature=temperature, chunk_size=chunk_size, aggregation=aggregation, segment_ids=segment_ids,
    )
    old = batch.fields["old_logprobs"]
    per_token, metrics = _clipped_surrogate(
        batch.logprobs, old, batch.fields["advantages"], clip_low, clip_high, dual_clip
    )
    raw_weight = clamped_exp(old - batch.fields["rollout_logprobs"])
    weight = jnp.minimum(raw_weight, tis_cap)
    per_token = lax.stop_gradient(weight) * per_token
    metrics = dict(metrics, tis_weight_mean=weight, tis_truncated_fraction=raw_weight > tis_cap)
    return finish(per_token, batch, metrics, aggregation=aggregation, normalizer=normalizer,
                  segment_ids=segment_ids, norm_length=norm_length)
