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

from jodc.ops.transports import c_library
from jodc.ops.transports.c_library import P, c_dbl, c_i32, c_i64, c_ptr, c_str

LIBRARY_NAME = "_ffi_cuda.so"
BUILD_HINT = "build it with `JODC_CUDA=1 pip install -e .` or `make native JODC_CUDA=1` (needs nvcc)"

_ERR_CAPACITY = c_library.ERR_CAPACITY

# The CUDA library's own C functions (those both libraries have: c_library.shared_signatures), as
# name -> (restype, argtypes without the trailing error buffer, fallible).
_SIGNATURES = {
    "jodc_cuda_device_count": (c_i32, (P(c_i32),), True),
    "jodc_cuda_heap_create": (c_i32, (c_i32, c_i32, c_dbl, P(c_i32), c_i32, P(c_i64)), True),
    "jodc_cuda_heap_placement": (c_i32, (c_i64, P(c_i32), c_i32, P(c_i32)), True),
    "jodc_cuda_heap_abort": (c_i32, (c_i64, c_str, c_str, c_i64), True),
    "jodc_cuda_heap_landing_slots": (c_i32, (c_i64, P(c_i32)), True),
    "jodc_cuda_bucket_info": (c_i32, (c_i64, c_i64, P(c_i64), P(c_i64), P(c_i32), P(c_i32)), True),
    # diagnostics (ffi/cuda/diagnostics.cu)
    "jodc_cuda_versions": (c_i32, (P(c_i32), P(c_i32)), True),
    "jodc_cuda_device_info": (c_i32, (c_i32, c_str, c_i64, P(c_i32), P(c_i32), P(c_i64)), True),
    "jodc_cuda_peer_info": (c_i32, (c_i32, c_i32, P(c_i32), P(c_i32)), True),
    "jodc_cuda_context_device": (c_i32, (P(c_i32),), True),
    "jodc_cuda_primary_context_active": (c_i32, (c_i32, P(c_i32)), True),
    # CUDA IPC: heaps across the processes of one node (ffi/cuda/ipc.cu, jodc/ops/transports/cuda_ipc.py)
    "jodc_cuda_pci_bus_id": (c_i32, (c_i32, c_str, c_i64), True),
    "jodc_cuda_ipc_links": (c_i32, (c_i32, c_str, P(c_i32), P(c_i32)), True),
    "jodc_cuda_ipc_heap_create": (c_i32, (c_i32, c_i32, c_i32, c_dbl, c_i32, c_i32, c_str, c_i32, P(c_i64)), True),
    "jodc_cuda_ipc_unlink": (c_i32, (c_str,), True),
    "jodc_cuda_ipc_bucket_register": (c_i32, (c_i64, c_i64, c_str, P(c_i64), c_str, c_i64), True),
    "jodc_cuda_ipc_bucket_import": (c_i32, (c_i64, c_i64, c_i32, c_str, c_i64), True),
    "jodc_cuda_ipc_bucket_publish": (c_i32, (c_i64, c_i64), True),
}

IPC_HANDLES_BYTES = 3 * 64  # per position and bucket: shard, accumulator, landing slots

# Every symbol the library exports: its C API and its handler table (the handlers themselves stay hidden).
EXPORTED_SYMBOLS = tuple(sorted({"jodc_cuda_handlers", *_SIGNATURES, *c_library.shared_signatures("jodc_cuda_")}))


def default_path() -> str:
    """Where the build puts the library: next to the ``jodc`` package."""
    return os.path.join(c_library.PACKAGE_DIR, LIBRARY_NAME)


class CudaLibrary(c_library.CLibrary):
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
    def heap_create(self, world: int, deterministic: bool, barrier_timeout_s: float, placement=None) -> int:
        """A heap of `world` positions; position p's memory on CUDA device ``placement[p]`` (the mesh's GPUs). Only
        those GPUs are touched. ``placement=None``: position p on visible GPU ``p % count`` (tests that drive the
        handlers by hand). The placement never changes afterwards."""
        gpus = [] if placement is None else [int(g) for g in placement]
        array = (c_i32 * max(len(gpus), 1))(*gpus)
        heap_id = c_i64()
        self._call("jodc_cuda_heap_create", int(world), int(bool(deterministic)), float(barrier_timeout_s), array,
                   len(gpus), ctypes.byref(heap_id))
        return int(heap_id.value)

    def heap_placement(self, heap_id: int) -> list[int]:
        """The CUDA device of each position."""
        out = (c_i32 * self.max_world)()
        world = c_i32()
        self._call("jodc_cuda_heap_placement", int(heap_id), out, self.max_world, ctypes.byref(world))
        return [int(out[p]) for p in range(world.value)]

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
    def bucket_get_accumulator(self, heap_id: int, bucket_id: int, device: int) -> bytes:
        """Raw bytes (fp32) of device `device`'s accumulated gradient, landing slots reduced in source order."""
        shard_numel = self.bucket_shard_numel(heap_id, bucket_id)
        out = np.zeros(shard_numel, np.float32)
        self._call("jodc_cuda_bucket_get_accumulator", int(heap_id), int(bucket_id), int(device),
                   out.ctypes.data_as(c_ptr), shard_numel)
        return out.tobytes()


    # -- diagnostics (the GPU runner's report, tests) -------------------------------------------------------------
    def versions(self) -> tuple[int, int]:
        """(driver, runtime) CUDA versions as 1000 * major + 10 * minor; driver 0 when none is installed."""
        driver, runtime = c_i32(), c_i32()
        self._call("jodc_cuda_versions", ctypes.byref(driver), ctypes.byref(runtime))
        return int(driver.value), int(runtime.value)

    def device_info(self, gpu: int) -> dict:
        """{'name', 'compute_capability': (major, minor), 'total_bytes'} of CUDA device `gpu`."""
        name = ctypes.create_string_buffer(256)
        major, minor, total = c_i32(), c_i32(), c_i64()
        self._call("jodc_cuda_device_info", int(gpu), name, len(name), ctypes.byref(major), ctypes.byref(minor),
                   ctypes.byref(total))
        return {"name": name.value.decode("utf-8", "replace"), "compute_capability": (major.value, minor.value),
                "total_bytes": int(total.value)}

    def peer_info(self, a: int, b: int) -> tuple[bool, bool]:
        """(GPU a can access GPU b's memory directly, native atomics work over their link)."""
        access, atomics = c_i32(), c_i32()
        self._call("jodc_cuda_peer_info", int(a), int(b), ctypes.byref(access), ctypes.byref(atomics))
        return bool(access.value), bool(atomics.value)

    def context_device(self) -> int:
        """The device of the calling thread's current CUDA context; -1 when none is current."""
        device = c_i32()
        self._call("jodc_cuda_context_device", ctypes.byref(device))
        return int(device.value)

    def primary_context_active(self, gpu: int) -> bool:
        """Whether GPU `gpu`'s primary context exists in this process (someone used that GPU)."""
        active = c_i32()
        self._call("jodc_cuda_primary_context_active", int(gpu), ctypes.byref(active))
        return bool(active.value)

    # -- CUDA IPC (multi-process heaps on one node; driven by jodc.ops.transports.cuda_ipc) -------------------------
    def pci_bus_id(self, gpu: int) -> str:
        out = ctypes.create_string_buffer(64)
        self._call("jodc_cuda_pci_bus_id", int(gpu), out, len(out))
        return out.value.decode()

    def ipc_links(self, gpu: int, peers: str) -> tuple[bool, bool]:
        """(GPU `gpu` reaches every peer GPU (PCI bus ids, one per line) directly, native atomics on every link)."""
        access, atomics = c_i32(), c_i32()
        self._call("jodc_cuda_ipc_links", int(gpu), str(peers).encode(), ctypes.byref(access), ctypes.byref(atomics))
        return bool(access.value), bool(atomics.value)

    def ipc_heap_create(self, world: int, deterministic: bool, landing_slots: bool, barrier_timeout_s: float,
                        position: int, gpu: int, shm_name: str, create: bool) -> int:
        heap_id = c_i64()
        self._call("jodc_cuda_ipc_heap_create", int(world), int(bool(deterministic)), int(bool(landing_slots)),
                   float(barrier_timeout_s), int(position), int(gpu), str(shm_name).encode(), int(bool(create)),
                   ctypes.byref(heap_id))
        return int(heap_id.value)

    def ipc_unlink(self, shm_name: str) -> None:
        self._call("jodc_cuda_ipc_unlink", str(shm_name).encode())

    def ipc_bucket_register(self, heap_id: int, numel: int, dtype: str) -> tuple[int, bytes]:
        """Allocates this process's position of a new (pending) bucket; returns (bucket id, its IPC handles)."""
        bucket_id = c_i64()
        handles = ctypes.create_string_buffer(IPC_HANDLES_BYTES)
        self._call("jodc_cuda_ipc_bucket_register", int(heap_id), int(numel), str(dtype).encode(),
                   ctypes.byref(bucket_id), handles, IPC_HANDLES_BYTES)
        return int(bucket_id.value), handles.raw

    def ipc_bucket_import(self, heap_id: int, bucket_id: int, position: int, handles: bytes) -> None:
        handles = bytes(handles)
        self._call("jodc_cuda_ipc_bucket_import", int(heap_id), int(bucket_id), int(position), handles, len(handles))

    def ipc_bucket_publish(self, heap_id: int, bucket_id: int) -> None:
        self._call("jodc_cuda_ipc_bucket_publish", int(heap_id), int(bucket_id))


# The PJRT client option that replaces XLA's default GPU client (see jax's cuda plugin: parsed as bool(int(value))).
TFRT_CLIENT_ENV = "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT"


def tfrt_client_requested(environ=None) -> bool:
    """Whether this process asked JAX for the TFRT GPU client (the same parsing as jax's cuda plugin)."""
    value = (os.environ if environ is None else environ).get(TFRT_CLIENT_ENV, "0").strip() or "0"
    try:
        return bool(int(value))
    except ValueError:
        return False  # jax itself refuses such a value when it creates the client


def check_pjrt_client(environ=None) -> None:
    """Refuses PJRT GPU clients under which the CUDA barrier could deadlock, before any heap exists.

    The barrier handler waits on the host for its kernel (that is how a timeout becomes an error of the barrier
    call). That is safe when every GPU's part of a launch is enqueued from its own thread, as XLA's default GPU client
    does; the TFRT GPU client (``XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1``) gives no such guarantee: device 0 waiting
    in its barrier could keep device 1's barrier from ever being launched, and every step would end in a timeout.
    """
    if tfrt_client_requested(environ):
        raise ValueError(
            f"jodc's CUDA ops do not support the TFRT GPU client ({TFRT_CLIENT_ENV}=1): their barrier blocks one "
            f"launch thread per GPU until every GPU arrives, and that client does not guarantee one launch thread per "
            f"GPU, so the barrier could deadlock until its timeout. Unset {TFRT_CLIENT_ENV} (or set it to 0) to use "
            f"XLA's default GPU client")


def placement_of(devices) -> list[int]:
    """The CUDA device ordinal of each mesh position (``device.local_hardware_id``), checked: one distinct GPU per
    position. ValueError naming the problem otherwise."""
    gpus = []
    for p, d in enumerate(devices):
        hw = getattr(d, "local_hardware_id", None)
        if hw is None or int(hw) < 0:
            raise ValueError(f"device {d} at position {p} has no local CUDA ordinal (local_hardware_id): a CUDA heap "
                             f"needs this process's GPUs")
        gpus.append(int(hw))
    seen = {}
    for p, g in enumerate(gpus):
        if g in seen:
            raise ValueError(f"positions {seen[g]} and {p} of the mesh are both CUDA device {g}: every position of a "
                             f"CUDA heap needs its own GPU")
        seen[g] = p
    return gpus


_lock = threading.Lock()
_library: CudaLibrary | None = None


def library() -> CudaLibrary:
    """The CUDA backend built into the package (loaded once); ImportError with build instructions if missing."""
    global _library
    with _lock:
        if _library is None:
            _library = c_library.load(
                CudaLibrary, default_path(), "jodc's CUDA library {path} is not built: " + BUILD_HINT,
                "jodc's CUDA library {path} cannot be loaded ({error}); rebuild it: " + BUILD_HINT)
        return _library
