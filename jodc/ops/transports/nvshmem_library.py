"""The NVSHMEM backend: GPU heaps across nodes (``jodc/_ffi_nvshmem.so``, built from ``ffi/nvshmem/*.cu``).

One process per GPU, one NVSHMEM PE per process, PE p = mesh position p. NVSHMEM is initialised from a unique id that
process 0 creates and the others receive through the heap's
:class:`jodc.ops.transports.exchange.Exchange` (the jax.distributed
key-value store or MPI), so no NVSHMEM launcher is needed. Buckets live in NVSHMEM's symmetric heap; registering and
freeing are collective (every process, same order). The ops are registered as ``jodc_nvshmem_<op>`` for platform CUDA
and take the same operands as the other backends; ``jodc.ops._call.target`` picks them for ``transport='nvshmem'``.

The NVSHMEM library links ``libnvshmem_host.so.3`` from the ``nvidia-nvshmem-cu12`` / ``-cu13`` wheel; it is built
with ``JODC_NVSHMEM=1`` (setup.py) and compile-checked by ``make cuda-check``.
"""
from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

from jodc.ops.transports import c_library
from jodc.ops.transports.c_library import P, c_dbl, c_i32, c_i64, c_ptr, c_str, c_u64
from jodc.ops.transports.exchange import all_or_raise

LIBRARY_NAME = "_ffi_nvshmem.so"
BUILD_HINT = ("build it with `JODC_CUDA=1 JODC_NVSHMEM=1 pip install -e .` after `pip install nvidia-nvshmem-cu12` "
              "(or -cu13, matching nvcc)")

# The NVSHMEM library's own C functions, as name -> (restype, argtypes without the trailing error buffer, fallible).
# Its handlers come from its handler table (jodc_nvshmem_handlers, generated from ffi/common/ops.h).
_SIGNATURES = {
    "jodc_nvshmem_live_heaps": (c_i64, (), False),
    "jodc_nvshmem_unique_id": (c_i32, (c_str, c_i64, P(c_i64)), True),
    "jodc_nvshmem_init": (c_i32, (c_i32, c_i32, c_str, c_i64, c_i32), True),
    "jodc_nvshmem_heap_create": (c_i32, (c_i32, c_dbl, P(c_i64)), True),
    "jodc_nvshmem_heap_free": (c_i32, (c_i64,), True),
    "jodc_nvshmem_heap_set_barrier_timeout": (c_i32, (c_i64, c_dbl), True),
    "jodc_nvshmem_heap_abort": (c_i32, (c_i64, c_str), True),
    "jodc_nvshmem_heap_state": (c_i32, (c_i64, P(c_i32), P(c_i32), P(c_i32), P(c_u64), c_str, c_i64), True),
    "jodc_nvshmem_bucket_register": (c_i32, (c_i64, c_i64, c_str, P(c_i64)), True),
    "jodc_nvshmem_bucket_free": (c_i32, (c_i64, c_i64), True),
    "jodc_nvshmem_bucket_info": (c_i32, (c_i64, c_i64, P(c_i64), P(c_i64), P(c_i32), P(c_i32)), True),
    "jodc_nvshmem_bucket_access": (c_i32, (c_i64, c_i64, c_i32, c_i32, c_i32, c_ptr, c_i64), True),
}
# Every symbol the library exports: its C API and its handler table (the handlers themselves stay hidden).
EXPORTED_SYMBOLS = tuple(sorted({"jodc_nvshmem_handlers", *_SIGNATURES}))


def default_path() -> str:
    return os.path.join(c_library.PACKAGE_DIR, LIBRARY_NAME)


def _preload_host_library() -> None:
    """Loads libnvshmem_host.so.3 from the wheel globally (the rpath baked in at build time may point elsewhere)."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia.nvshmem")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "lib", "libnvshmem_host.so.3")
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return


class NvshmemLibrary(c_library.CLibrary):
    """The NVSHMEM library's C API behind the method names SymmetricHeap and Bucket use (host access reaches only
    this process's own position: the others live in other processes)."""

    prefix = "jodc_nvshmem_"
    transport = "nvshmem"
    shared_api = False
    max_world = 64

    def __init__(self, path: str):
        _preload_host_library()
        super().__init__(path, _SIGNATURES)

    # -- initialisation and heaps (collective) ----------------------------------------------------------------
    def unique_id(self) -> bytes:
        out, length = ctypes.create_string_buffer(1024), c_i64()
        self._call("jodc_nvshmem_unique_id", out, len(out), ctypes.byref(length))
        return out.raw[: length.value]

    def init(self, rank: int, nranks: int, unique_id: bytes, gpu: int) -> None:
        self._call("jodc_nvshmem_init", int(rank), int(nranks), bytes(unique_id), len(unique_id), int(gpu))

    def heap_create(self, deterministic: bool, barrier_timeout_s: float) -> int:
        heap_id = c_i64()
        self._call("jodc_nvshmem_heap_create", int(bool(deterministic)), float(barrier_timeout_s),
                   ctypes.byref(heap_id))
        return int(heap_id.value)

    def heap_abort(self, heap_id: int, reason: str) -> str:
        self._call("jodc_nvshmem_heap_abort", int(heap_id), str(reason).encode())
        return self.heap_poisoned(heap_id)

    def _state(self, heap_id: int):
        world, me, landing = c_i32(), c_i32(), c_i32()
        gens = (c_u64 * self.max_world)()
        poisoned = ctypes.create_string_buffer(c_library.ERR_CAPACITY)
        self._call("jodc_nvshmem_heap_state", int(heap_id), ctypes.byref(world), ctypes.byref(me),
                   ctypes.byref(landing), gens, poisoned, c_library.ERR_CAPACITY)
        return world.value, me.value, bool(landing.value), [int(gens[p]) for p in range(world.value)], \
            poisoned.value.decode("utf-8", "replace")

    def heap_generations(self, heap_id: int) -> list[int]:
        return self._state(heap_id)[3]

    def heap_poisoned(self, heap_id: int) -> str:
        return self._state(heap_id)[4]

    def heap_landing_slots(self, heap_id: int) -> bool:
        return self._state(heap_id)[2]

    # -- buckets ------------------------------------------------------------------------------------------------
    def bucket_get_shard(self, heap_id: int, bucket_id: int, device: int) -> bytes:
        out = ctypes.create_string_buffer(self._shard_nbytes(heap_id, bucket_id))
        self._call("jodc_nvshmem_bucket_access", int(heap_id), int(bucket_id), int(device), 0, 0, out, len(out))
        return out.raw

    def bucket_set_shard(self, heap_id: int, bucket_id: int, device: int, data) -> None:
        raw = np.ascontiguousarray(np.frombuffer(bytes(data), np.uint8) if isinstance(data, (bytes, bytearray))
                                   else np.asarray(data).reshape(-1).view(np.uint8))
        self._call("jodc_nvshmem_bucket_access", int(heap_id), int(bucket_id), int(device), 0, 1,
                   raw.ctypes.data_as(c_ptr), raw.nbytes)

    def bucket_get_accumulator(self, heap_id: int, bucket_id: int, device: int) -> bytes:
        out = np.zeros(self.bucket_shard_numel(heap_id, bucket_id), np.float32)
        self._call("jodc_nvshmem_bucket_access", int(heap_id), int(bucket_id), int(device), 1, 0,
                   out.ctypes.data_as(c_ptr), out.nbytes)
        return out.tobytes()

    def bucket_zero_accumulator(self, heap_id: int, bucket_id: int, device: int) -> None:
        n = self.bucket_shard_numel(heap_id, bucket_id)
        self._call("jodc_nvshmem_bucket_access", int(heap_id), int(bucket_id), int(device), 1, 1, None, n * 4)


_lock = threading.Lock()
_library: NvshmemLibrary | None = None
_initialized: tuple | None = None  # (rank, nranks) once NVSHMEM runs in this process


def library() -> NvshmemLibrary:
    """The NVSHMEM backend built into the package (loaded once); ImportError with build instructions if missing."""
    global _library
    with _lock:
        if _library is None:
            _library = c_library.load(
                NvshmemLibrary, default_path(),
                "this heap needs the NVSHMEM backend (its mesh spans nodes) but {path} is not built: " + BUILD_HINT,
                "jodc's NVSHMEM library {path} cannot be loaded ({error}): " + BUILD_HINT)
        return _library


def initialize(lib, exchange, rank: int, nranks: int, gpu: int) -> None:
    """Initialises NVSHMEM once per process: rank 0's unique id goes to everyone through `exchange` (collective)."""
    global _initialized
    if _initialized is not None:
        if _initialized != (rank, nranks):
            raise ValueError(f"NVSHMEM already runs here as PE {_initialized[0]} of {_initialized[1]}; a heap over "
                             f"another process layout (PE {rank} of {nranks}) cannot share it")
        return
    lib.init(rank, nranks, share_unique_id(lib, exchange), gpu)
    _initialized = (rank, nranks)


def share_unique_id(lib, exchange) -> bytes:
    """Exchange rank 0 makes NVSHMEM's unique id, everyone gets it (collective). PE numbers stay mesh positions."""
    uid = lib.unique_id() if exchange.rank == 0 else b""
    return exchange.allgather("nvshmem-uid", uid)[0]


class NvshmemHeap:
    """One process's side of an NVSHMEM heap (collective registration and freeing, like IpcHeap)."""

    def __init__(self, lib, exchange, heap_id: int):
        self.lib, self.exchange, self.heap_id = lib, exchange, heap_id

    def register(self, numel: int, dtype: str, name: str) -> int:
        mine = {"numel": int(numel), "dtype": str(dtype), "name": str(name)}
        everyone = all_or_raise(self.exchange, "nvshmem-bucket", mine)
        if len({(v["numel"], v["dtype"]) for v in everyone}) != 1:
            raise ValueError("processes registered different buckets (same order and sizes everywhere): " +
                             "; ".join(f"process {r}: {v['name']!r} of {v['numel']} {v['dtype']}"
                                       for r, v in enumerate(everyone)))
        return self.lib.bucket_register(self.heap_id, numel, dtype)

    def barrier(self, key: str) -> None:
        self.exchange.allgather(f"nvshmem-barrier-{key}", b"")
