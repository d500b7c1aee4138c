"""Multi-process runs of the trainers: `mpirun -np N jodc-train sft ...`.

Under an MPI launcher each process drives engine.devices / N devices; `initialize` starts `jax.distributed`
through mpi4py (plain auto-detection fails under Open MPI 5), so the mesh holds every process's devices and the ODC
engine's heap uses the MPI transport. Every process computes the same data order and plans; only process 0
prints and writes metrics, timelines, the config and the HF export; checkpoints are written through orbax, which
coordinates the processes.
"""
from __future__ import annotations

import os

# Process-count variables of the common MPI launchers (Open MPI, MPICH/Hydra, PMIx).
_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")


def launched_processes(environ=os.environ) -> int:
    """How many processes an MPI launcher started for this job (1 when not launched by one)."""
    for key in _SIZE_VARIABLES[:3]:
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
    import jax

    if jax.distributed.is_initialized() if hasattr(jax.distributed, "is_initialized") else False:
        return
    try:
        from mpi4py import MPI  # noqa: F401  (initialises MPI with MPI_THREAD_MULTIPLE)
    except ImportError as e:
        raise ImportError("a multi-process run needs mpi4py: pip install 'jodc[mpi]'") from e
    jax.distributed.initialize(cluster_detection_method="mpi4py")


def is_primary() -> bool:
    """True in the process that prints and writes the run's outputs (process 0)."""
    import jax

    return jax.process_index() == 0
