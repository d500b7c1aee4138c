"""The ODC primitives' checks against numpy, shared by the CPU suite (tests/test_ops.py, simulated CPU devices) and
the GPU suite (tests/test_ops_cuda.py, real GPUs): each takes the mesh to run on, so both backends pass exactly the
same assertions."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from conftest import spmd
from jodc import ops


def check_gather_is_exact(mesh, numel):
    """A fp32 bucket set from the host comes back exactly, in fp32 and rounded to bf16 like numpy, on every device."""
    world = mesh.shape["d"]
    values = np.random.default_rng(numel).standard_normal(numel).astype(np.float32)
    with ops.SymmetricHeap(mesh) as heap:
        b = heap.register(numel)
        assert b.shard_numel * world >= numel and (b.shard_numel * 4) % 64 == 0
        b.set_full(values)
        np.testing.assert_array_equal(b.full(), values)

        def fn():
            full, tok = ops.gather(b, ops.new_token())
            full_bf16, tok = ops.gather(b, tok, dtype=jnp.bfloat16)
            return full, full_bf16, tok

        full, full_bf16, tok = spmd(mesh, fn)
    np.testing.assert_array_equal(np.asarray(full), np.broadcast_to(values, (world, numel)))
    np.testing.assert_array_equal(np.asarray(full_bf16),
                                  np.broadcast_to(values.astype(ml_dtypes.bfloat16), (world, numel)))
    np.testing.assert_array_equal(np.asarray(tok), 2)


def check_gather_keeps_shape_and_bf16_master(mesh, shape):
    """A bf16 master bucket of `shape` gathers in its shape, as bf16 and converted to fp32."""
    world = mesh.shape["d"]
    values = np.random.default_rng(0).standard_normal(shape).astype(ml_dtypes.bfloat16)
    with ops.SymmetricHeap(mesh) as heap:
        b = heap.register(shape, dtype=jnp.bfloat16)
        assert b.master_dtype == "bfloat16" and (b.shard_numel * 2) % 64 == 0
        b.set_full(values)

        def fn():
            full, tok = ops.gather(b, ops.new_token())
            full32, tok = ops.gather(b, tok, dtype=jnp.float32)
            return full, full32

        full, full32 = spmd(mesh, fn)
        np.testing.assert_array_equal(b.full(), values)
    assert full.shape == (world, *shape) and full.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(full)[-1], values)
    np.testing.assert_array_equal(np.asarray(full32)[0], values.astype(np.float32))


def check_scatter_accumulate_matches_numpy_sum(mesh, numel, grad_dtype, deterministic=False):
    """Every device pushes its own gradient: each owner's accumulator holds the float64 sum's slice (fp32 error)."""
    world = mesh.shape["d"]
    grads = np.random.default_rng(world).standard_normal((world, numel)).astype(np.float32).astype(grad_dtype)
    with ops.SymmetricHeap(mesh, deterministic=deterministic) as heap:
        b = heap.register(numel)

        def fn(g):
            tok = ops.scatter_accumulate(b, g, ops.new_token())
            tok = ops.barrier(heap, tok)
            acc, tok = ops.read_accumulator(b, tok)
            return acc, tok

        acc, tok = spmd(mesh, fn, jnp.asarray(grads))
        expected = np.asarray(grads, np.float64).sum(0)
        assembled = np.asarray(acc).reshape(-1)[:numel]
        np.testing.assert_allclose(assembled, expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(b.accumulated(), expected, rtol=1e-5, atol=1e-5)
        assert np.all(np.asarray(acc).reshape(-1)[numel:] == 0)  # padding never receives anything
        np.testing.assert_array_equal(np.asarray(tok), 3)
        assert heap.generations() == [1] * world


def check_concurrent_pushes_in_a_loop(mesh, numel, rounds):
    """Every device pushes `rounds` times into the same bucket at once (device d pushes d + 1): nothing is lost."""
    world = mesh.shape["d"]
    with ops.SymmetricHeap(mesh) as heap:
        b = heap.register(numel)

        def fn(scale):
            def body(i, tok):
                return ops.scatter_accumulate(b, jnp.full((numel,), scale, jnp.float32), tok)

            tok = lax.fori_loop(0, rounds, body, ops.new_token())
            return ops.barrier(heap, tok)

        spmd(mesh, fn, jnp.arange(1, world + 1, dtype=jnp.float32))
        total = rounds * world * (world + 1) / 2
        np.testing.assert_array_equal(b.accumulated(), np.full(numel, total, np.float32))


def accumulate_rounds(mesh, grads, deterministic):
    """grads[d, r] pushed by device d in round r, then one barrier: the accumulated bucket (fp32, flat). Checks that the
    host-side reduction (Bucket.accumulated) gives the same bits as read_accumulator."""
    rounds, numel = grads.shape[1], grads.shape[2]
    with ops.SymmetricHeap(mesh, deterministic=deterministic) as heap:
        b = heap.register(numel)

        def fn(g):
            tok = lax.fori_loop(0, rounds, lambda i, t: ops.scatter_accumulate(b, g[i], t), ops.new_token())
            tok = ops.barrier(heap, tok)
            acc, _ = ops.read_accumulator(b, tok)
            return acc

        out = np.asarray(spmd(mesh, fn, jnp.asarray(grads))).reshape(-1)[:numel]
        assert out.tobytes() == b.accumulated().tobytes()  # host-side reduction: same order, same bits
        return out


def source_order_sum(grads):
    """The deterministic mode's fixed order in fp32: per source, its pushes in program order; then sources 0, 1, ..."""
    world, rounds, numel = grads.shape
    per_source = np.zeros((world, numel), np.float32)
    for s in range(world):
        for r in range(rounds):
            per_source[s] += grads[s, r]
    expected = np.zeros(numel, np.float32)
    for s in range(world):
        expected += per_source[s]
    return expected


def check_zero_accumulator_and_publish(mesh, numel, deterministic, master=jnp.float32, dev_scale=0.5):
    """push -> barrier -> read -> zero -> publish(summed grad + device value) -> barrier -> gather: every device sees
    every owner's new shard, and the accumulators are zero again (`dev_scale` small keeps bf16 shards exact)."""
    world = mesh.shape["d"]
    with ops.SymmetricHeap(mesh, deterministic=deterministic) as heap:
        b = heap.register(numel, dtype=master)
        b.set_full(np.zeros(numel, np.float32))

        def step(dev_value):
            tok = ops.scatter_accumulate(b, jnp.ones((numel,)), ops.new_token())
            tok = ops.barrier(heap, tok)
            acc, tok = ops.read_accumulator(b, tok)
            tok = ops.zero_accumulator(b, tok)
            tok = ops.publish(b, acc + dev_value, tok)  # new shard = summed grad (world) + device value
            tok = ops.barrier(heap, tok)
            full, tok = ops.gather(b, tok, dtype=jnp.float32)
            acc_after, tok = ops.read_accumulator(b, tok)
            return full, acc_after

        full, acc_after = spmd(mesh, step, jnp.arange(world, dtype=jnp.float32) * dev_scale)
        owner = np.arange(numel) // b.shard_numel
        expected = float(world) + dev_scale * owner
        np.testing.assert_array_equal(np.asarray(full)[-1], expected)
        np.testing.assert_array_equal(np.asarray(acc_after), 0.0)
        np.testing.assert_array_equal(b.full().astype(np.float32), expected)
        assert heap.generations() == [2] * world


def check_heaps_are_released(mesh, lib, cycles):
    """Heaps and buckets created and freed `cycles` times (a bucket freed early, heaps freed twice) leave the
    library's tallies where they were."""
    base_heaps, base_bytes = lib.live_heaps(), lib.live_bytes()
    for i in range(cycles):
        heap = ops.SymmetricHeap(mesh, deterministic=i % 2 == 0)
        buckets = [heap.register(1000 * (j + 1)) for j in range(3)]
        assert lib.live_bytes() > base_bytes
        buckets[0].free()
        try:
            buckets[0].full()
        except ValueError as e:
            assert "freed" in str(e)
        else:
            raise AssertionError("a freed bucket was readable")
        heap.free()
        heap.free()  # idempotent
    assert lib.live_heaps() == base_heaps
    assert lib.live_bytes() == base_bytes
    jax.effects_barrier()
