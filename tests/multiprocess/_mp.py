"""Shared setup of the multi-process test workers (run under `mpirun`, never collected by pytest).

Each worker sets its own simulated device count before JAX is imported, initialises ``jax.distributed`` through
mpi4py, runs the named cases in order (every process runs the same ones: heap calls are collective) and exits non-zero
on the first failure; tests/test_multiprocess.py launches them with a timeout.
"""
import os
import sys
import traceback


def local_counts(spec, nprocs: int) -> list[int]:
    """Devices per process from a spec: "2" (every process 2) or "2,1,1" (one count per process, uneven)."""
    counts = [int(x) for x in str(spec).split(",")]
    if len(counts) == 1:
        counts = counts * nprocs
    if len(counts) != nprocs or min(counts) < 1:
        raise ValueError(f"device spec {spec!r} does not fit {nprocs} processes")
    return counts


def init(local_devices):
    """Forces this process's CPU device count (an int, or a spec for `local_counts`), then jax.distributed over MPI;
    returns (jax, comm)."""
    from mpi4py import MPI  # initialises MPI (MPI_THREAD_MULTIPLE)

    local_devices = local_counts(local_devices, MPI.COMM_WORLD.Get_size())[MPI.COMM_WORLD.Get_rank()]
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local_devices}"
    import jax

    jax.config.update("jax_enable_x64", False)
    jax.distributed.initialize(cluster_detection_method="mpi4py")
    assert jax.process_count() == MPI.COMM_WORLD.Get_size()
    assert jax.local_device_count() == local_devices
    return jax, MPI.COMM_WORLD


def global_mesh(jax):
    import numpy as np

    return jax.sharding.Mesh(np.array(jax.devices()), ("d",))


def local_mesh(jax):
    """A one-device mesh of this process's first device (where a reference engine runs)."""
    import numpy as np

    return jax.sharding.Mesh(np.array(jax.local_devices()[:1]), ("d",))


def spmd(jax, mesh, fn, *per_device_args):
    """jit(shard_map(fn)) over the global mesh. Args: numpy arrays with a leading device axis, equal everywhere.

    Returns, per output, {global device index: numpy value} for this process's devices.
    """
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.shape["d"]
    if not per_device_args:
        per_device_args = (jnp.zeros((n,), jnp.float32),)
        inner = fn
        fn = lambda _: inner()  # noqa: E731
    import numpy as np

    sharding = NamedSharding(mesh, P("d"))
    args = [jax.make_array_from_callback(np.shape(a), sharding, lambda idx, a=a: np.asarray(a)[idx])
            for a in per_device_args]

    def body(*xs):
        out = fn(*[x[0] for x in xs])
        return jax.tree.map(lambda o: o[None], out)

    sm = jax.shard_map(body, mesh=mesh, in_specs=tuple(P("d") for _ in args), out_specs=P("d"))
    outs = jax.block_until_ready(jax.jit(sm)(*args))
    single = not isinstance(outs, (tuple, list))
    outs = [outs] if single else list(outs)
    local = [{s.index[0].start: np.asarray(s.data)[0] for s in o.addressable_shards} for o in outs]
    return local[0] if single else local


def run_cases(cases: dict, names: list[str], comm):
    """Runs cases[name]() for each name; prints PASS lines (rank 0) and exits 1 on the first failure."""
    for name in names:
        try:
            cases[name]()
        except BaseException:  # noqa: BLE001 - report and fail the whole job
            sys.stdout.write(f"[rank {comm.Get_rank()}] FAIL {name}\n{traceback.format_exc()}\n")
            sys.stdout.flush()
            os._exit(1)
        comm.Barrier()
        if comm.Get_rank() == 0:
            print(f"PASS {name}", flush=True)
