"""What the stop tests share: a callback that sends the test's own process SIGTERM in the middle of a step, as a
scheduler's notice would arrive."""
import os
import signal

from jodc.train.core.callbacks import Callback


class SigtermAt(Callback):
    """Sends this process SIGTERM at the start of 0-based step `step` (after its evaluation, before its work)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_start(self, trainer, step: int) -> None:
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)
