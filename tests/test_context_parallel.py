"""Context-parallel attention: one sequence split over 2, 4 and 8 devices (zigzag), or several in one row over 2
and 4, packed with short sequences, gives the one-device computation's output and gradients; the zigzag layout round-trips and refuses bad input; the
keyed kernel matches a float64 numpy reference and skips what it should."""
import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jodc.balance.zigzag import (
    check_group_rows,
    segment_id_limit,
    zigzag_layout,
    zigzag_merge,
    zigzag_piece,
    zigzag_row,
    zigzag_split,
)
from jodc.models import DecoderConfig, dense_attention
from jodc.models.attention import block_interactions
from jodc.models.context_parallel import (
    AxisExchange,
    context_parallel_attention,
    context_parallel_block_pairs,
    context_parallel_layer_apply,
    group_keys,
)
from jodc.models.keyed_attention import (
    blockwise_keyed_attention,
    dense_keyed_attention,
    keyed_attention_part,
    keyed_attention_part_grads,
    keyed_block_pairs,
    keyed_mask,
    merge_keyed_parts,
)
from jodc.models.layerwise import init_group_params, layer_apply, positions_from_segment_ids

AXIS = "cp"
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def relative_error(got, want) -> float:
    """max |got - want| / max |want| (the figure the tolerances and the report use)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


# ----------------------------------------------------------------------------------------------------------
# float64 numpy reference of keyed attention (forward and backward)
# ----------------------------------------------------------------------------------------------------------


def numpy_keyed_attention(q, k, v, mask, dout):
    """Output and (dq, dk, dv) of masked softmax attention in float64; q [B,T,H,D], k/v [B,S,KV,D], mask [B,T,S]."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    groups = q.shape[2] // k.shape[2]
    k_h, v_h = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    scale = q.shape[-1] ** -0.5
    scores = np.einsum("bthd,bshd->bhts", q, k_h) * scale
    allowed = np.asarray(mask)[:, None]
    scores = np.where(allowed, scores, -np.inf)
    top = np.max(np.where(allowed, scores, -1e300), axis=-1, keepdims=True)
    probs = np.where(allowed, np.exp(scores - top), 0.0)
    total = probs.sum(-1, keepdims=True)
    probs = probs / np.where(total > 0, total, 1.0)
    out = np.einsum("bhts,bshd->bthd", probs, v_h)
    dv_h = np.einsum("bhts,bthd->bshd", probs, dout)
    dprobs = np.einsum("bthd,bshd->bhts", dout, v_h)
    dscores = probs * (dprobs - np.sum(dprobs * probs, axis=-1, keepdims=True)) * scale
    dq = np.einsum("bhts,bshd->bthd", dscores, k_h)
    dk_h = np.einsum("bhts,bthd->bshd", dscores, q)
    b, s, kv, d = k.shape
    fold = lambda x: x.reshape(b, s, kv, groups, d).sum(3)  # noqa: E731
    return out, (dq, fold(dk_h), fold(dv_h))


def random_qkv(rng, b, t, s):
    return (rng.standard_normal((b, t, HEADS, HEAD_DIM)).astype(np.float32),
            rng.standard_normal((b, s, KV_HEADS, HEAD_DIM)).astype(np.float32),
            rng.standard_normal((b, s, KV_HEADS, HEAD_DIM)).astype(np.float32))


def shuffled_keys(rng, b, t, s):
    """Segments and orders of queries and keys not tied to columns: several segments, keys in random order."""
    q_seg = rng.integers(0, 4, (b, t)).astype(np.int32)
    k_seg = rng.integers(0, 4, (b, s)).astype(np.int32)
    q_order = rng.integers(0, 40, (b, t)).astype(np.int32)
    k_order = rng.integers(0, 40, (b, s)).astype(np.int32)
    return q_seg, q_order, k_seg, k_order


@pytest.mark.parametrize("impl", ["dense", "blockwise"])
def test_keyed_attention_matches_float64_reference(impl):
    rng = np.random.default_rng(1)
    b, t, s = 2, 13, 29
    q, k, v = random_qkv(rng, b, t, s)
    keys = shuffled_keys(rng, b, t, s)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    fn = dense_keyed_attention if impl == "dense" else (
        lambda *a: blockwise_keyed_attention(*a, block_size=4))
    out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, *map(jnp.asarray, keys)), q, k, v)
    grads = pullback(jnp.asarray(dout))
    want_out, want_grads = numpy_keyed_attention(q, k, v, keyed_mask(*map(jnp.asarray, keys)), dout)
    assert relative_error(out, want_out) < 1e-5
    for got, want in zip(grads, want_grads):
        assert relative_error(got, want) < 1e-5


def test_keyed_attention_in_parts_merges_to_the_float64_reference():
    """The streamed form's kernels: the keys cut into three parts (some queries with no allowed key in a part, some
    with none at all), each part's output and log-sum-exp merged, then each part's gradients taken against the
    merged output and lse: the output, dq (summed over the parts) and every part's dk / dv equal the whole
    attention's (float64 numpy)."""
    rng = np.random.default_rng(3)
    b, t, s, block = 2, 12, 36, 4
    q, k, v = random_qkv(rng, b, t, s)
    q_seg, q_order, k_seg, k_order = shuffled_keys(rng, b, t, s)
    q_seg[:, :2] = 0  # padding queries: no key anywhere
    dout = rng.standard_normal(q.shape).astype(np.float32)
    want_out, (want_dq, want_dk, want_dv) = numpy_keyed_attention(
        q, k, v, keyed_mask(*map(jnp.asarray, (q_seg, q_order, k_seg, k_order))), dout)
    parts = [slice(0, 12), slice(12, 24), slice(24, 36)]

    def part_operands(p):
        keys = tuple(jnp.asarray(x) for x in (q_seg, q_order, k_seg[:, p], k_order[:, p]))
        return jnp.asarray(k[:, p]), jnp.asarray(v[:, p]), keys, keyed_block_pairs(*keys, block)

    out = lse = None
    for p in parts:
        k_p, v_p, keys, pairs = part_operands(p)
        part_out, part_lse = keyed_attention_part(jnp.asarray(q), k_p, v_p, keys, pairs, block)
        out, lse = (part_out, part_lse) if out is None else merge_keyed_parts(out, lse, part_out, part_lse)
    assert out.dtype == jnp.float32
    assert relative_error(out, want_out) < 1e-5
    dq = 0.0
    for p in parts:
        k_p, v_p, keys, pairs = part_operands(p)
        dq_p, dk_p, dv_p = keyed_attention_part_grads(jnp.asarray(q), k_p, v_p, keys, pairs, block, out, lse,
                                                      jnp.asarray(dout))
        dq = dq + dq_p
        assert relative_error(dk_p, want_dk[:, p]) < 1e-5 and relative_error(dv_p, want_dv[:, p]) < 1e-5
    assert relative_error(dq, want_dq) < 1e-5
    assert not np.asarray(out)[:, :2].any()  # no allowed key anywhere: output exactly 0


def test_keyed_attention_with_column_orders_is_dense_attention():
    rng = np.random.default_rng(2)
    seg = np.array([[1] * 7 + [2] * 5 + [0] * 3 + [3] * 9], np.int32)
    t = seg.shape[1]
    q, k, v = random_qkv(rng, 1, t, t)
    column = np.broadcast_to(np.arange(t, dtype=np.int32), seg.shape)
    keyed = blockwise_keyed_attention(q, k, v, seg, column, seg, column, block_size=4)
    np.testing.assert_allclose(keyed, dense_attention(q, k, v, jnp.asarray(seg)), rtol=1e-5, atol=1e-6)


def test_keyed_block_pairs_cover_every_allowed_pair():
    rng = np.random.default_rng(3)
    b, t, s, block = 2, 16, 24, 4
    keys = [jnp.asarray(x) for x in shuffled_keys(rng, b, t, s)]
    pairs = np.asarray(keyed_block_pairs(*keys, block))
    exact = np.asarray(keyed_mask(*keys)).reshape(b, t // block, block, s // block, block).any(axis=(2, 4))
    assert not (exact & ~pairs).any()


def test_keyed_attention_rejects_bad_operands():
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, 1, 8, 8)
    seg = np.ones((1, 8), np.int32)
    with pytest.raises(ValueError, match="k_order has shape"):
        dense_keyed_attention(q, k, v, seg, seg, seg, seg[:, :5])
    with pytest.raises(ValueError, match="must be integers"):
        dense_keyed_attention(q, k, v, seg, seg.astype(np.float32), seg, seg)
    with pytest.raises(ValueError, match="block_pairs has shape"):
        blockwise_keyed_attention(q, k, v, seg, seg, seg, seg, block_size=4, block_pairs_bij=jnp.ones((1, 2, 3), bool))


# ----------------------------------------------------------------------------------------------------------
# The zigzag layout
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length,group_size", [(64, 4), (61, 4), (5, 4), (3, 4), (1, 1), (17, 8), (100, 2)])
def test_zigzag_split_merge_round_trip(length, group_size):
    layout = zigzag_layout(length, group_size)
    values = np.arange(length * 3).reshape(length, 3) + 1
    pieces = zigzag_split(layout, values, pad_value=-1)
    assert pieces.shape == (group_size, layout.piece_length, 3)
    np.testing.assert_array_equal(zigzag_merge(layout, pieces), values)
    # every token once, padding exactly where the layout says, chunks i and 2k-1-i on member i
    assert sum(layout.tokens_of(d) for d in range(group_size)) == length
    for d in range(group_size):
        np.testing.assert_array_equal(pieces[d, :, 0] == -1, ~layout.valid(d))
        first, second = layout.chunks_of(d)
        assert (first, second) == (d, 2 * group_size - 1 - d)
        np.testing.assert_array_equal(layout.positions(d), np.where(layout.valid(d), layout.sequence_indices(d), 0))


def test_zigzag_balances_causal_work():
    """Every member gets the same number of (query, key) pairs under causal attention when L divides by 2k."""
    layout = zigzag_layout(96, 4)
    work = [int(np.sum(layout.positions(d) + 1)) for d in range(4)]
    assert len(set(work)) == 1


def test_zigzag_row_packs_piece_then_short_sequences():
    layout = zigzag_layout(10, 2)  # chunks of 3 (2 padding tokens at the end: member 0's second chunk)
    row = zigzag_row(layout, 0, 16, [2, 3])
    np.testing.assert_array_equal(row.segment_ids, [1, 1, 1, 1, 0, 0, 2, 2, 3, 3, 3, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(row.positions, [0, 1, 2, 9, 0, 0, 0, 1, 0, 1, 2, 0, 0, 0, 0, 0])
    assert row.split_segments == 1 and row.piece_starts == (0,) and row.short_starts == (6, 8)
    # a list of one layout is the same row
    listed = zigzag_row([layout], 0, 16, [2, 3])
    np.testing.assert_array_equal(listed.segment_ids, row.segment_ids)
    np.testing.assert_array_equal(listed.positions, row.positions)


def test_zigzag_row_packs_several_split_sequences_then_short_ones():
    """Pieces one after another (piece j as segment j + 1 with its global positions, its end padding 0), then the
    short sequences numbered after them."""
    layouts = [zigzag_layout(10, 2), zigzag_layout(4, 2), zigzag_layout(3, 2)]  # pieces of 6, 2 and 2 columns
    rows = [zigzag_row(layouts, d, 14, shorts) for d, shorts in ((0, [3]), (1, []))]
    np.testing.assert_array_equal(rows[0].segment_ids, [1, 1, 1, 1, 0, 0, 2, 2, 3, 0, 4, 4, 4, 0])
    np.testing.assert_array_equal(rows[0].positions, [0, 1, 2, 9, 0, 0, 0, 3, 0, 0, 0, 1, 2, 0])
    np.testing.assert_array_equal(rows[1].segment_ids, [1, 1, 1, 1, 1, 1, 2, 2, 3, 3, 0, 0, 0, 0])
    np.testing.assert_array_equal(rows[1].positions, [3, 4, 5, 6, 7, 8, 1, 2, 1, 2, 0, 0, 0, 0])
    assert [r.split_segments for r in rows] == [3, 3]
    assert rows[0].piece_starts == rows[1].piece_starts == (0, 6, 8)
    assert rows[0].short_starts == (10,) and rows[1].short_starts == ()
    # every split sequence's positions over the group are exactly its global positions
    for s, layout in enumerate(layouts, start=1):
        got = np.concatenate([r.positions[r.segment_ids == s] for r in rows])
        assert sorted(got.tolist()) == list(range(layout.length))
    check_group_rows(np.stack([r.segment_ids for r in rows])[:, None], np.stack([r.positions for r in rows])[:, None],
                     np.full((2, 1), 3))


def test_zigzag_piece_is_one_member_of_zigzag_split():
    layout = zigzag_layout(13, 3)
    values = np.arange(13 * 2).reshape(13, 2) + 1
    pieces = zigzag_split(layout, values, pad_value=-1)
    for d in range(3):
        np.testing.assert_array_equal(zigzag_piece(layout, d, values, pad_value=-1), pieces[d])
    with pytest.raises(ValueError, match="sequence of 13 tokens"):
        zigzag_piece(layout, 0, values[:5])
    with pytest.raises(ValueError, match="device must be an integer in"):
        zigzag_piece(layout, 3, values)


def test_zigzag_layout_rejects_bad_input():
    with pytest.raises(ValueError, match="length must be a positive integer"):
        zigzag_layout(0, 2)
    with pytest.raises(ValueError, match="group_size must be a positive integer"):
        zigzag_layout(8, 0)
    with pytest.raises(ValueError, match="group_size must be a positive integer"):
        zigzag_layout(8, 2.0)
    layout = zigzag_layout(8, 2)
    with pytest.raises(ValueError, match="sequence of 8 tokens"):
        zigzag_split(layout, np.zeros(7))
    with pytest.raises(ValueError, match="pieces must have shape"):
        zigzag_merge(layout, np.zeros((2, 3)))
    with pytest.raises(ValueError, match="device must be an integer in"):
        layout.chunks_of(2)
    with pytest.raises(ValueError, match="more than token_cap=6"):
        zigzag_row(layout, 0, 6, [3])
    with pytest.raises(ValueError, match="more than token_cap=7"):
        zigzag_row([layout, layout], 0, 7)
    with pytest.raises(ValueError, match="must be >= 1"):
        zigzag_row(layout, 0, 16, [0])
    with pytest.raises(ValueError, match="over one group; got group sizes"):
        zigzag_row([layout, zigzag_layout(8, 4)], 0, 16)
    with pytest.raises(ValueError, match="non-empty list"):
        zigzag_row([], 0, 16)


# ----------------------------------------------------------------------------------------------------------
# A split sequence packed with short sequences: the group's rows and the one-device row they come from
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class GroupCase:
    """Rows of a context-parallel group and the one-device reference row holding the same sequences.

    Member rows are [k * B, T] (member-major, so a shard_map over axis 0 gives each member its B rows); `source`
    maps every member column to its reference (row, column), or -1 over padding.
    """

    segment_ids: np.ndarray  # int32 [k*B, T]
    positions: np.ndarray  # int32 [k*B, T]
    split_segments: np.ndarray  # int32 [k*B]: how many split sequences each row holds (segments 1..n)
    source: np.ndarray  # int64 [k*B, T]: reference row * Tref + column, or -1
    reference_segment_ids: np.ndarray  # int32 [B, Tref]
    group_size: int


def group_case(lengths, group_size, token_cap, shorts_per_member, second_row_shorts=None) -> GroupCase:
    """Row 0 of every member: its zigzag pieces of the split sequences of `lengths` (an int: one sequence; a list:
    several in one row, piece after piece), then its short sequences. The reference row holds the split sequences
    first, then every member's short sequences. With `second_row_shorts`, every member has a second row of short
    sequences only (no split sequence)."""
    lengths = [lengths] if isinstance(lengths, int) else list(lengths)
    layouts = [zigzag_layout(n, group_size) for n in lengths]
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)  # each split sequence's first column
    split_total = sum(lengths)
    rows_per_member = 1 if second_row_shorts is None else 2
    ref_len = split_total + sum(map(sum, shorts_per_member))
    if second_row_shorts is not None:
        ref_len = max(ref_len, sum(map(sum, second_row_shorts)))
    ref_seg = np.zeros((rows_per_member, ref_len), np.int32)
    for j, (offset, n) in enumerate(zip(offsets, lengths)):
        ref_seg[0, offset : offset + n] = j + 1
    seg = np.zeros((group_size * rows_per_member, token_cap), np.int32)
    pos = np.zeros_like(seg)
    split = np.zeros(group_size * rows_per_member, np.int32)
    source = np.full(seg.shape, -1, np.int64)
    next_column, next_id = [split_total, 0], [len(lengths) + 1, 1]
    for d in range(group_size):
        r = d * rows_per_member
        row = zigzag_row(layouts, d, token_cap, shorts_per_member[d])
        seg[r], pos[r], split[r] = row.segment_ids, row.positions, row.split_segments
        for layout, start, offset in zip(layouts, row.piece_starts, offsets):
            source[r, start : start + layout.piece_length] = np.where(
                layout.valid(d), offset + layout.sequence_indices(d), -1)
        for start, n in zip(row.short_starts, shorts_per_member[d]):
            source[r, start : start + n] = np.arange(next_column[0], next_column[0] + n)
            ref_seg[0, next_column[0] : next_column[0] + n] = next_id[0]
            next_column[0] += n
            next_id[0] += 1
        if second_row_shorts is not None:
            column = 0
            for i, n in enumerate(second_row_shorts[d]):
                seg[r + 1, column : column + n] = 2 * i + 1 + d % 2  # ids need not be dense nor start at 1
                pos[r + 1, column : column + n] = np.arange(n)
                source[r + 1, column : column + n] = ref_len + np.arange(next_column[1], next_column[1] + n)
                ref_seg[1, next_column[1] : next_column[1] + n] = next_id[1]
                next_column[1] += n
                next_id[1] += 1
                column += n
    return GroupCase(seg, pos, split, source, ref_seg, group_size)


def scatter_to_members(case: GroupCase, reference, fill):
    """Member rows [k*B, T, ...] of a reference array [B, Tref, ...]; padding slots get `fill` (noise)."""
    flat = np.asarray(reference).reshape((-1,) + np.asarray(reference).shape[2:])
    out = np.array(fill, copy=True)
    valid = case.source >= 0
    out[valid] = flat[case.source[valid]]
    return out


def gather_from_members(case: GroupCase, members, reference_shape):
    """The reference layout [B, Tref, ...] of member rows (reference columns no member holds stay 0)."""
    members = np.asarray(members)
    flat = np.zeros((int(np.prod(reference_shape[:2])),) + members.shape[2:], members.dtype)
    valid = case.source >= 0
    flat[case.source[valid]] = members[valid]
    return flat.reshape(reference_shape[:2] + members.shape[2:])


def mesh_of(group_size):
    return Mesh(np.array(jax.devices("cpu")[:group_size]), (AXIS,))


def cp_attention_fn(case: GroupCase, impl, block_size):
    """shard_map computing every member's attention output for member-major q, k, v [k*B, T, ...]."""
    exchange = AxisExchange(AXIS)

    def member(q, k, v, seg, pos, split):
        keys = group_keys(seg, pos, split, exchange)
        return context_parallel_attention(q, k, v, keys, exchange, impl=impl, block_size=block_size)

    sharded = jax.shard_map(member, mesh=mesh_of(case.group_size), in_specs=(P(AXIS),) * 6, out_specs=P(AXIS))
    seg, pos, split = (jnp.asarray(x) for x in (case.segment_ids, case.positions, case.split_segments))
    return lambda q, k, v: sharded(q, k, v, seg, pos, split)


CASES = {
    # name: (length, group size, token cap, short sequences per member, second row)
    "two_devices_packed": (40, 2, 40, [[5, 7], [3]], None),
    "four_devices_padded_packed": (61, 4, 32, [[4], [9, 2], [], [6]], None),
    "eight_devices_packed": (96, 8, 24, [[3], [], [5], [2, 2], [], [7], [1], [4]], None),
    "four_devices_two_rows": (48, 4, 20, [[2], [], [3], [5]], [[6, 4], [3], [], [8, 1, 1]]),
    "more_chunks_than_tokens": (5, 4, 6, [[1], [2], [3], []], None),
    # several split sequences in one row (the fixed layout's rows): pieces one after another, then short sequences
    "two_devices_three_split_packed": ([30, 7, 12], 2, 40, [[5, 3], [4]], None),
    "four_devices_two_split_packed": ([40, 17], 4, 24, [[4], [], [2, 3], [1]], None),
    "four_devices_three_split_two_rows": ([21, 9, 14], 4, 24, [[3], [2, 4], [], [5]], [[6, 4], [3], [], [8, 1, 1]]),
}


# every case through the block-skipping path with small blocks; the dense path and one-block rows on one case (CI time)
@pytest.mark.parametrize("name,impl,block_size", [(name, "blockwise", 4) for name in sorted(CASES)] + [
    (sorted(CASES)[0], "blockwise", 128), (sorted(CASES)[0], "dense", 0),
    ("four_devices_three_split_two_rows", "dense", 0)])
def test_context_parallel_attention_equals_one_device(name, impl, block_size, record_property):
    length, k, cap, shorts, second = CASES[name]
    case = group_case(length, k, cap, shorts, second)
    rng = np.random.default_rng(len(name))
    ref_shape = case.reference_segment_ids.shape
    q_ref, k_ref, v_ref = random_qkv(rng, *ref_shape, ref_shape[1])
    dout_ref = rng.standard_normal(q_ref.shape).astype(np.float32)
    ref_seg = jnp.asarray(case.reference_segment_ids)

    def reference_loss(q, k, v):
        return jnp.sum(dense_attention(q, k, v, ref_seg) * dout_ref)

    want_loss, want_grads = jax.value_and_grad(reference_loss, argnums=(0, 1, 2))(q_ref, k_ref, v_ref)
    # padding slots of the member rows hold noise: it must not reach any output or gradient
    noise = lambda x: rng.standard_normal((k * ref_shape[0], cap) + x.shape[2:]).astype(np.float32)  # noqa: E731
    q_m, k_m, v_m = (scatter_to_members(case, x, noise(x)) for x in (q_ref, k_ref, v_ref))
    dout_m = scatter_to_members(case, dout_ref, np.zeros((k * ref_shape[0], cap) + dout_ref.shape[2:], np.float32))
    attend = cp_attention_fn(case, impl, block_size)

    def cp_loss(q, k, v):
        out = attend(q, k, v)
        return jnp.sum(out * dout_m), out

    (loss, out), grads = jax.jit(jax.value_and_grad(cp_loss, argnums=(0, 1, 2), has_aux=True))(q_m, k_m, v_m)
    errors = {"loss": relative_error(loss, want_loss),
              "out": relative_error(gather_from_members(case, out, ref_shape),
                                    dense_attention(q_ref, k_ref, v_ref, ref_seg))}
    for label, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
        errors[label] = relative_error(gather_from_members(case, got, ref_shape), want)
        assert not np.asarray(got)[case.source < 0].any(), f"{label} is not 0 over padding"
    assert not np.asarray(out)[case.source < 0].any(), "the output is not 0 over padding"
    record_property("relative_errors", errors)
    print(name, impl, block_size, errors)
    assert max(errors.values()) <= 1e-5, errors


@pytest.mark.parametrize("lengths,shorts", [(64, [[4, 4, 4], [8, 4], [], [12]]), ([32, 64], [[4, 4], [8], [], [4]])])
def test_block_pairs_skip_other_segments_and_the_future(lengths, shorts):
    """Own sequences visit what blockwise_attention visits on the member's own row and nothing of other members;
    the split sequences visit exactly the block pairs holding a causal (query, key) pair of one sequence when chunks
    are whole blocks (one split sequence in the row, or two)."""
    block = 4
    case = group_case(lengths, 4, 32, shorts)
    exchange = AxisExchange(AXIS)

    def member(seg, pos, split):
        keys = group_keys(seg, pos, split, exchange)
        mask = keyed_mask(keys.query_segment_bt, keys.query_order_bt,
                          keys.key_segment_gbt.transpose(1, 0, 2).reshape(seg.shape[0], -1),
                          keys.key_order_gbt.transpose(1, 0, 2).reshape(seg.shape[0], -1))
        return context_parallel_block_pairs(keys, block), mask

    pairs, mask = jax.jit(jax.shard_map(member, mesh=mesh_of(4), in_specs=(P(AXIS),) * 3, out_specs=P(AXIS)))(
        *(jnp.asarray(x) for x in (case.segment_ids, case.positions, case.split_segments)))
    pairs, mask = np.asarray(pairs), np.asarray(mask)
    t = case.segment_ids.shape[1]
    exact = mask.reshape(4, t // block, block, 4 * t // block, block).any(axis=(2, 4))
    np.testing.assert_array_equal(pairs, exact)
    for d in range(4):
        split_tokens = (case.segment_ids[d] > 0) & (case.segment_ids[d] <= case.split_segments[d])
        own = np.where(split_tokens, 0, case.segment_ids[d])[None]
        overlap, _ = block_interactions(jnp.asarray(own), block)
        own_blocks = slice(d * t // block, (d + 1) * t // block)
        split_query = split_tokens.reshape(-1, block).any(-1)
        np.testing.assert_array_equal(pairs[d][~split_query][:, own_blocks], np.asarray(overlap[0])[~split_query])
    assert pairs.sum() < pairs.size / 4  # most of the [T, kT] block grid is skipped


def test_group_keys_reject_bad_shapes():
    exchange = AxisExchange(AXIS)
    seg = jnp.ones((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="split_segments has shape"):
        group_keys(seg, seg, jnp.ones((2,), jnp.int32), exchange)
    with pytest.raises(ValueError, match="positions must be integers"):
        group_keys(seg, seg.astype(jnp.float32), jnp.ones((1,), jnp.int32), exchange)


def test_check_group_rows_accepts_zigzag_rows_and_names_mistakes():
    case = group_case(48, 4, 20, [[2], [], [3], [5]], [[6, 4], [3], [], [8, 1, 1]])
    seg, pos, split = (x.reshape((4, 2) + x.shape[1:]) for x in (case.segment_ids, case.positions,
                                                                   case.split_segments))
    check_group_rows(seg, pos, split)
    bad_split = split.copy()
    bad_split[2, 0] = 0
    with pytest.raises(ValueError, match=r"row 0: members \[0, 1, 3\] hold 1 split sequence\(s\) and members \[2\] "
                                         r"hold \[0\]"):
        check_group_rows(seg, pos, bad_split)
    bad_pos = pos.copy()
    bad_pos[1, 0, :12] = np.arange(12)  # member 1 claims member 0's positions
    with pytest.raises(ValueError, match="row 0: split sequence 1 has position"):
        check_group_rows(seg, bad_pos, split)
    with pytest.raises(ValueError, match="must be >= 0"):
        check_group_rows(-seg, pos, split)
    with pytest.raises(ValueError, match="more than the row's 20 columns"):
        check_group_rows(seg, pos, split * 21)
    limit = segment_id_limit(20, 4)
    assert limit == (2**31 - 1 - 20) // 4
    check_group_rows(np.where(seg > 1, limit, seg), pos, split)  # the largest id fits int32
    with pytest.raises(ValueError, match="too large"):
        check_group_rows(np.where(seg > 1, limit + 1, seg), pos, split)
    with pytest.raises(ValueError, match="must be integers"):
        check_group_rows(seg.astype(float), pos, split)
    with pytest.raises(ValueError, match=r"must be \[k, B, T\]"):
        check_group_rows(seg[0], pos, split)


# ----------------------------------------------------------------------------------------------------------
# Through a decoder layer: parameter gradients
# ----------------------------------------------------------------------------------------------------------

def reference_layer_inputs(case, hidden_size: int, *, seed: int):
    """(segment ids, positions, hidden states, output cotangent) of `case`'s one-device reference rows: random
    states and cotangents, zero on padding."""
    rng = np.random.default_rng(seed)
    ref_seg = jnp.asarray(case.reference_segment_ids)
    ref_pos = positions_from_segment_ids(ref_seg)
    h_ref = rng.standard_normal(case.reference_segment_ids.shape + (hidden_size,)).astype(np.float32)
    ct_ref = rng.standard_normal(h_ref.shape).astype(np.float32)
    h_ref[case.reference_segment_ids == 0] = 0
    ct_ref[case.reference_segment_ids == 0] = 0
    return ref_seg, ref_pos, h_ref, ct_ref


@pytest.mark.parametrize("group_size,lengths", [(2, None), (4, None), (8, None), (2, [11, 6, 4]), (4, [29, 10])])
def test_decoder_layer_parameter_gradients_equal_one_device(group_size, lengths, record_property):
    """One split sequence (None: 8k - 3 tokens) or several in one row, with short sequences beside them."""
    config = DecoderConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                           num_kv_heads=2, attention_impl="blockwise", attention_block_size=4)
    shorts = [[3, 2], [5], [], [4], [1, 1], [], [6], [2]][:group_size]
    case = group_case(8 * group_size - 3 if lengths is None else lengths, group_size, 20, shorts)
    params = init_group_params(config, "layer_0", jax.random.key(group_size), init_std=0.2)
    ref_seg, ref_pos, h_ref, ct_ref = reference_layer_inputs(case, config.hidden_size, seed=group_size)

    def reference_loss(params, h):
        return jnp.sum(layer_apply(config, params, h, ref_pos, ref_seg) * ct_ref)

    want_loss, (want_dparams, want_dh) = jax.value_and_grad(reference_loss, argnums=(0, 1))(params, h_ref)
    h_m = scatter_to_members(case, h_ref, np.zeros((group_size, 20, config.hidden_size), np.float32))
    ct_m = scatter_to_members(case, ct_ref, np.zeros_like(h_m))
    exchange = AxisExchange(AXIS)

    def member_loss(params, h, ct, seg, pos, split):
        keys = group_keys(seg, pos, split, exchange)
        out = context_parallel_layer_apply(config, params, h, pos, keys, exchange)
        return jax.lax.psum(jnp.sum(out * ct), AXIS)

    loss_fn = jax.shard_map(member_loss, mesh=mesh_of(group_size), in_specs=(P(),) + (P(AXIS),) * 5, out_specs=P())
    seg, pos, split = (jnp.asarray(x) for x in (case.segment_ids, case.positions, case.split_segments))
    loss, (dparams, dh) = jax.jit(jax.value_and_grad(lambda p, h: loss_fn(p, h, ct_m, seg, pos, split),
                                                     argnums=(0, 1)))(params, h_m)
    errors = {"loss": relative_error(loss, want_loss),
              "dh": relative_error(gather_from_members(case, dh, case.reference_segment_ids.shape), want_dh)}
    errors.update({f"d{name}": relative_error(dparams[name], want_dparams[name]) for name in params})
    record_property("relative_errors", errors)
    print(group_size, lengths, errors)
    assert max(errors.values()) <= 1e-5, errors


@pytest.mark.parametrize("lengths", [45, [27, 12, 5]])
def test_whole_decoder_loss_and_parameter_gradients_equal_one_device(lengths, record_property):
    """Embedding, two context-parallel layers and the head on 4 members: the token-level cross-entropy and the
    gradients of every parameter group equal `layerwise.forward` on the one-device row (one split sequence, or
    three in one row)."""
    from jodc.models.layerwise import EMBED, HEAD, embed_apply, forward, head_apply, init_params, layer_group_name

    group_size, cap = 4, 24
    config = DecoderConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                           num_kv_heads=2, attention_impl="blockwise", attention_block_size=4)
    case = group_case(lengths, group_size, cap, [[3], [2, 4], [], [5]])
    rng = np.random.default_rng(11)
    params = init_params(config, jax.random.key(3), init_std=0.2)
    ref_seg = jnp.asarray(case.reference_segment_ids)
    tokens_ref = rng.integers(0, config.vocab_size, ref_seg.shape).astype(np.int32)
    targets_ref = rng.integers(0, config.vocab_size, ref_seg.shape).astype(np.int32)
    weights_ref = (case.reference_segment_ids > 0).astype(np.float32)

    def token_nll(logits, targets, weights):
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0] * weights)

    def reference_loss(params):
        logits = forward(config, params, jnp.asarray(tokens_ref), positions_from_segment_ids(ref_seg), ref_seg)
        return token_nll(logits, targets_ref, weights_ref)

    want_loss, want_grads = jax.value_and_grad(reference_loss)(params)
    member_arrays = [scatter_to_members(case, x, np.zeros((group_size, cap), x.dtype))
                     for x in (tokens_ref, targets_ref, weights_ref)]
    exchange = AxisExchange(AXIS)

    def member_loss(params, tokens, targets, weights, seg, pos, split):
        keys = group_keys(seg, pos, split, exchange)
        h = embed_apply(config, params[EMBED], tokens)
        for i in range(config.num_layers):
            h = context_parallel_layer_apply(config, params[layer_group_name(i)], h, pos, keys, exchange)
        logits = head_apply(config, params[HEAD], h, params[EMBED])
        return jax.lax.psum(token_nll(logits, targets, weights), AXIS)

    loss_fn = jax.shard_map(member_loss, mesh=mesh_of(group_size), in_specs=(P(),) + (P(AXIS),) * 6, out_specs=P())
    rows = [jnp.asarray(x) for x in member_arrays + [case.segment_ids, case.positions, case.split_segments]]
    loss, grads = jax.jit(jax.value_and_grad(lambda p: loss_fn(p, *rows)))(params)
    errors = {"loss": relative_error(loss, want_loss)}
    for group in params:
        for name in params[group]:
            errors[f"{group}.{name}"] = relative_error(grads[group][name], want_grads[group][name])
    record_property("relative_errors", errors)
    print(max(errors.items(), key=lambda item: item[1]))
    assert max(errors.values()) <= 1e-5, errors
