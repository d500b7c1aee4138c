"""The in-process transports: one process's devices share a heap in its own memory (CPU) or through CUDA peer
pointers (GPUs of one process)."""
from __future__ import annotations

from jodc.ops.transports import cuda_library, registration
from jodc.ops.transports.base import Transport, check_single_process


class LocalCpuTransport(Transport):
    """Host memory of this process (``jodc._ffi``): every CPU device of the mesh is a thread here."""

    host_memory = True

    def __init__(self, along_axis, deterministic: bool, barrier_timeout_s: float):
        check_single_process(along_axis)
        lib = registration.cpu_library()
        registration.ensure_registered("cpu")
        super().__init__(lib, int(lib.heap_create(len(along_axis), deterministic, barrier_timeout_s)))


class CudaLocalTransport(Transport):
    """GPUs of this process (``jodc/_ffi_cuda.so``): peer pointers between them, position p's memory on the GPU that
    runs position p."""

    def __init__(self, along_axis, deterministic: bool, barrier_timeout_s: float):
        check_single_process(along_axis)
        lib = cuda_library.library()
        registration.ensure_registered("gpu")
        super().__init__(lib, create_gpu_heap(lib, along_axis, deterministic, barrier_timeout_s))


def create_gpu_heap(lib, along_axis, deterministic: bool, barrier_timeout_s: float) -> int:
    """Creates an in-process GPU heap: refuses PJRT clients the barrier cannot serve, and places position p's memory
    on the GPU that runs position p (meshes need not follow jax.devices()) at creation, so the library touches only
    the mesh's GPUs (peer access, pinned blocks, contexts)."""
    cuda_library.check_pjrt_client()
    placement = cuda_library.placement_of(along_axis)
    return int(lib.heap_create(len(along_axis), deterministic, barrier_timeout_s, placement))
