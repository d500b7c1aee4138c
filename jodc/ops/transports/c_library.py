"""What the ctypes-loaded native libraries (CUDA: ``cuda_library.py``, MPI: ``mpi_library.py``, NVSHMEM:
``nvshmem_library.py``) share: binding their C API, turning
its error convention into Python exceptions, and reading their FFI handler table.

The C convention (ffi/mpi/capi.cc, ffi/cuda/management.cu): a fallible function takes a trailing message buffer and
its capacity and returns 0 on success, 1 on failure, 2 on an allocation the device could not satisfy.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

from jodc.ops.transports import target_names

#: The ``jodc`` package's folder: the build puts the native libraries there.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ERR_CAPACITY = 16384
OUT_OF_MEMORY = 2
ERR_ARGS = (ctypes.c_char_p, ctypes.c_int64)  # trailing (message buffer, capacity) of every fallible function
_MAX_OPS = 64


def load(library_class, path: str, missing: str, broken: str):
    """`library_class(path)`, loaded; ImportError saying `missing` (formatted with the path) when the file is not
    there, or `broken` (with the path and the loader's error) when it does not load."""
    if not os.path.exists(path):
        raise ImportError(missing.format(path=path))
    try:
        return library_class(path)
    except (OSError, AttributeError) as e:
        raise ImportError(broken.format(path=path, error=e)) from e


c_i32, c_i64, c_u64, c_dbl = ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_double
c_ptr, c_str, P = ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER


def shared_signatures(prefix: str) -> dict:
    """The C functions both libraries have (same arguments), which CLibrary's methods call, under `prefix`:
    {name: (restype, argtypes without the error buffer, fallible)}."""
    return {prefix + name: sig for name, sig in {
        "shard_numel": (c_i64, (c_i64, c_i32, c_i32), False),
        "live_heaps": (c_i64, (), False),
        "live_bytes": (c_i64, (), False),
        "heap_free": (c_i32, (c_i64,), True),
        "heap_set_barrier_timeout": (c_i32, (c_i64, c_dbl), True),
        "heap_generations": (c_i32, (c_i64, P(c_u64), c_i32, P(c_i32)), True),
        "heap_poisoned": (c_i32, (c_i64, c_str, c_i64, P(c_i64)), True),
        "bucket_register": (c_i32, (c_i64, c_i64, c_str, P(c_i64)), True),
        "bucket_free": (c_i32, (c_i64, c_i64), True),
        "bucket_get_shard": (c_i32, (c_i64, c_i64, c_i32, c_ptr, c_i64), True),
        "bucket_set_shard": (c_i32, (c_i64, c_i64, c_i32, c_ptr, c_i64), True),
        "bucket_get_accumulator": (c_i32, (c_i64, c_i64, c_i32, c_ptr, c_i64), True),
        "bucket_zero_accumulator": (c_i32, (c_i64, c_i64, c_i32), True),
    }.items()}


class CLibrary:
    """A shared library whose C API is :func:`shared_signatures` plus `signatures` (its own functions, same form).

    `prefix` names the library's C functions (``jodc_cuda_``, ``jodc_mpi_``); `transport` says which FFI targets
    its handler table must hold (see :mod:`jodc.ops.transports.target_names`).
    """

    prefix = ""
    transport = "local"
    # Whether the library has the whole shared_signatures API (the NVSHMEM library has only its handler table and
    # its own functions: host access reaches only this process's position there).
    shared_api = True

    def __init__(self, path: str, signatures: dict):
        self.path = path
        self._lib = ctypes.CDLL(path)
        handlers = getattr(self._lib, self.prefix + "handlers")
        handlers.restype = ctypes.c_int32
        handlers.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32]
        shared = shared_signatures(self.prefix) if self.shared_api else {}
        for name, (restype, argtypes, fallible) in {**shared, **signatures}.items():
            fn = getattr(self._lib, name)
            fn.restype = restype
            fn.argtypes = list(argtypes) + (list(ERR_ARGS) if fallible else [])

    def _call(self, name: str, *args) -> None:
        """Calls a fallible C function; raises ValueError (MemoryError for return code 2) with its message."""
        err = ctypes.create_string_buffer(ERR_CAPACITY)
        rc = getattr(self._lib, name)(*args, err, ERR_CAPACITY)
        if rc == OUT_OF_MEMORY:
            raise MemoryError(err.value.decode("utf-8", "replace"))
        if rc != 0:
            raise ValueError(err.value.decode("utf-8", "replace"))

    def handler_pointers(self) -> dict[str, int]:
        """FFI target name -> address of its handler, from the library's table (ffi/common/ops.h)."""
        names = (ctypes.c_char_p * _MAX_OPS)()
        pointers = (ctypes.c_void_p * _MAX_OPS)()
        count = getattr(self._lib, self.prefix + "handlers")(names, pointers, _MAX_OPS)
        if not 0 <= count <= _MAX_OPS:
            raise RuntimeError(f"{self.path}: its handler table reports {count} entries")
        prefix = target_names.PREFIXES[self.transport]
        return {prefix + names[i].decode(): int(pointers[i]) for i in range(count)}

    def handlers(self) -> dict:
        """FFI target name -> PyCapsule of its handler (for ``jax.ffi.register_ffi_target``)."""
        import jax

        return {name: jax.ffi.pycapsule(ptr) for name, ptr in self.handler_pointers().items()}

    # -- what both libraries' C APIs offer under their prefix ----------------------------------------------------
    max_world = 64  # the most devices heap_generations reads back

    def _fn(self, name: str):  # getattr: ctypes caches the function (and its argtypes) by attribute only
        return getattr(self._lib, self.prefix + name)

    def shard_numel(self, numel: int, world: int, master_bytes: int) -> int:
        """Padded elements per shard (ffi/common/layout.h: the same layout as the CPU extension's)."""
        return int(self._fn("shard_numel")(int(numel), int(world), int(master_bytes)))

    def live_heaps(self) -> int:
        return int(self._fn("live_heaps")())

    def live_bytes(self) -> int:
        """Bytes of native memory this process holds for all of the library's heaps."""
        return int(self._fn("live_bytes")())

    def heap_free(self, heap_id: int) -> None:
        self._call(self.prefix + "heap_free", int(heap_id))

    def heap_set_barrier_timeout(self, heap_id: int, timeout_s: float) -> None:
        self._call(self.prefix + "heap_set_barrier_timeout", int(heap_id), float(timeout_s))

    def heap_generations(self, heap_id: int) -> list[int]:
        """Per device of the heap, how many barriers it has entered."""
        out = (ctypes.c_uint64 * self.max_world)()
        world = ctypes.c_int32()
        self._call(self.prefix + "heap_generations", int(heap_id), out, self.max_world, ctypes.byref(world))
        return [int(out[p]) for p in range(world.value)]

    def heap_poisoned(self, heap_id: int) -> str:
        """Why the heap is unusable ("" while healthy)."""
        out = ctypes.create_string_buffer(ERR_CAPACITY)
        length = ctypes.c_int64()
        self._call(self.prefix + "heap_poisoned", int(heap_id), out, ERR_CAPACITY, ctypes.byref(length))
        return out.value.decode("utf-8", "replace")

    def bucket_free(self, heap_id: int, bucket_id: int) -> None:
        self._call(self.prefix + "bucket_free", int(heap_id), int(bucket_id))

    def bucket_zero_accumulator(self, heap_id: int, bucket_id: int, device: int) -> None:
        self._call(self.prefix + "bucket_zero_accumulator", int(heap_id), int(bucket_id), int(device))

    def bucket_register(self, heap_id: int, numel: int, dtype: str) -> int:
        bucket_id = ctypes.c_int64()
        self._call(self.prefix + "bucket_register", int(heap_id), int(numel), str(dtype).encode(),
                   ctypes.byref(bucket_id))
        return int(bucket_id.value)

    def _bucket_info(self, heap_id: int, bucket_id: int) -> tuple[int, int, int, int]:
        """(numel, shard_numel, master bytes, world) of a bucket, from the library's ``<prefix>bucket_info`` (the CUDA
        and NVSHMEM libraries; the MPI library keeps its sizes on the Python side instead)."""
        numel, shard_numel, master_bytes, world = c_i64(), c_i64(), c_i32(), c_i32()
        self._call(self.prefix + "bucket_info", int(heap_id), int(bucket_id), ctypes.byref(numel),
                   ctypes.byref(shard_numel), ctypes.byref(master_bytes), ctypes.byref(world))
        return numel.value, shard_numel.value, master_bytes.value, world.value

    def bucket_shard_numel(self, heap_id: int, bucket_id: int) -> int:
        return int(self._bucket_info(heap_id, bucket_id)[1])

    def _shard_nbytes(self, heap_id: int, bucket_id: int) -> int:
        _, shard_numel, master_bytes, _ = self._bucket_info(heap_id, bucket_id)
        return shard_numel * master_bytes

    def bucket_get_shard(self, heap_id: int, bucket_id: int, device: int) -> bytes:
        """Raw bytes of device `device`'s master shard (padded); the caller views them with the master dtype."""
        out = ctypes.create_string_buffer(self._shard_nbytes(heap_id, bucket_id))
        self._call(self.prefix + "bucket_get_shard", int(heap_id), int(bucket_id), int(device), out, len(out))
        return out.raw

    def bucket_set_shard(self, heap_id: int, bucket_id: int, device: int, data) -> None:
        """Writes device `device`'s master shard from a host buffer of exactly the shard's bytes."""
        if isinstance(data, (bytes, bytearray, memoryview)):
            raw = np.frombuffer(data, dtype=np.uint8)
        else:
            raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        self._call(self.prefix + "bucket_set_shard", int(heap_id), int(bucket_id), int(device),
                   raw.ctypes.data_as(ctypes.c_void_p), raw.nbytes)
