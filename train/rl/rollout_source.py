"""Where an RL step's rollout comes from, chosen once (`make_rollout_source`) from `rollout.max_staleness`:

- `SyncRollouts` (0): the trainer samples step s's rollout itself, now, from the current weights; nothing is held
  between steps, so a checkpoint holds no rollout.
- `AsyncRollouts` source (k > 0): a sampler thread (computing the rollouts itself, or in a child process at a low OS
  priority with `rollout.sampler: process`) samples step s from the weights of step max(0, s - k) while the trainer
  trains; the k rollouts sampled ahead go into every checkpoint, so a resumed run continues exactly. Across
  processes (mpirun) every process runs its own sampler thread, which samples its share of each rollout (itself, or
  through its child process); the run's layout (layout.py) makes the step's rollout of it, and a checkpoint holds
  the whole of each rollout sampled ahead (a resume in any layout reads it).

Both have one interface for the RL loop: `get(step, params)` -> (the step's `StepRollout`, seconds the trainer
waited), `host_weights` (which weights `params` must be), `sampler_busy(start, end, scored)`,
`checkpoint_state(done)`, `restore(step, state, where)` and `close()`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..core.callbacks import emit
from ..core.config import ConfigError
from .async_rollouts import AsyncRollouts, check_staleness
from .layout import RolloutLayout
from .rollout_exchange import CHECKPOINT_TAGS
from .partial_rollouts import PartialRollouts
from .sampler import RolloutSampler, stream_shape
from .sampler_process import SamplerProcess
from .scored import ScoredRollout, StepRollout


class SyncRollouts:
    """The trainer samples each step's rollout itself (rollout.max_staleness: 0)."""

    host_weights = False  # the sampler takes the trainer's weights as they are on the devices

    def __init__(self, sampler: RolloutSampler, *, trainer, callbacks=()):
        self.sampler, self.trainer, self.callbacks = sampler, trainer, tuple(callbacks)

    def get(self, step: int, params) -> tuple[StepRollout, float]:
        """Step `step`'s rollout from `params` (version `step`); the trainer waited for all of it."""
        emit(self.callbacks, "on_rollout_start", self.trainer, step)
        scored = self.sampler(step, params, step)
        emit(self.callbacks, "on_rollout_end", self.trainer, step, scored)
        check_staleness(scored.versions, step, 0)
        return scored, scored.seconds

    def sampler_busy(self, start: float, end: float, scored: StepRollout) -> float:
        """Seconds the sampler worked between `start` and `end` (the step): the rollout's own."""
        return scored.seconds

    def checkpoint_state(self, done: int) -> dict[str, Any]:
        return {}

    def restore(self, step: int, state: dict[str, Any], where: str) -> None:
        pass

    def close(self) -> None:
        pass


@dataclasses.dataclass
class ProcessShares:
    """`produce(step, params, version)` for the sampler thread when a sampler process computes this process's share
    (`sampler_process.py`): the layout makes the step's rollout of it, as `RolloutSampler.__call__` does."""

    share: SamplerProcess
    layout: RolloutLayout

    def __call__(self, step: int, params, version: int) -> StepRollout:
        return self.layout.step_rollout(step, lambda: self.share(step, params, version))

    def close(self) -> None:
        self.share.close()


class AsyncRolloutSource:
    """Rollouts sampled ahead by a sampler thread from weights at most `max_staleness` versions old; with
    `partial` (a `PartialRollouts`) the thread's streams carry generation on across policy updates."""

    def __init__(self, sampler: RolloutSampler, *, max_staleness: int, process: ProcessShares | None = None,
                 partial: PartialRollouts | None = None):
        self.sampler, self.max_staleness, self.process, self.partial = sampler, max_staleness, process, partial
        self.lag = partial.lag if partial is not None else 0  # rollouts a checkpoint holds: k - lag
        self.thread: AsyncRollouts | None = None  # started by the first `get`, at the run's first step
        self.restored: dict[int, StepRollout] = {}  # rollouts sampled ahead, from the checkpoint

    @property
    def host_weights(self) -> bool:
        """Whether the sampler takes host fp32 weights (a sampler process, to which they are pickled) rather than the
        copies made on the devices."""
        return self.process is not None

    def get(self, step: int, params) -> tuple[StepRollout, float]:
        """Publishes `params` as version `step` and takes the rollout sampled from version max(0, step - k)
        (refused if staler than k)."""
        if self.thread is None:
            self.thread = AsyncRollouts(self.process or self.partial or self.sampler, max_staleness=self.max_staleness,
                                        start_step=step, pending=self.restored)
            self.restored = {}
        self.thread.publish(step, params)
        return self.thread.get(step)

    def sampler_busy(self, start: float, end: float, scored: StepRollout) -> float:
        """Seconds the sampler thread worked between `start` and `end`."""
        return self.thread.busy_seconds(start, end)

    def checkpoint_state(self, done: int) -> dict[str, Any]:
        """The rollouts sampled ahead (from weights no longer in the engine), whole."""
        if self.thread is not None:
            pending = self.thread.pending(done)
        else:  # nothing ran since the restore
            pending = [self.restored[s] for s in sorted(self.restored)]
        state = {"pending_rollouts": [self.sampler.layout.whole(p).to_json() for p in pending]}
        if self.partial is not None:  # each process's streams between phases: rows under way, waiting, finished
            state["partial_rollouts"] = self.sampler.layout.gather(
                self.partial.state, what="the partial rollouts' streams for the checkpoint", tags=CHECKPOINT_TAGS)
        return state

    def restore(self, step: int, state: dict[str, Any], where: str) -> None:
        k, s = self.max_staleness, self.sampler
        pending = [ScoredRollout.from_json(p) for p in state.get("pending_rollouts") or []]
        if [p.step for p in pending] != list(range(step, step + k - self.lag)):
            raise RuntimeError(f"checkpoint {where} does not hold the rollouts of steps {step + 1}.."
                               f"{step + k - self.lag} that rollout.max_staleness={k} sampled ahead")
        if self.partial is not None:
            streams = state.get("partial_rollouts")
            if not isinstance(streams, list) or len(streams) != s.layout.processes:
                saved = len(streams) if isinstance(streams, list) else 0
                raise RuntimeError(f"checkpoint {where} holds the partial rollouts' streams of {saved} process(es); "
                                   f"it resumes only with as many (this run has {s.layout.processes})")
            self.partial.restore(streams[s.layout.process])
        self.restored = {p.step: s.layout.view(p, num_prompts=s.rollout.prompts_per_step,
                                               group_size=s.rollout.group_size, devices=s.devices) for p in pending}

    def close(self) -> None:
        """Stops the sampler thread, then its process."""
        try:
            thread, self.thread = self.thread, None
            if thread is not None:
                thread.close()
        finally:
            process, self.process = self.process, None
            if process is not None:
                process.close()


def make_rollout_source(rollout, sampler: RolloutSampler, *, reward_spec: str | None, trainer, callbacks=(),
                        deterministic: bool = True):
    """The source `rollout` (the config's section) asks for; the sampler process starts now (its imports overlap
    the engine's compilation) and computes this process's share (the sampler's layout is its trainer's). Partial
    rollouts keep generating while the next version is awaited unless the run is `deterministic`.
    ConfigError for what cannot run (a reward function that does not pickle for the sampler process)."""
    if not rollout.max_staleness:
        return SyncRollouts(sampler, trainer=trainer, callbacks=callbacks)
    process = None
    if rollout.sampler == "process":
        try:
            process = ProcessShares(SamplerProcess(sampler, nice=rollout.sampler_nice, reward_spec=reward_spec),
                                    sampler.layout)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    partial = (PartialRollouts(sampler, stream_shape(rollout), keep_generating=not deterministic)
               if rollout.partial_rollouts else None)
    return AsyncRolloutSource(sampler, max_staleness=rollout.max_staleness, process=process, partial=partial)
