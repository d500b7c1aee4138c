"""Asynchronous rollouts with bounded staleness (`rollout.max_staleness: k > 0`).

A sampler thread generates the rollouts of the coming steps while the trainer trains on the current one, as
AReaL's rollout workers do. The schedule is deterministic, so a run is reproducible and resumes exactly: the
rollout of 0-based step s is sampled with the weights of policy version `behaviour_version(s, k) = max(0, s - k)`
(version v = the weights at the start of step v, after v steps of updates). In the steady state every rollout is
exactly k versions old: while the trainer runs step s it has published version s, and the sampler is producing
rollout s + k from it. At most k + 1 rollouts are pending, and a version's weights are dropped once no future
rollout needs them (at most k + 1 host copies of the parameters).

The trainer takes rollout s with `get(s)`, which checks each response's recorded version against the bound
(`check_staleness`: a response older than k versions, or from a version the trainer has not reached, is refused
with `StaleRolloutError`) and reports how long the trainer waited.

Devices: on CPU the simulated devices of `--xla_force_host_platform_device_count` share the host's cores, so
there is nothing to partition: the sampler computes with its own host copy of the weights, split over the
engine's devices as every rollout is (`RolloutSampler`), the trainer's engine on the same devices, and the two
overlap because JAX dispatch and XLA execution release the GIL (the only Python work in the sampler thread,
tokenizing and the reward function, holds it briefly). On an accelerator the same thread overlaps the sampler's
kernels with the trainer's on the same devices. Across processes each process runs its own thread, which samples
its share of each rollout and exchanges it with the other processes' threads (`RolloutSampler.__call__`). With
`rollout.sampler: process` the thread hands each rollout to a `SamplerProcess` (a child at a lower OS priority,
`sampler_process.py`) instead of computing it; everything else here is unchanged.

A producer may complete rollout s one phase later (`produce.lag = 1`: partial rollouts, partial_rollouts.py): it is
then handed version max(0, s + 1 - k) for it, a checkpoint holds one rollout fewer, and the producer keeps its own
state (the streams). A producer with an `idle_round()` is called for one round of work at a time while the thread
waits for the next version, instead of the thread sleeping.

Checkpoints: `pending(done)` waits until the rollouts of steps done .. done + k - 1 (sampled from versions up to
done - 1, all published by then) exist and returns them; the trainer stores them in its checkpoint, and a resumed
run hands them back to a new `AsyncRollouts`, so it continues with the same rollouts, sampled from the same
weights, as the uninterrupted run.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping

import numpy as np

from .scored import StepRollout


class StaleRolloutError(RuntimeError):
    """A rollout sampled by weights more than `rollout.max_staleness` versions older than the trainer's."""


def behaviour_version(step: int, max_staleness: int) -> int:
    """The policy version whose weights sample 0-based step `step`'s rollout."""
    return max(0, step - max_staleness)


def check_staleness(versions: np.ndarray, step: int, max_staleness: int) -> int:
    """The rollout's staleness (step - oldest version); StaleRolloutError if a response is older than
    `max_staleness` versions or newer than the trainer's `step`."""
    versions = np.asarray(versions)
    if versions.size == 0:
        raise StaleRolloutError(f"step {step + 1}: the rollout has no responses")
    newest, oldest = int(versions.max()), int(versions.min())
    if newest > step:
        raise StaleRolloutError(f"step {step + 1}: responses sampled by policy version {newest}, newer than the "
                                f"trainer's version {step}")
    if step - oldest > max_staleness:
        count = int(np.sum(step - versions > max_staleness))
        raise StaleRolloutError(f"step {step + 1}: {count} response(s) sampled by policy version {oldest}, "
                                f"{step - oldest} versions old, beyond rollout.max_staleness={max_staleness}")
    return step - oldest


class AsyncRollouts:
    """The sampler thread and the rollouts it has produced (see the module docstring).

    produce: `produce(step, params, version) -> StepRollout` (a `RolloutSampler`).
    start_step: the first step the trainer will ask for; `pending` holds the rollouts of start_step .. from a
      checkpoint (consecutive steps); the thread continues after them.
    """

    def __init__(self, produce: Callable[[int, Any, int], StepRollout], *, max_staleness: int, start_step: int,
                 pending: Mapping[int, StepRollout] | None = None, name: str = "rl-sampler"):
        if max_staleness < 1:
            raise ValueError(f"AsyncRollouts needs max_staleness >= 1, got {max_staleness}")
        pending = dict(pending or {})
        if sorted(pending) != list(range(start_step, start_step + len(pending))):
            raise ValueError(f"pending rollouts must be of consecutive steps from {start_step}, got {sorted(pending)}")
        self.produce, self.max_staleness = produce, max_staleness
        # a producer that completes rollout s one phase later (partial rollouts) needs version s + lag - k for it
        self.lag = int(getattr(produce, "lag", 0))
        self._cond = threading.Condition()
        self._params: dict[int, Any] = {}
        self._ready: dict[int, StepRollout] = pending
        self._next = start_step + len(pending)  # the next step the thread samples
        self._errors: dict[int, BaseException] = {}
        self._stop = False
        self._busy: list[tuple[float, float]] = []  # the thread's working intervals (perf_counter)
        self._busy_since: float | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- the sampler thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        idle_round = getattr(self.produce, "idle_round", None)
        while True:
            with self._cond:
                step = self._next
                version = behaviour_version(step + self.lag, self.max_staleness)
                while not self._stop and version not in self._params and idle_round is None:
                    self._cond.wait()
                if self._stop:
                    return
                waiting = version not in self._params
                if not waiting:
                    params = self._params[version]
                self._busy_since = time.perf_counter()
            if waiting:  # a producer that works while the next version is awaited (partial rollouts)
                self._idle(idle_round)
                continue
            try:
                out = self.produce(step, params, version)
            except BaseException as e:  # noqa: BLE001 (handed to the trainer when it asks for this step)
                out = e
            with self._cond:
                self._busy.append((self._busy_since, time.perf_counter()))
                self._busy_since = None
                self._cond.notify_all()  # the waiters wake once the lock is released, after the updates below
                if isinstance(out, BaseException):
                    self._errors[step] = out
                    return
                self._ready[step] = out
                self._next = step + 1
                needed = behaviour_version(self._next + self.lag, self.max_staleness)
                for v in [v for v in self._params if v < needed]:
                    del self._params[v]

    def _idle(self, idle_round: Callable[[], bool]) -> None:
        """One round of the producer's work under the weights it has, or (nothing to do) a wait for the trainer."""
        try:
            worked = idle_round()
        except BaseException as e:  # noqa: BLE001 (handed to the trainer when it asks for the next step)
            worked = False
            with self._cond:
                self._errors[self._next] = e
        with self._cond:
            if worked:
                self._busy.append((self._busy_since, time.perf_counter()))
            self._busy_since = None
            if not worked and not self._errors:
                self._cond.wait(timeout=1.0)
            if self._errors:
                self._stop = True

    # -- the trainer's side -------------------------------------------------------------------------------------
    def publish(self, version: int, params) -> None:
        """The weights of policy `version` (host group pytrees; not modified afterwards)."""
        with self._cond:
            if version >= behaviour_version(self._next + self.lag, self.max_staleness):
                self._params[version] = params
            self._cond.notify_all()

    def _wait_for(self, step: int) -> None:
        """Blocks until rollout `step` exists; re-raises the sampler's error for it."""
        while step not in self._ready:
            if step in self._errors or (self._errors and min(self._errors) <= step):
                raise self._errors[min(self._errors)]
            if not self._thread.is_alive() and not self._stop:
                raise RuntimeError("the rollout sampler thread stopped unexpectedly")
            self._cond.wait(timeout=1.0)

    def get(self, step: int) -> tuple[StepRollout, float]:
        """(rollout of step `step`, seconds the trainer waited for it); the staleness bound is checked."""
        started = time.perf_counter()
        with self._cond:
            self._wait_for(step)
            out = self._ready.pop(step)
            for s in [s for s in self._ready if s < step]:
                del self._ready[s]
        check_staleness(out.versions, step, self.max_staleness)
        return out, time.perf_counter() - started

    def pending(self, done: int) -> list[StepRollout]:
        """The rollouts of steps done .. done + k - 1 - lag (waits for them): what a checkpoint of step `done`
        holds. The thread has then produced rollout done + k - 1 - lag (or the trainer has taken it) and waits
        for version done, which the trainer has not published yet: a producer with state of its own (partial
        rollouts) is between phases."""
        ahead = range(done, done + self.max_staleness - self.lag)
        with self._cond:
            for step in ahead:
                self._wait_for(step)
            return [self._ready[s] for s in ahead]

    def busy_seconds(self, start: float, end: float) -> float:
        """How long the sampler thread worked within the perf_counter interval [start, end]."""
        with self._cond:
            intervals = list(self._busy) + ([(self._busy_since, end)] if self._busy_since is not None else [])
            self._busy = [(a, b) for a, b in self._busy if b > start]  # older ones are never asked for again
        return float(sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals))

    def close(self, timeout: float = 120.0) -> None:
        """Stops the thread after its current rollout (waits up to `timeout` seconds)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)
