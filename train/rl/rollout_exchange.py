"""Assembling a rollout sampled in shares by the processes of a multi-process run (`mpirun`).

Each process samples and scores only its share of a step's prompts (the shares of its devices, `device_shares`);
`gather_shares` then gives every process every share, in process order, once per step: the token arrays are
all-gathered after sampling (so the planner, the advantages and the agreement check see the whole rollout as
before), while the sampling and the reward calls are not repeated. A process whose share failed sends its error
instead, and every process raises `RolloutShareError` naming it and its cause; a process that sends nothing within
`timeout_s` (hung, or gone under `mpirun --enable-recovery`) is named by a `RolloutShareError` in every process
that waited for it. Without `mpirun --enable-recovery` a process that dies ends the whole job at once (Open MPI).

Transport: MPI point-to-point on MPI_COMM_WORLD (mpi4py, already initialised by `jax.distributed`; MPI rank =
JAX process index), non-blocking and polled, so the wait can time out instead of hanging inside MPI.
"""
from __future__ import annotations

import pickle
import time
import traceback
from typing import Any, Callable

import numpy as np

_TAG_SIZE, _TAG_DATA = 7301, 7302  # message tags of the exchange (point-to-point: no other message uses them)
_POLL_S = 0.001
_ABANDONED: list = []  # buffers of exchanges that timed out, which MPI may still access


class RolloutShareError(RuntimeError):
    """A process's share of a rollout failed or did not arrive; raised in every process of the run."""


def allgather_bytes(payload: bytes, *, timeout_s: float | None, what: str, comm=None) -> list[bytes]:
    """Every process's `payload`, in process order (this process's own included). TimeoutError naming the
    processes that sent nothing within `timeout_s` seconds (None: wait forever)."""
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    data = np.frombuffer(payload, np.uint8)
    header = np.array([data.size], np.int64)
    peers = [p for p in range(size) if p != rank]
    sends = [comm.Isend(header, dest=p, tag=_TAG_SIZE) for p in peers]
    sends += [comm.Isend(data, dest=p, tag=_TAG_DATA) for p in peers]
    sizes = {p: np.zeros(1, np.int64) for p in peers}
    waiting = {p: ("size", comm.Irecv(sizes[p], source=p, tag=_TAG_SIZE)) for p in peers}
    received: dict[int, bytes] = {rank: payload}
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
                waiting[p] = ("data", comm.Irecv(buffers[p], source=p, tag=_TAG_DATA))
            else:
                received[p] = buffers.pop(p).tobytes()
                del waiting[p]
        if waiting and not progressed:
            if deadline is not None and time.monotonic() > deadline:
                for _, request in waiting.values():
                    request.Cancel()
                # the sends may still read these buffers: keep them alive (the run is failing anyway)
                _ABANDONED.append((header, data, buffers, sizes, sends))
                raise TimeoutError(f"{what}: process(es) {sorted(waiting)} sent nothing within {timeout_s:g} s")
            time.sleep(_POLL_S)
    for request in sends:
        request.Wait()
    return [received[p] for p in range(size)]


def gather_shares(produce: Callable[[], Any], *, what: str, timeout_s: float | None, comm=None) -> list[Any]:
    """Runs `produce()` (this process's share) and returns every process's share in process order. If any
    process's `produce` raised, or a process sent nothing within `timeout_s`, every process raises
    RolloutShareError naming the processes and their causes (this process's own error chained)."""
    own_error = None
    try:
        message = ("ok", produce())
    except Exception as e:  # noqa: BLE001 (sent to the other processes, then raised here too)
        own_error = e
        message = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    try:
        parts = [pickle.loads(b) for b in allgather_bytes(pickle.dumps(message), timeout_s=timeout_s, what=what,
                                                           comm=comm)]
    except TimeoutError as e:
        raise RolloutShareError(str(e)) from own_error
    failed = [(p, text) for p, (status, text) in enumerate(parts) if status == "error"]
    if failed:
        causes = "\n".join(f"process {p}: {text}" for p, text in failed)
        raise RolloutShareError(f"{what} failed in process(es) {[p for p, _ in failed]}:\n{causes}") from own_error
    return [value for _, value in parts]
