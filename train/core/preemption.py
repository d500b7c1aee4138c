"""Stop requests from a scheduler: SIGTERM, what SLURM, Kubernetes and most batch systems send before SIGKILL.

A run handles it as it handles Ctrl-C between steps, but without losing the step under way: that step finishes,
it is checkpointed, and the run stops with `Preempted` (the `jodc-train` CLI then exits with status 143, the
status of a process ended by SIGTERM, so the scheduler sees a terminated job, not a finished one; rerunning the
same command resumes from that checkpoint).

`PreemptionWatch` installs a SIGTERM handler (in the main thread; it only records the signal) for as long as the
outermost watch lasts: the CLI holds one around the whole command, so a SIGTERM while the model is built, restored
or warm-started stops the run at the end of its first step instead of killing it; `Trainer.train` holds one too
(for runs started from Python). After every step every process asks `reached(step)`; across processes the answer
is agreed by a small all-gather of every process's flag (`distributed.any_process`), so a SIGTERM that reaches one
process only (a scheduler's notice may reach one host first) stops every process at the same step, which all of
them checkpoint (a collective save).

Why not JAX's preemption sync point (`multihost_utils.reached_preemption_sync_point`, whose notifier catches
SIGTERM once `jax.distributed` is initialised): it agrees on one past the furthest step counter any process had
reported when the notice came, so a notice that arrives before the first step of a resumed run, or after an RL
warm start's own steps (its counter then runs ahead of the RL steps), names a step the loop never asks about, and
the signal is lost, as it was before (tried under mpirun). The handler installed here replaces JAX's notifier.
"""
from __future__ import annotations

import signal
import threading

from . import distributed

#: The CLI's exit status after a SIGTERM stop (128 + SIGTERM, as for a process the signal ended).
EXIT_STATUS = 128 + signal.SIGTERM


class Preempted(Exception):
    """The run stopped on SIGTERM after checkpointing step `step` (`checkpoint`: its directory)."""

    def __init__(self, step: int, checkpoint: str | None):
        self.step, self.checkpoint = step, checkpoint
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint"
        super().__init__(f"stopped by SIGTERM after step {step} ({where}); run the same command again to resume")


class _Requests:
    """The process's one SIGTERM handler and what it recorded, shared by nested watches."""
    requested = False
    depth = 0            # watches entered and not yet left
    previous = None      # the handler the outermost watch replaced (None: it installed none)


def _on_sigterm(signum, frame) -> None:
    _Requests.requested = True


class PreemptionWatch:
    """Whether a stop was requested by SIGTERM, agreed by every process at the same step (module docstring).

    Use it as a context manager (nesting is allowed: the outermost one installs and removes the handler, and forgets
    a request when it ends) and call `reached(step)` after every step, in every process, at the same steps."""

    def __enter__(self) -> PreemptionWatch:
        if _Requests.depth == 0 and threading.current_thread() is threading.main_thread():  # handlers live there
            _Requests.previous = signal.signal(signal.SIGTERM, _on_sigterm)
        _Requests.depth += 1
        return self

    def __exit__(self, *exc) -> None:
        _Requests.depth -= 1
        if _Requests.depth == 0:
            if _Requests.previous is not None:
                signal.signal(signal.SIGTERM, _Requests.previous)
            _Requests.previous, _Requests.requested = None, False

    def reached(self, step: int) -> bool:
        """True when the run must checkpoint step `step` (just finished) and stop: a SIGTERM reached this process
        or, across processes, any of them (a collective: every process must ask after the same steps)."""
        return distributed.any_process(_Requests.requested)
