"""The transports of a symmetric heap, behind one small interface (`Transport`), chosen once from the mesh
(`select`, in `choice`), with the native libraries each one loads (`*_library`, `registration`, `target_names`).

=============  =========================  =====================================================================
transport      class                      serves
=============  =========================  =====================================================================
``local``      `LocalCpuTransport`        CPU devices of this process (host memory)
``mpi``        `MpiTransport`             CPU devices of several processes (MPI-3 one-sided windows)
``local``      `CudaLocalTransport`       GPUs of this process (peer pointers)
``cuda_ipc``   `CudaIpcTransport`         one GPU per process, the processes of one node (CUDA IPC handles)
``nvshmem``    `NvshmemTransport`         one GPU per process, several nodes (NVSHMEM)
=============  =========================  =====================================================================
"""
from __future__ import annotations

import numpy as np

from jodc.ops.transports import cuda_ipc
from jodc.ops.transports.base import Transport, check_single_process
from jodc.ops.transports.choice import gpu_exchange, mesh_processes, select
from jodc.ops.transports.gpu_processes import CudaIpcTransport, NvshmemTransport
from jodc.ops.transports.local import CudaLocalTransport, LocalCpuTransport
from jodc.ops.transports.mpi import MpiTransport

__all__ = ["CudaIpcTransport", "CudaLocalTransport", "LocalCpuTransport", "MpiTransport", "NvshmemTransport",
           "Transport", "check_single_process", "mesh_processes", "open_transport", "select"]


def along_axis(mesh, axis_name: str) -> np.ndarray:
    """The mesh's devices in position order along `axis_name` (other axes have size 1)."""
    world = int(mesh.shape[axis_name])
    return np.moveaxis(mesh.devices, mesh.axis_names.index(axis_name), 0).reshape(world)


def open_transport(mesh, axis_name: str, platform: str, requested: str, *, deterministic: bool,
                   barrier_timeout_s: float, progress_thread: bool | None) -> Transport:
    """Opens the heap over `mesh` (devices of `platform`) on the transport `select` chooses for `requested` ('auto' or
    a transport's name: `jodc.ops.transports.choice`). On GPUs across processes this is collective: the processes
    exchange their nodes first, and the heap sets up through the same exchange."""
    devices = along_axis(mesh, axis_name)
    processes = mesh_processes(mesh.devices.flat)
    if platform == "cpu":
        if select(platform, requested, processes) == "mpi":
            return MpiTransport(mesh, axis_name, deterministic, barrier_timeout_s, progress_thread)
        return LocalCpuTransport(devices, deterministic, barrier_timeout_s)
    exchange, nodes = gpu_exchange(processes, requested)
    name = select(platform, requested, processes, nodes)
    if name == "local":
        check_single_process(devices)
        if platform not in ("cuda", "gpu"):
            raise ValueError(f"jodc ops support cpu and cuda devices, not {platform!r}")
        return CudaLocalTransport(devices, deterministic, barrier_timeout_s)
    import jax

    position, device = cuda_ipc.local_position(devices, jax.process_index())
    opened = CudaIpcTransport if name == "cuda_ipc" else NvshmemTransport
    return opened(exchange, len(devices), position, int(device.local_hardware_id), deterministic, barrier_timeout_s)
