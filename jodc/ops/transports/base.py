"""What every transport of a symmetric heap offers the heap (`Transport`), and the checks of an in-process heap.

A transport is how one heap's native memory reaches its devices: in-process memory on CPU or GPU (`local`), MPI
one-sided windows across processes (`mpi`), CUDA IPC handles across the processes of a node (`cuda_ipc`) or NVSHMEM
across nodes (`nvshmem`). `jodc.ops.transports.open_transport` picks and opens one from the mesh, once; the heap then
only delegates to it.
"""
from __future__ import annotations

from typing import Any


class Transport:
    """One heap's side in this process: `lib` (the native library whose C API serves the heap: creation, buckets,
    host access, barrier state) and `heap_id`. Subclasses open the heap in `__init__` and override the hooks where
    their heap is collective across processes."""

    # what `SymmetricHeap.transport` says; picks the FFI targets the ops call (`target_names`)
    name = "local"
    host_memory = False  # the heap lives in host memory (checked against the machine's before a bucket is allocated)

    def __init__(self, lib: Any, heap_id: int):
        self.lib, self.heap_id = lib, int(heap_id)

    def register(self, numel: int, master: str, name: str, *, index: int, shape: tuple[int, ...]) -> int:
        """Registers the next bucket (the heap's `index`-th, `name`, `shape`, flat `numel`, master dtype `master`);
        returns its id. Collective for multi-process transports: every process registers the same bucket here."""
        return int(self.lib.bucket_register(self.heap_id, numel, master))

    def before_free(self, what: str) -> None:
        """Called before the heap or one of its buckets (`what`: 'heap' or 'bucket') is freed: a multi-process GPU
        heap waits until no process still uses the memory this one unmaps."""

    def after_free(self) -> None:
        """Called once the heap is freed: drop what the transport kept for it."""


def check_single_process(devices) -> None:
    """The in-process heap (CPU memory, or CUDA peer pointers within one process) reaches only this process's
    devices. Refuses a mesh holding devices of other processes with a clear message; a multi-process transport (MPI,
    CUDA IPC, NVSHMEM) replaces this check with its own."""
    import jax

    me = jax.process_index()
    remote = sorted({int(d.process_index) for d in devices if int(d.process_index) != me})
    if remote:
        raise ValueError(
            f"the heap's mesh holds devices of process(es) {remote}, but this process is {me}: jodc's in-process "
            f"heap reaches only the devices of one process (no multi-process transport is available here); use a "
            f"mesh of this process's devices (jax.local_devices())")
