"""The ODC primitives on 1/2/4/8 simulated CPU devices, checked against numpy."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import ops_checks
from conftest import cpu_mesh, spmd
from jodc import ops
from jodc.ops.transports import registration

WORLDS = [1, 2, 4, 8]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("numel", [1, 17, 1000, 4096 + 3])
def test_gather_is_exact(world, numel):
    ops_checks.check_gather_is_exact(cpu_mesh(world), numel)


def test_gather_keeps_bucket_shape_and_bf16_master():
    ops_checks.check_gather_keeps_shape_and_bf16_master(cpu_mesh(4), (3, 5, 7))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.bfloat16])
def test_scatter_accumulate_matches_numpy_sum(world, grad_dtype):
    ops_checks.check_scatter_accumulate_matches_numpy_sum(cpu_mesh(world), 3001, grad_dtype)


def test_concurrent_pushes_from_every_device_in_a_loop():
    """All 8 devices push 20 times each into the same bucket at once; nothing is lost."""
    ops_checks.check_concurrent_pushes_in_a_loop(cpu_mesh(8), 50_000, 20)


def test_per_device_while_loop_trip_counts():
    """Device d runs d + 1 microbatches (its own loop bound, no collective inside) and pushes each one."""
    mesh = cpu_mesh(4)
    numel = 777
    with ops.SymmetricHeap(mesh) as heap:
        b = heap.register(numel)
        b.set_full(np.ones(numel, np.float32))

        def fn(trips):
            def cond(carry):
                i, _ = carry
                return i < trips

            def body(carry):
                i, tok = carry
                w, tok = ops.gather(b, tok)
                tok = ops.scatter_accumulate(b, w * (i + 1).astype(jnp.float32), tok)
                return i + 1, tok

            _, tok = lax.while_loop(cond, body, (jnp.int32(0), ops.new_token()))
            return ops.barrier(heap, tok)

        tok = spmd(mesh, fn, jnp.arange(1, 5, dtype=jnp.int32))
        # device d pushes 1 + 2 + ... + (d + 1)
        expected = sum(k * (k + 1) / 2 for k in range(1, 5))
        np.testing.assert_array_equal(b.accumulated(), np.full(numel, expected, np.float32))
        # token counts the ops each device ran: 2 per trip + the barrier
        np.testing.assert_array_equal(np.asarray(tok), [2 * t + 1 for t in range(1, 5)])


def test_deterministic_mode_is_bit_for_bit_repeatable():
    mesh = cpu_mesh(8)
    numel, rounds = 20_001, 5
    rng = np.random.default_rng(7)
    grads = (rng.standard_normal((8, rounds, numel)) * 10.0 ** rng.integers(-4, 4, (8, rounds, 1))).astype(np.float32)
    first = ops_checks.accumulate_rounds(mesh, grads, True)
    for _ in range(4):
        assert first.tobytes() == ops_checks.accumulate_rounds(mesh, grads, True).tobytes()
    expected = ops_checks.source_order_sum(grads)
    assert first.tobytes() == expected.tobytes()
    np.testing.assert_allclose(ops_checks.accumulate_rounds(mesh, grads, False), expected, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("deterministic", [False, True])
def test_zero_accumulator_and_publish(deterministic):
    ops_checks.check_zero_accumulator_and_publish(cpu_mesh(4), 100, deterministic, dev_scale=100.0)


def test_barrier_orders_publish_before_peer_gather():
    """Each device publishes, then a barrier, then every device reads all peers' new shards."""
    mesh = cpu_mesh(8)
    numel = 8 * 64
    with ops.SymmetricHeap(mesh) as heap:
        b = heap.register(numel)

        def fn(dev):
            tok = ops.publish(b, jnp.full((b.shard_numel,), dev), ops.new_token())
            tok = ops.barrier(heap, tok)
            full, _ = ops.gather(b, tok)
            return full

        full = np.asarray(spmd(mesh, fn, jnp.arange(8, dtype=jnp.float32)))
        np.testing.assert_array_equal(full, np.broadcast_to(np.repeat(np.arange(8.0), 64), (8, numel)))
        assert heap.generations() == [1] * 8


def test_barrier_timeout_names_missing_devices():
    mesh = cpu_mesh(4)
    heap = ops.SymmetricHeap(mesh, barrier_timeout_s=0.3)
    try:
        def fn(dev):
            return lax.cond(dev == 0, lambda t: ops.barrier(heap, t), lambda t: t, ops.new_token())

        with pytest.raises(Exception, match=r"timed out after 0.3 s .*device\(s\) \[1, 2, 3\] never arrived"):
            jax.block_until_ready(spmd(mesh, fn, jnp.arange(4)))
        with pytest.raises(RuntimeError, match="never arrived"):
            heap.register(10)  # a poisoned heap refuses further use
    finally:
        with pytest.warns(RuntimeWarning, match="never arrived"):
            heap.free()
    jax.effects_barrier()  # the failure does not linger


def test_heaps_are_released():
    lib = registration.cpu_library()
    mesh = cpu_mesh(4)
    base_bytes = lib.live_bytes()
    ops_checks.check_heaps_are_released(mesh, lib, 20)
    # a heap dropped without free() is released by its finalizer
    heap = ops.SymmetricHeap(mesh)
    heap.register(10_000)
    del heap
    import gc

    gc.collect()
    assert lib.live_bytes() == base_bytes


@pytest.mark.parametrize("numel,world,master_bytes", [(1, 1, 4), (1, 8, 2), (17, 3, 4), (10**6 + 1, 8, 2),
                                                      (123457, 7, 4)])
def test_layout_pads_and_aligns(numel, world, master_bytes):
    shard = registration.cpu_library().shard_numel(numel, world, master_bytes)
    assert shard * world >= numel
    assert (shard * master_bytes) % 64 == 0 and (shard * 4) % 64 == 0
    assert shard * (world - 1) < numel + world * 32 or numel < 32 * world  # padding stays below one quantum


# ---------------------------------------------------------------------------------------------------------------
# bad input: clear Python errors before dispatch; the native handler refuses what slips through

def test_bad_input_is_rejected_in_python():
    mesh4, mesh2 = cpu_mesh(4), cpu_mesh(2)
    with ops.SymmetricHeap(mesh4) as heap:
        b = heap.register((10, 10))
        tok = ops.new_token()
        with pytest.raises(ValueError, match="inside jax.shard_map over mesh axis 'd'"):
            ops.gather(b, tok)
        with pytest.raises(ValueError, match="heap .* was created for 4"):
            spmd(mesh2, lambda: ops.gather(b, ops.new_token()))
        with pytest.raises(ValueError, match=r"gradient of shape \(99,\) does not match bucket"):
            spmd(mesh4, lambda: ops.scatter_accumulate(b, jnp.zeros(99), ops.new_token()))
        with pytest.raises(ValueError, match="gradient must be float32 or bfloat16, got int32"):
            spmd(mesh4, lambda: ops.scatter_accumulate(b, jnp.zeros((10, 10), jnp.int32), ops.new_token()))
        with pytest.raises(ValueError, match="dtype must be float32 or bfloat16, got float16"):
            spmd(mesh4, lambda: ops.gather(b, ops.new_token(), dtype=jnp.float16))
        with pytest.raises(ValueError, match="token must be an int32 scalar"):
            spmd(mesh4, lambda: ops.gather(b, jnp.zeros((2,), jnp.int32)))
        with pytest.raises(ValueError, match="shards are"):
            spmd(mesh4, lambda: ops.publish(b, jnp.zeros(3), ops.new_token()))
        with pytest.raises(ValueError, match="float32 or bfloat16"):
            heap.register(10, dtype=jnp.int8)
        with pytest.raises(ValueError, match="at least one element"):
            heap.register(0)
        with pytest.raises(ValueError, match="holds 100 elements, got 3"):
            b.set_full(np.zeros(3))
        b.free()
        with pytest.raises(ValueError, match="has been freed"):
            spmd(mesh4, lambda: ops.gather(b, ops.new_token()))
    with pytest.raises(ValueError, match="has been freed"):
        spmd(mesh4, lambda: ops.barrier(heap, ops.new_token()))
    with pytest.raises(ValueError, match="not 'x'"):
        ops.SymmetricHeap(mesh4, "x")


def test_native_handlers_return_errors_instead_of_crashing():
    """Bypass the Python checks: the handlers themselves refuse unknown ids, bad sizes and device indices. A handler
    that fails aborts its heap (peers waiting in a barrier must not wait for the timeout), so each case runs on a
    fresh heap, which is poisoned with the device and the cause afterwards."""
    mesh = cpu_mesh(2)
    tok_t = jax.ShapeDtypeStruct((), jnp.int32)
    full_t = jax.ShapeDtypeStruct((64,), jnp.float32)

    def raw(target, results, *args, dev=None, heap_id=None, bucket_id=None):
        with ops.SymmetricHeap(mesh) as heap:
            b = heap.register(64)
            attrs = dict(heap=np.int64(heap.id if heap_id is None else heap_id))
            if bucket_id is not False:
                attrs["bucket"] = np.int64(b.id if bucket_id is None else bucket_id)

            def fn():
                d = lax.axis_index("d").astype(jnp.int32) if dev is None else jnp.int32(dev)
                return jax.ffi.ffi_call(target, results, has_side_effect=True)(d, *args, **attrs)

            try:
                jax.block_until_ready(spmd(mesh, fn))
            except Exception as e:  # noqa: BLE001 - the handler's error, checked by the caller
                error = str(e)
            else:
                error = ""
            poisoned = heap.poisoned
            with pytest.warns(RuntimeWarning, match="a queued computation had failed"):
                heap.free()
            return error, poisoned

    cases = [
        (("jodc_gather", (full_t, tok_t), jnp.int32(0)), dict(bucket_id=999999), "bucket 999999 is not registered"),
        (("jodc_gather", (full_t, tok_t), jnp.int32(0)), dict(heap_id=888888), "heap 888888 is not registered"),
        (("jodc_gather", (jax.ShapeDtypeStruct((63,), jnp.float32), tok_t), jnp.int32(0)), {},
         "output has 63 elements"),
        (("jodc_scatter_accumulate", (tok_t,), jnp.zeros(65), jnp.int32(0)), {}, "gradient has 65 elements"),
        (("jodc_barrier", (tok_t,), jnp.int32(0)), dict(dev=5, bucket_id=False), r"device index 5 outside \[0, 2\)"),
        (("jodc_publish", (tok_t,), jnp.zeros(32, jnp.bfloat16), jnp.int32(0)), {},
         "master dtype float32"),
    ]
    for args, kwargs, message in cases:
        error, poisoned = raw(*args, **kwargs)
        assert re.search(message, error), (message, error)
        if "heap_id" in kwargs:
            assert poisoned == ""  # no such heap: nothing to abort, the real heap stays healthy
        else:  # the heap records which device failed and why; every later op fails with it
            assert re.search(r"aborted: device \d failed: jodc \w+: .*" + message, poisoned), poisoned
    # a heap whose ops never failed stays healthy
    with ops.SymmetricHeap(mesh) as heap:
        b = heap.register(64)
        full, _ = spmd(mesh, lambda: ops.gather(b, ops.new_token()))
        assert full.shape == (2, 64) and heap.poisoned == ""
