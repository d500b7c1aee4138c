"""Which transport serves a heap: the one place that decides (`select`), from the mesh's processes and, for GPUs
across processes, their nodes.

=========  =================================  ==================================================================
platform   requested                          chosen
=========  =================================  ==================================================================
CPU        'auto'                             'mpi' when the mesh holds devices of several processes, else 'local'
CPU        'local' / 'mpi'                    itself ('local' refused across processes; 'mpi' may be forced on one)
GPU        'auto'                             one process: 'local'; one node: 'cuda_ipc'; several nodes: 'nvshmem'
GPU        'local' / 'cuda_ipc' / 'nvshmem'   itself, where it can serve the layout (else a ValueError saying why)
=========  =================================  ==================================================================
"""
from __future__ import annotations

from typing import Iterable, Sequence

from jodc.ops.transports import mpi_library
from jodc.ops.transports.exchange import Exchange, default_exchange, node_id

CPU_TRANSPORTS = ("auto", "local", "mpi")
GPU_TRANSPORTS = ("auto", "local", "cuda_ipc", "nvshmem")

_heaps_opened = 0  # multi-process GPU heaps this process opened: the same sequence in every process (collective)


def mesh_processes(devices: Iterable) -> list[int]:
    """The sorted JAX process indices owning `devices` (e.g. ``mesh.devices.flat``)."""
    return sorted({int(d.process_index) for d in devices})


def select(platform: str, requested: str, processes: Sequence[int], nodes: dict[int, str] | None = None) -> str:
    """The transport of a heap over devices of `platform` ('cpu', else GPUs) owned by `processes` (JAX process
    indices), given what the user `requested` ('auto' or a transport's name). GPUs across several processes also need
    every process's node id in `nodes` (`gpu_exchange` gathers them). ValueError when the request cannot serve the
    layout; ImportError when the MPI transport it needs is not available."""
    if platform == "cpu":
        return _select_cpu(requested, list(processes))
    return _select_gpu(requested, list(processes), nodes)


def _select_cpu(requested: str, processes: list[int]) -> str:
    if requested not in CPU_TRANSPORTS:
        raise ValueError(f"transport must be one of {CPU_TRANSPORTS}, got {requested!r}")
    if requested == "local" and len(processes) > 1:
        raise ValueError(f"transport='local' cannot serve a mesh over processes {processes}: use 'mpi' (or 'auto')")
    if requested == "auto":
        requested = "mpi" if len(processes) > 1 else "local"
    reason = mpi_library.why_missing() if requested == "mpi" else None
    if reason is not None:
        raise ImportError(f"this heap needs the MPI transport (its mesh spans processes {processes}) but {reason}: "
                          f"{mpi_library.INSTALL_HINT}")
    return requested


def _select_gpu(requested: str, processes: list[int], nodes: dict[int, str] | None) -> str:
    if requested not in GPU_TRANSPORTS:
        raise ValueError(f"transport for GPU meshes must be one of {GPU_TRANSPORTS}, got {requested!r}")
    if len(processes) <= 1:
        if requested in ("auto", "local"):
            return "local"
        raise ValueError(f"transport={requested!r} needs a mesh spanning several processes (this one lives in process "
                         f"{processes}); one process uses 'local' (peer pointers)")
    if requested == "local":
        raise ValueError(f"transport='local' cannot serve a mesh over processes {processes}: use 'cuda_ipc' (one "
                         f"node), 'nvshmem' (several nodes) or 'auto'")
    if nodes is None or set(nodes) != set(processes):
        raise ValueError(f"the node of every process is needed to pick a GPU transport (got {nodes})")
    distinct = sorted(set(nodes.values()))
    if requested == "auto":
        return "cuda_ipc" if len(distinct) == 1 else "nvshmem"
    if requested == "cuda_ipc" and len(distinct) > 1:
        by_node = {n: [p for p in processes if nodes[p] == n] for n in distinct}
        raise ValueError(f"transport='cuda_ipc' needs every process on one node; this mesh spans {len(distinct)} "
                         f"nodes (processes per node: {list(by_node.values())}): use 'nvshmem' or 'auto'")
    return requested


def gpu_exchange(processes: Sequence[int], requested: str) -> tuple[Exchange | None, dict[int, str] | None]:
    """(exchange, node of each process) for a GPU heap over `processes`, when the choice needs them: several
    processes and a request that may name a multi-process transport. Then collective (every process of the mesh calls
    it), and the heap sets up through the same exchange. Otherwise (None, None) without any communication."""
    global _heaps_opened
    processes = list(processes)
    if len(processes) <= 1 or requested == "local" or requested not in GPU_TRANSPORTS:
        return None, None
    _heaps_opened += 1
    exchange = default_exchange(processes, group=f"gpu-heap-{_heaps_opened}")
    nodes = {p: n.decode() for p, n in zip(processes, exchange.allgather("node", node_id().encode()))}
    return exchange, nodes
