"""How the processes of a multi-process GPU heap talk while they set it up: an :class:`Exchange` (a collective
all-gather of bytes) over the ``jax.distributed`` key-value store, MPI, or threads of one process (tests), the
node identity that decides between CUDA IPC and NVSHMEM, and the validated all-gather both transports use
(`all_or_raise`: a process that fails makes every process raise its error instead of leaving the others waiting)."""
from __future__ import annotations

import base64
import json
import socket
import threading
from typing import Protocol, Sequence


class Exchange(Protocol):
    """Collective all-gather among the heap's processes: ``rank`` is this process's index among them (0..size-1)."""

    rank: int
    size: int

    def allgather(self, key: str, value: bytes) -> list[bytes]:
        """Every process's `value` for `key`, in rank order. Collective: all processes call it with the same key."""


class KeyValueExchange:
    """An :class:`Exchange` over the ``jax.distributed`` key-value store (no MPI needed)."""

    def __init__(self, client, rank: int, size: int, group: str, timeout_s: float = 600.0):
        self.client, self.rank, self.size, self.group = client, rank, size, group
        self.timeout_ms = int(timeout_s * 1000)
        self._seq = 0

    def allgather(self, key: str, value: bytes) -> list[bytes]:
        self._seq += 1
        prefix = f"jodc/{self.group}/{self._seq}/{key}"
        self.client.key_value_set(f"{prefix}/{self.rank}", base64.b64encode(value).decode())
        return [base64.b64decode(self.client.blocking_key_value_get(f"{prefix}/{r}", self.timeout_ms))
                for r in range(self.size)]


class MpiExchange:
    """An :class:`Exchange` over MPI: `ranks` are the MPI ranks of the heap's processes, in heap order."""

    def __init__(self, comm, ranks: Sequence[int]):
        self.ranks = list(ranks)
        self.comm = comm.Create_group(comm.group.Incl(self.ranks)) if len(self.ranks) != comm.size else comm
        self.rank, self.size = self.comm.rank, self.comm.size

    def allgather(self, key: str, value: bytes) -> list[bytes]:
        return list(self.comm.allgather(bytes(value)))


class LocalExchange:
    """An in-process :class:`Exchange` for tests: `size` threads, one exchange each, sharing one board."""

    def __init__(self, board: dict, rank: int, size: int):
        self.board, self.rank, self.size = board, rank, size
        self._seq = 0
        board.setdefault("_cv", threading.Condition())

    @classmethod
    def group(cls, size: int) -> list["LocalExchange"]:
        board: dict = {}
        return [cls(board, r, size) for r in range(size)]

    def allgather(self, key: str, value: bytes, timeout_s: float = 30.0) -> list[bytes]:
        self._seq += 1
        slot = (self._seq, key)
        cv = self.board["_cv"]
        with cv:
            self.board.setdefault(slot, {})[self.rank] = bytes(value)
            cv.notify_all()
            if not cv.wait_for(lambda: len(self.board[slot]) == self.size, timeout=timeout_s):
                raise TimeoutError(f"exchange {slot} timed out: ranks {sorted(self.board[slot])} of {self.size}")
            return [self.board[slot][r] for r in range(self.size)]


def node_id() -> str:
    """This machine's identity: hostname plus boot id (two containers with one hostname are not one node)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def default_exchange(processes: Sequence[int], group: str) -> Exchange:
    """The exchange among `processes` (JAX process indices): jax.distributed's key-value store when JAX runs several
    processes, else MPI. RuntimeError when neither is available."""
    import jax

    me = int(jax.process_index())
    if me not in processes:
        raise ValueError(f"process {me} holds no device of this mesh (its processes: {list(processes)})")
    try:
        from jax._src import distributed

        client = distributed.global_state.client
    except Exception:  # noqa: BLE001 - private API moved
        client = None
    if client is not None:
        return KeyValueExchange(client, list(processes).index(me), len(processes), group)
    try:
        from mpi4py import MPI
    except ImportError:
        MPI = None
    if MPI is not None and MPI.COMM_WORLD.size > 1:
        rank_of = {int(p): r for r, p in enumerate(MPI.COMM_WORLD.allgather(me))}
        return MpiExchange(MPI.COMM_WORLD, [rank_of[p] for p in processes])
    raise RuntimeError("a GPU heap across processes needs jax.distributed.initialize() (its key-value store carries "
                       "the CUDA IPC handles) or MPI (mpi4py)")


def _json(value) -> bytes:
    return json.dumps(value, sort_keys=True).encode()


def all_or_raise(exchange: Exchange, key: str, mine: dict) -> list[dict]:
    """All-gathers `mine` (a dict, with 'error' set on failure); raises the first process's error everywhere."""
    everyone = [json.loads(v) for v in exchange.allgather(key, _json(mine))]
    failed = [(r, v["error"]) for r, v in enumerate(everyone) if v.get("error")]
    if failed:
        rank, error = failed[0]
        raise RuntimeError(f"{key}: process {rank} of the heap failed: {error}")
    return everyone
