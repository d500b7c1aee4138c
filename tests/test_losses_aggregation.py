"""Loss aggregation modes, global normalisers across microbatches, and packed (segment-id) sequences."""
import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jodc.losses import (
    AGGREGATIONS,
    aggregate,
    broadcast_sequence_mean,
    dppo_loss,
    gspo_loss,
    loss_normalizer,
    ppo_loss,
)

# ------------------------------------------------------------------------------------------------------------
# float64 numpy reference: explicit loops over sequences
# ------------------------------------------------------------------------------------------------------------


def np_sequences(mask, segment_ids=None):
    """{(row, segment): [positions]} of valid tokens; segment 0 (padding) never counts."""
    seqs = {}
    for b, t in zip(*np.nonzero(np.asarray(mask) != 0)):
        seg = 1 if segment_ids is None else int(segment_ids[b, t])
        if seg > 0:
            seqs.setdefault((b, seg), []).append((b, t))
    return seqs


def np_aggregate(values, mask, mode, *, normalizer=None, segment_ids=None, norm_length=None):
    values = np.asarray(values, np.float64)
    seqs = np_sequences(mask, segment_ids)
    sums = [sum(values[p] for p in pos) for pos in seqs.values()]
    if mode == "token-sum":  # no denominator: the normalizer is ignored
        return sum(sums)
    if mode == "token-mean":
        count = sum(len(pos) for pos in seqs.values())
        return sum(sums) / (normalizer if normalizer is not None else max(count, 1))
    if mode == "seq-mean-token-mean":
        total = sum(s / len(pos) for s, pos in zip(sums, seqs.values()))
    elif mode == "seq-mean-token-sum":
        total = sum(sums)
    else:
        total = sum(sums) / (values.shape[1] if norm_length is None else norm_length)
    return total / (normalizer if normalizer is not None else max(len(seqs), 1))


# ------------------------------------------------------------------------------------------------------------
# aggregate
# ------------------------------------------------------------------------------------------------------------

VALUES = np.array([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]], np.float32)
MASK = np.array([[1, 1, 0, 0], [1, 1, 1, 1]], np.float32)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 10 + 20 + 30 + 40) / 6),
        ("token-sum", 1 + 2 + 10 + 20 + 30 + 40),
        ("seq-mean-token-mean", (1.5 + 25.0) / 2),
        ("seq-mean-token-sum", (3 + 100) / 2),
        ("seq-mean-token-sum-norm", (3 + 100) / (2 * 4)),
    ],
)
def test_aggregate_hand_cases(mode, expected):
    np.testing.assert_allclose(aggregate(VALUES, MASK, mode), expected, rtol=1e-6)


def test_aggregate_hand_cases_with_segments_normalizer_and_norm_length():
    # row 0 holds sequences 1 (t = 0, 1) and 2 (t = 2); t = 3 is padding. Row 1 holds one sequence.
    segment_ids = np.array([[1, 1, 2, 0], [1, 1, 1, 1]], np.int32)
    mask = np.array([[1, 1, 1, 1], [1, 1, 1, 1]], np.float32)  # padding masked by segment 0 anyway
    got = aggregate(VALUES, mask, "seq-mean-token-mean", segment_ids=segment_ids)
    np.testing.assert_allclose(got, (1.5 + 3.0 + 25.0) / 3, rtol=1e-6)
    got = aggregate(VALUES, mask, "token-mean", segment_ids=segment_ids, normalizer=10.0)
    np.testing.assert_allclose(got, (1 + 2 + 3 + 100) / 10, rtol=1e-6)
    got = aggregate(VALUES, mask, "seq-mean-token-sum-norm", segment_ids=segment_ids, norm_length=8)
    np.testing.assert_allclose(got, (3 + 3 + 100) / (3 * 8), rtol=1e-6)
    np.testing.assert_allclose(loss_normalizer(mask, "seq-mean-token-sum", segment_ids=segment_ids), 3.0)
    np.testing.assert_allclose(loss_normalizer(mask, "token-mean", segment_ids=segment_ids), 7.0)
    np.testing.assert_allclose(loss_normalizer(MASK, "seq-mean-token-mean"), 2.0)


def test_aggregate_ignores_whatever_masked_positions_hold():
    values = VALUES.copy()
    values[0, 2:] = np.nan
    for mode in AGGREGATIONS:
        np.testing.assert_allclose(aggregate(values, MASK, mode), aggregate(VALUES, MASK, mode), rtol=1e-6)
    grad = jax.grad(lambda v: aggregate(v, MASK, "seq-mean-token-mean"))(values)
    assert np.isfinite(grad).all()
    np.testing.assert_allclose(grad, MASK * np.array([[0.25], [0.125]]), rtol=1e-6)


def test_empty_microbatch_gives_zero_not_nan():
    empty = np.zeros_like(MASK)
    for mode in AGGREGATIONS:
        assert float(aggregate(VALUES, empty, mode)) == 0.0
        assert float(aggregate(VALUES, empty, mode, normalizer=5.0)) == 0.0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), mode=st.sampled_from(AGGREGATIONS), packed=st.booleans())
def test_aggregate_matches_numpy_reference(seed, mode, packed):
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((3, 8)).astype(np.float32)
    mask = (rng.random((3, 8)) < 0.7).astype(np.float32)
    segment_ids = np.sort(rng.integers(0, 4, (3, 8)), axis=1).astype(np.int32) if packed else None
    normalizer = float(rng.integers(1, 20)) if rng.random() < 0.5 else None
    got = aggregate(values, mask, mode, segment_ids=segment_ids, normalizer=normalizer, norm_length=6)
    expected = np_aggregate(values, mask, mode, segment_ids=segment_ids, normalizer=normalizer, norm_length=6)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_broadcast_sequence_mean():
    segment_ids = np.array([[1, 1, 2, 0], [1, 1, 1, 1]], np.int32)
    got = broadcast_sequence_mean(VALUES, MASK, segment_ids=segment_ids)
    # row 0: sequence 1 = {1, 2} -> 1.5; sequence 2 has no valid token (mask 0) -> 0; padding slot -> 0
    np.testing.assert_allclose(got, [[1.5, 1.5, 0.0, 0.0], [25.0] * 4], rtol=1e-6)
    got = broadcast_sequence_mean(VALUES, MASK)
    np.testing.assert_allclose(got, [[1.5] * 4, [25.0] * 4], rtol=1e-6)


def test_aggregation_argument_errors():
    with pytest.raises(ValueError, match="unknown aggregation 'mean'"):
        aggregate(VALUES, MASK, "mean")
    with pytest.raises(ValueError, match=r"mask has shape \(2, 3\)"):
        aggregate(VALUES, MASK[:, :3])
    with pytest.raises(ValueError, match="segment_ids must be an integer"):
        aggregate(VALUES, MASK, segment_ids=MASK)
    with pytest.raises(ValueError, match="norm_length"):
        aggregate(VALUES, MASK, "seq-mean-token-sum-norm", norm_length=0)
    with pytest.raises(ValueError, match="unknown aggregation"):
        loss_normalizer(MASK, "sum")


# ------------------------------------------------------------------------------------------------------------
# Microbatches with global normalisers == the whole minibatch; packed rows == one sequence per row
# ------------------------------------------------------------------------------------------------------------


def _policy_batch(seed, b=6, t=7, v=9):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((b, t, v)).astype(np.float32)
    tokens = rng.integers(0, v, (b, t)).astype(np.int32)
    old = (np.log(rng.uniform(0.05, 0.9, (b, t)))).astype(np.float32)
    adv = rng.standard_normal((b, t)).astype(np.float32)
    mask = (rng.random((b, t)) < 0.8).astype(np.float32)
    mask[3] = 0.0  # a sequence with no trained token does not count
    return logits, tokens, old, adv, mask


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_microbatch_sum_with_global_normalizer_equals_minibatch(mode):
    logits, tokens, old, adv, mask = _policy_batch(0)
    options = dict(aggregation=mode, delta_low=0.05, delta_high=0.05)

    @jax.jit
    def loss_and_grad(x, tok, old, adv, mask, normalizer):
        return jax.value_and_grad(lambda y: dppo_loss(y, tok, old, adv, mask, normalizer=normalizer,
                                                      **options)[0])(x)

    whole_loss, whole_grad = jax.value_and_grad(
        lambda y: dppo_loss(y, tokens, old, adv, mask, **options)[0])(logits)
    # Microbatches hold different numbers of tokens and sequences (row 3 has none), as on different devices.
    splits = [slice(0, 2), slice(2, 4), slice(4, 6)]
    normalizer = sum(loss_normalizer(mask[s], mode) for s in splits)
    parts = [loss_and_grad(logits[s], tokens[s], old[s], adv[s], mask[s], normalizer) for s in splits]
    np.testing.assert_allclose(sum(p[0] for p in parts), whole_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.concatenate([p[1] for p in parts]), whole_grad, rtol=1e-5, atol=1e-7)


def _pack(rows, lengths, t_packed):
    """Lay out per-sequence arrays (one per row, padded) into packed rows of length t_packed."""
    placement = [(0, 0, 1), (0, 3, 2), (1, 0, 1), (1, 5, 2)]  # (packed row, offset, segment id), in order
    packed, segments = [], np.zeros((2, t_packed), np.int32)
    for arr in rows:
        out = np.zeros((2, t_packed) + arr.shape[2:], arr.dtype)
        for i, (row, off, seg) in enumerate(placement):
            out[row, off:off + lengths[i]] = arr[i, :lengths[i]]
        packed.append(out)
    for i, (row, off, seg) in enumerate(placement):
        segments[row, off:off + lengths[i]] = seg
    return packed, segments


@pytest.mark.parametrize("loss_name", ["gspo", "ppo"])
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_packed_segments_equal_one_sequence_per_row(loss_name, mode):
    """A sequence means a (row, segment) pair: packing sequences into rows does not change the loss."""
    lengths = [3, 4, 5, 2]
    logits, tokens, old, adv, mask = _policy_batch(1, b=4, t=5)
    for i, n in enumerate(lengths):  # GSPO-style sequence-level advantages; tail of each row is padding
        adv[i, :] = adv[i, 0]
        mask[i, n:] = 0.0
    mask[:, 0] = 1.0
    (p_logits, p_tokens, p_old, p_adv, p_mask), segment_ids = _pack([logits, tokens, old, adv, mask], lengths, 8)
    fn = {"gspo": gspo_loss, "ppo": ppo_loss}[loss_name]
    kwargs = dict(aggregation=mode, norm_length=5)
    if loss_name == "gspo":
        kwargs.update(clip_low=0.2, clip_high=0.2)
    run = jax.jit(lambda *args, segment_ids=None: fn(*args, segment_ids=segment_ids, **kwargs))
    unpacked_loss, unpacked_metrics = run(logits, tokens, old, adv, mask)
    packed_loss, packed_metrics = run(p_logits, p_tokens, p_old, p_adv, p_mask, segment_ids=segment_ids)
    np.testing.assert_allclose(packed_loss, unpacked_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(packed_metrics["ratio_mean"], unpacked_metrics["ratio_mean"], rtol=1e-5)
    if loss_name == "gspo":
        # without segment ids, the two sequences sharing a packed row would share one ratio
        merged_loss, _ = run(p_logits, p_tokens, p_old, p_adv, p_mask)
        assert abs(float(merged_loss) - float(unpacked_loss)) > 1e-4
