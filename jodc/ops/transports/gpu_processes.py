"""The GPU transports across processes: CUDA IPC (the processes of one node map each other's allocations, so the
kernels keep using peer pointers; `cuda_ipc`) and NVSHMEM (several nodes; `nvshmem_library`). Both set up through
an `Exchange` (`exchange`) and register and free buckets collectively."""
from __future__ import annotations

from jodc.ops.transports import cuda_ipc, cuda_library, nvshmem_library, registration
from jodc.ops.transports.base import Transport


class _CollectiveGpuTransport(Transport):
    """A heap whose processes each hold one position: `collective` is this process's side (`IpcHeap`,
    `NvshmemHeap`), which registers buckets everywhere at once and meets the others before memory is freed.
    Subclasses open their heap in `open` (collective over `exchange`, this process at `position` on CUDA device
    `gpu`), after the PJRT client is checked."""

    def __init__(self, exchange, world: int, position: int, gpu: int, deterministic: bool,
                 barrier_timeout_s: float):
        cuda_library.check_pjrt_client()
        lib, heap_id, self.collective = self.open(exchange, world, position, gpu, deterministic, barrier_timeout_s)
        super().__init__(lib, heap_id)

    def open(self, exchange, world: int, position: int, gpu: int, deterministic: bool,
             barrier_timeout_s: float) -> tuple:
        """(library, heap id, this process's collective side) of a new heap."""
        raise NotImplementedError

    def register(self, numel: int, master: str, name: str, *, index: int, shape: tuple[int, ...]) -> int:
        return int(self.collective.register(numel, master, name))

    def before_free(self, what: str) -> None:
        self.collective.barrier(f"free-{what}")  # no process still uses memory that this one unmaps


class CudaIpcTransport(_CollectiveGpuTransport):
    name = "cuda_ipc"

    def open(self, exchange, world, position, gpu, deterministic, barrier_timeout_s):
        lib = cuda_library.library()
        registration.ensure_registered("gpu")  # CUDA IPC runs the in-process kernels over mapped peer memory
        heap = cuda_ipc.IpcHeap.create(lib, exchange, world, position, gpu, deterministic, barrier_timeout_s)
        return lib, heap.heap_id, heap


class NvshmemTransport(_CollectiveGpuTransport):
    name = "nvshmem"

    def open(self, exchange, world, position, gpu, deterministic, barrier_timeout_s):
        lib = nvshmem_library.library()
        registration.register_targets("nvshmem", lib, "nvshmem", "CUDA")
        if exchange.size != world:
            raise ValueError(f"an NVSHMEM heap needs one process per position: {world} positions, {exchange.size} "
                             f"processes")
        nvshmem_library.initialize(lib, exchange, position, world, gpu)  # PE = position
        heap_id = lib.heap_create(deterministic, barrier_timeout_s)
        return lib, heap_id, nvshmem_library.NvshmemHeap(lib, exchange, heap_id)
