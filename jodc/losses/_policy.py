"""Plumbing shared by the policy losses: checking the batch, computing log pi, sanitising padded positions,
aggregating the per-token loss and averaging metrics.

A loss's own formula (its *kernel*, see ``jodc.losses.spec``) sees only ``TokenBatch``: every per-token array
already checked, cast to the compute dtype and zeroed where the token is not trained on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax import lax

from jodc.losses._checks import check_bt, check_choice, check_chunk_size, check_logits, check_positive
from jodc.losses.aggregation import AGGREGATIONS, aggregate, masked_mean, valid_tokens
from jodc.losses.logprobs import _gather, compute_dtype

#: Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exponentiation, so a stale or corrupt
#: anchor log-prob cannot overflow the ratio to inf (exp(20) ~ 4.9e8 is far past any clip or cap).
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class TokenBatch:
    """The per-token quantities a loss kernel reads, all [B, T] in the compute dtype (except ``valid``).

    Fields at positions that are not valid are replaced by 0, so garbage in padding (NaN, -inf) never reaches
    a gradient."""

    logprobs: jax.Array  # log pi(a_t), differentiable
    entropy: jax.Array  # H(pi(. | s_t)), stop-gradient (a metric)
    fields: Mapping[str, jax.Array]  # the caller's per-token arrays by argument name, sanitised
    valid: jax.Array  # bool: mask != 0 (and segment id > 0 when segments are given)
    segment_ids: Any  # [B, T] int or None: the sequences of packed rows (see ``aggregation``)
    extra_logprobs: jax.Array | None = None  # log pi at extra ids [B, T, K], when asked for


def prepare(
    fn: str,
    logits,
    tokens,
    mask,
    fields: Mapping[str, object],
    *,
    temperature: float,
    chunk_size: int | None,
    aggregation: str,
    segment_ids=None,
    extra_ids=None,
) -> TokenBatch:
    """Check shapes and options, compute log pi (and entropy) at the tokens, sanitise the per-token fields."""
    check_logits(fn, logits)
    logits = jnp.asarray(logits)
    bt = tuple(logits.shape[:2])
    check_bt(fn, "tokens", tokens, bt, integer=True)
    check_bt(fn, "mask", mask, bt)
    for name, value in fields.items():
        if value is None:
            raise ValueError(f"{fn}: {name} is required (a [B, T] array), got None")
        check_bt(fn, name, value, bt)
    if segment_ids is not None:
        check_bt(fn, "segment_ids", segment_ids, bt, integer=True)
    check_choice(fn, "aggregation", aggregation, AGGREGATIONS)
    check_positive(fn, "temperature", temperature)
    check_chunk_size(fn, chunk_size)

    ids_btk = jnp.asarray(tokens)[..., None]
    if extra_ids is not None:
        ids_btk = jnp.concatenate([ids_btk, jnp.asarray(extra_ids).astype(ids_btk.dtype)], axis=-1)
    lp_btk, entropy_bt = _gather(
        logits, ids_btk, temperature=temperature, chunk_size=chunk_size, entropy_has_grad=False
    )
    cdt = compute_dtype(logits.dtype)
    valid_bt = valid_tokens(mask, segment_ids)
    clean = {name: jnp.where(valid_bt, jnp.asarray(value).astype(cdt), 0) for name, value in fields.items()}
    return TokenBatch(
        logprobs=lp_btk[..., 0],
        entropy=lax.stop_gradient(entropy_bt),
        fields=clean,
        valid=valid_bt,
        segment_ids=segment_ids,
        extra_logprobs=None if extra_ids is None else lp_btk[..., 1:],
    )


def clamped_exp(log_ratio: jax.Array) -> jax.Array:
    """exp of a log-ratio clamped to +-LOG_RATIO_CLAMP."""
    return jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def abs_zero_subgradient(x: jax.Array) -> jax.Array:
    """|x| whose gradient at x = 0 is 0 (sign(x) everywhere), as torch's ``abs``; ``jnp.abs`` has gradient 1 at 0.

    Where a penalty is |log r| the anchor often equals the policy exactly (the first step of a KL penalty to the
    initial policy, the first minibatch after a bit-identical recompute): the penalty is 0 there and so must its
    gradient be. sign(x) * x is |x| exactly in floating point and ``jnp.sign`` has a zero derivative."""
    return jnp.sign(x) * x


def straight_through(weight: jax.Array, logprobs: jax.Array) -> jax.Array:
    """``weight`` in value, ``weight * d log pi`` in gradient: sg(weight) * exp(log pi - sg(log pi)).

    Lets a loss report the surrogate's value (e.g. -A * min(r, C)) while its gradient is a stop-gradient
    weight times the score function, as in DPPO's truncated weight and CISPO."""
    return lax.stop_gradient(weight) * jnp.exp(logprobs - lax.stop_gradient(logprobs))


def finish(
    per_token_loss: jax.Array,
    batch: TokenBatch,
    metrics: Mapping[str, jax.Array],
    *,
    aggregation: str,
    normalizer,
    norm_length: int | None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Aggregate the per-token loss; turn per-token metric arrays into scalar means over valid tokens.

    A metric given as a [B, T] array is averaged over valid tokens; a scalar is passed through. Metrics are
    local (this microbatch) and carry no gradient. ``entropy`` is always added."""
    loss = aggregate(
        per_token_loss,
        batch.valid,
        aggregation,
        normalizer=normalizer,
        segment_ids=batch.segment_ids,
        norm_length=norm_length,
    )
    out: dict[str, jax.Array] = {}
    for name, value in metrics.items():
        value = lax.stop_gradient(jnp.asarray(value))
        out[name] = masked_mean(value.astype(per_token_loss.dtype), batch.valid) if value.ndim == 2 else value
    out["entropy"] = masked_mean(batch.entropy, batch.valid)
    return loss, out
