"""Stop requests from a scheduler: SIGTERM, what SLURM, Kubernetes and most batch systems send before SIGKILL.

A run handles it as it handles Ctrl-C between steps, but without losing the step under way: that step finishes,
it is checkpointed, and the run stops with `Preempted` (the `jodc-train` CLI then exits with status 143, the
status of a process ended by SIGTERM, so the scheduler sees a terminated job, not a finished one; rerunning the
same command resumes from that checkpoint).

* One process: `PreemptionWatch` installs a SIGTERM handler for the training loop (in the main thread; it only
  records the signal) and restores the previous one afterwards.
* Several processes (`jax.distributed`): JAX's preemption notifier catches SIGTERM in whichever process gets it
  and the coordination service tells the others; every process asks
  `multihost_utils.reached_preemption_sync_point(step)` after every step, which becomes true in all of them at the
  same step (one past the furthest step any process had reached when the notice arrived). Every process therefore
  saves the same step, a collective, and stops. No Python handler is installed there: it would replace JAX's.
"""
from __future__ import annotations

import signal
import threading

import jax
from jax.experimental import multihost_utils

#: The CLI's exit status after a SIGTERM stop (128 + SIGTERM, as for a process the signal ended).
EXIT_STATUS = 128 + signal.SIGTERM


class Preempted(Exception):
    """The run stopped on SIGTERM after checkpointing step `step` (`checkpoint`: its directory)."""

    def __init__(self, step: int, checkpoint: str | None):
        self.step, self.checkpoint = step, checkpoint
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint"
        super().__init__(f"stopped by SIGTERM after step {step} ({where}); run the same command again to resume")


class PreemptionWatch:
    """Whether a stop was requested by SIGTERM, agreed by every process at the same step (module docstring).

    Use it as a context manager around the step loop and call `reached(step)` after every step, in every process,
    with the same increasing step numbers."""

    def __init__(self):
        self._received = False
        self._previous = None  # the SIGTERM handler replaced in a single-process run
        self._synced = False   # across processes: JAX's preemption sync point is available

    def __enter__(self) -> PreemptionWatch:
        if jax.process_count() > 1:
            self._synced = True
        elif threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_sigterm(self, signum, frame) -> None:
        self._received = True

    def reached(self, step: int) -> bool:
        """True when the run must checkpoint step `step` (just finished) and stop."""
        if self._synced:
            try:
                return multihost_utils.reached_preemption_sync_point(step)
            except RuntimeError as e:  # jax_enable_preemption_service is off: no agreement is possible
                self._synced = False
                print(f"warning: a SIGTERM cannot stop this run cleanly across processes: {e}", flush=True)
        return self._received
