"""GPU heaps across the processes of one node: the CUDA IPC handle exchange (the choice of transport: `choice`).

A GPU mesh of one process uses the in-process heap (peer pointers, ``transport='local'``). A mesh spanning several
processes on one node (the common launch: one process per GPU) uses CUDA IPC (``'cuda_ipc'``): every process
allocates its own position's memory, exports CUDA IPC handles, and maps everyone else's, so the kernels keep using
peer pointers (ffi/cuda/ipc.cu). Processes may also share one GPU (CUDA maps another process's allocation on the same
device; the GPU time-slices between them, so this serves tests, not speed): their XLA memory pools must then leave
room for the heap (see :func:`shared_gpu_warnings`). A mesh spanning several nodes needs NVSHMEM (``'nvshmem'``,
jodc/ops/transports/nvshmem_library.py).

The processes talk through an :class:`Exchange`: the ``jax.distributed`` key-value store when JAX was initialised for
several processes, else MPI (``mpi4py``). The protocol is collective (every process of the heap makes the same calls
in the same order) and validated: a process that fails or disagrees (a different bucket size, order or dtype) makes
every process raise the same error instead of leaving the others waiting.
"""
from __future__ import annotations

import os
import secrets
import warnings
from typing import Sequence

from jodc.ops.transports.exchange import Exchange, all_or_raise, node_id

HANDLE_BYTES = 64 * 3  # per position and bucket: shard, accumulator, landing slots (ffi/cuda/ipc.cu)


# The environment variables that size a JAX process's XLA memory pool on its GPU (read by jax's CUDA plugin).
PREALLOCATE_ENV = "XLA_PYTHON_CLIENT_PREALLOCATE"
MEM_FRACTION_ENVS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # the newer name first
ALLOCATOR_ENV = "XLA_PYTHON_CLIENT_ALLOCATOR"
DEFAULT_POOL_FRACTION = 0.75
# What processes sharing a GPU must leave outside their XLA pools for the heap's buckets (allocated with cudaMalloc).
MIN_FREE_FRACTION_OF_SHARED_GPU = 0.1


def xla_pool_fraction(environ=None) -> float:
    """The fraction of its GPU this process's XLA pool takes at start-up (jax's CUDA plugin's parsing of the
    environment): 0 when the pool grows on demand (``XLA_PYTHON_CLIENT_PREALLOCATE=false``) or there is none (the
    'platform' allocator); else the memory fraction (default 0.75)."""
    env = os.environ if environ is None else environ
    if env.get(ALLOCATOR_ENV, "").strip().lower() == "platform":
        return 0.0
    if env.get(PREALLOCATE_ENV, "").strip() in ("false", "False", "0"):
        return 0.0
    for name in MEM_FRACTION_ENVS:
        value = env.get(name, "").strip()
        if value:
            try:
                return float(value)
            except ValueError:
                return DEFAULT_POOL_FRACTION  # jax itself refuses such a value when it creates the client
    return DEFAULT_POOL_FRACTION


def positions_by_gpu(everyone: Sequence[dict]) -> dict[str, list[int]]:
    """PCI bus id -> the sorted heap positions whose processes run on that GPU (several when processes share one)."""
    by_gpu: dict[str, list[int]] = {}
    for v in everyone:
        by_gpu.setdefault(v["pci"], []).append(int(v["position"]))
    return {pci: sorted(ps) for pci, ps in by_gpu.items()}


def shared_gpu_warnings(everyone: Sequence[dict]) -> list[str]:
    """One message per GPU that several processes of the heap share while their XLA pools, preallocated at start-up
    (each process's ``xla_pool`` fraction), leave less than 10% of it: the buckets are allocated outside the pools, so
    registering them would fail for lack of memory."""
    messages = []
    pools = {int(v["position"]): float(v.get("xla_pool", 0.0)) for v in everyone}
    for pci, positions in sorted(positions_by_gpu(everyone).items()):
        taken = sum(pools[p] for p in positions)
        if len(positions) > 1 and taken > 1.0 - MIN_FREE_FRACTION_OF_SHARED_GPU:
            share = (1.0 - 2 * MIN_FREE_FRACTION_OF_SHARED_GPU) / len(positions)
            messages.append(
                f"GPU {pci} is shared by the processes of positions {positions}, whose XLA memory pools take "
                f"{taken:.0%} of it at start-up: the heap's buckets live outside those pools and may not fit. Start "
                f"each process with {PREALLOCATE_ENV}=false, or with XLA_PYTHON_CLIENT_MEM_FRACTION={share:.2f} or "
                f"less")
    return messages


class IpcHeap:
    """One process's side of a CUDA IPC heap: its position and GPU, the library, the exchange."""

    def __init__(self, lib, exchange: Exchange, heap_id: int, positions: Sequence[int], position: int, gpu: int,
                 gpu_sharing: dict[str, list[int]] | None = None):
        self.lib, self.exchange, self.heap_id = lib, exchange, heap_id
        self.positions = list(positions)  # positions[r]: the position of the process of exchange rank r
        self.world, self.position, self.gpu = len(self.positions), position, gpu
        self.gpu_sharing = dict(gpu_sharing or {})  # PCI bus id -> the positions running on that GPU
        self._registered = 0

    @property
    def shared_gpu(self) -> bool:
        """Whether another process of the heap runs on this process's GPU."""
        return any(self.position in ps and len(ps) > 1 for ps in self.gpu_sharing.values())

    @classmethod
    def create(cls, lib, exchange: Exchange, world: int, position: int, gpu: int, deterministic: bool,
               barrier_timeout_s: float, environ=None) -> "IpcHeap":
        """Collective: every process of the heap calls this with its own position and GPU. Processes may share a GPU
        (warned about when their XLA pools leave it too little memory: `environ` is this process's environment)."""
        mine = {"position": position, "gpu": gpu, "node": node_id(), "pid": os.getpid(),
                "xla_pool": xla_pool_fraction(environ)}
        try:
            mine["pci"] = lib.pci_bus_id(gpu)
        except Exception as e:  # noqa: BLE001 - reported to every process below
            mine["error"] = f"GPU {gpu}: {e}"
        everyone = all_or_raise(exchange, "ipc-heap-info", mine)
        positions = sorted(v["position"] for v in everyone)
        if positions != list(range(world)):
            raise ValueError(f"a CUDA IPC heap of {world} positions needs one position per process, got positions "
                             f"{positions} from {exchange.size} processes")
        nodes = sorted({v["node"] for v in everyone})
        if len(nodes) != 1:
            raise ValueError(f"a CUDA IPC heap needs every process on one node, got {nodes}")
        for message in shared_gpu_warnings(everyone):
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        links = {"access": True, "atomics": True}
        try:
            # the other GPUs only: memory of processes on this GPU is local memory (no link, native atomics)
            peers = "\n".join(sorted({v["pci"] for v in everyone} - {mine["pci"]}))
            links["access"], links["atomics"] = lib.ipc_links(gpu, peers)
        except Exception as e:  # noqa: BLE001
            links["error"] = f"GPU {gpu}: {e}"
        all_links = all_or_raise(exchange, "ipc-heap-links", links)
        no_access = [everyone[r]["position"] for r, v in enumerate(all_links) if not v["access"]]
        if no_access:
            raise ValueError(f"the GPUs of positions {no_access} cannot access every other GPU of the heap directly "
                             f"(no NVLink or PCIe P2P): CUDA IPC needs peer access between all of them")
        landing = bool(deterministic) or not all(v["atomics"] for v in all_links)
        owner = next(r for r, v in enumerate(everyone) if v["position"] == 0)
        name = f"/jodc-{everyone[owner]['pid']}-{secrets.token_hex(6)}" if exchange.rank == owner else ""
        names = [n.decode() for n in exchange.allgather("ipc-heap-name", name.encode())]
        name = names[owner]
        # the owner creates the shared control block first, then everyone else opens it, then its name goes away
        status = {}
        heap_id = None
        if exchange.rank == owner:
            try:
                heap_id = lib.ipc_heap_create(world, deterministic, landing, barrier_timeout_s, position, gpu, name,
                                              True)
            except Exception as e:  # noqa: BLE001
                status["error"] = str(e)
        all_or_raise(exchange, "ipc-heap-created", status)
        status = {}
        if exchange.rank != owner:
            try:
                heap_id = lib.ipc_heap_create(world, deterministic, landing, barrier_timeout_s, position, gpu, name,
                                              False)
            except Exception as e:  # noqa: BLE001
                status["error"] = str(e)
        try:
            all_or_raise(exchange, "ipc-heap-opened", status)
        except Exception:
            if heap_id is not None:
                lib.heap_free(heap_id)
            raise
        finally:
            if exchange.rank == owner:
                try:
                    lib.ipc_unlink(name)
                except Exception:  # noqa: BLE001 - already gone: nothing to clean up
                    pass
        return cls(lib, exchange, heap_id, [v["position"] for v in everyone], position, gpu, positions_by_gpu(everyone))

    def register(self, numel: int, dtype: str, name: str) -> int:
        """Collective: registers the next bucket everywhere; returns this process's bucket id. Every process must
        register the same buckets in the same order (checked: a mismatch raises everywhere)."""
        self._registered += 1
        mine = {"seq": self._registered, "numel": int(numel), "dtype": str(dtype), "name": str(name)}
        bucket_id = None
        try:
            bucket_id, handles = self.lib.ipc_bucket_register(self.heap_id, numel, dtype)
            mine["handles"] = handles.hex()
        except MemoryError as e:
            mine["error"] = f"out of GPU memory on position {self.position}: {e}"
        except Exception as e:  # noqa: BLE001
            mine["error"] = f"position {self.position}: {e}"
        try:
            everyone = all_or_raise(self.exchange, "ipc-bucket", mine)
            shapes = {(v["seq"], v["numel"], v["dtype"]) for v in everyone}
            if len(shapes) != 1:
                described = [f"process {r}: bucket #{v['seq']} {v['name']!r} of {v['numel']} {v['dtype']}"
                             for r, v in enumerate(everyone)]
                raise ValueError("processes registered different buckets (same order and sizes everywhere): " +
                                 "; ".join(described))
            status = {}
            try:
                for r, v in enumerate(everyone):
                    if r != self.exchange.rank:
                        self.lib.ipc_bucket_import(self.heap_id, bucket_id, self.positions[r],
                                                   bytes.fromhex(v["handles"]))
                self.lib.ipc_bucket_publish(self.heap_id, bucket_id)
            except Exception as e:  # noqa: BLE001
                status["error"] = f"position {self.position}: {e}"
            all_or_raise(self.exchange, "ipc-bucket-ready", status)
        except Exception:
            if bucket_id is not None:
                self.lib.bucket_free(self.heap_id, bucket_id)
            raise
        return bucket_id

    def barrier(self, key: str) -> None:
        """Every process reaches this point before any goes on (before memory that peers map is freed)."""
        self.exchange.allgather(f"ipc-barrier-{key}", b"")


# ---- SymmetricHeap's entry point --------------------------------------------------------------------------------


def local_position(along_axis, process: int) -> tuple[int, object]:
    """(position, device) of `process`'s one device along the heap's axis; ValueError unless it has exactly one."""
    mine = [(p, d) for p, d in enumerate(along_axis) if int(d.process_index) == int(process)]
    if len(mine) != 1:
        raise ValueError(f"a GPU heap across processes needs exactly one GPU per process on the heap's axis (launch one "
                         f"process per GPU); process {process} has positions {[p for p, _ in mine]}")
    return mine[0]
