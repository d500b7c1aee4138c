"""A GPU heap across processes of one node, run for real (tests/test_ops_cuda.py): the launcher and one process's cases.

The launcher (:func:`launch`, importable without a GPU) starts PROCESSES copies of this script under one deadline,
either one GPU per process or all of them on GPU 0 (:func:`plan_devices`: CUDA IPC maps another process's memory on
the same device too), each with a capped XLA memory pool (:func:`child_environment`) so that several JAX processes
and the heap fit on one GPU. The first process that fails ends the others at once.

One process (``python tests/cuda_ipc_cases.py --process-id I --num-processes N --port P --device-id G ...``):
``jax.distributed`` on localhost with ``local_device_ids=[G]``, then, per accumulation mode (atomic, deterministic), a
heap over the global mesh whose transport must be 'cuda_ipc' (or the one forced with --transport): the buckets'
IPC handles are exchanged, and gather, scatter_accumulate, barrier, read_accumulator, zero_accumulator and publish
are checked against numpy across the processes over several rounds, with the barrier generations read from the shared
control block. With --faults (two processes, CUDA IPC): position 1 never enters a barrier (position 0 times out naming
it, and position 1 sees that cause through the shared control block), and position 1 aborts the heap while position 0
waits in a barrier (released at once with position 1's reason). Prints "IPC CASES PASSED <transport> ..." at the end.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"atomic": False, "deterministic": True}  # accumulation mode -> SymmetricHeap(deterministic=...)
# Each process's XLA pool grows on demand up to this fraction of its GPU (PREALLOCATE=false): a pytest process that
# preallocated 75% of the GPU leaves the rest for these processes and their heaps.
CHILD_POOL_FRACTION = 0.1
FAULT_TIMEOUT_S = 2.0  # the barrier timeout of the timeout case
# The launcher's deadline for its processes, and the cap of their host-side waits; a time-boxed GPU check
# (tools/gpu_check.py) sets it well inside its step's limit.
PROCESS_TIMEOUT_ENV = "JODC_TEST_PROCESS_TIMEOUT_S"


def process_timeout_s(default: float = 300.0, environ=None) -> float:
    """How long launched processes may run: $JODC_TEST_PROCESS_TIMEOUT_S if set (a positive number), else `default`."""
    text = (os.environ if environ is None else environ).get(PROCESS_TIMEOUT_ENV, "").strip()
    if not text:
        return default
    value = float(text)
    if not value > 0:
        raise ValueError(f"{PROCESS_TIMEOUT_ENV} must be a positive number of seconds, got {text!r}")
    return value
ABORT_AFTER_S = 2.0  # how long position 0 waits in its barrier before position 1 aborts the heap


# ---- the launcher (no JAX) -----------------------------------------------------------------------------------------

def plan_devices(processes: int, gpus: int, share: bool) -> list[int]:
    """The GPU (local device id) of each process: all on GPU 0 when `share`, else GPU i for process i. ValueError
    when there are fewer than two processes or (not sharing) fewer GPUs than processes."""
    if processes < 2:
        raise ValueError(f"a heap across processes needs at least two processes, got {processes}")
    if gpus < 1:
        raise ValueError("no GPU to run on")
    if share:
        return [0] * processes
    if gpus < processes:
        raise ValueError(f"one GPU per process needs {processes} GPUs, this machine has {gpus} (share=True runs "
                         f"every process on GPU 0)")
    return list(range(processes))


def child_environment(base: dict, root: str = ROOT) -> dict:
    """The environment of one launched process: jodc and tests/ importable, no simulated CPU devices (XLA_FLAGS of the
    test process), and an XLA pool that grows on demand up to CHILD_POOL_FRACTION of the GPU. The fraction goes into
    whichever of jax's two variable names the base environment already uses (jax refuses both at once)."""
    from jodc.ops.transports import cuda_ipc

    env = dict(base)
    # first on the path, before what the base environment had (an overlay environment's site folder: keep it)
    env["PYTHONPATH"] = os.pathsep.join([root, os.path.join(root, "tests")] +
                                        [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("XLA_FLAGS", None)
    env[cuda_ipc.PREALLOCATE_ENV] = "false"
    names = [n for n in cuda_ipc.MEM_FRACTION_ENVS if n in base] or ["XLA_PYTHON_CLIENT_MEM_FRACTION"]
    for name in names:
        env[name] = str(CHILD_POOL_FRACTION)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(processes: int, gpus: int, *, share: bool, timeout_s: float, case_args=(), script: str | None = None,
           environ=None) -> list[tuple[int | None, str]]:
    """Runs `processes` copies of `script` (default: this file) with --process-id/--num-processes/--port/--device-id
    plus `case_args`; returns (exit code, output) per process, in order. Every process is ended (its whole process
    group) by the deadline `timeout_s`, or as soon as another one has failed; an ended process's code is None."""
    script = script or os.path.abspath(__file__)
    devices = plan_devices(processes, gpus, share)
    env = child_environment(os.environ if environ is None else environ)
    port = free_port()
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(processes)]
    procs = [subprocess.Popen([sys.executable, script, "--process-id", str(i), "--num-processes", str(processes),
                               "--port", str(port), "--device-id", str(devices[i]), *case_args],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
             for i, log in enumerate(logs)]
    codes: list[int | None] = [None] * processes
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and None in codes:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                break  # one failed: the others would wait for it until the deadline
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return list(zip(codes, outputs))


# ---- one process ---------------------------------------------------------------------------------------------------

def check_ops(mesh, deterministic: bool, transport: str) -> str:
    """Every op across the processes against numpy, several rounds, on a fresh heap; returns a line describing it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jodc import ops

    nproc = len(mesh.devices.flat)
    numel, rounds = 10_007, 5
    rng = np.random.default_rng(0)
    values = rng.standard_normal(numel).astype(np.float32)
    grads = rng.standard_normal((nproc, numel)).astype(np.float32)
    with ops.SymmetricHeap(mesh, deterministic=deterministic, barrier_timeout_s=min(60.0, process_timeout_s()),
                           transport=transport) as heap:
        assert heap.transport == ("cuda_ipc" if transport == "auto" else transport), heap.transport
        sharing = getattr(getattr(heap._transport, "collective", None), "gpu_sharing", {})
        one_gpu = len(sharing) == 1
        if one_gpu:  # the processes' memory is all local to one GPU: native atomics, landing slots only if asked
            assert heap.landing_slots == deterministic, (heap.landing_slots, deterministic)
        b = heap.register(numel)  # the IPC handles of every position are exchanged and mapped here
        me = heap.positions[jax.local_devices()[0]]
        padded = np.zeros(b.padded_numel, np.float32)
        padded[:numel] = values
        b.set_shard(me, padded[me * b.shard_numel:(me + 1) * b.shard_numel])

        def body(g):
            def step(r, carry):
                tok, total = carry
                tok = ops.barrier(heap, tok)
                full, tok = ops.gather(b, tok)
                tok = ops.scatter_accumulate(b, g[0] * (r + 1).astype(jnp.float32), tok)
                tok = ops.barrier(heap, tok)
                acc, tok = ops.read_accumulator(b, tok)
                tok = ops.zero_accumulator(b, tok)
                own = lax.dynamic_slice_in_dim(jnp.pad(full, (0, b.padded_numel - numel)),
                                               lax.axis_index("d") * b.shard_numel, b.shard_numel)
                tok = ops.publish(b, own + 1.0, tok)
                return tok, total + acc + jnp.sum(full) * 0.0

            _, total = lax.fori_loop(0, rounds, step, (ops.new_token(), jnp.zeros((b.shard_numel,), jnp.float32)))
            return total[None]

        sharding = NamedSharding(mesh, P("d"))
        g = jax.make_array_from_process_local_data(sharding, grads[me][None])
        sm = jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
        out = jax.block_until_ready(jax.jit(sm)(g))
        mine = np.asarray(out.addressable_shards[0].data)[0]
        expected = sum(grads.sum(0) * (r + 1) for r in range(rounds))
        lo, hi = b.owner_range(me)
        np.testing.assert_allclose(mine[:hi - lo], expected[lo:hi], rtol=1e-4, atol=1e-3)
        # every round published full[own slice] + 1 on each position: rounds added everywhere (own shard checked:
        # with NVSHMEM the host reaches only its own position)
        np.testing.assert_allclose(b.shard(me)[:hi - lo], values[lo:hi] + rounds, rtol=1e-6)
        if heap.transport == "cuda_ipc":  # the host reads every position, the other processes' through their handles
            np.testing.assert_allclose(b.full(), values + rounds, rtol=1e-6)
        assert heap.generations() == [2 * rounds] * nproc  # every process's arrivals, read from the shared block
        return (f"{'deterministic' if deterministic else 'atomic'}: landing_slots={int(heap.landing_slots)} "
                f"one_gpu={int(one_gpu)}")


def _skip_barrier_at(mesh, heap, skipping: int):
    """A compiled program in which every position but `skipping` enters one barrier of `heap`; and its input."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jodc import ops

    def body(x):
        enter = lax.axis_index("d") != skipping
        tok = lax.cond(enter, lambda t: ops.barrier(heap, t), lambda t: t, ops.new_token())
        return (tok + x[0].astype(jnp.int32))[None]

    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")),
                                               np.zeros((len(mesh.local_devices),), np.float32))
    sm = jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    return jax.jit(sm).lower(x).compile(), x


def _free_failed(heap) -> None:
    import warnings

    with warnings.catch_warnings():  # the failed computation is reported as a warning while freeing
        warnings.simplefilter("ignore", RuntimeWarning)
        heap.free()


def _failed_barrier(compiled, x) -> tuple[str, float]:
    """(error message, seconds until it came) of a barrier on position 0 that must fail: position 1 never arrives."""
    import jax

    start = time.perf_counter()
    try:
        jax.block_until_ready(compiled(x))
    except Exception as e:  # noqa: BLE001 - the expected failure, checked by the caller
        return str(e), time.perf_counter() - start
    raise AssertionError("position 0's barrier passed although position 1 never arrived")


@contextlib.contextmanager
def _barrier_skipped_by_position_1(mesh, sync, timeout_s: float, label: str):
    """A heap and a program with a barrier on every position but 1, compiled by every process before any runs it;
    yields (heap, this process's position, program, its input); frees the (failed) heap at the end."""
    import jax

    from jodc import ops

    heap = ops.SymmetricHeap(mesh, barrier_timeout_s=timeout_s)
    try:
        compiled, x = _skip_barrier_at(mesh, heap, skipping=1)
        sync.allgather(f"{label}-compiled", b"")
        yield heap, heap.positions[jax.local_devices()[0]], compiled, x
    finally:
        _free_failed(heap)


def check_timeout(mesh, sync) -> str:
    """Position 1 never enters the barrier: position 0 times out naming it, and position 1, whose own ops all
    succeeded, finds the heap poisoned with position 0's cause through the shared control block."""
    import jax

    with _barrier_skipped_by_position_1(mesh, sync, FAULT_TIMEOUT_S, "timeout") as (heap, me, compiled, x):
        if me == 0:
            message, elapsed = _failed_barrier(compiled, x)
            assert "device(s) [1] never arrived" in message, message
            assert FAULT_TIMEOUT_S * 0.9 < elapsed < FAULT_TIMEOUT_S + 5.0, elapsed
        else:
            jax.block_until_ready(compiled(x))  # no barrier on this position: returns at once
        sync.allgather("timeout-seen", b"")  # position 0 has timed out (and shared its cause) by now
        poisoned = heap.poisoned
        assert "never arrived" in poisoned, poisoned
        if me != 0:
            assert "aborted by the process of position 0 sharing it" in poisoned, poisoned
        try:
            heap.register(16)
        except RuntimeError as e:  # every later use fails with the cause, in every process
            assert "never arrived" in str(e), e
        else:
            raise AssertionError("a poisoned heap accepted a bucket")
        return "timeout: ok"


def check_abort(mesh, sync) -> str:
    """Position 0 waits in a barrier with a 60 s timeout; position 1 aborts the heap ABORT_AFTER_S later: position 0
    is released at once, failing with position 1's reason."""
    reason = "position 1 gives up on purpose"
    with _barrier_skipped_by_position_1(mesh, sync, 60.0, "abort") as (heap, me, compiled, x):
        if me == 0:
            message, elapsed = _failed_barrier(compiled, x)
            assert reason in message and "position 1" in message, message
            # it waited for the abort (not failed before), and was released long before its timeout
            assert ABORT_AFTER_S * 0.5 < elapsed < ABORT_AFTER_S + 10.0, elapsed
        else:
            time.sleep(ABORT_AFTER_S)
            heap.abort(reason)
        sync.allgather("abort-seen", b"")
        assert reason in heap.poisoned, heap.poisoned
        return "abort: ok"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True, help="the jax.distributed coordinator's port on 127.0.0.1")
    parser.add_argument("--device-id", type=int, required=True, help="this process's GPU (local_device_ids=[it])")
    parser.add_argument("--transport", default="auto", choices=("auto", "cuda_ipc", "nvshmem"))
    parser.add_argument("--modes", default="atomic,deterministic",
                        help=f"accumulation modes to check, comma-separated, of {sorted(MODES)}")
    parser.add_argument("--faults", action="store_true", help="the timeout and abort cases too (CUDA IPC, 2 processes)")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown or not args.modes:
        parser.error(f"--modes: unknown mode(s) {unknown}; choose from {sorted(MODES)}")
    if args.faults and (args.num_processes != 2 or args.transport == "nvshmem"):
        parser.error("--faults needs two processes and CUDA IPC")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    import jax
    import numpy as np

    jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.num_processes,
                               process_id=args.process_id, local_device_ids=[args.device_id])
    from jax._src import distributed

    from jodc.ops.transports import exchange

    devices = jax.devices()
    assert len(devices) == args.num_processes and len(jax.local_devices()) == 1, (devices, jax.local_devices())
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    # host-side rendezvous points of the fault cases (the key-value store, no collective: processes may share a GPU)
    sync = exchange.KeyValueExchange(distributed.global_state.client, args.process_id, args.num_processes,
                                      "ipc-cases", timeout_s=min(120.0, process_timeout_s()))
    lines = [check_ops(mesh, MODES[m], args.transport) for m in args.modes]
    if args.faults:
        lines += [check_timeout(mesh, sync), check_abort(mesh, sync)]
    for line in lines:
        print(line, flush=True)
    transport = "cuda_ipc" if args.transport == "auto" else args.transport
    print(f"IPC CASES PASSED {transport} modes={','.join(args.modes)} faults={int(args.faults)}", flush=True)


if __name__ == "__main__":
    main()
