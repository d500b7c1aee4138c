"""Ctrl-C held back across work that must not be torn: a checkpoint save, the swap of an export into place.

Python raises KeyboardInterrupt wherever the main thread happens to be when SIGINT arrives. A checkpoint save runs
threading code there (orbax hands its file work to a thread pool from an event loop), and an interrupt inside a
lock's wait can leave the lock released that the code then releases again: the run ends with "RuntimeError: release
unlocked lock" instead of KeyboardInterrupt, so the trainer neither recognises the interrupt nor says which
checkpoint is the latest (seen on CI: Ctrl-C during the RL trainer's scheduled save). An interrupt between the two
renames that swap a new export into place would leave the earlier export under another name.

`interrupts_held(what)` lets the block finish first: a Ctrl-C inside it is recorded (and one line on stderr says
what is being finished), and KeyboardInterrupt is raised when the block is done, so the save is complete and the
trainer reports it as the latest checkpoint. A second Ctrl-C raises at once (the user chose to abandon the work: a
save torn then is never taken for a checkpoint, orbax renames it into place only when complete).

It acts only in the main thread (where Python runs signal handlers) and only while SIGINT has Python's own handler
(`signal.default_int_handler`): a program that handles or ignores SIGINT itself keeps its choice. Nested blocks
leave the outermost one in charge.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def interrupts_held(what: str) -> Iterator[None]:
    """Runs the block with Ctrl-C held back until it ends (module docstring); `what` names the work in the notice."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    received: list[int] = []

    def record(signum, frame) -> None:
        if received:
            raise KeyboardInterrupt  # the second Ctrl-C: stop waiting
        received.append(signum)
        # not print(): the main thread may be inside a write to sys.stderr (a reentrant call would fail)
        os.write(2, f"\nCtrl-C: finishing {what} first (press Ctrl-C again to abandon it)\n".encode())

    previous = signal.signal(signal.SIGINT, record)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt
