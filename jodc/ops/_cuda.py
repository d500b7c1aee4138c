"""The CUDA backend: ``jodc/_ffi_cuda.so`` (built from ``ffi/cuda/*.cu``) loaded with ctypes.

:func:`library` returns an object with the same Python-level methods as the CPU extension ``jodc._ffi`` (see
``ffi/module.cc``), so :class:`jodc.ops.heap.SymmetricHeap` drives either backend the same way. Native failures
raise ``ValueError`` carrying the library's message (``MemoryError`` for allocations a GPU cannot satisfy).

The library is a plain shared object with a C API (no pybind11: nvcc never sees Python headers). It links the CUDA
runtime statically, so loading it needs no GPU; creating a heap does.
"""
from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

from jodc.ops import _clib
from jodc.ops._clib import P, c_dbl, c_i32, c_i64, c_ptr, c_str

LIBRARY_NAME = "_ffi_cuda.so"
BUILD_HINT = "build it with `JODC_CUDA=1 pip install -e .` or `make native JODC_CUDA=1` (needs nvcc)"

_ERR_CAPACITY = _clib.ERR_CAPACITY

# The CUDA library's own C functions (those both libraries have: _clib.shared_signatures), as
# name -> (restype, argtypes without the trailing error buffer, fallible).
_SIGNATURES = {
    "jodc_cuda_device_count": (c_i32, (P(c_i32),), True),
    "jodc_cuda_heap_create": (c_i32, (c_i32, c_i32, c_dbl, P(c_i64)), True),
    "jodc_cuda_heap_set_placement": (c_i32, (c_i64, P(c_i32), c_i32), True),
    "jodc_cuda_heap_abort": (c_i32, (c_i64, c_str, c_str, c_i64), True),
    "jodc_cuda_heap_landing_slots": (c_i32, (c_i64, P(c_i32)), True),
    "jodc_cuda_bucket_info": (c_i32, (c_i64, c_i64, P(c_i64), P(c_i64), P(c_i32), P(c_i32)), True),
}

# Every symbol the library exports: its C API and its handler table (the handlers themselves stay hidden).
EXPORTED_SYMBOLS = tuple(sorted({"jodc_cuda_handlers", *_SIGNATURES, *_clib.shared_signatures("jodc_cuda_")}))


def default_path() -> str:
    """Where the build puts the library: next to the ``jodc`` package."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), LIBRARY_NAME)


class CudaLibrary(_clib.CLibrary):
    """The CUDA library's C API behind the CPU extension's method names (any path: tests load fresh builds)."""

    prefix = "jodc_cuda_"

    def __init__(self, path: str):
        super().__init__(path, _SIGNATURES)

    # -- devices ----------------------------------------------------------------------------------------------
    def device_count(self) -> int:
        """CUDA devices visible to this process (ValueError when there is no usable driver or device)."""
        count = c_i32()
        self._call("jodc_cuda_device_count", ctypes.byref(count))
        return int(count.value)

    # -- heaps ----------------------------------------------------------------------------------------------
    def heap_create(self, world: int, deterministic: bool, barrier_timeout_s: float) -> int:
        heap_id = c_i64()
        self._call("jodc_cuda_heap_create", int(world), int(bool(deterministic)), float(barrier_timeout_s),
                   ctypes.byref(heap_id))
        return int(heap_id.value)

    def heap_set_placement(self, heap_id: int, gpus) -> None:
        """Puts device p's memory on CUDA device ``gpus[p]`` (default: p). Only before the first bucket."""
        gpus = [int(g) for g in gpus]
        array = (c_i32 * max(len(gpus), 1))(*gpus)
        self._call("jodc_cuda_heap_set_placement", int(heap_id), array, len(gpus))

    def heap_abort(self, heap_id: int, reason: str) -> str:
        """Poisons the heap with "aborted: <reason>" (a first cause stays) and releases its waiting barrier kernels;
        returns the poison message now recorded."""
        out = ctypes.create_string_buffer(_ERR_CAPACITY)
        self._call("jodc_cuda_heap_abort", int(heap_id), str(reason).encode(), out, _ERR_CAPACITY)
        return out.value.decode("utf-8", "replace")

    def heap_landing_slots(self, heap_id: int) -> bool:
        """Whether pushes go to per-source landing slots (deterministic heap, or GPUs without peer atomics)."""
        flag = c_i32()
        self._call("jodc_cuda_heap_landing_slots", int(heap_id), ctypes.byref(flag))
        return bool(flag.value)

    # -- buckets --------------------------------------------------------------------------------------------
    def _bucket_info(self, heap_id: int, bucket_id: int) -> tuple[int, int, int, int]:
        numel, shard_numel, master_bytes, world = c_i64(), c_i64(), c_i32(), c_i32()
        self._call("jodc_cuda_bucket_info", int(heap_id), int(bucket_id), ctypes.byref(numel),
                   ctypes.byref(shard_numel), ctypes.byref(master_bytes), ctypes.byref(world))
        return numel.value, shard_numel.value, master_bytes.value, world.value

    def bucket_shard_numel(self, heap_id: int, bucket_id: int) -> int:
        return int(self._bucket_info(heap_id, bucket_id)[1])

    def _shard_nbytes(self, heap_id: int, bucket_id: int) -> int:
        _, shard_numel, master_bytes, _ = self._bucket_info(heap_id, bucket_id)
        return shard_numel * master_bytes

    def bucket_get_accumulator(self, heap_id: int, bucket_id: int, device: int) -> bytes:
        """Raw bytes (fp32) of device `device`'s accumulated gradient, landing slots reduced in source order."""
        shard_numel = self.bucket_shard_numel(heap_id, bucket_id)
        out = np.zeros(shard_numel, np.float32)
        self._call("jodc_cuda_bucket_get_accumulator", int(heap_id), int(bucket_id), int(device),
                   out.ctypes.data_as(c_ptr), shard_numel)
        return out.tobytes()


_lock = threading.Lock()
_library: CudaLibrary | None = None


def library() -> CudaLibrary:
    """The CUDA backend built into the package (loaded once); ImportError with build instructions if missing."""
    global _library
    with _lock:
        if _library is None:
            path = default_path()
            if not os.path.exists(path):
                raise ImportError(f"jodc's CUDA library {path} is not built: {BUILD_HINT}")
            try:
                _library = CudaLibrary(path)
            except (OSError, AttributeError) as e:
                raise ImportError(f"jodc's CUDA library {path} cannot be loaded ({e}); rebuild it: {BUILD_HINT}") from e
        return _library
