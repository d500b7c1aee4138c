"""Rollout correction: importance weights and rejection masks for the rollout engine / trainer mismatch.

Liu, Li et al., "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch"
(2025); verl's rollout correction (``rollout_is`` / ``rollout_rs``). The rollout engine's log-probs ``log mu``
differ from the trainer's ``log pi`` at the same weights (other kernels, other precision, stale weights). With
``lr_t = log pi(a_t) - log mu(a_t)`` over the valid tokens:

* **IS weights** (``rollout_is_weights``): ``token`` level w_t = exp(lr_t) (biased, low variance) or ``sequence``
  level w_i = exp(sum_{t in i} lr_t) for every token of sequence i (unbiased, high variance). Log-ratios are
  clamped to +-20 before ``exp``. With ``lower=None`` weights are truncated at ``upper`` (TIS); with a lower
  bound, weights outside [lower, upper] are set to 0 (IcePop). Weights carry no gradient and are 0 on padding.
* **Rejection** (``rollout_rejection_mask``): a token or a whole sequence is dropped when a divergence statistic
  exceeds its threshold. ``k1 = -lr`` (from samples of mu, an estimate of KL(mu || pi)), ``k2 = lr^2 / 2``,
  ``k3 = exp(lr) - 1 - lr``; criteria ``token_k{1,2,3}``, ``seq_sum_k{1,2,3}``, ``seq_mean_k{1,2,3}``,
  ``seq_max_k{2,3}`` (token log-ratios clamped to +-20 first). k1 criteria keep log(lower) <= statistic <= log(upper) (``lower`` defaults to 1 / upper);
  the others keep statistic <= upper.

* **Batch normalisation** (``normalize_is_weights``, or ``rollout_is_weights(..., batch_normalize=True)``): the
  weights divided by their mean, so they average 1 over the batch (verl's ``rollout_is_batch_normalize``): over
  the valid tokens for token-level weights, over the sequences for sequence-level ones. Across microbatches and
  devices the mean must be the whole batch's: sum ``is_weight_totals`` (weight sum, count) over them and pass the
  totals, as with the losses' ``normalizer``.
* **Off-policy sequence masking** (``off_policy_sequence_mask``, DeepSeek-V3.2's OPSM, TRL's
  ``off_policy_mask_threshold``): a token with a negative advantage is dropped when its sequence's mean
  ``log mu - log pi`` exceeds a threshold: a response the policy has moved away from is not pushed down further.

All are pure functions over log-probs [B, T]: multiply the advantages by the weights (for the PPO family a
non-negative stop-gradient weight on the advantage equals one on the per-token loss) and the mask by the kept
mask (so rejected tokens also leave the loss's denominator, as in verl). Sequences follow ``segment_ids`` as in
``jodc.losses.aggregation``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jodc.losses._checks import (check_bt, check_choice, check_nonnegative, check_per_token, check_positive,
                                 shape_of)
from jodc.losses._policy import LOG_RATIO_CLAMP
from jodc.losses.aggregation import _count_sequences, _per_sequence_sums, masked_mean, valid_tokens
from jodc.losses.logprobs import compute_dtype
from jodc.losses.ppo import IS_LEVELS

REJECTION_CRITERIA: tuple[str, ...] = tuple(
    [f"token_k{i}" for i in (1, 2, 3)] + [f"seq_sum_k{i}" for i in (1, 2, 3)]
    + [f"seq_mean_k{i}" for i in (1, 2, 3)] + ["seq_max_k2", "seq_max_k3"]
)


#: A batch mean of the weights at or below this leaves them unnormalised (factor 1), as in verl.
NORM_FLOOR = 1e-8


def _log_ratio(fn, logprobs, rollout_logprobs, mask, segment_ids):
    """(lr [B, T] in the compute dtype, 0 where not valid; valid [B, T])."""
    check_per_token(fn, "logprobs", logprobs, mask, segment_ids, others=(("rollout_logprobs", rollout_logprobs),))
    logprobs, rollout_logprobs = jnp.asarray(logprobs), jnp.asarray(rollout_logprobs)
    dtype = compute_dtype(jnp.result_type(logprobs.dtype, rollout_logprobs.dtype))
    valid = valid_tokens(mask, segment_ids)
    lr = jnp.where(valid, logprobs.astype(dtype) - rollout_logprobs.astype(dtype), 0.0)
    return lax.stop_gradient(lr), valid


def _sequence_stat(values, valid, segment_ids, reduce: str) -> jax.Array:
    """Per token, the sum / mean / max of ``values`` over the valid tokens of its sequence."""
    if reduce == "max":
        sums, counts, slot, num = _per_sequence_sums(values, valid, segment_ids)
        maxima = jax.ops.segment_max(jnp.where(valid, values, -jnp.inf).reshape(-1), slot.reshape(-1),
                                     num_segments=num)
        return jnp.where(counts > 0, maxima, 0.0)[slot]
    sums, counts, slot, _ = _per_sequence_sums(values, valid, segment_ids)
    return (sums if reduce == "sum" else sums / jnp.maximum(counts, 1))[slot]


def rollout_is_weights(logprobs, rollout_logprobs, mask, *, level: str = "token", upper: float = 2.0,
                       lower: float | None = None, segment_ids=None,
                       batch_normalize: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Importance weights pi / mu [B, T] (no gradient, 0 on padding) and metrics (see the module docstring).

    ``logprobs`` are the trainer's log pi(a_t), ``rollout_logprobs`` the rollout engine's log mu(a_t).
    ``batch_normalize`` divides the truncated weights by their mean over this call's valid tokens (``token``) or
    sequences (``sequence``), as verl's ``rollout_is_batch_normalize``; for a batch split over microbatches or
    devices use ``normalize_is_weights`` with the batch's totals instead. Metrics: is_weight_mean (over valid
    tokens, of the returned weights), is_truncated_fraction (tokens whose raw weight was above ``upper``, or
    outside [lower, upper] with a lower bound), and with ``batch_normalize`` is_batch_norm_factor (the divisor)."""
    fn = "rollout_is_weights"
    check_choice(fn, "level", level, IS_LEVELS)
    check_positive(fn, "upper", upper)
    if lower is not None:
        check_positive(fn, "lower", lower)
        if lower > upper:
            raise ValueError(f"{fn}: lower must be <= upper, got lower={lower!r}, upper={upper!r}")
    lr, valid = _log_ratio(fn, logprobs, rollout_logprobs, mask, segment_ids)
    if level == "sequence":
        lr = _sequence_stat(lr, valid, segment_ids, "sum")
    raw = jnp.where(valid, jnp.exp(jnp.clip(lr, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), 0.0)
    if lower is None:
        outside = raw > upper
        weights = jnp.minimum(raw, upper)
    else:
        outside = valid & ((raw < lower) | (raw > upper))
        weights = jnp.where(outside, 0.0, raw)
    metrics = {"is_truncated_fraction": masked_mean(outside.astype(weights.dtype), valid)}
    if batch_normalize:
        weights, metrics["is_batch_norm_factor"] = _normalized(
            weights, _weight_totals(weights, valid, level, segment_ids))
    return weights, {"is_weight_mean": masked_mean(weights, valid), **metrics}


def _check_weights(fn, weights, mask, level, segment_ids):
    """(weights in the compute dtype, valid [B, T]) after checking shapes and the level."""
    check_choice(fn, "level", level, IS_LEVELS)
    check_per_token(fn, "weights", weights, mask, segment_ids)
    weights = jnp.asarray(weights)
    return lax.stop_gradient(weights.astype(compute_dtype(weights.dtype))), valid_tokens(mask, segment_ids)


def _weight_totals(weights, valid, level, segment_ids) -> tuple[jax.Array, jax.Array]:
    """(sum of the weights, count) over the valid tokens, or over the sequences (each sequence's weight once)."""
    if level == "token":
        return jnp.sum(jnp.where(valid, weights, 0.0)), jnp.sum(valid).astype(weights.dtype)
    sums, counts, _, _ = _per_sequence_sums(weights, valid, segment_ids)
    per_sequence = jnp.where(counts > 0, sums / jnp.maximum(counts, 1), 0.0)  # its tokens share one weight
    return jnp.sum(per_sequence), _count_sequences(valid, segment_ids, weights.dtype)


def _normalized(weights, totals) -> tuple[jax.Array, jax.Array]:
    """(weights / mean, mean), or (weights, 1) when the mean is at most NORM_FLOOR (or there is nothing)."""
    total, count = (jnp.asarray(x, weights.dtype) for x in totals)
    mean = total / jnp.maximum(count, 1)
    factor = jnp.where((count > 0) & (mean > NORM_FLOOR), mean, 1.0)
    return weights / factor, factor


def is_weight_totals(weights, mask, *, level: str = "token", segment_ids=None) -> tuple[jax.Array, jax.Array]:
    """The local (weight sum, count) whose batch-wide sums ``normalize_is_weights`` divides by: over the valid
    tokens for ``level="token"``; over the sequences with a valid token for ``"sequence"`` (each sequence's
    weight counted once). Sum both over every microbatch and device of the batch."""
    weights, valid = _check_weights("is_weight_totals", weights, mask, level, segment_ids)
    return _weight_totals(weights, valid, level, segment_ids)


def normalize_is_weights(weights, mask, *, level: str = "token", totals=None,
                         segment_ids=None) -> tuple[jax.Array, jax.Array]:
    """Importance weights rescaled to mean 1 over the batch: (weights / mean, mean), no gradient.

    ``weights`` [B, T] as ``rollout_is_weights`` returns them (truncated, 0 on padding). ``totals`` = (weight
    sum, count) over the whole batch, the sums of ``is_weight_totals`` over its microbatches and devices; None
    uses this call's own. A mean at or below 1e-8 (all weights ~0) leaves the weights as they are (factor 1), as
    verl does. Token-level weights average 1 over the valid tokens, sequence-level ones over the sequences."""
    fn = "normalize_is_weights"
    weights, valid = _check_weights(fn, weights, mask, level, segment_ids)
    if totals is None:
        totals = _weight_totals(weights, valid, level, segment_ids)
    elif not isinstance(totals, (tuple, list)) or len(totals) != 2 or any(shape_of(x) != () for x in totals):
        raise ValueError(f"{fn}: totals must be a pair of scalars (weight sum, count) from is_weight_totals, got "
                         f"{totals!r}")
    normalized, factor = _normalized(weights, totals)
    return jnp.where(valid, normalized, 0.0), factor


def _check_criterion(fn, criterion, upper, lower):
    check_choice(fn, "criterion", criterion, REJECTION_CRITERIA)
    check_positive(fn, "upper", upper)
    if lower is not None and not criterion.endswith("k1"):
        raise ValueError(f"{fn}: lower applies to the k1 criteria only, got lower={lower!r} with {criterion!r}")
    if lower is not None:
        check_positive(fn, "lower", lower)


def _rejected(criterion, upper, lower, lr, valid, segment_ids):
    """(rejected [B, T] bool, statistic [B, T]) of one criterion over the log-ratios ``lr`` of the ``valid`` tokens."""
    estimator = criterion[-2:]
    lr = jnp.clip(lr, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_stat = {"k1": -lr, "k2": 0.5 * lr * lr, "k3": jnp.expm1(lr) - lr}[estimator]
    token_stat = jnp.where(valid, token_stat, 0.0)
    stat = token_stat if criterion.startswith("token") else _sequence_stat(
        token_stat, valid, segment_ids, criterion.split("_")[1])
    if estimator == "k1":
        low = math.log(1.0 / upper if lower is None else lower)
        keep = (stat >= low) & (stat <= math.log(upper))
    else:
        keep = stat <= upper
    return valid & ~keep, stat


def rollout_rejection_mask(logprobs, rollout_logprobs, mask, *, criterion: str | Sequence[str] = "token_k1",
                           upper: float | Sequence[float], lower: float | None | Sequence[float | None] = None,
                           segment_ids=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The mask with rejected tokens (or whole sequences) set to 0, in ``mask``'s dtype, and metrics.

    ``criterion`` is one of ``REJECTION_CRITERIA``; thresholds as in the module docstring (k1 criteria take ratio
    bounds ``lower`` / ``upper``; the others a divergence bound ``upper``). Metrics: rejected_fraction (of valid
    tokens), statistic_mean (the criterion's statistic over valid tokens).

    Several criteria at once: ``criterion`` a sequence of names and ``upper`` (and ``lower``, if given) sequences
    of the same length. Every criterion is evaluated on the *original* mask and a token is kept only if all keep
    it. Feeding one call's output into the next is not the same: a sequence statistic (``seq_mean_*``) of the
    second call would then be taken over the tokens the first one left. Metrics: rejected_fraction (by any
    criterion), and ``<criterion>/rejected_fraction`` and ``<criterion>/statistic_mean`` for each."""
    fn = "rollout_rejection_mask"
    several = not isinstance(criterion, str)
    criteria = list(criterion) if several else [criterion]
    uppers = _per_criterion(fn, "upper", upper, criteria, several)
    lowers = _per_criterion(fn, "lower", lower, criteria, several)
    if several and (not criteria or len(set(criteria)) != len(criteria)):
        raise ValueError(f"{fn}: criterion must be one name or a non-empty sequence of distinct names, "
                         f"got {criterion!r}")
    for name, up, low in zip(criteria, uppers, lowers):
        _check_criterion(fn, name, up, low)
    lr, valid = _log_ratio(fn, logprobs, rollout_logprobs, mask, segment_ids)
    rejected = jnp.zeros_like(valid)
    metrics = {}
    for name, up, low in zip(criteria, uppers, lowers):
        rejected_by, stat = _rejected(name, up, low, lr, valid, segment_ids)
        rejected = rejected | rejected_by
        prefix = f"{name}/" if several else ""
        metrics[prefix + "rejected_fraction"] = masked_mean(rejected_by.astype(lr.dtype), valid)
        metrics[prefix + "statistic_mean"] = masked_mean(stat, valid)
    if several:
        metrics["rejected_fraction"] = masked_mean(rejected.astype(lr.dtype), valid)
    mask = jnp.asarray(mask)
    return jnp.where(rejected, jnp.zeros_like(mask), mask), metrics


def _per_criterion(fn, name, value, criteria, several):
    """``value`` as one entry per criterion: a sequence of the same length when several criteria are given."""
    if not several:
        if isinstance(value, (list, tuple)):
            raise ValueError(f"{fn}: {name} must be a number for one criterion, got {value!r}")
        return [value]
    if value is None:
        return [None] * len(criteria)
    if not isinstance(value, (list, tuple)) or len(value) != len(criteria):
        raise ValueError(f"{fn}: with criteria {list(criteria)}, {name} must be a sequence of {len(criteria)} "
                         f"values (one per criterion), got {value!r}")
    return list(value)


def off_policy_sequence_mask(logprobs, rollout_logprobs, advantages, mask, *, threshold: float,
                             segment_ids=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DeepSeek-V3.2's off-policy sequence mask (OPSM; TRL's ``off_policy_mask_threshold``): ``mask`` with a
    token set to 0 when its advantage is negative and its sequence's mean log-ratio

        d_i = mean_{t in i} (log mu(a_t) - log pi(a_t))

    exceeds ``threshold`` (delta >= 0). ``logprobs`` [B, T] are the current policy's log pi (no gradient is taken),
    ``rollout_logprobs`` the sampling policy's log mu, ``advantages`` [B, T] per token (an outcome advantage is
    the same on every token of a response, and then a whole sequence goes). The sign is the paper's and TRL's:
    d_i > 0 when the policy now finds the response less likely than the sampler did (d_i estimates
    KL(mu || pi) from mu's samples; it is the ``seq_mean_k1`` statistic of ``rollout_rejection_mask``). Such a
    negative sample pushes the policy further from where the data came from; positive-advantage tokens are kept
    whatever d_i. Metrics: masked_fraction (of valid tokens), sequence_log_ratio_mean (d over valid tokens)."""
    fn = "off_policy_sequence_mask"
    check_nonnegative(fn, "threshold", threshold)
    lr, valid = _log_ratio(fn, logprobs, rollout_logprobs, mask, segment_ids)
    check_bt(fn, "advantages", advantages, lr.shape)
    negative = valid & (jnp.where(valid, jnp.asarray(advantages), 0) < 0)
    divergence = _sequence_stat(-lr, valid, segment_ids, "mean")
    dropped = negative & (divergence > threshold)
    mask = jnp.asarray(mask)
    return jnp.where(dropped, jnp.zeros_like(mask), mask), {
        "masked_fraction": masked_mean(dropped.astype(lr.dtype), valid),
        "sequence_log_ratio_mean": masked_mean(divergence, valid)}
