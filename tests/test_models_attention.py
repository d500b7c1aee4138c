"""Segment-aware attention: blockwise == dense (values and gradients), padding, and block skipping."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jodc.models import attention, blockwise_attention, dense_attention
from jodc.models.attention import block_interactions
from jodc.models.attention_inputs import check_attention_inputs


def qkv(b, t, h=4, kv=2, d=8, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((b, t, h, d)), dtype),
            jnp.asarray(rng.standard_normal((b, t, kv, d)), dtype),
            jnp.asarray(rng.standard_normal((b, t, kv, d)), dtype))


def segments(*rows):
    """Rows given as lists of segment lengths; id 0 entries are padding runs, written as (0, n)."""
    out = []
    for row in rows:
        ids, next_id = [], 1
        for item in row:
            if isinstance(item, tuple):
                ids += [0] * item[1]
            else:
                ids += [next_id] * item
                next_id += 1
        out.append(ids)
    return jnp.asarray(out, jnp.int32)


LAYOUTS = {
    "one_sequence": segments([37]),
    "packed_with_tail_padding": segments([5, 9, 1, 13, (0, 9)]),
    "padding_between": segments([6, (0, 4), 10, 17]),
    "two_rows": segments([20, 17], [3, 3, 3, 3, 25]),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("block_size", [4, 16, 128])
def test_blockwise_equals_dense_values_and_gradients(layout, block_size):
    seg = LAYOUTS[layout]
    q, k, v = qkv(seg.shape[0], seg.shape[1], seed=block_size)
    ct = jax.random.normal(jax.random.key(0), q.shape)

    def run(fn):
        out, pullback = jax.vjp(fn, q, k, v)
        return out, pullback(ct)

    out_d, grads_d = run(lambda q, k, v: dense_attention(q, k, v, seg))
    out_b, grads_b = jax.jit(lambda q, k, v: run(lambda q, k, v: blockwise_attention(q, k, v, seg,
                                                                                     block_size=block_size)))(q, k, v)
    np.testing.assert_allclose(out_b, out_d, rtol=1e-5, atol=1e-5)
    for gb, gd in zip(grads_b, grads_d):
        assert np.isfinite(np.asarray(gb)).all()
        np.testing.assert_allclose(gb, gd, rtol=1e-4, atol=1e-5)


def test_padding_queries_output_zero_and_tokens_see_only_their_segment():
    seg = segments([4, 5, (0, 3)])
    q, k, v = qkv(1, 12)
    for impl in ("blockwise", "dense"):
        out = attention(q, k, v, seg, impl=impl, block_size=4)
        np.testing.assert_array_equal(out[0, 9:], 0.0)
        # the first token of segment 2 attends only to itself: its output is its own value (per kv group)
        np.testing.assert_allclose(out[0, 4], jnp.repeat(v[0, 4], 2, axis=0), rtol=1e-6)
        # changing segment 1 does not change segment 2
        v2 = v.at[0, :4].set(100.0)
        np.testing.assert_allclose(attention(q, k, v2, seg, impl=impl, block_size=4)[0, 4:9], out[0, 4:9], rtol=1e-6)


def test_all_padding_row_is_finite_with_zero_gradients():
    seg = jnp.zeros((1, 16), jnp.int32)
    q, k, v = qkv(1, 16)
    out, grads = jax.value_and_grad(lambda q, k, v: jnp.sum(blockwise_attention(q, k, v, seg, block_size=4) ** 2),
                                    argnums=(0, 1, 2))(q, k, v)
    assert float(out) == 0.0
    for g in grads:
        np.testing.assert_array_equal(g, 0.0)


def test_non_contiguous_segment_ids_are_still_correct():
    """Ids that come back after another segment (not the packing convention) still give the dense result."""
    seg = jnp.asarray([[1, 1, 2, 2, 1, 1, 3, 3, 2, 2, 0, 1]], jnp.int32)
    q, k, v = qkv(1, 12, seed=5)
    np.testing.assert_allclose(blockwise_attention(q, k, v, seg, block_size=2), dense_attention(q, k, v, seg),
                               rtol=1e-5, atol=1e-5)


def test_block_skipping_visits_only_blocks_that_share_a_segment():
    block = 64
    long_row = jnp.ones((1, 1024), jnp.int32)
    packed_row = jnp.asarray(np.repeat(np.arange(1, 17), 64)[None], jnp.int32)
    overlap_long, first_long = block_interactions(long_row, block)
    overlap_packed, first_packed = block_interactions(packed_row, block)
    nb = 1024 // block
    assert int(overlap_long.sum()) == nb * (nb + 1) // 2  # causal: every block at or below the diagonal
    assert int(overlap_packed.sum()) == nb  # each sequence is one block: only the diagonal
    np.testing.assert_array_equal(first_long[0], 0)
    np.testing.assert_array_equal(first_packed[0], np.arange(nb))
    # trailing padding blocks have nothing to do (first key block past the diagonal)
    padded = jnp.asarray([[1] * 100 + [0] * 28], jnp.int32)
    _, first = block_interactions(padded, 32)
    np.testing.assert_array_equal(first[0], [0, 0, 0, 0])
    _, first = block_interactions(jnp.asarray([[1] * 64 + [0] * 64], jnp.int32), 32)
    np.testing.assert_array_equal(first[0], [0, 0, 3, 4])


def test_bf16_inputs_stay_bf16_and_close_to_fp32():
    seg = segments([10, 22])
    q, k, v = qkv(1, 32)
    out32 = blockwise_attention(q, k, v, seg, block_size=8)
    out16 = blockwise_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), seg,
                                block_size=8)
    assert out16.dtype == jnp.bfloat16
    np.testing.assert_allclose(out16.astype(jnp.float32), out32, atol=5e-2)


def test_check_attention_inputs_names_what_does_not_fit():
    """The one operand check of every attention path (the flash kernel's too): shapes, head counts, segment ids."""
    q, k, v = qkv(1, 8)
    seg = jnp.ones((1, 8), jnp.int32)
    check_attention_inputs(q, k, v, seg)  # fits: no error
    with pytest.raises(ValueError, match="expects q"):
        check_attention_inputs(q[0], k, v, seg)
    with pytest.raises(ValueError, match="must have the same shape"):
        check_attention_inputs(q, k, v[:, :4], seg)
    with pytest.raises(ValueError, match="does not match q"):
        check_attention_inputs(q, k[:, :4], v[:, :4], seg)


def test_attention_rejects_bad_inputs():
    q, k, v = qkv(1, 8)
    seg = jnp.ones((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="unknown attention impl"):
        attention(q, k, v, seg, impl="flashy")
    with pytest.raises(ValueError, match="segment_ids shape"):
        dense_attention(q, k, v, jnp.ones((1, 7), jnp.int32))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        blockwise_attention(q[:, :, :3], k, v, seg)
    with pytest.raises(ValueError, match="integers"):
        blockwise_attention(q, k, v, seg.astype(jnp.float32))
    with pytest.raises(ValueError, match="block_size"):
        blockwise_attention(q, k, v, seg, block_size=0)
