"""Wall-clock timers of a training step, as context managers: `with timers("reward"): ...` adds the block's
seconds to `timers["reward"]`, and `timers.timed("plan", planner)` times every call of a function (the planner
runs inside the data or update code, so it is timed where it is called).

The trainer takes the totals after each step (`take`) and writes them into the step's record as
`<name>_seconds` (`plan` as `plan_ms`), so a step's time split is measured by one mechanism, not by hand.
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections import defaultdict
from typing import Any, Callable, Iterator, Sequence

import numpy as np


class Timers:
    """Named wall-clock totals since the last `take`."""

    def __init__(self):
        self.seconds: defaultdict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:  # a block that raises still counts (a failing plan took its time too)
            self.seconds[name] += time.perf_counter() - started

    def __getitem__(self, name: str) -> float:
        return self.seconds.get(name, 0.0)

    def timed(self, name: str, fn: Callable) -> Callable:
        """`fn` whose every call is timed under `name`."""
        @functools.wraps(fn)
        def call(*args, **kwargs):
            with self(name):
                return fn(*args, **kwargs)

        return call

    def take(self) -> dict[str, float]:
        """The totals since the last `take` (seconds by name); resets them."""
        seconds, self.seconds = dict(self.seconds), defaultdict(float)
        return seconds


def step_times(seconds: dict[str, float]) -> dict[str, float]:
    """A step's timer totals as record fields: `<name>_seconds`, and the planner's time as `plan_ms` (always
    present: the metric that shows what planning costs next to the step time)."""
    fields = {f"{name}_seconds": value for name, value in seconds.items() if name != "plan"}
    fields["plan_ms"] = seconds.get("plan", 0.0) * 1e3
    return fields


def timing_summary(records: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """Mean and max planning time against the mean step time over `records` (the steps this invocation ran;
    None without any)."""
    if not records:
        return {"plan_ms_mean": None, "plan_ms_max": None, "step_seconds_mean": None}
    plan_ms = [r["plan_ms"] for r in records]
    return {"plan_ms_mean": float(np.mean(plan_ms)), "plan_ms_max": float(np.max(plan_ms)),
            "step_seconds_mean": float(np.mean([r["step_seconds"] for r in records]))}


def timing_lines(summary: dict[str, Any]) -> list[str]:
    """The summary line on planning time, or none when no step ran."""
    if summary.get("plan_ms_mean") is None:
        return []
    return [f"planning:   {summary['plan_ms_mean']:.2f} ms mean, {summary['plan_ms_max']:.2f} ms max per step "
            f"(mean step {summary['step_seconds_mean'] * 1e3:.1f} ms)"]
