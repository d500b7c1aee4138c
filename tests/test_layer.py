"""odc_layer: the per-layer custom_vjp (gather in forward, re-gather in backward, push the weight gradient)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import cpu_mesh
from jodc import ops

D_IN, D_HID, D_OUT, BATCH = 24, 40, 16, 3


def mlp_layer(w, x):
    return jnp.tanh(x @ w)


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((D_IN, D_HID)) / np.sqrt(D_IN)).astype(np.float32)
    w2 = (rng.standard_normal((D_HID, D_OUT)) / np.sqrt(D_HID)).astype(np.float32)
    return w1, w2


def reference_loss(w1, w2, xs):
    """The unsharded loss: the sum over every device's batch."""
    return jnp.sum(mlp_layer(w2, mlp_layer(w1, xs.reshape(-1, D_IN))) ** 2)


def odc_grads(world, xs, w1, w2, *, dtype=None, deterministic=False, residual_log=None):
    mesh = cpu_mesh(world)
    with ops.SymmetricHeap(mesh, deterministic=deterministic) as heap:
        b1, b2 = heap.register(w1.shape, name="w1"), heap.register(w2.shape, name="w2")
        b1.set_full(w1)
        b2.set_full(w2)
        layer1 = ops.odc_layer(mlp_layer, b1, dtype=dtype)
        layer2 = ops.odc_layer(mlp_layer, b2, dtype=dtype)

        def body(x):
            x = x[0]

            def local_loss(x, token):
                h, token = layer1(x, token)
                y, token = layer2(h, token)
                return jnp.sum(y.astype(jnp.float32) ** 2), token

            loss, vjp_fn, token = jax.vjp(local_loss, x, ops.new_token(), has_aux=True)
            if residual_log is not None:
                residual_log.extend(leaf.shape for leaf in jax.tree.leaves(vjp_fn))
            dx, _ = vjp_fn(jnp.ones_like(loss))
            token = ops.after(token, dx)  # every push of the backward pass happened before the barrier
            token = ops.barrier(heap, token)
            return loss[None], dx[None]

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=(P("d"), P("d"))))
        loss, dx = jax.block_until_ready(fn(xs))
        hlo = fn.lower(xs).as_text()
        compiled = fn.lower(xs).compile().as_text()
        return np.asarray(loss).sum(), b1.accumulated(), b2.accumulated(), np.asarray(dx), (hlo, compiled)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_gradient_equals_unsharded_grad(world):
    w1, w2 = make_params()
    xs = np.random.default_rng(world).standard_normal((world, BATCH, D_IN)).astype(np.float32)
    loss, g1, g2, dx, _ = odc_grads(world, xs, w1, w2)
    ref_loss, (r1, r2, rx) = jax.value_and_grad(reference_loss, argnums=(0, 1, 2))(w1, w2, xs)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(g1, r1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g2, r2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, rx, rtol=1e-5, atol=1e-5)


def test_bf16_compute_accumulates_in_fp32():
    w1, w2 = make_params(1)
    xs = np.random.default_rng(3).standard_normal((4, BATCH, D_IN)).astype(np.float32)
    _, g1, g2, _, (hlo, _) = odc_grads(4, xs, w1, w2, dtype=jnp.bfloat16)
    _, (r1, r2) = jax.value_and_grad(reference_loss, argnums=(0, 1))(w1, w2, xs)
    assert g1.dtype == np.float32
    np.testing.assert_allclose(g1, r1, rtol=0.05, atol=0.05 * np.abs(r1).max())
    np.testing.assert_allclose(g2, r2, rtol=0.05, atol=0.05 * np.abs(r2).max())
    assert "tensor<960xbf16>" in hlo  # the gather itself delivers bf16 parameters


def test_backward_regathers_and_saves_only_activations():
    """Two gathers per layer (forward and backward), and nothing parameter-sized is kept between them."""
    w1, w2 = make_params()
    xs = np.ones((2, BATCH, D_IN), np.float32)
    residuals = []
    _, _, _, _, (hlo, compiled) = odc_grads(2, xs, w1, w2, residual_log=residuals)
    assert hlo.count("custom_call @jodc_gather(") == 4
    assert hlo.count("custom_call @jodc_scatter_accumulate(") == 2
    # in the compiled schedule, compute separates the gathers: layer 2's forward gather waits for layer 1's output,
    # and the backward re-gathers wait for the cotangents (XLA must not hoist them into the forward pass)
    import re

    schedule = re.findall(r'custom_call_target="(jodc_gather|jodc_scatter_accumulate)"|= \S+ (fusion|dot)\(',
                          compiled)
    ops_in_order = [a or "compute" for a, b in schedule]
    gathers = [i for i, op in enumerate(ops_in_order) if op == "jodc_gather"]
    assert len(gathers) == 4
    for first, second in zip(gathers, gathers[1:3]):
        assert "compute" in ops_in_order[first + 1:second], ops_in_order
    assert ops_in_order.index("jodc_scatter_accumulate") > gathers[2], ops_in_order
    assert residuals, "vjp saved nothing?"
    biggest = max(int(np.prod(s)) for s in residuals)
    assert biggest < min(w1.size, w2.size), f"a residual of {biggest} elements looks like saved parameters"


def test_deterministic_layer_gradients_are_bitwise_repeatable():
    w1, w2 = make_params(2)
    xs = np.random.default_rng(5).standard_normal((8, BATCH, D_IN)).astype(np.float32)
    first = odc_grads(8, xs, w1, w2, deterministic=True)
    again = odc_grads(8, xs, w1, w2, deterministic=True)
    assert first[1].tobytes() == again[1].tobytes() and first[2].tobytes() == again[2].tobytes()


def test_unflatten_maps_a_flat_bucket_to_a_pytree():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((D_IN, D_HID)).astype(np.float32)
    bias = rng.standard_normal((D_HID,)).astype(np.float32)
    flat = np.concatenate([w.reshape(-1), bias])

    def unflatten(v):
        return {"w": v[: w.size].reshape(w.shape), "b": v[w.size:]}

    def layer_fn(p, x):
        return jnp.tanh(x @ p["w"] + p["b"])

    xs = rng.standard_normal((4, BATCH, D_IN)).astype(np.float32)
    mesh = cpu_mesh(4)
    with ops.SymmetricHeap(mesh) as heap:
        bucket = heap.register(flat.size)
        bucket.set_full(flat)
        layer = ops.odc_layer(layer_fn, bucket, unflatten=unflatten)

        def body(x):
            def loss(x, t):
                y, t = layer(x, t)
                return jnp.sum(y), t

            val, vjp_fn, tok = jax.vjp(loss, x[0], ops.new_token(), has_aux=True)
            dx, _ = vjp_fn(jnp.ones_like(val))
            ops.barrier(heap, ops.after(tok, dx))
            return val[None]

        jax.block_until_ready(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(xs))
        got = bucket.accumulated()
    ref = jax.grad(lambda p: jnp.sum(layer_fn(p, xs.reshape(-1, D_IN))))({"w": w, "b": bias})
    np.testing.assert_allclose(got[: w.size].reshape(w.shape), ref["w"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[w.size:], ref["b"], rtol=1e-5, atol=1e-5)
