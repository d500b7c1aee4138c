"""The MPI transport: CPU devices of several processes share a heap through MPI-3 one-sided windows
(``jodc/_ffi_mpi.so``, bound in `mpi_library`). Creation, registration and freeing are collective over
``MPI.COMM_WORLD``."""
from __future__ import annotations

from jodc.ops.transports import mpi_library, registration
from jodc.ops.transports.base import Transport


class MpiTransport(Transport):
    name = "mpi"
    host_memory = True

    def __init__(self, mesh, axis_name: str, deterministic: bool, barrier_timeout_s: float,
                 progress_thread: bool | None):
        lib = mpi_library.library()
        registration.register_targets("mpi", lib, "mpi", "cpu")
        super().__init__(lib, mpi_library.create_heap(lib, mesh, axis_name, deterministic, barrier_timeout_s,
                                               progress_thread))

    def register(self, numel: int, master: str, name: str, *, index: int, shape: tuple[int, ...]) -> int:
        # collective: every process registers the same bucket here, or all raise
        mpi_library.check_registration(self.heap_id, index, name, shape, master)
        return super().register(numel, master, name, index=index, shape=shape)

    def after_free(self) -> None:
        mpi_library.forget(self.heap_id)
