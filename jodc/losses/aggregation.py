"""Reducing a per-token loss [B, T] to a scalar, with local or global denominators.

Mode names follow the convention of verl's ``agg_loss`` (token-mean, seq-mean-token-mean, seq-mean-token-sum,
seq-mean-token-sum-norm). Writing ``l`` for the per-token loss, ``m`` for the 0/1 mask, ``s`` for a sequence and
``n_s`` for its number of valid tokens:

* ``token-mean``:              sum_s sum_t m l / N_tokens                        (DAPO, "global token mean")
* ``token-sum``:               sum_s sum_t m l                                   (no denominator)
* ``seq-mean-token-mean``:     sum_s (sum_t m l / n_s) / N_seqs                  (GRPO as published, GSPO)
* ``seq-mean-token-sum``:      sum_s sum_t m l / N_seqs
* ``seq-mean-token-sum-norm``: sum_s sum_t m l / (N_seqs * L)                    (Dr.GRPO; L a fixed length)

A *sequence* is a row of the batch, or, when ``segment_ids`` [B, T] is given (packed microbatches: 0 = padding,
1, 2, ... = sequences within a row), a (row, segment) pair. Only sequences with at least one valid token count.

Distributed training: pass ``normalizer`` = the global number of tokens (token-mean) or of sequences (the seq-*
modes) over every device and microbatch of the minibatch (``token-sum`` has no denominator and ignores it). The local loss then is a partial sum, and summing the
partial losses gives exactly the loss of the whole minibatch. ``loss_normalizer`` computes the local counts to
be summed. Packing must not split a sequence across microbatches (the per-sequence token mean is local).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jodc.losses._checks import check_choice, check_per_token

AGGREGATIONS: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def valid_tokens(mask, segment_ids=None) -> jax.Array:
    """Boolean [B, T]: mask != 0, and (when given) segment id > 0."""
    valid_bt = jnp.asarray(mask) != 0
    if segment_ids is not None:
        valid_bt = jnp.logical_and(valid_bt, jnp.asarray(segment_ids) > 0)
    return valid_bt


def _sequence_index(valid_bt: jax.Array, segment_ids) -> tuple[jax.Array, int]:
    """(sequence slot of every token [B, T], number of slots). Row b, segment s -> slot b * (T + 1) + s.

    Segment ids must lie in [0, T] (a row of T tokens holds at most T sequences)."""
    b, t = valid_bt.shape
    if segment_ids is None:
        return jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t)), b
    seg_bt = jnp.asarray(segment_ids).astype(jnp.int32)
    return jnp.arange(b, dtype=jnp.int32)[:, None] * (t + 1) + seg_bt, b * (t + 1)


def _per_sequence_sums(values_bt, valid_bt, segment_ids):
    """(sum of valid values per sequence slot, valid token count per slot, slot of each token, slot count)."""
    slot_bt, num_slots = _sequence_index(valid_bt, segment_ids)
    slots = slot_bt.reshape(-1)
    value_sums = jax.ops.segment_sum(
        jnp.where(valid_bt, values_bt, 0).reshape(-1), slots, num_segments=num_slots
    )
    counts = jax.ops.segment_sum(valid_bt.reshape(-1).astype(values_bt.dtype), slots, num_segments=num_slots)
    return value_sums, counts, slot_bt, num_slots


def _count_sequences(valid_bt, segment_ids, dtype) -> jax.Array:
    """Number of sequences holding at least one valid token."""
    if segment_ids is None:
        return jnp.sum(jnp.any(valid_bt, axis=-1)).astype(dtype)
    slot_bt, num_slots = _sequence_index(valid_bt, segment_ids)
    counts = jax.ops.segment_sum(valid_bt.reshape(-1).astype(jnp.int32), slot_bt.reshape(-1), num_slots)
    return jnp.sum(counts > 0).astype(dtype)


def _check(fn, values, mask, mode, segment_ids):
    check_choice(fn, "aggregation", mode, AGGREGATIONS)
    check_per_token(fn, "values", values, mask, segment_ids)


def loss_normalizer(mask, aggregation: str = "token-mean", *, segment_ids=None) -> jax.Array:
    """The local denominator of ``aggregation``: the number of valid tokens (token-mean) or of sequences with at
    least one valid token (seq-* modes), as an fp32 scalar. Sum it over all microbatches and devices of a
    minibatch and pass the total as ``normalizer``. ``token-sum`` has no denominator: 1."""
    fn = "loss_normalizer"
    mask = jnp.asarray(mask)
    _check(fn, mask, mask, aggregation, segment_ids)
    valid_bt = valid_tokens(mask, segment_ids)
    if aggregation == "token-sum":
        return jnp.ones((), jnp.float32)
    if aggregation == "token-mean":
        return jnp.sum(valid_bt).astype(jnp.float32)
    return _count_sequences(valid_bt, segment_ids, jnp.float32)


def aggregate(
    values,
    mask,
    aggregation: str = "token-mean",
    *,
    normalizer=None,
    segment_ids=None,
    norm_length: int | None = None,
) -> jax.Array:
    """Reduce a per-token loss ``values`` [B, T] to a scalar (see the module docstring for the modes).

    ``normalizer`` replaces the local token / sequence count by a global one (``token-sum``, a plain sum whose
    partial sums already add up to the minibatch's, ignores it). ``norm_length`` is the constant L
    of ``seq-mean-token-sum-norm`` (Dr.GRPO's generation budget); it defaults to T, which is only meaningful for
    unpacked [num_sequences, max_length] batches, so pass it explicitly for packed rows. Masked positions never
    contribute, whatever they hold (NaN included).
    """
    fn = "aggregate"
    values = jnp.asarray(values)
    _check(fn, values, mask, aggregation, segment_ids)
    if norm_length is not None and (not isinstance(norm_length, int) or norm_length < 1):
        raise ValueError(f"{fn}: norm_length must be a positive int, got {norm_length!r}")
    valid_bt = valid_tokens(mask, segment_ids)
    dtype = values.dtype
    if aggregation == "token-sum":
        return jnp.sum(jnp.where(valid_bt, values, 0))
    if aggregation == "token-mean":
        total = jnp.sum(jnp.where(valid_bt, values, 0))
        if normalizer is None:
            return total / jnp.maximum(jnp.sum(valid_bt).astype(dtype), 1)
        return total / jnp.asarray(normalizer, dtype)

    if aggregation == "seq-mean-token-mean":
        value_sums, counts, _, _ = _per_sequence_sums(values, valid_bt, segment_ids)
        total = jnp.sum(value_sums / jnp.maximum(counts, 1))
    else:
        total = jnp.sum(jnp.where(valid_bt, values, 0))
        if aggregation == "seq-mean-token-sum-norm":
            total = total / (values.shape[1] if norm_length is None else norm_length)
    if normalizer is None:
        return total / jnp.maximum(_count_sequences(valid_bt, segment_ids, dtype), 1)
    return total / jnp.asarray(normalizer, dtype)


def broadcast_sequence_mean(values, mask, *, segment_ids=None) -> jax.Array:
    """Per token, the mean of ``values`` over the valid tokens of the token's own sequence ([B, T] -> [B, T]).

    Differentiable in ``values`` (GSPO's length-normalised sequence log-ratio is built from it). Positions that
    are not valid get the mean of their slot anyway (0 when the slot has no valid token)."""
    fn = "broadcast_sequence_mean"
    values = jnp.asarray(values)
    _check(fn, values, mask, "token-mean", segment_ids)
    valid_bt = valid_tokens(mask, segment_ids)
    value_sums, counts, slot_bt, _ = _per_sequence_sums(values, valid_bt, segment_ids)
    means = value_sums / jnp.maximum(counts, 1)
    return means[slot_bt]


def broadcast_sequence_sum(values, mask, *, segment_ids=None) -> jax.Array:
    """Per token, the sum of ``values`` over the valid tokens of the token's own sequence ([B, T] -> [B, T]);
    differentiable, like ``broadcast_sequence_mean``."""
    values = jnp.asarray(values)
    _check("broadcast_sequence_sum", values, mask, "token-mean", segment_ids)
    value_sums, _, slot_bt, _ = _per_sequence_sums(values, valid_tokens(mask, segment_ids), segment_ids)
    return value_sums[slot_bt]


def masked_mean(values, valid_bt) -> jax.Array:
    """Mean of ``values`` over valid positions (0 when there are none); for metrics."""
    values = jnp.asarray(values)
    count = jnp.sum(valid_bt).astype(values.dtype)
    return jnp.sum(jnp.where(valid_bt, values, 0)) / jnp.maximum(count, 1)
