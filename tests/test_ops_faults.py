"""Hostile-but-fair input to the native ops (issue 11, items 1-4): sizes that overflow, meshes a heap cannot serve,
extreme barrier timeouts, and a device that fails while the others wait in a barrier.

Tests that wait for a barrier run under :func:`bounded`: if the call has not returned in time (the behaviour before
the fix: waiting for the whole barrier timeout), the heap is freed natively, which wakes the barrier, and the test
fails instead of hanging the suite.
"""
import math
import signal
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P

import fsdp_toy
from conftest import cpu_mesh
from jodc import ops
from jodc.fsdp import ODCEngine, OptimizerConfig
from jodc.ops import layout
from jodc.ops.transports import registration

LIB = registration.cpu_library()
INT64_MAX = 2**63 - 1


def spmd(mesh, fn, *args, wait=True):
    """fn(device index) under jit + shard_map over axis 'd' (one leading device axis per result)."""
    n = mesh.shape["d"]

    def body(x):
        out = fn(lax.axis_index("d"))
        return jax.tree.map(lambda o: o[None], out)

    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(jnp.zeros((n,)))
    return jax.block_until_ready(out) if wait else out


def bounded(fn, heap, seconds=60.0):
    """Runs fn() in a thread. Returns (result or exception, seconds it took). If it is still running after `seconds`,
    frees the heap natively (waking its barriers, so nothing stays blocked) and fails the test."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome["value"] = e

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        heap._finalizer.detach()
        heap._freed = True
        heap._lib.heap_free(heap.id)
        thread.join(30)
        pytest.fail(f"still waiting after {seconds} s (the others waited for the barrier timeout)")
    return outcome.get("value"), time.monotonic() - start


def free_after_failure(close):
    """Frees a heap (or closes an engine) whose queued computation failed; must not hang. The failure may surface
    again as a RuntimeWarning, which is expected here."""
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        close()
    assert time.monotonic() - start < 10


# -----------------------------------------------------------------------------------------------------------------
# item 1: sizes that overflow or cannot be allocated

def test_overflowing_bucket_is_refused_naming_it_and_its_bytes():
    with ops.SymmetricHeap(cpu_mesh(4)) as heap:
        base = LIB.live_bytes()
        # 2**62 elements: 2**64 bytes of shards, which wrapped to 0 natively (then zeroing wrote past 64 bytes)
        with pytest.raises(ValueError, match=r"bucket 'huge' of 4611686018427387904 elements is too large: it needs "
                                             r"36893488147419103232 bytes .*beyond 64-bit"):
            heap.register((2**31, 2**31), name="huge")
        with pytest.raises(ValueError, match=r"bucket 'bucket0' of \d+ elements is too large"):
            heap.register((2**40, 2**23), dtype=jnp.bfloat16)
        assert LIB.live_bytes() == base and heap.buckets == ()
        # the heap is unharmed: a normal bucket works, host zeroing included
        b = heap.register(100)
        b.set_full(np.arange(100.0))
        b.zero_accumulators()
        np.testing.assert_array_equal(b.full(), np.arange(100.0))


def test_bucket_beyond_memory_is_a_memory_error_naming_it_and_its_bytes():
    with ops.SymmetricHeap(cpu_mesh(4), deterministic=True) as heap:
        # 2**40 fp32 elements over 4 devices: shard 2**40 + accumulator 2**40 + landing 2**42 bytes per device
        with pytest.raises(MemoryError, match=r"bucket 'big' needs 26388279066624 bytes \(shard 1099511627776 \+ "
                                              r"accumulator 1099511627776 \+ landing slots 4398046511104 bytes per "
                                              r"device, 4 devices\), but only \d+ bytes of host memory"):
            heap.register(2**40, name="big")
        assert heap.buckets == () and heap.poisoned == ""


def test_native_registration_refuses_what_python_would():
    """Bypassing the Python checks: the native registry refuses too (ValueError / MemoryError), never wraps."""
    with ops.SymmetricHeap(cpu_mesh(4)) as heap:
        base = LIB.live_bytes()
        with pytest.raises(ValueError, match="is too large: .*overflows 64-bit byte counts"):
            LIB.bucket_register(heap.id, 2**62, "float32")
        with pytest.raises(ValueError, match="is too large"):
            LIB.bucket_register(heap.id, INT64_MAX, "bfloat16")
        with pytest.raises(MemoryError, match=r"out of host memory: a bucket of 1099511627776 float32 elements over "
                                              r"4 devices in heap \d+ needs 8796093022208 bytes"):
            LIB.bucket_register(heap.id, 2**40, "float32")
        assert LIB.live_bytes() == base
        with pytest.raises(MemoryError, match="exceed the host memory available"):
            LIB.memcpy_bandwidth(2**62, 2, 1)  # the benchmark helper's buffers are checked too
        assert LIB.shard_numel(INT64_MAX, 1, 4) == -1 and LIB.shard_numel(0, 4, 4) == -1
        assert LIB.shard_numel(10, 0, 4) == -1 and LIB.shard_numel(10, 4, 3) == -1


@given(numel=st.one_of(st.integers(1, 10**7), st.integers(1, INT64_MAX), st.integers(2**56, 2**62)),
       world=st.integers(1, 64), master_bytes=st.sampled_from([2, 4]), landing=st.booleans())
def test_python_layout_mirrors_the_native_arithmetic(numel, world, master_bytes, landing):
    native_shard = LIB.shard_numel(numel, world, master_bytes)
    native = LIB.bucket_bytes(numel, world, master_bytes, landing)
    try:
        shard = layout.shard_numel(numel, world, master_bytes)
    except ValueError:
        assert native_shard == -1 and native is None
        return
    assert shard == native_shard
    try:
        ours = layout.bucket_bytes(numel, world, master_bytes, landing)
    except ValueError:
        assert native is None
        # the exact bytes really are beyond int64
        assert shard * (master_bytes + 4 + (4 * world if landing else 0)) * world + 63 > INT64_MAX
        return
    assert native == {"shard": ours.shard, "accumulator": ours.accumulator, "landing": ours.landing,
                      "per_device": ours.per_device, "total": ours.total}
    assert shard * world >= numel and (shard * master_bytes) % 64 == 0 and (shard * 4) % 64 == 0


# -----------------------------------------------------------------------------------------------------------------
# item 2: meshes one heap cannot serve

def test_heap_refuses_a_mesh_with_another_axis_of_size_above_one():
    devices = np.array(jax.devices("cpu")[:4])
    with pytest.raises(ValueError, match=r"shared by the replicas along \{'x': 2\}.*share barrier counters"):
        ops.SymmetricHeap(jax.sharding.Mesh(devices.reshape(2, 2), ("d", "x")))
    with pytest.raises(ValueError, match=r"replicas along \{'x': 4\}"):
        ops.SymmetricHeap(jax.sharding.Mesh(devices.reshape(1, 4), ("d", "x")))
    # other axes of size 1 are harmless
    with ops.SymmetricHeap(jax.sharding.Mesh(devices.reshape(4, 1), ("d", "x"))) as heap:
        assert heap.world == 4


def test_ops_refuse_a_mesh_with_another_axis_of_size_above_one():
    """A heap made for 4 devices used under shard_map over a (4, 2) mesh: 8 devices would share it."""
    with ops.SymmetricHeap(cpu_mesh(4)) as heap:
        b = heap.register(64)
        mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:8]).reshape(4, 2), ("d", "x"))
        body = lambda x: ops.gather(b, ops.new_token())[0][None]  # noqa: E731
        for axis_names in ({"d", "x"}, {"d"}):
            fn = jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"), axis_names=axis_names)
            with pytest.raises(ValueError, match=r"jodc.ops.gather: the mesh here also has axes \{'x': 2\}"):
                jax.jit(fn)(jnp.zeros(4))
        assert heap.generations() == [0] * 4


def test_heap_refuses_devices_of_other_processes(monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda *a, **k: 1)  # every CPU device now belongs to "process 0"
    with pytest.raises(ValueError, match=r"devices of process\(es\) \[0\], but this process is 1: .*one process"):
        ops.SymmetricHeap(cpu_mesh(4))


# -----------------------------------------------------------------------------------------------------------------
# item 3: barrier timeouts

def late_barrier(heap, delay_s):
    """Device 0 enters the barrier at once, the others `delay_s` later (a host callback sleeps first)."""

    def sleep(dev):
        if int(dev) != 0:
            time.sleep(delay_s)
        return np.int32(0)

    def fn(dev):
        zero = jax.pure_callback(sleep, jax.ShapeDtypeStruct((), jnp.int32), dev)
        return ops.barrier(heap, ops.new_token() + zero)

    return fn


@pytest.mark.parametrize("timeout_s", [1e10, 1e12, math.inf])
def test_huge_and_infinite_barrier_timeouts_wait(timeout_s):
    mesh = cpu_mesh(4)
    heap = ops.SymmetricHeap(mesh, barrier_timeout_s=timeout_s)
    try:
        result, seconds = bounded(lambda: spmd(mesh, late_barrier(heap, 0.6)), heap)
        if isinstance(result, BaseException):
            raise result
        assert seconds >= 0.6 and heap.generations() == [1] * 4 and heap.poisoned == ""
    finally:
        heap.free()


def test_default_barrier_timeout_comes_from_the_environment(monkeypatch):
    """A heap made without a timeout takes $JODC_BARRIER_TIMEOUT_S (seconds under tools/gpu_check.py), else 300 s;
    an explicit timeout wins; a bad value names the variable."""
    from jodc.ops import heap as heap_module

    assert heap_module.default_barrier_timeout_s({}) == heap_module.DEFAULT_BARRIER_TIMEOUT_S == 300.0
    assert heap_module.default_barrier_timeout_s({"JODC_BARRIER_TIMEOUT_S": " 7.5 "}) == 7.5
    assert heap_module.default_barrier_timeout_s({"JODC_BARRIER_TIMEOUT_S": "inf"}) == math.inf
    for bad in ("0", "-2", "nan", "soon"):
        with pytest.raises(ValueError, match=f"JODC_BARRIER_TIMEOUT_S must be .* got '{bad}'"):
            heap_module.default_barrier_timeout_s({"JODC_BARRIER_TIMEOUT_S": bad})
    monkeypatch.setenv("JODC_BARRIER_TIMEOUT_S", "12")
    mesh = cpu_mesh(2)
    with ops.SymmetricHeap(mesh) as heap:
        assert heap.barrier_timeout_s == 12.0
    with ops.SymmetricHeap(mesh, barrier_timeout_s=3) as heap:
        assert heap.barrier_timeout_s == 3.0


def test_barrier_timeout_is_honoured_and_validated():
    mesh = cpu_mesh(4)
    for bad in (0, -1.0, math.nan, "soon", True):
        with pytest.raises(ValueError, match="barrier_timeout_s must be"):
            ops.SymmetricHeap(mesh, barrier_timeout_s=bad)
    with ops.SymmetricHeap(mesh, barrier_timeout_s=60) as heap:
        for bad in (0, math.nan, -math.inf):
            with pytest.raises(ValueError, match="barrier_timeout_s must be"):
                heap.barrier_timeout_s = bad
        heap.barrier_timeout_s = math.inf
        assert heap.barrier_timeout_s == math.inf
        heap.barrier_timeout_s = 5.0  # a finite value between arrivals 0.6 s apart: passes
        result, _ = bounded(lambda: spmd(mesh, late_barrier(heap, 0.6)), heap)
        assert not isinstance(result, BaseException), result
    # the native conversion of seconds to nanoseconds saturates instead of wrapping, like its Python mirror
    for seconds in (1e-12, 0.3, 1.5, 300.0, 9.2e9, 9.3e9, 1e10, 1e300, math.inf, 0.0, -1.0, math.nan):
        assert LIB.timeout_nanos(seconds) == layout.timeout_nanos(seconds), seconds
    assert LIB.timeout_nanos(math.inf) == INT64_MAX and LIB.timeout_nanos(1e10) == INT64_MAX
    assert LIB.timeout_nanos(0.3) == 300_000_000 and LIB.timeout_nanos(math.nan) == -1
    with pytest.raises(ValueError, match="must be > 0 seconds"):
        LIB.heap_create(4, False, math.nan)


# -----------------------------------------------------------------------------------------------------------------
# item 4: a failing device aborts the heap; its peers leave the barrier at once

def test_native_error_on_one_device_fails_every_device_at_once():
    """Device 0's gather names a bucket that does not exist; devices 1-3 wait in the barrier (timeout 120 s)."""
    mesh = cpu_mesh(4)
    heap = ops.SymmetricHeap(mesh, barrier_timeout_s=120)
    heap.register(64)
    full_t, tok_t = jax.ShapeDtypeStruct((64,), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)

    def fn(dev):
        def bad_gather(tok):
            call = jax.ffi.ffi_call("jodc_gather", (full_t, tok_t), has_side_effect=True)
            return call(dev.astype(jnp.int32), tok, heap=np.int64(heap.id), bucket=np.int64(999999))[1]

        tok = lax.cond(dev == 0, bad_gather, lambda t: t, ops.new_token())
        return ops.barrier(heap, tok)

    error, seconds = bounded(lambda: spmd(mesh, fn), heap)
    assert isinstance(error, Exception), error
    assert "bucket 999999 is not registered" in str(error)
    assert seconds < 30, seconds
    assert heap.poisoned.startswith("aborted: device 0 failed: jodc gather: bucket 999999 is not registered")
    free_after_failure(heap.free)


def raise_on_device_0(kind):
    """A per-device function that raises in a host callback on device 0 before the barrier (cause: 'boom')."""

    def boom(dev):
        if int(dev) == 0:
            raise ValueError("boom on device 0")
        return np.int32(0)

    def fn(dev, token):
        if kind == "pure_callback":
            return token + jax.pure_callback(boom, jax.ShapeDtypeStruct((), jnp.int32), dev)
        jax.debug.callback(boom, dev)  # unordered: device 0 still fails before its barrier most of the time
        return token

    return fn


@pytest.mark.parametrize("kind", ["pure_callback", "debug_callback"])
def test_host_callback_error_on_one_device_fails_every_device_at_once(kind):
    mesh = cpu_mesh(4)
    heap = ops.SymmetricHeap(mesh, barrier_timeout_s=120)
    b = heap.register(256)
    fail = raise_on_device_0(kind)

    def fn(dev):
        tok = fail(dev, ops.new_token())
        tok = ops.barrier(heap, tok)
        full, tok = ops.gather(b, tok)
        return full

    error, seconds = bounded(lambda: ops.block_until_ready(spmd(mesh, fn, wait=False), heap), heap)
    assert isinstance(error, ops.DeviceFailed), error
    assert error.device == 0 and "ValueError: boom on device 0" in error.cause
    assert "aborted: device 0 failed: " in str(error) and "boom on device 0" in str(error)
    assert seconds < 30, seconds
    # the heap stays poisoned with the cause: later use fails clearly until it is re-created
    with pytest.raises(RuntimeError, match="aborted: device 0 failed: .*boom on device 0"):
        heap.register(10)
    with pytest.raises(RuntimeError, match="aborted: device 0 failed"):
        spmd(mesh, lambda dev: ops.gather(b, ops.new_token())[0])
    free_after_failure(heap.free)


def test_abort_wakes_a_barrier_waiting_for_a_device_that_never_comes():
    mesh = cpu_mesh(4)
    heap = ops.SymmetricHeap(mesh, barrier_timeout_s=math.inf)

    def fn(dev):
        return lax.cond(dev == 0, lambda t: ops.barrier(heap, t), lambda t: t, ops.new_token())

    threading.Timer(0.5, heap.abort, args=("the operator gave up",)).start()
    error, seconds = bounded(lambda: spmd(mesh, fn), heap)
    assert isinstance(error, Exception) and "aborted: the operator gave up" in str(error), error
    assert 0.4 < seconds < 30
    assert heap.abort("a second cause") == heap.poisoned  # the first cause stays
    assert heap.poisoned.startswith("aborted: the operator gave up")
    free_after_failure(heap.free)


def test_ctrl_c_while_waiting_aborts_the_heap():
    """Ctrl-C during ops.block_until_ready aborts the heap, so a device waiting in the barrier leaves and freeing the
    heap afterwards does not wait for the barrier timeout (60 s here; inf would be forever). Started as a background
    job (`nohup make test &`, a non-interactive shell's `cmd &`), pytest inherits SIGINT ignored, and then
    `_thread.interrupt_main` does nothing: the test starts from that case, so it holds in a terminal and in such runs
    alike."""
    runner = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _ctrl_c_while_waiting()
    finally:
        signal.signal(signal.SIGINT, runner)


def _ctrl_c_while_waiting():
    import _thread

    mesh = cpu_mesh(4)
    heap = ops.SymmetricHeap(mesh, barrier_timeout_s=60)

    def fn(dev):
        return lax.cond(dev == 0, lambda t: ops.barrier(heap, t), lambda t: t, ops.new_token())

    out = spmd(mesh, fn, wait=False)
    stop = threading.Event()

    def press_ctrl_c():  # every 0.5 s until the heap is aborted: on a loaded box one press can be lost before the wait
        while not stop.wait(0.5) and not heap.poisoned:
            _thread.interrupt_main()

    # Python's own SIGINT handler for the simulated Ctrl-C: `_thread.interrupt_main` does nothing while SIGINT is
    # ignored (why this test failed in full-suite runs started with `nohup ... &` and passed when run alone in a
    # terminal; no test or library of the suite changes the handler, and conftest's check fails a test that does)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=press_ctrl_c, daemon=True).start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            ops.block_until_ready(out, heap)
    finally:
        stop.set()
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - start < 30
    assert heap.poisoned.startswith("aborted: interrupted (KeyboardInterrupt)")
    free_after_failure(heap.free)


class FailingODCEngine(ODCEngine):
    """The ODC engine with a host callback that raises on device 0 before the first step's first barrier (armed once
    built: the barrier after publishing the initial shards is not the step's)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._armed = True

    def _barrier(self, token, recorder, **kinds):
        if getattr(self, "_armed", False):
            self._armed = False
            token = raise_on_device_0("pure_callback")(lax.axis_index("d"), token)
        return super()._barrier(token, recorder, **kinds)


def test_odc_engine_step_fails_at_once_when_a_device_fails():
    model, groups = fsdp_toy.make_model(num_layers=2)
    engine = FailingODCEngine(model, groups, cpu_mesh(4), optimizer=OptimizerConfig(learning_rate=1e-2),
                              barrier_timeout_s=120)
    batch = fsdp_toy.random_minibatch([2, 1, 1, 2], seed=0)
    error, seconds = bounded(lambda: engine.step(batch), engine.heap)
    assert isinstance(error, ops.DeviceFailed) and error.device == 0, error
    assert "boom on device 0" in str(error) and seconds < 30
    with pytest.raises(RuntimeError, match="aborted: device 0 failed"):
        engine.step(batch)  # poisoned until re-created
    free_after_failure(engine.close)


def test_trainer_configs_set_the_barrier_timeout():
    from jodc.train.rl import config as rl_config
    from jodc.train.core.config import ConfigError, load_config
    from jodc.train.core.model import make_engine

    assert load_config().engine.barrier_timeout_s == 300.0
    model, groups = fsdp_toy.make_model(num_layers=1)
    for overrides, expected in ((["--barrier_timeout_s", "7.5"], 7.5), (["--engine.barrier_timeout_s", "null"],
                                                                         math.inf)):
        engine = make_engine(load_config(None, overrides), model, groups)
        try:
            assert engine.heap.barrier_timeout_s == expected
        finally:
            engine.close()
    refused = r"engine.barrier_timeout_s must be (> 0|a finite number)"  # nan/inf: the finite check comes first
    for bad in ("0", "-3", "nan", "inf"):
        with pytest.raises(ConfigError, match=refused):
            load_config(None, ["--barrier_timeout_s", bad])
        with pytest.raises(ConfigError, match=refused):
            rl_config.load_rl_config(None, ["--barrier_timeout_s", bad])
    engine = make_engine(rl_config.load_rl_config(None, ["--barrier_timeout_s", "42"]), model, groups)  # RL's too
    try:
        assert engine.heap.barrier_timeout_s == 42.0
    finally:
        engine.close()
