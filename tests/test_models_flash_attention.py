"""The fused Pallas attention (models/flash_attention.py) against the dense reference: values and gradients on
packed layouts with padding, grouped-query heads, bf16; in Pallas' interpret mode here (the same kernel code the
GPU compiles), so CPU CI checks it. Small shapes: interpret mode runs the kernel op by op."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jodc.models import attention, dense_attention
from jodc.models.attention import resolve_impl
from jodc.models.flash_attention import FLASH_BLOCK, flash_attention, flash_block
from test_models_attention import qkv, segments

ON_GPU = jax.default_backend() == "gpu"  # make gpu-check runs this file on the GPU: the compiled kernel
#: fp32 tolerance: interpret mode computes in fp32 exactly like the reference's order of magnitude; the compiled
#: Triton kernel multiplies fp32 tiles in TF32 (10-bit mantissa) on the GPU's tensor cores.
FP32_TOL = dict(rtol=5e-3, atol=5e-3) if ON_GPU else dict(rtol=1e-5, atol=1e-5)
FP32_GRAD_TOL = dict(rtol=1e-2, atol=1e-2) if ON_GPU else dict(rtol=1e-4, atol=1e-5)

LAYOUTS = {
    # 40 tokens: not a multiple of the tile (padded to 64 inside and cut back)
    "packed_with_tail_padding": segments([5, 9, 1, 13, (0, 12)]),
    # padding between sequences, and a second row that is padding only
    "padding_between_and_padding_row": segments([6, (0, 4), 10, 20], [(0, 40)]),
}


def _run(fn, q, k, v, ct):
    out, pullback = jax.vjp(fn, q, k, v)
    return out, pullback(ct)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_flash_equals_dense_values_and_gradients(layout):
    seg = LAYOUTS[layout]
    q, k, v = qkv(seg.shape[0], seg.shape[1], h=4, kv=2, d=16, seed=3)
    ct = jax.random.normal(jax.random.key(1), q.shape)
    out_d, grads_d = _run(lambda q, k, v: dense_attention(q, k, v, seg), q, k, v, ct)
    out_f, grads_f = jax.jit(lambda q, k, v: _run(lambda q, k, v: flash_attention(q, k, v, seg, block_size=16),
                                                  q, k, v, ct))(q, k, v)
    np.testing.assert_allclose(out_f, out_d, **FP32_TOL)
    np.testing.assert_array_equal(np.asarray(out_f)[np.asarray(seg) == 0], 0.0)  # padding queries: exactly 0
    for gf, gd in zip(grads_f, grads_d):
        assert np.isfinite(np.asarray(gf)).all()
        np.testing.assert_allclose(gf, gd, **FP32_GRAD_TOL)


def test_flash_bf16_is_bf16_and_within_bf16_tolerance():
    """bf16 operands: the kernel's matmuls in bf16 with fp32 accumulation; compared with the fp32 dense result at
    bf16's resolution (2^-8 relative, a few units in the last place after a softmax and a sum)."""
    seg = segments([10, 22])
    q, k, v = qkv(1, 32, d=16, seed=4)
    out32 = dense_attention(q, k, v, seg)
    q16, k16, v16 = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out16 = flash_attention(q16, k16, v16, seg, block_size=16)
    assert out16.dtype == jnp.bfloat16
    np.testing.assert_allclose(out16.astype(jnp.float32), out32, atol=3e-2, rtol=2e-2)
    grad16 = jax.grad(lambda q: jnp.sum(flash_attention(q, k16, v16, seg, block_size=16).astype(jnp.float32)))(q16)
    grad32 = jax.grad(lambda q: jnp.sum(dense_attention(q, k, v, seg)))(q)
    assert grad16.dtype == jnp.bfloat16
    np.testing.assert_allclose(grad16.astype(jnp.float32), grad32, atol=6e-2, rtol=5e-2)


def test_the_decoder_with_flash_attention_equals_blockwise():
    from test_models import perturbed_params, random_tokens, tiny_config
    from jodc.models import forward

    config = tiny_config(qkv_bias=True)
    params = perturbed_params(config)
    tokens = random_tokens((1, 24), seed=2)
    seg = segments([7, 11, (0, 6)])
    blockwise = forward(config.replace(attention_impl="blockwise"), params, tokens, None, seg)
    flash = forward(config.replace(attention_impl="flash"), params, tokens, None, seg)
    np.testing.assert_allclose(flash, blockwise, **(FP32_GRAD_TOL if ON_GPU else dict(rtol=1e-4, atol=1e-4)))


def test_auto_is_flash_on_a_gpu_backend_and_blockwise_elsewhere(monkeypatch):
    assert resolve_impl("auto") == ("flash" if ON_GPU else "blockwise")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_impl("auto") == "flash"
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert resolve_impl("auto") == "blockwise"
    assert resolve_impl("dense") == "dense"
    with pytest.raises(ValueError, match="unknown attention impl"):
        resolve_impl("cudnn")


def test_flash_tiles():
    assert flash_block(40, FLASH_BLOCK) == 64 and flash_block(5, FLASH_BLOCK) == 16
    assert flash_block(4096, FLASH_BLOCK) == FLASH_BLOCK and flash_block(4096, 64) == 64
    for bad in (8, 96, 0, "128"):
        with pytest.raises(ValueError, match="power of two >= 16"):
            flash_block(64, bad)
    q, k, v = qkv(1, 8)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention(q[:, :, :3], k, v, jnp.ones((1, 8), jnp.int32), impl="flash")
