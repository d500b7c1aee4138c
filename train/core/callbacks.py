"""Extension points of a run: an engine factory and callbacks, so that code around a run (benchmarks, profilers,
user tooling) observes and adapts it without patching the library.

- `EngineFactory`: what builds the run's engine from (config, staged model, initial groups); `make_engine` by
  default. A factory may also define `release(engine)`, called instead of `engine.close()` when the run ends (an
  engine pool that reuses engines across runs keeps them open).
- `Callback`: hooks the loop calls in this order for each step: `on_step_start`, then for an RL step
  `on_rollout_start` / `on_rollout_end` around a rollout the trainer samples itself (synchronous rollouts; an
  asynchronous sampler thread or process samples outside the step), then `on_update_start` / `on_update_end` around
  each optimizer update, then `on_step_end` with the step's record. Every hook is optional (the base class's do
  nothing); the evaluation that runs before a step is outside its start / end.
"""
from __future__ import annotations

from typing import Any, Protocol


class EngineFactory(Protocol):
    def __call__(self, config, model, groups) -> Any: ...


class Callback:
    """Hooks of a run (see the module docstring); subclass and override the ones you need."""

    def on_step_start(self, trainer, step: int) -> None:
        """Before 0-based step `step`'s work (after its evaluation)."""

    def on_step_end(self, trainer, step: int, record: dict) -> None:
        """After step `step`, with its metrics record so far (timers are added after this hook)."""

    def on_rollout_start(self, trainer, step: int) -> None:
        """Before the trainer samples step `step`'s rollout itself (RL, synchronous rollouts)."""

    def on_rollout_end(self, trainer, step: int, rollout) -> None:
        """After that rollout was sampled and scored (a `ScoredRollout`; across processes with `rollout.assembly:
        sharded` a `ShardedRollout`: this process's share and the whole rollout's metadata)."""

    def on_update_start(self, trainer) -> None:
        """Before one optimizer update (the engine's step)."""

    def on_update_end(self, trainer, result) -> None:
        """After it, with the engine's `StepResult`."""


def emit(callbacks, hook: str, *args) -> None:
    """Calls `hook(*args)` on every callback, in order."""
    for callback in callbacks:
        getattr(callback, hook)(*args)
