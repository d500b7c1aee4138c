"""The ODC primitives on real GPUs (the CUDA kernels of ffi/cuda), checked against numpy and the CPU backend.

Marked ``cuda``; the whole module skips cleanly without a CUDA device or without the CUDA build of jodc
(``JODC_CUDA=1 make test`` builds it; ``pytest -m cuda`` selects these tests). Tests over a mesh use every visible
GPU (1 to 8). Tests that call the handlers directly simulate a world of several devices on one GPU, so the
multi-owner kernel paths, the barrier timeout and the fault handling run on single-GPU runners too.
"""
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import cuda_ipc_cases
import ops_checks
from conftest import cpu_mesh, spmd
from jodc import ops
from jodc.ops.transports import registration
from jodc.ops.heap import _settle_ops_before_free, default_barrier_timeout_s

# Marks split the module into `make gpu-check`'s steps (tools/gpu_check.py; every test is in exactly one, checked
# by tests/test_gpu_check.py): raw_handlers (handlers driven directly, several positions on one GPU), stress (issue 15's
# (a)-(e)), processes (one heap over several processes), sanitizer (compute-sanitizer, a step of its own), the rest
# (the ops through jax on the GPU mesh).
pytestmark = pytest.mark.cuda


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


# `make test-gpu` sets JODC_REQUIRE_GPU=1: on a GPU runner a missing GPU or CUDA build is a failure, never a skip.
REQUIRE_GPU = os.environ.get("JODC_REQUIRE_GPU", "") not in ("", "0")


def _unavailable(reason: str):
    if REQUIRE_GPU:
        raise RuntimeError(f"JODC_REQUIRE_GPU is set but {reason}")
    pytest.skip(reason, allow_module_level=True)


GPUS = _gpus()
if not GPUS:
    _unavailable("needs a CUDA device (jax.devices('gpu') is empty)")
try:
    from jodc.ops.transports import cuda_library

    LIB = cuda_library.library()
except ImportError as e:
    _unavailable(f"the CUDA build of jodc is missing: {e}")

N_GPUS = len(GPUS)
# Every wait is bounded: launched processes by the launcher's deadline, barriers by the heaps' default timeout (both
# seconds under tools/gpu_check.py: $JODC_TEST_PROCESS_TIMEOUT_S, $JODC_BARRIER_TIMEOUT_S); tests that need a barrier
# to outlast a second take at most LONG_BARRIER_S.
PROCESS_TIMEOUT_S = cuda_ipc_cases.process_timeout_s()
LONG_BARRIER_S = min(60.0, default_barrier_timeout_s())
WORLDS = sorted({1, min(2, N_GPUS), N_GPUS})
TOKEN = jax.ShapeDtypeStruct((), jnp.int32)


def gpu_mesh(n: int, axis: str = "d"):
    return jax.sharding.Mesh(np.array(GPUS[:n]), (axis,))


# ---------------------------------------------------------------------------------------------------------------
# over a mesh of every GPU, through jodc.ops

@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("numel", [1, 17, 1000, 4096 + 3, 1 << 20])
def test_gather_is_exact(world, numel):
    ops_checks.check_gather_is_exact(gpu_mesh(world), numel)


def test_gather_bf16_master_matches_the_cpu_conversion():
    ops_checks.check_gather_keeps_shape_and_bf16_master(gpu_mesh(N_GPUS), (3, 5, 77))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("deterministic", [False, True])
def test_scatter_accumulate_matches_numpy_sum(world, grad_dtype, deterministic):
    ops_checks.check_scatter_accumulate_matches_numpy_sum(gpu_mesh(world), 30_001, grad_dtype, deterministic)


def test_concurrent_pushes_from_every_gpu_in_a_loop():
    """Every GPU pushes 20 times into the same bucket at once (atomics or landing slots); nothing is lost."""
    ops_checks.check_concurrent_pushes_in_a_loop(gpu_mesh(N_GPUS), 1 << 18, 20)


def test_deterministic_mode_is_bit_for_bit_repeatable_and_equals_the_cpu_backend():
    world = N_GPUS
    numel, rounds = 20_001, 5
    rng = np.random.default_rng(7)
    grads = (rng.standard_normal((world, rounds, numel)) *
             10.0 ** rng.integers(-4, 4, (world, rounds, 1))).astype(np.float32)
    first = ops_checks.accumulate_rounds(gpu_mesh(world), grads, True)
    for _ in range(3):
        assert first.tobytes() == ops_checks.accumulate_rounds(gpu_mesh(world), grads, True).tobytes()
    expected = ops_checks.source_order_sum(grads)
    assert first.tobytes() == expected.tobytes()
    if world <= len(jax.devices("cpu")):  # the CPU backend agrees bit for bit
        assert first.tobytes() == ops_checks.accumulate_rounds(cpu_mesh(world), grads, True).tobytes()
    np.testing.assert_allclose(ops_checks.accumulate_rounds(gpu_mesh(world), grads, False), expected, rtol=1e-4,
                               atol=1e-3)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("master", [jnp.float32, jnp.bfloat16])
def test_zero_accumulator_and_publish(deterministic, master):
    # device values stay small (dev_scale 0.5) so every new shard value is exact in bf16 too
    ops_checks.check_zero_accumulator_and_publish(gpu_mesh(N_GPUS), 1000, deterministic, master, dev_scale=0.5)


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
    ops_checks.check_heaps_are_released(gpu_mesh(N_GPUS), LIB, 6)


# ---------------------------------------------------------------------------------------------------------------
# the handlers called directly: a world of several devices simulated on one GPU (positions wrap onto the GPUs)

class RawHeap:
    """A heap made through the library itself, for calling the handlers with explicit device indices."""

    def __init__(self, world, *, deterministic=False, timeout_s=None):
        registration.ensure_registered("gpu")  # the key SymmetricHeap uses for GPU meshes
        self.world = world
        self.id = LIB.heap_create(world, deterministic, default_barrier_timeout_s() if timeout_s is None else timeout_s)

    def register(self, numel, dtype="float32"):
        return LIB.bucket_register(self.id, numel, dtype)

    def call(self, target, results, device, *args, **attrs):
        """Runs one handler on GPU 0 as device `device` (an operand, like axis_index); returns its results."""
        fn = _raw_call(target, results, tuple(sorted((k, int(v)) for k, v in attrs.items())))
        placed = [jax.device_put(x, GPUS[0]) for x in (jnp.int32(device), *args)]
        return jax.block_until_ready(fn(*placed))

    def prepare(self, target, results, device, *args, **attrs):
        """`call`'s handler call compiled now, with its operands on the GPU: a function that runs it and returns its
        results (timed tests measure no compilation or transfer)."""
        fn = _raw_call(target, results, tuple(sorted((k, int(v)) for k, v in attrs.items())))
        placed = [jax.device_put(x, GPUS[0]) for x in (jnp.int32(device), *args)]
        compiled = fn.lower(*placed).compile()
        return lambda: jax.block_until_ready(compiled(*placed))

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


@pytest.mark.raw_handlers
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


@pytest.mark.raw_handlers
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


@pytest.mark.raw_handlers
def test_raw_barrier_passes_when_everyone_arrives_in_order():
    heap = RawHeap(1)
    try:
        for g in range(1, 4):
            (tok,) = heap.call("jodc_barrier", (TOKEN,), 0, jnp.int32(10), heap=heap.id)
            assert int(tok) == 11
            assert LIB.heap_generations(heap.id) == [g]
    finally:
        heap.free()


@pytest.mark.raw_handlers
def test_native_handlers_return_errors_instead_of_crashing():
    """Bypass the Python checks: the handlers refuse unknown ids, bad sizes and device indices. A handler that fails
    aborts its heap (peers spinning in a barrier kernel must not wait for the timeout), so each case runs on a fresh
    heap, which is poisoned with the cause afterwards."""
    full_t = jax.ShapeDtypeStruct((64,), jnp.float32)

    def failing(call, message, *, poisons=True):
        """`call(heap, ids, shard_numel)` must fail with `message` (a regex, or a function of shard_numel)."""
        heap = RawHeap(2)
        try:
            bucket = heap.register(64)
            ids = dict(heap=heap.id, bucket=bucket)
            n = LIB.bucket_shard_numel(heap.id, bucket)
            message = message(n) if callable(message) else message
            with pytest.raises(Exception, match=message):
                call(heap, ids, n)
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
    failing(lambda h, ids, n: h.call("jodc_read_accumulator", (jax.ShapeDtypeStruct((n + 1,), jnp.float32), TOKEN), 0,
                                     jnp.int32(0), **ids), lambda n: f"read_accumulator: output has {n + 1} elements")
    failing(lambda h, ids, n: h.call("jodc_zero_accumulator", (TOKEN,), 0, jnp.int32(0), heap=h.id, bucket=424242),
            "zero_accumulator: bucket 424242 is not registered")
    failing(lambda h, ids, n: h.call("jodc_barrier", (TOKEN,), 0, jnp.zeros(2, jnp.int32), heap=h.id),
            "barrier: operand 'token' must be an int32 scalar, got 2 elements")
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


# ---------------------------------------------------------------------------------------------------------------
# issue 15: the defects of the line-by-line review, each checked where it shows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra) -> dict:
    """The environment of a JAX process started next to this one on the same GPU(s): this test process preallocated
    most of each GPU for XLA, so the child's pool grows on demand and is capped (cuda_ipc_cases.child_environment)."""
    return dict(cuda_ipc_cases.child_environment(os.environ), **extra)


def run_python(code: str, *, env=None, timeout=PROCESS_TIMEOUT_S) -> str:
    """Runs `code` in a fresh interpreter (no JAX state of this process: contexts, flags); returns its stdout."""
    full_env = child_env(**(env or {}))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=ROOT)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_heap_touches_only_its_own_gpus_and_leaves_no_context_current():
    """Defect 2: heap creation used to enable peer access on the default placement (GPUs 0..world-1) before the
    mesh's placement arrived, and ScopedDevice "restored" device 0 when nothing was current (creating a context on
    GPU 0). Without JAX in the process, a heap on the last GPU must leave GPU 0 untouched and no context current."""
    out = run_python("""
        import importlib.util, threading
        # load jodc/ops/transports/cuda_library.py alone: importing the jodc.ops package imports JAX, which must not run here
        spec = importlib.util.spec_from_file_location("cuda_alone", "jodc/ops/transports/cuda_library.py")
        _cuda = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(cuda_library)
        lib = cuda_library.library()
        last = lib.device_count() - 1
        result = {}
        def work():
            result["before"] = lib.context_device()
            heap = lib.heap_create(1, False, 5.0, [last])
            assert lib.heap_placement(heap) == [last]
            bucket = lib.bucket_register(heap, 1000, "float32")
            lib.bucket_zero_accumulator(heap, bucket, 0)
            lib.bucket_get_shard(heap, bucket, 0)
            lib.bucket_free(heap, bucket)
            lib.heap_free(heap)
            result["after"] = lib.context_device()
            result["gpu0"] = lib.primary_context_active(0)
            result["last"] = lib.primary_context_active(last)
        t = threading.Thread(target=work)
        t.start(); t.join()
        print(result["before"], result["after"], int(result["gpu0"]), int(result["last"]), last)
    """)
    before, after, gpu0, last_active, last = (int(x) for x in out.split())
    assert before == -1 and after == -1, "a management call left a CUDA context current on the calling thread"
    assert last_active == 1
    if last > 0:
        assert gpu0 == 0, "creating a heap on the last GPU created a context on GPU 0"


@pytest.mark.raw_handlers
def test_barrier_reports_belong_to_the_heap():
    """Defect 3: each barrier borrows one of its heap's pinned reports (allocated with the heap, freed with it), so
    fresh host threads (each new thread used to cudaHostAlloc a report of its own, never freed) work and nothing
    is allocated inside a barrier."""
    heap = RawHeap(1)
    try:
        def one():
            (tok,) = heap.call("jodc_barrier", (TOKEN,), 0, jnp.int32(0), heap=heap.id)
            assert int(tok) == 1

        for _ in range(20):
            t = threading.Thread(target=one)
            t.start()
            t.join()
        assert LIB.heap_generations(heap.id) == [20]
        assert LIB.heap_poisoned(heap.id) == ""
    finally:
        heap.free()


@pytest.mark.raw_handlers
@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.bfloat16])
def test_subnormal_gradients_atomic_mode_flushes_landing_slots_keep(grad_dtype):
    """Defect 4: float atomics on global memory flush subnormals to zero (scalar and sm_90 vector reductions alike),
    the landing slots and the CPU backend do not. The documented behaviour: deterministic heaps keep subnormals bit for
    bit; atomic mode gives, per element, either the exact sum or the flushed one."""
    tiny = np.float32(2.0 ** -130)  # subnormal in fp32 (and representable in bf16)
    numel = 4096 + 5  # vector body and scalar tail
    grads = np.full((1, numel), tiny, np.float32).astype(grad_dtype)
    exact = np.asarray(grads, np.float32)[0]
    for deterministic in (True, False):
        heap = RawHeap(1, deterministic=deterministic)
        try:
            bucket = heap.register(numel)
            heap.call("jodc_scatter_accumulate", (TOKEN,), 0, jnp.asarray(grads[0]), jnp.int32(0), heap=heap.id,
                      bucket=bucket)
            got = np.frombuffer(LIB.bucket_get_accumulator(heap.id, bucket, 0), np.float32)[:numel]
            if deterministic or LIB.heap_landing_slots(heap.id):
                assert got.tobytes() == exact.tobytes()
            else:
                assert np.all((got == exact) | (got == 0.0))
        finally:
            heap.free()


@pytest.mark.raw_handlers
def test_atomic_accumulation_is_exact_on_every_lane_layout():
    """Defect 4: contiguous lanes with 16-byte vector reductions (sm_90) or scalar ones (sm_80), vector body and
    scalar tails, aligned and unaligned gradients: every element gets exactly its integer-valued contributions."""
    world = 3
    for numel in (1, 3, 4, 5, 4096, 4099, 100_003):
        heap = RawHeap(world)
        try:
            bucket = heap.register(numel)
            shard_numel = LIB.bucket_shard_numel(heap.id, bucket)
            base = np.arange(numel, dtype=np.float32) % 1024
            for d in range(world):
                heap.call("jodc_scatter_accumulate", (TOKEN,), d, jnp.asarray(base * (d + 1)), jnp.int32(0),
                          heap=heap.id, bucket=bucket)
            got = np.concatenate([np.frombuffer(LIB.bucket_get_accumulator(heap.id, bucket, d), np.float32)
                                  for d in range(world)])
            np.testing.assert_array_equal(got[:numel], base * 6)
            assert np.all(got[numel:world * shard_numel] == 0)
        finally:
            heap.free()


@pytest.mark.parametrize("order", ["forward", "reversed"])
def test_token_ops_run_on_the_streams_gpu(order):
    """Defect 6: after / depend_on now select the stream's GPU like every other handler. A mesh whose positions run
    on GPUs in reverse order exercises threads whose current device is not the stream's."""
    devices = GPUS[::-1] if order == "reversed" else GPUS
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))

    def body(x):
        tok = ops.new_token()
        tok = ops.after(tok, x)
        y = ops.depend_on(x * 2.0, tok)
        return y, tok[None]

    sm = jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=(P("d"), P("d")))
    x = jnp.arange(4.0 * len(devices))
    y, tok = jax.block_until_ready(jax.jit(sm)(x))
    np.testing.assert_array_equal(np.asarray(y), np.arange(4.0 * len(devices)) * 2.0)
    np.testing.assert_array_equal(np.asarray(tok), 1)


@pytest.mark.raw_handlers
def test_management_does_not_wait_for_another_heaps_spinning_barrier():
    """Defect 7: registering, host copies and zeroing used the legacy default stream (queued behind every kernel of
    blocking streams) and held heap->mu across allocations; freeing ran cudaDeviceSynchronize. While heap A's barrier
    spins for a device that never comes, heap B's management calls must finish long before A times out."""
    timeout = 20.0
    a = RawHeap(2, timeout_s=timeout)
    b = RawHeap(1)
    errors = []

    def spin():
        try:
            a.call("jodc_barrier", (TOKEN,), 0, jnp.int32(0), heap=a.id)
        except Exception as e:  # noqa: BLE001 - the expected timeout
            errors.append(e)

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(1.0)  # the barrier kernel is spinning now
        start = time.perf_counter()
        bucket = b.register(1 << 16)
        LIB.bucket_set_shard(b.id, bucket, 0, np.ones(LIB.bucket_shard_numel(b.id, bucket), np.float32))
        LIB.bucket_get_shard(b.id, bucket, 0)
        LIB.bucket_zero_accumulator(b.id, bucket, 0)
        LIB.bucket_get_accumulator(b.id, bucket, 0)
        elapsed = time.perf_counter() - start
        assert spinner.is_alive(), "heap A's barrier did not spin: the test proves nothing"
        assert elapsed < timeout / 2, f"heap B's management waited {elapsed:.1f} s behind heap A's barrier"
    finally:
        LIB.heap_abort(a.id, "test over")  # releases the spinning kernel at once
        spinner.join(timeout=timeout + 30)
        a.free()
        b.free()
    assert errors and "test over" in str(errors[0])


def test_tfrt_gpu_client_is_refused_at_heap_creation():
    """Defect 8: under the TFRT GPU client the blocking barrier could deadlock; creating a heap must say so. Where
    this jax cannot start the TFRT GPU client at all, there is nothing to refuse: the test skips saying why (and
    tools/cuda_report.py --check-junit counts that skip as a software one, to be read)."""
    out = run_python("""
        import jax, numpy as np
        from jodc import ops
        try:
            gpus = jax.devices("gpu")
        except Exception as e:  # the client itself did not start: not jodc's refusal
            print("TFRT CLIENT DID NOT START", type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")
            raise SystemExit(0)
        mesh = jax.sharding.Mesh(np.array(gpus[:1]), ("d",))
        try:
            ops.SymmetricHeap(mesh)
        except ValueError as e:
            print("REFUSED", e)
        else:
            print("ACCEPTED")
    """, env={"XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "1"})
    if "TFRT CLIENT DID NOT START" in out:
        pytest.skip(f"jax {jax.__version__} could not start the TFRT GPU client here ({out.strip()[-300:]}): "
                    "no heap to refuse")
    assert "REFUSED" in out and "TFRT GPU client" in out, out


# ---------------------------------------------------------------------------------------------------------------
# issue 15: the stress tests a GPU run must pass first

def _busy(device, rounds):
    """Device-dependent busy work: device d runs (d + 1) * rounds small matmuls first, so devices reach each barrier
    at very different times."""
    x = jnp.full((64, 64), 1e-3, jnp.float32)
    return lax.fori_loop(0, (device + 1) * rounds, lambda i, a: jnp.tanh(a @ a), x)[0, 0]


@pytest.mark.stress
def test_stress_a_publish_barrier_gather_1000_rounds_with_skewed_devices():
    """(a) 1000 rounds of publish -> barrier -> gather, each device doing a different amount of busy work first,
    barrier_timeout_s=10: every gathered shard equals the round number (a barrier that lets a device through early
    shows as a stale or torn shard)."""
    world, rounds, numel = N_GPUS, 1000, 4096 * N_GPUS + 7
    mesh = gpu_mesh(world)
    with ops.SymmetricHeap(mesh, barrier_timeout_s=10.0) as heap:
        b = heap.register(numel)

        def fn(dev):
            def body(r, carry):
                tok, bad = carry
                noise = _busy(dev, 3) * 0.0  # data dependence: the busy work happens before the publish
                shard = jnp.full((b.shard_numel,), r.astype(jnp.float32) + noise, jnp.float32)
                tok = ops.publish(b, shard, tok)
                tok = ops.barrier(heap, tok)
                full, tok = ops.gather(b, tok)
                bad = bad + jnp.sum(full != r.astype(jnp.float32))
                tok = ops.barrier(heap, tok)  # nobody publishes round r + 1 before everyone has gathered round r
                return tok, bad

            tok, bad = lax.fori_loop(0, rounds, body, (ops.new_token(), jnp.int32(0)))
            return bad, tok

        bad, _ = spmd(mesh, fn, jnp.arange(world, dtype=jnp.int32))
        assert np.asarray(bad).tolist() == [0] * world
        assert heap.generations() == [2 * rounds] * world


@pytest.mark.stress
@pytest.mark.parametrize("deterministic", [False, True])
def test_stress_b_push_barrier_read_zero_1000_rounds(deterministic):
    """(b) 1000 rounds of push -> barrier -> read/zero -> barrier with skewed devices: every round's accumulated
    shard equals numpy's sum; deterministic mode is bit for bit the CPU backend's result."""
    world, rounds, numel = N_GPUS, 1000, 2048 * N_GPUS + 3
    rng = np.random.default_rng(3)
    base = rng.standard_normal((world, numel)).astype(np.float32)

    def run(mesh, skew):
        with ops.SymmetricHeap(mesh, deterministic=deterministic, barrier_timeout_s=10.0) as heap:
            b = heap.register(numel)

            def fn(dev, g):
                def body(r, carry):
                    tok, total = carry
                    noise = _busy(dev, 2) * 0.0 if skew else 0.0
                    tok = ops.scatter_accumulate(b, g * (r % 7 + 1).astype(jnp.float32) + noise, tok)
                    tok = ops.barrier(heap, tok)
                    acc, tok = ops.read_accumulator(b, tok)
                    tok = ops.zero_accumulator(b, tok)
                    tok = ops.barrier(heap, tok)
                    return tok, total + acc * (r + 1).astype(jnp.float32)

                _, total = lax.fori_loop(0, rounds, body,
                                         (ops.new_token(), jnp.zeros((b.shard_numel,), jnp.float32)))
                return total

            return np.asarray(spmd(mesh, fn, jnp.arange(world, dtype=jnp.int32), jnp.asarray(base)))

    got = run(gpu_mesh(world), True).reshape(-1)[:numel]
    # numpy: round r accumulates sum_s base[s] * (r % 7 + 1) (sources in order, fp32), weighted by r + 1
    per_round = {}
    for k in range(1, 8):
        acc = np.zeros(numel, np.float32)
        for s in range(world):
            acc += base[s] * np.float32(k)
        per_round[k] = acc
    expected = np.zeros(numel, np.float32)
    for r in range(rounds):
        expected += per_round[r % 7 + 1] * np.float32(r + 1)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-2)
    if deterministic:
        assert got.tobytes() == expected.tobytes()
        if world <= len(jax.devices("cpu")):
            cpu = run(cpu_mesh(world), False).reshape(-1)[:numel]
            assert got.tobytes() == cpu.tobytes()


@pytest.mark.stress
@pytest.mark.skipif(N_GPUS < 2, reason="needs two GPUs (one device missing a barrier, the others waiting)")
def test_stress_c_one_device_times_out_the_others_are_released_in_time():
    """(c) device 0 never arrives: every other device is released within the timeout + 1 s (measured on a compiled
    executable, so no compile time is counted), with the missing device named."""
    timeout = 3.0
    mesh = gpu_mesh(N_GPUS)
    heap = ops.SymmetricHeap(mesh, barrier_timeout_s=timeout)
    try:
        def fn(dev):
            tok = lax.cond(dev[0] == 0, lambda t: t, lambda t: ops.barrier(heap, t), ops.new_token())
            return tok[None]

        sm = jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
        compiled = jax.jit(sm).lower(jnp.arange(N_GPUS, dtype=jnp.int32)).compile()
        start = time.perf_counter()
        with pytest.raises(Exception, match=r"device\(s\) \[0\] never arrived"):
            jax.block_until_ready(compiled(jnp.arange(N_GPUS, dtype=jnp.int32)))
        elapsed = time.perf_counter() - start
        assert elapsed < timeout + 1.0, f"the waiting devices were released after {elapsed:.2f} s"
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            heap.free()


@pytest.mark.stress
def test_stress_c_raw_waiting_device_is_released_within_timeout_plus_1s():
    """(c) on one GPU: device 1 of a 2-device heap (raw handler) waits for device 0, which never comes; it is released
    within the timeout + 1 s (a compiled executable: no compile time counted), naming device 0."""
    timeout = 3.0
    heap = RawHeap(2, timeout_s=timeout)
    try:
        barrier = heap.prepare("jodc_barrier", (TOKEN,), 1, jnp.int32(0), heap=heap.id)
        start = time.perf_counter()
        with pytest.raises(Exception, match=r"device\(s\) \[0\] never arrived \(device 1 waited\)"):
            barrier()
        elapsed = time.perf_counter() - start
        assert timeout * 0.9 < elapsed < timeout + 1.0, f"released after {elapsed:.2f} s"
    finally:
        heap.free()


@pytest.mark.stress
def test_stress_c_abort_releases_waiting_devices_at_once():
    """(c, fail fast) A device that fails instead of timing out aborts the heap: a waiting barrier returns within a
    second, long before its timeout (raw handler on one GPU: device 0 of a 2-device heap waits)."""
    heap = RawHeap(2, timeout_s=LONG_BARRIER_S)
    try:
        barrier = heap.prepare("jodc_barrier", (TOKEN,), 0, jnp.int32(0), heap=heap.id)
        timer = threading.Timer(0.5, lambda: LIB.heap_abort(heap.id, "device 1 failed"))
        timer.start()
        start = time.perf_counter()
        with pytest.raises(Exception, match="device 1 failed"):
            barrier()
        assert time.perf_counter() - start < 0.5 + 1.0
        timer.join()
    finally:
        heap.free()


@pytest.mark.stress
@pytest.mark.parametrize("op", ["gather", "scatter_accumulate", "publish", "read_accumulator", "zero_accumulator"])
def test_stress_c_a_handler_error_releases_waiting_devices_at_once(op):
    """(c, defect 5) Device 1's op fails in its handler (here: an unregistered bucket) while device 0 waits in a
    barrier with a long timeout (LONG_BARRIER_S): the failure aborts the heap, so device 0 is released within a
    second, with device 1's error as the cause (raw handlers on one GPU: device 0 of a 2-device heap waits on another
    thread)."""
    heap = RawHeap(2, timeout_s=LONG_BARRIER_S)
    waited = {}
    waiter = threading.Thread()
    try:
        n = LIB.bucket_shard_numel(heap.id, heap.register(64))
        barrier = heap.prepare("jodc_barrier", (TOKEN,), 0, jnp.int32(0), heap=heap.id)
        # device 1's failing call, compiled before the clock starts
        full_t = jax.ShapeDtypeStruct((64,), jnp.float32)
        calls = {
            "gather": lambda: heap.prepare("jodc_gather", (full_t, TOKEN), 1, jnp.int32(0), heap=heap.id,
                                           bucket=999999),
            "scatter_accumulate": lambda: heap.prepare("jodc_scatter_accumulate", (TOKEN,), 1, jnp.zeros(64),
                                                       jnp.int32(0), heap=heap.id, bucket=999999),
            "publish": lambda: heap.prepare("jodc_publish", (TOKEN,), 1, jnp.zeros(n), jnp.int32(0), heap=heap.id,
                                            bucket=999999),
            "read_accumulator": lambda: heap.prepare("jodc_read_accumulator",
                                                     (jax.ShapeDtypeStruct((n,), jnp.float32), TOKEN), 1,
                                                     jnp.int32(0), heap=heap.id, bucket=999999),
            "zero_accumulator": lambda: heap.prepare("jodc_zero_accumulator", (TOKEN,), 1, jnp.int32(0),
                                                     heap=heap.id, bucket=999999),
        }
        failing = calls[op]()

        def wait():
            start = time.perf_counter()
            try:
                barrier()
            except Exception as e:  # noqa: BLE001 - the expected abort, checked below
                waited["error"] = str(e)
            waited["seconds"] = time.perf_counter() - start

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(1.0)  # device 0's barrier kernel is spinning now
        assert waiter.is_alive(), f"the barrier did not wait: {waited}"
        failed_at = time.perf_counter()
        with pytest.raises(Exception, match=f"jodc {op}: bucket 999999 is not registered"):
            failing()
        waiter.join(timeout=30)
        released_after = time.perf_counter() - failed_at
        assert not waiter.is_alive() and released_after < 1.0, f"released {released_after:.2f} s after the failure"
        assert "bucket 999999 is not registered" in waited.get("error", ""), waited
    finally:
        LIB.heap_abort(heap.id, "test over")
        if waiter.is_alive():
            waiter.join(timeout=LONG_BARRIER_S + 10)
        heap.free()


# min_graph_size=1: XLA forms a command buffer of any size (its default needs several kernels in a row), so the program
# below is sure to have some, unless this XLA ignores the flags.
COMMAND_BUFFER_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE --xla_gpu_graph_min_graph_size=1"


@pytest.mark.stress
def test_stress_d_jodc_calls_stay_outside_command_buffers():
    """(d) With command buffers on for fusions, custom calls and while loops, XLA must keep every jodc custom call out
    of them (a captured barrier would be replayed without its host wait; captured ops would bake in stale pointers).
    Compiled in a fresh process (the flag is read when the backend starts); the check reads the optimized HLO. It
    proves something only if XLA formed command buffers at all: where it formed none (this XLA ignores the flags, or
    no longer captures such programs), the test skips saying so instead of passing on nothing."""
    out = run_python(f"""
        import os
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " {COMMAND_BUFFER_FLAGS}"
        import jax, jax.numpy as jnp, numpy as np
        from jax import lax
        from jax.sharding import PartitionSpec as P
        from jodc import ops
        import hlo_check  # tools/
        devices = jax.devices("gpu")
        mesh = jax.sharding.Mesh(np.array(devices), ("d",))
        with ops.SymmetricHeap(mesh) as heap:
            b = heap.register(4096)
            def body(x):
                def step(i, tok):
                    full, tok = ops.gather(b, tok)
                    tok = ops.scatter_accumulate(b, jnp.tanh(full) * x[0], tok)
                    return tok
                tok = lax.fori_loop(0, 3, step, ops.new_token())
                tok = ops.barrier(heap, tok)
                acc, tok = ops.read_accumulator(b, tok)
                return acc * 2.0
            sm = jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
            x = jnp.ones((len(devices),))
            compiled = jax.jit(sm).lower(x).compile()
            text = compiled.as_text()
            calls, captured = hlo_check.jodc_calls_in_command_buffers(text)
            print("CALLS", calls, "CAPTURED", captured, "BUFFERS", hlo_check.command_buffer_count(text))
            jax.block_until_ready(compiled(x))
    """)
    calls = int(re.search(r"CALLS (\d+)", out).group(1))
    assert calls >= 4, out  # gather, scatter_accumulate, barrier, read_accumulator survived compilation
    assert "CAPTURED []" in out, out
    buffers = int(re.search(r"BUFFERS (\d+)", out).group(1))
    if buffers == 0:
        pytest.skip(f"XLA (jax {jax.__version__}) formed no command buffer under {COMMAND_BUFFER_FLAGS}: nothing was "
                    "there to keep the jodc calls out of, so the check is void on this version")


@pytest.mark.stress
def test_stress_e_bucket_above_2_31_elements():
    """(e) A bucket of more than 2^31 elements (bf16 master: 4 GiB of shards, 8 GiB of fp32 accumulators over the
    GPUs): publish / gather / scatter / read index it with 64-bit offsets. Skipped when GPU memory is short."""
    numel = 2**31 + 1001
    mesh = gpu_mesh(N_GPUS)
    with ops.SymmetricHeap(mesh) as heap:
        try:
            b = heap.register(numel, dtype=jnp.bfloat16)
        except MemoryError as e:
            pytest.skip(f"not enough GPU memory for 2^31 elements: {e}")
        shard_numel = b.shard_numel
        assert shard_numel % 32 == 0  # 64-byte shards of bf16

        def fn(dev):
            # int32 indices cannot span 2^31 elements (x64 is off): every check uses static slices and uint32 counts
            tok = ops.publish(b, jnp.full((shard_numel,), dev + 1, jnp.bfloat16), ops.new_token())
            tok = ops.barrier(heap, tok)
            full, tok = ops.gather(b, tok)
            wrong = jnp.uint32(0)
            for o in range(N_GPUS):
                lo, hi = min(o * shard_numel, numel), min((o + 1) * shard_numel, numel)
                if hi > lo:
                    wrong += jnp.sum(lax.slice(full, (lo,), (hi,)) != jnp.bfloat16(o + 1), dtype=jnp.uint32)
            tok = ops.scatter_accumulate(b, jnp.ones((numel,), jnp.bfloat16), tok)
            tok = ops.barrier(heap, tok)
            acc, tok = ops.read_accumulator(b, tok)
            rows = acc.reshape(-1, 32)
            full_count = jnp.sum(jnp.sum(rows == N_GPUS, axis=1, dtype=jnp.uint32), dtype=jnp.uint32)
            zero_count = jnp.sum(jnp.sum(rows == 0, axis=1, dtype=jnp.uint32), dtype=jnp.uint32)
            return jnp.stack([wrong, full_count, zero_count])

        try:
            out = spmd(mesh, fn, jnp.arange(N_GPUS, dtype=jnp.int32))
        except Exception as e:  # noqa: BLE001 - XLA's own buffers may not fit next to the heap
            if "RESOURCE_EXHAUSTED" in str(e) or "Out of memory" in str(e):
                pytest.skip(f"not enough GPU memory for XLA's buffers of 2^31 elements: {e}")
            raise
        for d, (wrong, full_count, zero_count) in enumerate(np.asarray(out).tolist()):
            valid = max(0, min(shard_numel, numel - d * shard_numel))
            assert wrong == 0, f"device {d} gathered {wrong} wrong elements"
            assert (full_count, zero_count) == (valid, shard_numel - valid), d


@pytest.mark.sanitizer
def test_stress_f_compute_sanitizer_memcheck_and_racecheck():
    """(f) compute-sanitizer's memcheck and racecheck over jodc's kernels (every op, both accumulation modes, several
    positions on one GPU): no error. `make sanitize-gpu` runs the same tools over the single-GPU tests."""
    nvcc = shutil.which("nvcc")
    sanitizer = shutil.which("compute-sanitizer") or (
        os.path.join(os.path.dirname(nvcc), "compute-sanitizer") if nvcc else None)
    if not sanitizer or not os.path.exists(sanitizer):
        pytest.fail("compute-sanitizer not found (the CUDA toolkit's bin/ must be on PATH on GPU runners)")
    for tool in ("memcheck", "racecheck"):
        # --report-api-errors no: the CUDA API errors XLA itself provokes and handles (probing pointers, attributes)
        # are not jodc's; jodc checks every API call's result itself. Only jodc's kernels are checked (kns=jodc).
        proc = subprocess.run(
            [sanitizer, "--tool", tool, "--error-exitcode", "97", "--report-api-errors", "no", "--kernel-name",
             "kns=jodc", sys.executable, os.path.join(ROOT, "tests", "cuda_sanitize_cases.py")],
            capture_output=True, text=True, timeout=cuda_ipc_cases.process_timeout_s(600.0), cwd=ROOT,
            env=child_env())
        assert proc.returncode == 0, f"{tool}: exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
        assert "ALL CASES PASSED" in proc.stdout
        assert re.search(r"ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards", proc.stdout + proc.stderr), tool


# ---------------------------------------------------------------------------------------------------------------
# several processes on one node: CUDA IPC (jax.distributed on localhost; tests/cuda_ipc_cases.py)

def _check_ipc_processes(results, transport: str) -> None:
    for i, (code, out) in enumerate(results):
        assert code == 0 and f"IPC CASES PASSED {transport}" in out, f"process {i} (exit {code}):\n{out[-5000:]}"


@pytest.mark.processes
@pytest.mark.skipif(N_GPUS < 2, reason="needs two GPUs (one process per GPU)")
@pytest.mark.parametrize("transport", ["auto", "nvshmem"])
def test_gpu_heap_across_two_processes(transport):
    """One process per GPU: the transport chosen for a mesh of two processes on one node is cuda_ipc (and NVSHMEM,
    forced, works there too), and every op gives numpy's answer across them in both accumulation modes; with CUDA IPC
    also a barrier timeout and an abort across the processes. Bounded: killed after PROCESS_TIMEOUT_S (300 s)."""
    faults = ["--faults"] if transport == "auto" else []
    args = ["--transport", transport, *faults]
    results = cuda_ipc_cases.launch(2, N_GPUS, share=False, timeout_s=PROCESS_TIMEOUT_S, case_args=args)
    _check_ipc_processes(results, "cuda_ipc" if transport == "auto" else transport)


@pytest.mark.processes
def test_gpu_heap_across_two_processes_on_one_gpu():
    """Issue 28 item 3: two processes on GPU 0 (local_device_ids=[0] each, XLA pools capped) share buckets through
    CUDA IPC, which maps another process's memory on the same device: the handle exchange, the shared control block,
    barriers across the processes (arrivals, a timeout naming the missing position, an abort releasing a waiting
    barrier with the other process's reason) and both accumulation modes (atomic, then landing slots). It checks
    function, not speed (the GPU time-slices between the processes). Bounded: killed after PROCESS_TIMEOUT_S."""
    results = cuda_ipc_cases.launch(2, N_GPUS, share=True, timeout_s=PROCESS_TIMEOUT_S, case_args=["--faults"])
    _check_ipc_processes(results, "cuda_ipc")
    for _, out in results:  # one GPU: native atomics in atomic mode, landing slots only when deterministic
        assert "atomic: landing_slots=0 one_gpu=1" in out and "deterministic: landing_slots=1 one_gpu=1" in out, out


def test_bench_primitives_runs_on_the_cuda_mesh():
    """bench/primitives.py --platform gpu measures jodc's kernels against NCCL and reports every ratio (a quick run:
    the table of docs/benchmarks.md comes from a full one)."""
    proc = subprocess.run([sys.executable, "-m", "bench.primitives", "--platform", "gpu",
                           "--quick", "--mib", "4", "--no-save"], capture_output=True, text=True,
                          timeout=cuda_ipc_cases.process_timeout_s(600.0),
                          cwd=ROOT, env=child_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["platform"] == "gpu" and line["devices"] == N_GPUS
    for key in ("gather_vs_all_gather", "scatter_vs_psum_scatter", "scatter_vs_psum_scatter_accumulate"):
        assert line[key] > 0
