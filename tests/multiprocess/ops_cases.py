"""ODC ops across processes (MPI transport), mirroring tests/test_ops.py. Usage, under mpirun:

    python ops_cases.py LOCAL_DEVICES [case ...]     (no case: all of them)

LOCAL_DEVICES: devices per process, "2" for every process or "2,1,1" for one count each (uneven hosts).
"""
import os
import sys
import time

import _mp  # noqa: E402

SPEC = sys.argv[1]
jax, comm = _mp.init(SPEC)
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from jodc import ops  # noqa: E402

RANK, NPROCS = comm.Get_rank(), comm.Get_size()
COUNTS = _mp.local_counts(SPEC, NPROCS)  # devices per process
FIRST = [sum(COUNTS[:r]) for r in range(NPROCS)]  # global index of each process's first device (process-major)
mesh = _mp.global_mesh(jax)
WORLD = mesh.shape["d"]


def expect_raises(fn, *fragments):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        text = str(e)
        for f in fragments:
            assert f in text, f"expected {f!r} in error: {text}"
        return text
    raise AssertionError(f"no error raised; expected one mentioning {fragments}")


def case_transport_is_mpi():
    with ops.SymmetricHeap(mesh) as heap:
        assert heap.transport == "mpi", heap.transport
        assert heap.world == WORLD == sum(COUNTS)
        assert "transport=mpi" in repr(heap)


def heap_over_mpi_windows(**kw):
    """A heap whose bucket windows are not shared memory (JODC_MPI_SHARED_MEMORY=0 at creation): every remote shard
    goes through MPI_Get, as on a heap spanning nodes."""
    os.environ["JODC_MPI_SHARED_MEMORY"] = "0"
    try:
        return ops.SymmetricHeap(mesh, **kw)
    finally:
        del os.environ["JODC_MPI_SHARED_MEMORY"]


def case_gather_is_exact():
    # 2**20 + 5 elements: a 4 MiB output, copied with streaming stores (ffi/mpi/copy.h), with a ragged last shard
    for shared in (True, False):
        for numel in (1, 17, 1000, 4096 + 3, 2**20 + 5):
            values = np.random.default_rng(numel).standard_normal(numel).astype(np.float32)
            with (ops.SymmetricHeap(mesh) if shared else heap_over_mpi_windows()) as heap:
                # one node: shared-memory windows by default (peers' shards copied directly), MPI_Get when refused
                assert heap._lib.heap_shared_memory(heap.id) == shared
                b = heap.register(numel)
                if RANK == 0:
                    b.set_full(values)  # one process writes every shard (remote ones with MPI_Put)
                comm.Barrier()
                np.testing.assert_array_equal(b.full(), values)  # every process reads them all back

                def fn():
                    full, tok = ops.gather(b, ops.new_token())
                    full_bf16, tok = ops.gather(b, tok, dtype=jnp.bfloat16)
                    return full, full_bf16, tok

                full, full_bf16, tok = _mp.spmd(jax, mesh, fn)
            assert sorted(full) == [FIRST[RANK] + i for i in range(COUNTS[RANK])]
            for d in full:
                np.testing.assert_array_equal(full[d], values)
                np.testing.assert_array_equal(full_bf16[d], values.astype(ml_dtypes.bfloat16))
                assert tok[d] == 2


def case_gather_bf16_master_keeps_shape():
    values = np.random.default_rng(0).standard_normal((3, 5, 7)).astype(ml_dtypes.bfloat16)
    with ops.SymmetricHeap(mesh) as heap:
        b = heap.register((3, 5, 7), dtype=jnp.bfloat16)
        b.set_full(values)  # every process writes the same values: harmless
        comm.Barrier()

        def fn():
            full, tok = ops.gather(b, ops.new_token())
            full32, tok = ops.gather(b, tok, dtype=jnp.float32)
            return full, full32

        full, full32 = _mp.spmd(jax, mesh, fn)
    for d in full:
        assert full[d].shape == (3, 5, 7) and full[d].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(full[d], values)
        np.testing.assert_array_equal(full32[d], values.astype(np.float32))


def _pushes(numel, dtype, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((WORLD, numel)).astype(np.float32).astype(dtype)


def case_scatter_accumulate_matches_numpy_sum():
    numel = 3001
    for grad_dtype in (np.float32, ml_dtypes.bfloat16):
        grads = _pushes(numel, grad_dtype, 1)
        with ops.SymmetricHeap(mesh) as heap:
            b = heap.register(numel)

            def fn(g):
                tok = ops.scatter_accumulate(b, g, ops.new_token())
                tok = ops.scatter_accumulate(b, g * 2, tok)  # two microbatches
                tok = ops.barrier(heap, tok)
                acc, tok = ops.read_accumulator(b, tok)
                return acc, tok

            acc, _ = _mp.spmd(jax, mesh, fn, grads)
            want = (grads.astype(np.float64) * 3).sum(0)
            for d, a in acc.items():
                lo, hi = b.owner_range(d)
                np.testing.assert_allclose(a[: hi - lo], want[lo:hi], rtol=1e-5, atol=1e-5)
                assert not a[hi - lo:].any()  # padding stays zero
            comm.Barrier()
            np.testing.assert_allclose(b.accumulated(), want, rtol=1e-5, atol=1e-5)  # host reads remote owners


def case_publish_then_gather_sees_new_shards():
    for shared in (True, False):
        publish_then_gather(shared)


def publish_then_gather(shared):
    numel = 1000
    with (ops.SymmetricHeap(mesh) if shared else heap_over_mpi_windows()) as heap:
        b = heap.register(numel)
        new = np.stack([np.full(b.shard_numel, d + 1, np.float32) for d in range(WORLD)])

        def fn(shard):
            tok = ops.publish(b, shard, ops.new_token())
            tok = ops.barrier(heap, tok)
            full, tok = ops.gather(b, tok)
            return full

        full = _mp.spmd(jax, mesh, fn, new)
        want = new.reshape(-1)[:numel]
        for d in full:
            np.testing.assert_array_equal(full[d], want)
        comm.Barrier()
        np.testing.assert_array_equal(b.full(), want)


def case_zero_accumulator():
    numel = 257
    with ops.SymmetricHeap(mesh) as heap:
        b = heap.register(numel)
        grads = _pushes(numel, np.float32, 2)

        def fn(g):
            tok = ops.scatter_accumulate(b, g, ops.new_token())
            tok = ops.barrier(heap, tok)
            before, tok = ops.read_accumulator(b, tok)
            tok = ops.zero_accumulator(b, tok)
            tok = ops.barrier(heap, tok)
            after, tok = ops.read_accumulator(b, tok)
            return before, after

        before, after = _mp.spmd(jax, mesh, fn, grads)
        for d in before:
            assert np.abs(before[d]).sum() > 0 or b.owner_range(d)[0] == b.owner_range(d)[1]
            assert not after[d].any()
        comm.Barrier()
        assert not b.accumulated().any()
        assert heap.generations() == [2] * WORLD


def case_deterministic_is_bitwise_source_ordered():
    numel = 2049
    grads = _pushes(numel, np.float32, 3) * np.float32(1e3)
    for _ in range(2):  # the same bits on every run
        with ops.SymmetricHeap(mesh, deterministic=True) as heap:
            b = heap.register(numel)

            def fn(g):
                tok = ops.scatter_accumulate(b, g, ops.new_token())
                tok = ops.scatter_accumulate(b, g * np.float32(0.5), tok)
                tok = ops.barrier(heap, tok)
                acc, tok = ops.read_accumulator(b, tok)
                return acc

            acc = _mp.spmd(jax, mesh, fn, grads)
            # single-process deterministic order: base 0 + slot(source 0) + slot(source 1) + ..., each slot the
            # float32 sum of that source's pushes in push order
            slots = grads + grads * np.float32(0.5)
            want = np.zeros(numel, np.float32)
            for s in range(WORLD):
                want = want + slots[s]
            for d, a in acc.items():
                lo, hi = b.owner_range(d)
                assert np.array_equal(a[: hi - lo].view(np.uint32), want[lo:hi].view(np.uint32)), d


def case_registration_mismatch_names_bucket_and_processes():
    with ops.SymmetricHeap(mesh) as heap:
        heap.register(100, name="embed")
        size = 200 if RANK == NPROCS - 1 else 300
        text = expect_raises(lambda: heap.register(size, name="head"), "head", "differs", f"process(es) [{NPROCS - 1}]",
                             "(200,)", "(300,)")
        if RANK == 0:
            print("mismatch message:", text, flush=True)
        dtype = jnp.bfloat16 if RANK == 0 else jnp.float32
        expect_raises(lambda: heap.register(64, dtype=dtype, name="w"), "bfloat16", "float32", "process(es) [0]")
        name = "a" if RANK == 0 else "b"
        expect_raises(lambda: heap.register(64, name=name), "'a'", "'b'")
        heap.register(64, name="ok")  # the heap is still usable: nothing was allocated for the refused buckets


def case_barrier_timeout_names_missing_process():
    heap = ops.SymmetricHeap(mesh, barrier_timeout_s=1.0)
    last = NPROCS - 1

    def fn(dev):
        skip = dev.astype(jnp.int32) >= FIRST[last]  # the last process's devices never arrive
        return lax.cond(skip, lambda t: t, lambda t: ops.barrier(heap, t), ops.new_token())

    devs = np.arange(WORLD, dtype=np.float32)
    if RANK != last:
        t0 = time.monotonic()
        missing = ", ".join(str(FIRST[last] + i) for i in range(COUNTS[last]))
        text = expect_raises(lambda: _mp.spmd(jax, mesh, fn, devs), "timed out after 1 s",
                             f"device(s) [{missing}] never arrived", f"held by process(es) [{last}]")
        assert time.monotonic() - t0 < 1.0 + 10, time.monotonic() - t0
        if RANK == 0:
            print("timeout message:", text.splitlines()[0], flush=True)
    else:
        _mp.spmd(jax, mesh, fn, devs)  # no barrier here: returns at once
    comm.Barrier()
    # The failure reached the process whose devices were missing: its heap is poisoned with the waiter's message.
    text = expect_raises(heap.check_alive, "never arrived")
    assert "process" in text
    heap.free()


def case_progress_thread_and_collective_bucket_free():
    numel = 4099
    grads = _pushes(numel, np.float32, 4)
    with ops.SymmetricHeap(mesh, progress_thread=True) as heap:  # forced on (a one-host run defaults to off)
        dead = heap.register(10, name="dead")
        dead.free()  # collective: every process frees it here
        b = heap.register(numel, name="w")

        def fn(g):
            tok = ops.scatter_accumulate(b, g, ops.new_token())
            tok = ops.barrier(heap, tok)
            full, tok = ops.gather(b, tok)
            acc, tok = ops.read_accumulator(b, tok)
            return acc

        acc = _mp.spmd(jax, mesh, fn, grads)
        want = grads.astype(np.float64).sum(0)
        for d, a in acc.items():
            lo, hi = b.owner_range(d)
            np.testing.assert_allclose(a[: hi - lo], want[lo:hi], rtol=1e-5, atol=1e-5)
        expect_raises(lambda: dead.shard(0), "freed")
        assert [x.name for x in heap.buckets] == ["w"]


def case_native_handlers_return_errors():
    """Bypass the Python checks: the MPI handlers refuse unknown ids, bad sizes, out-of-range device indices and a
    device index that belongs to another process (a mesh/placement mismatch), without poisoning the heap."""
    with ops.SymmetricHeap(mesh) as heap:
        b = heap.register(64)
        tok_t = jax.ShapeDtypeStruct((), jnp.int32)
        full_t = jax.ShapeDtypeStruct((64,), jnp.float32)
        ids = dict(heap=np.int64(heap.id), bucket=np.int64(b.id))

        def raw(target, results, *args, dev=None, **attrs):
            def fn():
                d = lax.axis_index("d").astype(jnp.int32) if dev is None else jnp.int32(dev)
                return jax.ffi.ffi_call(target, results, has_side_effect=True)(d, *args, **attrs)

            return _mp.spmd(jax, mesh, fn)

        expect_raises(lambda: raw("jodc_mpi_gather", (full_t, tok_t), jnp.int32(0), heap=np.int64(heap.id),
                                  bucket=np.int64(999999)), "bucket 999999 is not registered")
        expect_raises(lambda: raw("jodc_mpi_gather", (full_t, tok_t), jnp.int32(0), heap=np.int64(888888),
                                  bucket=np.int64(b.id)), "heap 888888 is not registered")
        expect_raises(lambda: raw("jodc_mpi_gather", (jax.ShapeDtypeStruct((63,), jnp.float32), tok_t),
                                  jnp.int32(0), **ids), "output has 63 elements")
        expect_raises(lambda: raw("jodc_mpi_scatter_accumulate", (tok_t,), jnp.zeros(65), jnp.int32(0), **ids),
                      "gradient has 65 elements")
        expect_raises(lambda: raw("jodc_mpi_barrier", (tok_t,), jnp.int32(0), dev=WORLD + 3, heap=np.int64(heap.id)),
                      f"device index {WORLD + 3} outside [0, {WORLD})")
        other = FIRST[(RANK + 1) % NPROCS]  # a device of the next process
        expect_raises(lambda: raw("jodc_mpi_gather", (full_t, tok_t), jnp.int32(0), dev=other, **ids),
                      f"device {other} belongs to process {(RANK + 1) % NPROCS}", f"this is process {RANK}")
        expect_raises(lambda: raw("jodc_mpi_publish", (tok_t,), jnp.zeros(b.shard_numel, jnp.bfloat16),
                                  jnp.int32(0), **ids), "master dtype float32")
        comm.Barrier()
        heap.check_alive()  # still healthy
        full = _mp.spmd(jax, mesh, lambda: ops.gather(b, ops.new_token())[0])
        assert all(v.shape == (64,) for v in full.values())


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    names = sys.argv[2:] or list(CASES)
    _mp.run_cases(CASES, names, comm)
