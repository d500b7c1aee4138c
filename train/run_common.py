"""What the SFT and RL runs share: saving a step's checkpoint once, releasing their resources, and the lines of
the end-of-run summary that say where everything was written."""
from __future__ import annotations

from typing import Any, Sequence


class TrainingRun:
    """Base of `SFTRun` and `RLRun`. Subclasses set `store` (a CheckpointStore), `engine` and `config`, and say
    what besides the engine state a checkpoint holds (`_trainer_state`)."""

    store: Any
    engine: Any = None
    last_saved_step: int | None = None

    def _trainer_state(self, done: int) -> dict[str, Any]:
        raise NotImplementedError

    def _save(self, done: int) -> None:
        """Checkpoints step `done` (once: a step saved on schedule is not saved again at the end)."""
        if self.last_saved_step == done:
            return
        trainer_state = {**self._trainer_state(done), "engine": self.config.trainer.engine,
                         "devices": self.config.trainer.devices}
        self.store.save(done, self.engine.state_dict(), trainer_state)
        self.last_saved_step = done

    def close(self) -> None:
        """Releases the engine's native resources and the checkpoint manager."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.store.close()


def output_lines(summary: dict[str, Any], extra: Sequence[str] = ()) -> list[str]:
    """checkpoint, metrics, the run's own outputs (`extra`), HF export."""
    lines = [f"checkpoint: {summary['checkpoint']}",
             f"metrics:    {summary['metrics']} (TensorBoard: {summary['tensorboard']})", *extra]
    if summary["hf_export"]:
        lines.append(f"HF export:  {summary['hf_export']}")
    return lines
