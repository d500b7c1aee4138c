"""The GPU transports across processes: CUDA IPC (the processes of one node map each other's allocations, so the
kernels keep using peer pointers; `jodc.ops._cuda_ipc`) and NVSHMEM (several nodes; `jodc.ops._nvshmem`). Both set
up through an `Exchange` (`jodc.ops._exchange`) and register and free buckets collectively."""
from __future__ import annotations

from jodc.ops import _cuda, _cuda_ipc, _native, _nvshmem
from jodc.ops.transports.base import Transport


class _CollectiveGpuTransport(Transport):
    """A heap whose processes each hold one position: `collective` is this process's side (`IpcHeap`,
    `NvshmemHeap`), which registers buckets everywhere at once and meets the others before memory is freed."""

    def __init__(self, lib, heap_id: int, collective):
        super().__init__(lib, heap_id)
        self.collective = collective

    def register(self, numel: int, master: str, name: str, *, index: int, shape: tuple[int, ...]) -> int:
        return int(self.collective.register(numel, master, name))

    def before_free(self, what: str) -> None:
        self.collective.barrier(f"free-{what}")  # no process still uses memory that this one unmaps


class CudaIpcTransport(_CollectiveGpuTransport):
    name = "cuda_ipc"

    def __init__(self, exchange, world: int, position: int, gpu: int, deterministic: bool,
                 barrier_timeout_s: float):
        _cuda.check_pjrt_client()
        lib = _cuda.library()
        _native.ensure_registered("gpu")  # CUDA IPC runs the in-process kernels over mapped peer memory
        heap = _cuda_ipc.IpcHeap.create(lib, exchange, world, position, gpu, deterministic, barrier_timeout_s)
        super().__init__(lib, heap.heap_id, heap)


class NvshmemTransport(_CollectiveGpuTransport):
    name = "nvshmem"

    def __init__(self, exchange, world: int, position: int, gpu: int, deterministic: bool,
                 barrier_timeout_s: float):
        _cuda.check_pjrt_client()
        lib = _nvshmem.library()
        _native.register_targets("nvshmem", lib, "nvshmem", "CUDA")
        if exchange.size != world:
            raise ValueError(f"an NVSHMEM heap needs one process per position: {world} positions, {exchange.size} "
                             f"processes")
        _nvshmem.initialize(lib, exchange, position, world, gpu)  # PE = position
        heap_id = lib.heap_create(deterministic, barrier_timeout_s)
        super().__init__(lib, heap_id, _nvshmem.NvshmemHeap(lib, exchange, heap_id))
