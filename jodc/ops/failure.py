"""Failing fast when one device fails: wait for each device's results separately and abort the heap on the first error.

A barrier waits for every device of the heap. When one device's computation fails before it arrives (a native op
returned an error, a host callback raised), the others would wait for the whole barrier timeout. Native ops abort the
heap themselves when they fail; errors raised outside them (host callbacks, XLA's own errors) are seen only by the
host: the failing device's outputs become ready-with-error early while its peers still wait. So
:func:`block_until_ready` waits on every device's output shards in its own thread, and the first failure aborts the
heap (``SymmetricHeap.abort``): its waiting peers leave the barrier at once with "aborted: device k failed: <cause>".
A device that never arrives without failing is still reported by the barrier timeout.

Known gap: a device blocked in an XLA collective (e.g. a ``psum``) waiting for a failed peer cannot be woken by an
abort; the wait then gives up after :data:`ABORT_GRACE_S` and reports the cause anyway (XLA's CPU runtime ends the
process 40 s later: its rendezvous refuses to wait longer for a participant).
"""
from __future__ import annotations

import queue
import re
import threading

import jax

ABORT_GRACE_S = 10.0  # how long the other devices get to leave after an abort before the error is raised anyway


class DeviceFailed(RuntimeError):
    """A device's computation failed; its heap was aborted so the other devices failed too (not timed out).

    Attributes: ``device`` (position along the heap's axis, or -1 when unknown) and ``cause`` (a one-line summary of
    the first error); the original exception is chained as ``__cause__``."""

    def __init__(self, message: str, device: int, cause: str):
        super().__init__(message)
        self.device = device
        self.cause = cause


def summarize(error: BaseException) -> str:
    """One line for a (possibly multi-line, traceback-carrying) runtime error: its first line, plus its last line when
    that differs (a host callback's error ends with the Python exception, e.g. "ValueError: boom")."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    if len(lines) == 1:
        return lines[0]
    return f"{lines[0]} ... {lines[-1]}"


class _Waiters:
    """Reusable daemon threads for the per-device waits (starting threads for every step would cost about a
    millisecond). A job goes to an idle thread, or a new one; a thread stuck on a device that never finishes simply
    never becomes idle again, and daemon threads never hold up the interpreter's exit."""

    def __init__(self):
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue] = []

    def run(self, job) -> None:
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name="jodc-wait", daemon=True).start()
        inbox.put(job)

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            inbox.get()()
            with self._lock:
                self._idle.append(inbox)


_WAITERS = _Waiters()


def _shards_by_position(heap, outputs) -> dict[int, list]:
    """The single-device arrays of `outputs`, grouped by the heap position of their device (-1: not the heap's)."""
    groups: dict[int, list] = {}
    for leaf in jax.tree.leaves(outputs):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            groups.setdefault(heap.positions.get(shard.device, -1), []).append(shard.data)
    return groups


def block_until_ready(outputs, heap):
    """``jax.block_until_ready(outputs)`` that aborts `heap` on the first failed device and raises
    :class:`DeviceFailed` naming it and its cause. Ctrl-C while waiting aborts the heap too (then re-raises), so
    freeing it afterwards does not wait for a barrier timeout. Returns `outputs`."""
    groups = _shards_by_position(heap, outputs)
    done: queue.Queue = queue.Queue()

    def wait(position: int, arrays: list) -> None:
        try:
            for a in arrays:
                a.block_until_ready()
        except BaseException as e:  # noqa: BLE001 - reported to the waiting thread
            done.put((position, e))
            return
        done.put((position, None))

    for position, arrays in groups.items():
        _WAITERS.run(lambda position=position, arrays=arrays: wait(position, arrays))

    failure: tuple[int, BaseException] | None = None
    pending = len(groups)
    try:
        while pending:
            try:
                position, error = done.get(timeout=ABORT_GRACE_S if failure is not None else 0.5)
            except queue.Empty:
                if failure is not None:
                    break  # the others did not leave in time (e.g. blocked in an XLA collective): report anyway
                continue  # a short timeout keeps Ctrl-C responsive
            pending -= 1
            if error is not None and failure is None:
                failure = (position, error)
                who = f"device {position}" if position >= 0 else "a device outside the heap"
                heap.abort(f"{who} failed: {summarize(error)}")
    except KeyboardInterrupt:
        heap.abort("interrupted (KeyboardInterrupt) while waiting for the devices")
        raise
    if failure is not None:
        position, error = failure
        poison = heap.poisoned or summarize(error)
        # the first error seen may be a peer leaving the barrier; the poison names the device that failed first
        named = re.search(r"aborted: device (\d+) failed", poison)
        if named:
            position = int(named.group(1))
        raise DeviceFailed(f"heap {heap.id}: {poison}", position, summarize(error)) from error
    return outputs
