"""Multi-process runs of the trainers: `mpirun -np N jodc-train sft ...`.

Under an MPI launcher each process drives engine.devices / N devices; `initialize` starts `jax.distributed`
through mpi4py (plain auto-detection fails under Open MPI 5), so the mesh holds every process's devices and the ODC
engine's heap uses the MPI transport. Every process computes the same data order and plans; only process 0
prints and writes metrics, timelines, the config and the HF export; checkpoints are written through orbax, which
coordinates the processes.
"""
from __future__ import annotations

import hashlib
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

# Process-count variables of the common MPI launchers (Open MPI, MPICH/Hydra, PMIx).
_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")


def launched_processes(environ=os.environ) -> int:
    """How many processes an MPI launcher started for this job (1 when not launched by one)."""
    for key in _SIZE_VARIABLES:
        value = environ.get(key)
        if value and value.isdigit():
            return int(value)
    return 1


def local_device_count(total_devices: int, processes: int) -> int:
    """Devices each process drives; the total must split evenly."""
    if total_devices % processes:
        raise ValueError(f"engine.devices={total_devices} does not split over {processes} processes")
    return total_devices // processes


def initialize() -> None:
    """jax.distributed over the processes of MPI_COMM_WORLD (idempotent); needs the jodc[mpi] extra."""
    if jax.distributed.is_initialized() if hasattr(jax.distributed, "is_initialized") else False:
        return
    from jodc.ops.transports.mpi_library import quiet_one_sided_components

    quiet_one_sided_components()  # before MPI starts: no error-looking lines from Open MPI's UCX probe
    try:
        from mpi4py import MPI  # noqa: F401  (initialises MPI with MPI_THREAD_MULTIPLE)
    except ImportError as e:
        raise ImportError("a multi-process run needs mpi4py: pip install 'jodc[mpi]'") from e
    jax.distributed.initialize(cluster_detection_method="mpi4py")


def is_primary() -> bool:
    """True in the process that prints and writes the run's outputs (process 0)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Waits until every process of the run reaches the barrier `name` (a no-op in a single-process run): e.g. until
    process 0 has written a file the others read next."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def digest(arrays) -> np.ndarray:
    """A 128-bit digest (uint32 [4]) of a sequence of arrays: their dtypes, shapes and bytes, in order."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return np.frombuffer(h.digest()[:16], np.uint32).copy()


def check_agreement(what: str, value) -> None:
    """Raises RuntimeError in every process unless all processes hold the same `value` (e.g. a `digest`, or a
    function returning it: called only in a multi-process run); `what` names it in the error. A no-op in a
    single-process run.

    The processes of a multi-process run each compute what they must agree on (an RL step's rollout, rewards and
    advantages) instead of receiving it; this check turns a divergence (a non-deterministic reward function, a
    process sampling with other parameters) into an error naming the processes instead of silently training each
    process's devices on different data."""
    if jax.process_count() == 1:
        return
    value = np.asarray(value() if callable(value) else value)
    values = np.asarray(multihost_utils.process_allgather(value)).reshape(jax.process_count(), *value.shape)
    differ = [p for p in range(values.shape[0]) if not np.array_equal(values[p], values[0])]
    if differ:
        raise RuntimeError(f"the processes disagree on {what}: process(es) {differ} computed something else than "
                           "process 0 (every process must compute it identically: is a reward function or the data "
                           "non-deterministic?)")


def any_process(flag: bool) -> bool:
    """Whether `flag` is true in any process of the run (a collective across processes: every process must call it
    at the same point; in a single-process run `flag` itself)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.asarray(multihost_utils.process_allgather(np.asarray([flag], np.int32))).any())
