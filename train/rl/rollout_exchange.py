"""Exchanges between the processes of a multi-process run (`mpirun`) while they sample and assemble a rollout.

Each process samples and scores only its share of a step's prompts (the shares of its devices, `device_shares`).
`gather_shares` gives every process every process's value (a share, or with `rollout.assembly: sharded` only the
share's metadata, `assembly.py`), in process order, once per step; `exchange` sends each process its own value
(the training sequences the plan puts on its devices). Either way the sampling and the reward calls are not
repeated. A process whose part failed sends its error instead, and every process raises `RolloutShareError`
naming it and its cause; a process that sends nothing within `timeout_s` (hung, or gone under
`mpirun --enable-recovery`) is named by a `RolloutShareError` in every process that waited for it. Without
`mpirun --enable-recovery` a process that dies ends the whole job at once (Open MPI). `bytes_received` counts
what this process received, for the step record and the benchmark.

Transport: MPI point-to-point on MPI_COMM_WORLD (mpi4py, already initialised by `jax.distributed`; MPI rank =
JAX process index), non-blocking and polled, so the wait can time out instead of hanging inside MPI. Exchanges that
may run at the same time (the sampler thread's, the trainer's) use different message tags.
"""
from __future__ import annotations

import pickle
import threading
import time
import traceback
from typing import Any, Callable, Sequence

import numpy as np

_POLL_S = 0.001
_ABANDONED: list = []  # buffers of exchanges that timed out, which MPI may still access
SHARE_TAGS = (7301, 7302)  # the sampler's exchange of each rollout's shares (the sampler thread, asynchronously)
ASSEMBLY_TAGS = (7303, 7304)  # the trainer's exchanges while it assembles a step's minibatches (train/rl/assembly.py)
CHECKPOINT_TAGS = (7305, 7306)  # the trainer's gathering of the rollouts sampled ahead into a checkpoint
EVALUATION_TAGS = (7307, 7308)  # the trainer's exchange of the held-out evaluation's rewards (RLRun.evaluate)
_received = [0]  # bytes this process received from the others over all exchanges (`bytes_received`)
_received_lock = threading.Lock()


def bytes_received() -> int:
    """Bytes this process has received from the other processes by all exchanges so far (headers included): the
    difference over a step is what the step's rollout and its assembly cost in traffic."""
    with _received_lock:
        return _received[0]


def _count_received(n: int) -> None:
    with _received_lock:
        _received[0] += n


class RolloutShareError(RuntimeError):
    """A process's share of a rollout failed or did not arrive; raised in every process of the run."""


def allgather_bytes(payload: bytes, *, timeout_s: float | None, what: str, comm=None,
                    tags: tuple[int, int] = SHARE_TAGS) -> list[bytes]:
    """Every process's `payload`, in process order (this process's own included). TimeoutError naming the
    processes that sent nothing within `timeout_s` seconds (None: wait forever)."""
    size = _world(comm).Get_size()
    return alltoall_bytes([payload] * size, timeout_s=timeout_s, what=what, comm=comm, tags=tags)


def alltoall_bytes(payloads: Sequence[bytes], *, timeout_s: float | None, what: str, comm=None,
                   tags: tuple[int, int] = SHARE_TAGS) -> list[bytes]:
    """Sends `payloads[p]` to process p (one message to every other process, empty ones included, so that a process
    always hears from every other one) and returns what each process sent this one, in process order (this
    process's own `payloads[rank]` at its place). TimeoutError naming the processes that sent nothing within
    `timeout_s` seconds (None: wait forever). `tags`: (size tag, data tag); exchanges that may run at the same time
    in two threads (the sampler thread's and the trainer's) must use different tags."""
    comm = _world(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    if len(payloads) != size:
        raise ValueError(f"{what}: {len(payloads)} payloads for {size} processes")
    size_tag, data_tag = tags
    peers = [p for p in range(size) if p != rank]
    data = {p: np.frombuffer(payloads[p], np.uint8) for p in peers}
    headers = {p: np.array([data[p].size], np.int64) for p in peers}
    sends = [comm.Isend(headers[p], dest=p, tag=size_tag) for p in peers]
    sends += [comm.Isend(data[p], dest=p, tag=data_tag) for p in peers]
    sizes = {p: np.zeros(1, np.int64) for p in peers}
    waiting = {p: ("size", comm.Irecv(sizes[p], source=p, tag=size_tag)) for p in peers}
    received: dict[int, bytes] = {rank: payloads[rank]}
    buffers: dict[int, np.ndarray] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while waiting:
        progressed = False
        for p, (stage, request) in list(waiting.items()):
            if not request.Test():
                continue
            progressed = True
            if stage == "size":
                buffers[p] = np.empty(int(sizes[p][0]), np.uint8)
                waiting[p] = ("data", comm.Irecv(buffers[p], source=p, tag=data_tag))
            else:
                received[p] = buffers.pop(p).tobytes()
                del waiting[p]
                _count_received(headers[p].nbytes + len(received[p]))
        if waiting and not progressed:
            if deadline is not None and time.monotonic() > deadline:
                for _, request in waiting.values():
                    request.Cancel()
                # the sends may still read these buffers: keep them alive (the run is failing anyway)
                _ABANDONED.append((headers, data, buffers, sizes, sends))
                raise TimeoutError(f"{what}: process(es) {sorted(waiting)} sent nothing within {timeout_s:g} s")
            time.sleep(_POLL_S)
    for request in sends:
        request.Wait()
    return [received[p] for p in range(size)]


def _world(comm):
    """`comm`, or MPI_COMM_WORLD (MPI rank = JAX process index)."""
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    return comm


def gather_shares(produce: Callable[[], Any], *, what: str, timeout_s: float | None, comm=None,
                  tags: tuple[int, int] = SHARE_TAGS) -> list[Any]:
    """Runs `produce()` (this process's share) and returns every process's share in process order. If any
    process's `produce` raised, or a process sent nothing within `timeout_s`, every process raises
    RolloutShareError naming the processes and their causes (this process's own error chained)."""
    return exchange(lambda: [produce()] * _world(comm).Get_size(), what=what, timeout_s=timeout_s, comm=comm,
                    tags=tags, same_for_all=True)


def exchange(produce: Callable[[], Sequence[Any]], *, what: str, timeout_s: float | None, comm=None,
             tags: tuple[int, int] = SHARE_TAGS, same_for_all: bool = False) -> list[Any]:
    """Runs `produce()` -> one value per process (value p goes to process p; this process's own stays here) and
    returns what every process produced for this one, in process order. The error semantics of `gather_shares`:
    if any process's `produce` raised, or a process sent nothing within `timeout_s`, every process raises
    RolloutShareError naming the processes and their causes (this process's own error chained).
    `same_for_all`: every value is the same object (pickled once)."""
    size = _world(comm).Get_size()
    own_error = None
    try:
        values = list(produce())
        if len(values) != size:
            raise ValueError(f"{what}: produced {len(values)} values for {size} processes")
        if same_for_all:
            payload = pickle.dumps(("ok", values[0]))
            payloads = [payload] * size
        else:
            payloads = [pickle.dumps(("ok", v)) for v in values]
    except Exception as e:  # noqa: BLE001 (sent to the other processes, then raised here too)
        own_error = e
        payloads = [pickle.dumps(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))] * size
    try:
        raw = alltoall_bytes(payloads, timeout_s=timeout_s, what=what, comm=comm, tags=tags)
    except TimeoutError as e:
        raise RolloutShareError(str(e)) from own_error
    parts = [pickle.loads(b) for b in raw]
    failed = [(p, text) for p, (status, text) in enumerate(parts) if status == "error"]
    if failed:
        causes = "\n".join(f"process {p}: {text}" for p, text in failed)
        raise RolloutShareError(f"{what} failed in process(es) {[p for p, _ in failed]}:\n{causes}") from own_error
    return [value for _, value in parts]
