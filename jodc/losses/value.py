"""The critic's clipped value loss (PPO's value function loss, as verl's ``compute_value_loss``).

With V the value head's prediction, V_old the values at rollout time (before the update) and R the returns
(``gae_advantages``' second output), per token

    V_clip = clip(V, V_old - c, V_old + c)
    l_t    = max((V - R)^2, (V_clip - R)^2)

and the loss is 0.5 * aggregate(l) over the valid tokens (``jodc.losses.aggregate``'s modes and global
normaliser). The clip keeps one update from moving the value far from V_old, as the ratio clip does for the
policy. ``clip_range=None`` switches clipping off (the plain 0.5 * squared error). Metrics: ``vf_clipfrac`` (the
fraction of valid tokens where the clipped error is the larger one, verl's ``vf_clipfrac``) and ``vpred_mean``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jodc.losses._checks import check_bt, check_choice, check_nonnegative, shape_of
from jodc.losses.aggregation import AGGREGATIONS, aggregate, masked_mean, valid_tokens
from jodc.losses.logprobs import compute_dtype

#: verl's default ``critic.cliprange_value``.
DEFAULT_VALUE_CLIP = 0.5


def clipped_value_loss(values, returns, old_values, mask, *, clip_range: float | None = DEFAULT_VALUE_CLIP,
                       aggregation: str = "token-mean", normalizer=None, segment_ids=None,
                       norm_length: int | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(0.5 * aggregated clipped squared error, metrics) for value predictions ``values`` [B, T] (differentiable),
    ``returns`` and ``old_values`` [B, T] (data) and ``mask`` [B, T]; see the module docstring."""
    fn = "clipped_value_loss"
    bt = shape_of(values)
    if len(bt) != 2:
        raise ValueError(f"{fn}: values must have shape [B, T], got shape {bt}")
    for name, x in (("returns", returns), ("old_values", old_values), ("mask", mask)):
        check_bt(fn, name, x, bt)
    if segment_ids is not None:
        check_bt(fn, "segment_ids", segment_ids, bt, integer=True)
    check_choice(fn, "aggregation", aggregation, AGGREGATIONS)
    if clip_range is not None:
        check_nonnegative(fn, "clip_range", clip_range)
    values = jnp.asarray(values)
    dtype = compute_dtype(values.dtype)
    valid_bt = valid_tokens(mask, segment_ids)

    def clean(x):  # padding may hold anything: it must not reach a gradient
        return jnp.where(valid_bt, jnp.asarray(x).astype(dtype), 0.0)

    v_bt, r_bt = clean(values), lax.stop_gradient(clean(returns))
    unclipped_bt = jnp.square(v_bt - r_bt)
    if clip_range is None:
        per_token, clipped_frac = unclipped_bt, jnp.zeros((), dtype)
    else:
        old_bt = lax.stop_gradient(clean(old_values))
        clipped_bt = jnp.square(jnp.clip(v_bt, old_bt - clip_range, old_bt + clip_range) - r_bt)
        per_token = jnp.maximum(unclipped_bt, clipped_bt)
        clipped_frac = masked_mean((clipped_bt > unclipped_bt).astype(dtype), valid_bt)
    loss = 0.5 * aggregate(per_token, valid_bt, aggregation, normalizer=normalizer, segment_ids=segment_ids,
                           norm_length=norm_length)
    return loss, {"vf_clipfrac": clipped_frac, "vpred_mean": lax.stop_gradient(masked_mean(v_bt, valid_bt))}
