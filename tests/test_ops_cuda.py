"""The ODC primitives on real GPUs (the CUDA kernels of ffi/cuda), checked against numpy and the CPU backend.

Marked ``cuda``; the whole module skips cleanly without a CUDA device or without the CUDA build of jodc
(``JODC_CUDA=1 make test`` builds it; ``pytest -m cuda`` selects these tests). Tests over a mesh use every visible
GPU (1 to 8). Tests that call the handlers directly simulate a world of several devices on one GPU, so the
multi-owner kernel paths, the barrier timeout and the fault handling run on single-GPU runners too.
"""
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from conftest import cpu_mesh, spmd
from jodc import ops
from jodc.ops import _native
from jodc.ops.heap import _settle_ops_before_free

pytestmark = pytest.mark.cuda


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


GPUS = _gpus()
if not GPUS:
    pytest.skip("needs a CUDA device (jax.devices('gpu') is empty)", allow_module_level=True)
try:
    from jodc.ops import _cuda

    LIB = _cuda.library()
except ImportError as e:
    pytest.skip(f"the CUDA build of jodc is missing: {e}", allow_module_level=True)

N_GPUS = len(GPUS)
WORLDS = sorted({1, min(2, N_GPUS), N_GPUS})
TOKEN = jax.ShapeDtypeStruct((), jnp.int32)


def gpu_mesh(n: int, axis: str = "d"):
    return jax.sharding.Mesh(np.array(GPUS[:n]), (axis,))


# ---------------------------------------------------------------------------------------------------------------
# over a mesh of every GPU, through jodc.ops

@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("numel", [1, 17, 1000, 4096 + 3, 1 << 20])
def test_gather_is_exact(world, numel):
    mesh = gpu_mesh(world)
    values = np.random.default_rng(numel).standard_normal(numel).astype(np.float32)
    with ops.SymmetricHeap(mesh) as heap:
        b = heap.register(numel)
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


def test_gather_bf16_master_matches_the_cpu_conversion():
    mesh = gpu_mesh(N_GPUS)
    values = np.random.default_rng(0).standard_normal((3, 5, 77)).astype(ml_dtypes.bfloat16)
    with ops.SymmetricHeap(mesh) as heap:
        b = heap.register((3, 5, 77), dtype=jnp.bfloat16)
        b.set_full(values)

        def fn():
            full, tok = ops.gather(b, ops.new_token())
            full32, tok = ops.gather(b, tok, dtype=jnp.float32)
            return full, full32

        full, full32 = spmd(mesh, fn)
        np.testing.assert_array_equal(b.full(), values)
    assert full.shape == (N_GPUS, 3, 5, 77) and full.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(full)[-1], values)
    np.testing.assert_array_equal(np.asarray(full32)[0], values.astype(np.float32))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("deterministic", [False, True])
def test_scatter_accumulate_matches_numpy_sum(world, grad_dtype, deterministic):
    mesh = gpu_mesh(world)
    numel = 30_001
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


def test_concurrent_pushes_from_every_gpu_in_a_loop():
    """Every GPU pushes 20 times into the same bucket at once (atomics or landing slots); nothing is lost."""
    mesh = gpu_mesh(N_GPUS)
    numel, rounds = 1 << 18, 20
    with ops.SymmetricHeap(mesh) as heap:
        b = heap.register(numel)

        def fn(scale):
            def body(i, tok):
                return ops.scatter_accumulate(b, jnp.full((numel,), scale, jnp.float32), tok)

            tok = lax.fori_loop(0, rounds, body, ops.new_token())
            return ops.barrier(heap, tok)

        spmd(mesh, fn, jnp.arange(1, N_GPUS + 1, dtype=jnp.float32))
        total = rounds * N_GPUS * (N_GPUS + 1) / 2
        np.testing.assert_array_equal(b.accumulated(), np.full(numel, total, np.float32))


def test_deterministic_mode_is_bit_for_bit_repeatable_and_equals_the_cpu_backend():
    world = N_GPUS
    numel, rounds = 20_001, 5
    rng = np.random.default_rng(7)
    grads = (rng.standard_normal((world, rounds, numel)) *
             10.0 ** rng.integers(-4, 4, (world, rounds, 1))).astype(np.float32)

    def run(mesh, deterministic):
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

    first = run(gpu_mesh(world), True)
    for _ in range(3):
        assert first.tobytes() == run(gpu_mesh(world), True).tobytes()
    # fixed order: per source, its pushes in program order; then sources 0, 1, ...
    per_source = np.zeros((world, numel), np.float32)
    for s in range(world):
        for r in range(rounds):
            per_source[s] += grads[s, r]
    expected = np.zeros(numel, np.float32)
    for s in range(world):
        expected += per_source[s]
    assert first.tobytes() == expected.tobytes()
    if world <= len(jax.devices("cpu")):
        assert first.tobytes() == run(cpu_mesh(world), True).tobytes()  # the CPU backend agrees bit for bit
    np.testing.assert_allclose(run(gpu_mesh(world), False), expected, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("master", [jnp.float32, jnp.bfloat16])
def test_zero_accumulator_and_publish(deterministic, master):
    mesh = gpu_mesh(N_GPUS)
    numel = 1000
    with ops.SymmetricHeap(mesh, deterministic=deterministic) as heap:
        b = heap.register(numel, dtype=master)
        b.set_full(np.zeros(numel, np.float32))

        def step(dev_value):
            tok = ops.scatter_accumulate(b, jnp.ones((numel,)), ops.new_token())
            tok = ops.barrier(heap, tok)
            acc, tok = ops.read_accumulator(b, tok)
            tok = ops.zero_accumulator(b, tok)
            tok = ops.publish(b, acc + dev_value, tok)  # new shard = summed grad + device value
            tok = ops.barrier(heap, tok)
            full, tok = ops.gather(b, tok, dtype=jnp.float32)
            acc_after, tok = ops.read_accumulator(b, tok)
            return full, acc_after

        # device values stay small so every new shard value is exact in bf16 too
        full, acc_after = spmd(mesh, step, jnp.arange(N_GPUS, dtype=jnp.float32) * 0.5)
        owner = np.arange(numel) // b.shard_numel
        expected = float(N_GPUS) + 0.5 * owner
        np.testing.assert_array_equal(np.asarray(full)[-1], expected)
        np.testing.assert_array_equal(np.asarray(acc_after), 0.0)
        np.testing.assert_array_equal(b.full().astype(np.float32), expected)
        assert heap.generations() == [2] * N_GPUS


@pytest.mark.skipif(N_GPUS < 2, reason="needs two GPUs for a mesh barrier (the raw test below covers one GPU)")
def test_mesh_barrier_timeout_names_missing_devices():
    mesh = gpu_mesh(N_GPUS)
    heap = ops.SymmetricHeap(mesh, barrier_timeout_s=0.3)
    try:
        def fn(dev):
            return lax.cond(dev == 0, lambda t: ops.barrier(heap, t), lambda t: t, ops.new_token())

        missing = ", ".join(str(d) for d in range(1, N_GPUS))
        with pytest.raises(Exception, match=rf"timed out after 0.3 s .*device\(s\) \[{missing}\] never arrived"):
            jax.block_until_ready(spmd(mesh, fn, jnp.arange(N_GPUS)))
        with pytest.raises(RuntimeError, match="never arrived"):
            heap.register(10)  # a poisoned heap refuses further use
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            heap.free()


def test_oversized_buckets_are_refused_naming_the_bytes():
    """Issue 11 item 1 on the GPU: sizes that overflow are a ValueError, sizes no GPU can hold a MemoryError (both in
    Python and in the library itself), and the heap stays usable."""
    with ops.SymmetricHeap(gpu_mesh(N_GPUS)) as heap:
        base = LIB.live_bytes()
        with pytest.raises(ValueError, match=r"bucket 'huge' of 4611686018427387904 elements is too large"):
            heap.register((2**31, 2**31), name="huge")
        with pytest.raises(ValueError, match="overflows 64-bit byte counts"):
            LIB.bucket_register(heap.id, 2**62, "float32")
        with pytest.raises(MemoryError, match=r"bucket 'big' .*out of GPU memory: .* needs \d+ bytes on GPU"):
            heap.register(2**45, name="big")  # 128 TiB of fp32 shards alone
        assert LIB.live_bytes() == base and heap.poisoned == ""
        b = heap.register(100)
        b.set_full(np.arange(100.0))
        b.zero_accumulators()
        np.testing.assert_array_equal(b.full(), np.arange(100.0))


def test_heaps_are_released():
    mesh = gpu_mesh(N_GPUS)
    base_heaps, base_bytes = LIB.live_heaps(), LIB.live_bytes()
    for i in range(6):
        heap = ops.SymmetricHeap(mesh, deterministic=i % 2 == 0)
        buckets = [heap.register(1000 * (j + 1)) for j in range(3)]
        assert LIB.live_bytes() > base_bytes
        buckets[0].free()
        heap.free()
        heap.free()  # idempotent
    assert LIB.live_heaps() == base_heaps
    assert LIB.live_bytes() == base_bytes


# ---------------------------------------------------------------------------------------------------------------
# the handlers called directly: a world of several devices simulated on one GPU (positions wrap onto the GPUs)

class RawHeap:
    """A heap made through the library itself, for calling the handlers with explicit device indices."""

    def __init__(self, world, *, deterministic=False, timeout_s=300.0):
        _native.ensure_registered("gpu")  # the key SymmetricHeap uses for GPU meshes
        self.world = world
        self.id = LIB.heap_create(world, deterministic, timeout_s)

    def register(self, numel, dtype="float32"):
        return LIB.bucket_register(self.id, numel, dtype)

    def call(self, target, results, device, *args, **attrs):
        """Runs one handler on GPU 0 as device `device` (an operand, like axis_index); returns its results."""
        fn = _raw_call(target, results, tuple(sorted((k, int(v)) for k, v in attrs.items())))
        placed = [jax.device_put(x, GPUS[0]) for x in (jnp.int32(device), *args)]
        return jax.block_until_ready(fn(*placed))

    def free(self):
        with warnings.catch_warnings():  # drop JAX's record of the calls that failed on purpose
            warnings.simplefilter("ignore", RuntimeWarning)
            _settle_ops_before_free(f"raw heap {self.id}")
        LIB.heap_free(self.id)


@functools.lru_cache(maxsize=None)
def _raw_call(target, results, attrs):
    """One jitted function per (target, result types, attributes), so repeated calls do not recompile."""
    attrs = {k: np.int64(v) for k, v in attrs}

    def fn(dev, *xs):
        return jax.ffi.ffi_call(target, results, has_side_effect=True)(dev, *xs, **attrs)

    return jax.jit(fn)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("master", ["float32", "bfloat16"])
def test_raw_multi_owner_paths_on_one_gpu(deterministic, master):
    world, numel = 3, 5003
    heap = RawHeap(world, deterministic=deterministic)
    try:
        bucket = heap.register(numel, master)
        shard_numel = LIB.bucket_shard_numel(heap.id, bucket)
        np_master = np.float32 if master == "float32" else ml_dtypes.bfloat16
        values = np.random.default_rng(1).standard_normal(shard_numel * world).astype(np_master)
        for d in range(world):
            LIB.bucket_set_shard(heap.id, bucket, d, values[d * shard_numel:(d + 1) * shard_numel].view(np.uint8))
        ids = dict(heap=heap.id, bucket=bucket)
        for d in range(world):
            for out_dtype in (jnp.float32, jnp.bfloat16):
                full, tok = heap.call("jodc_gather", (jax.ShapeDtypeStruct((numel,), out_dtype), TOKEN), d,
                                      jnp.int32(41), **ids)
                assert int(tok) == 42
                np.testing.assert_array_equal(np.asarray(full), values[:numel].astype(out_dtype))
        grads = np.random.default_rng(2).standard_normal((world, numel)).astype(np.float32)
        for d in range(world):
            heap.call("jodc_scatter_accumulate", (TOKEN,), d, jnp.asarray(grads[d]), jnp.int32(0), **ids)
        expected = np.zeros(numel, np.float32)
        for d in range(world):
            expected += grads[d]
        got = np.concatenate([np.asarray(heap.call("jodc_read_accumulator",
                                                   (jax.ShapeDtypeStruct((shard_numel,), jnp.float32), TOKEN), d,
                                                   jnp.int32(0), **ids)[0]) for d in range(world)])[:numel]
        if deterministic:
            assert got.tobytes() == expected.tobytes()
        else:
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
        heap.call("jodc_zero_accumulator", (TOKEN,), 1, jnp.int32(0), **ids)
        acc1 = np.frombuffer(LIB.bucket_get_accumulator(heap.id, bucket, 1), np.float32)
        assert np.all(acc1 == 0)
        new_shard = np.full(shard_numel, 7.0, np.float32).astype(np_master)
        heap.call("jodc_publish", (TOKEN,), 2, jnp.asarray(new_shard), jnp.int32(0), **ids)
        np.testing.assert_array_equal(np.frombuffer(LIB.bucket_get_shard(heap.id, bucket, 2), np_master), new_shard)
    finally:
        heap.free()


def test_raw_barrier_timeout_names_missing_devices_and_poisons():
    heap = RawHeap(4, timeout_s=0.3)
    try:
        with pytest.raises(Exception, match=r"timed out after 0.3 s .*device\(s\) \[1, 2, 3\] never arrived"):
            heap.call("jodc_barrier", (TOKEN,), 0, jnp.int32(0), heap=heap.id)
        assert LIB.heap_generations(heap.id) == [1, 0, 0, 0]
        assert "never arrived" in LIB.heap_poisoned(heap.id)
        with pytest.raises(Exception, match="never arrived"):  # every later op fails with the same message
            heap.call("jodc_barrier", (TOKEN,), 1, jnp.int32(0), heap=heap.id)
    finally:
        heap.free()


def test_raw_barrier_passes_when_everyone_arrives_in_order():
    heap = RawHeap(1)
    try:
        for g in range(1, 4):
            (tok,) = heap.call("jodc_barrier", (TOKEN,), 0, jnp.int32(10), heap=heap.id)
            assert int(tok) == 11
            assert LIB.heap_generations(heap.id) == [g]
    finally:
        heap.free()


def test_native_handlers_return_errors_instead_of_crashing():
    """Bypass the Python checks: the handlers refuse unknown ids, bad sizes and device indices. A handler that fails
    aborts its heap (peers spinning in a barrier kernel must not wait for the timeout), so each case runs on a fresh
    heap, which is poisoned with the cause afterwards."""
    full_t = jax.ShapeDtypeStruct((64,), jnp.float32)

    def failing(call, message, *, poisons=True):
        heap = RawHeap(2)
        try:
            bucket = heap.register(64)
            ids = dict(heap=heap.id, bucket=bucket)
            with pytest.raises(Exception, match=message):
                call(heap, ids, LIB.bucket_shard_numel(heap.id, bucket))
            poisoned = LIB.heap_poisoned(heap.id)
            if poisons:
                assert "aborted: the device on GPU 0 failed: jodc " in poisoned and re.search(message, poisoned)
            else:
                assert poisoned == ""
        finally:
            heap.free()

    failing(lambda h, ids, n: h.call("jodc_gather", (full_t, TOKEN), 0, jnp.int32(0), heap=h.id, bucket=999999),
            "bucket 999999 is not registered")
    failing(lambda h, ids, n: h.call("jodc_gather", (full_t, TOKEN), 0, jnp.int32(0), heap=888888,
                                     bucket=ids["bucket"]), "heap 888888 is not registered", poisons=False)
    failing(lambda h, ids, n: h.call("jodc_gather", (jax.ShapeDtypeStruct((63,), jnp.float32), TOKEN), 0,
                                     jnp.int32(0), **ids), "output has 63 elements")
    failing(lambda h, ids, n: h.call("jodc_scatter_accumulate", (TOKEN,), 0, jnp.zeros(65), jnp.int32(0), **ids),
            "gradient has 65 elements")
    failing(lambda h, ids, n: h.call("jodc_publish", (TOKEN,), 0, jnp.zeros(n, jnp.bfloat16), jnp.int32(0), **ids),
            "master dtype float32")
    failing(lambda h, ids, n: h.call("jodc_barrier", (TOKEN,), 5, jnp.int32(0), heap=h.id),  # seen by the kernel
            r"device index 5 outside \[0, 2\)")
    heap = RawHeap(2)
    try:
        bucket = heap.register(64)
        ids = dict(heap=heap.id, bucket=bucket)
        full, _ = heap.call("jodc_gather", (full_t, TOKEN), 1, jnp.int32(0), **ids)
        assert full.shape == (64,) and LIB.heap_poisoned(heap.id) == ""  # no error: the heap stays healthy
        # a data op cannot report a bad index itself (the index lives on the GPU): its kernel does nothing and
        # records a fault, which the next call reports; the heap is poisoned from then on
        heap.call("jodc_gather", (full_t, TOKEN), 7, jnp.int32(0), **ids)
        with pytest.raises(Exception, match=r"gather kernel .* received device index 7 outside \[0, 2\)"):
            heap.call("jodc_barrier", (TOKEN,), 0, jnp.int32(0), heap=heap.id)
        assert "device index 7" in LIB.heap_poisoned(heap.id)
    finally:
        heap.free()
