"""What the SFT and RL runs share: saving a step's checkpoint once, releasing their resources, and the lines of
the end-of-run summary that say where everything was written."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import numpy as np


class TrainingRun:
    """Base of `SFTRun` and `RLRun`. Subclasses set `store` (a CheckpointStore), `engine` and `config`, and say
    what besides the engine state a checkpoint holds (`_trainer_state`)."""

    store: Any
    engine: Any = None
    last_saved_step: int | None = None

    def _trainer_state(self, done: int) -> dict[str, Any]:
        raise NotImplementedError

    def _save(self, done: int) -> None:
        """Checkpoints step `done` (once: a step saved on schedule is not saved again at the end); parameters that
        are not all finite are never saved."""
        if self.last_saved_step == done:
            return
        trainer_state = {**self._trainer_state(done), "engine": self.config.engine.name,
                         "devices": self.config.engine.devices, "schedule_steps": self.config.total_steps}
        engine_state = self.engine.state_dict()
        bad = sorted(g for g, v in engine_state["params"].items() if not np.isfinite(v).all())
        if bad:  # the engines never apply a non-finite step; this is the last line of defence for checkpoints
            raise FloatingPointError(f"step {done}: parameter groups {bad} hold NaN or inf values; refusing to save "
                                     f"them (latest checkpoint: step {self.store.latest_step()})")
        self.store.save(done, engine_state, trainer_state)
        self.last_saved_step = done

    def close(self) -> None:
        """Releases the engine's native resources and the checkpoint manager."""
        try:
            if self.engine is not None:
                engine, self.engine = self.engine, None
                engine.close()
        finally:
            self.store.close()  # also when the engine fails to close: no orbax thread outlives the run


class TimedPlanner:
    """Calls `planner` and adds its wall time to `seconds`: the trainers' `plan_ms` metric, so the cost of planning
    (which grows with devices and sequences) can be read next to the step time it is part of."""

    def __init__(self, planner: Callable):
        self.planner = planner
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.planner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started

    def take_ms(self) -> float:
        """Milliseconds spent planning since the last call; resets the count."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds * 1e3


def timing_summary(plan_ms: Sequence[float], step_seconds: Sequence[float]) -> dict[str, float | None]:
    """Mean and max planning time against the mean step time, over the steps this invocation ran (None without
    any)."""
    if not plan_ms:
        return {"plan_ms_mean": None, "plan_ms_max": None, "step_seconds_mean": None}
    return {"plan_ms_mean": float(np.mean(plan_ms)), "plan_ms_max": float(np.max(plan_ms)),
            "step_seconds_mean": float(np.mean(step_seconds))}


def timing_lines(summary: dict[str, Any]) -> list[str]:
    """The summary line on planning time, or none when no step ran."""
    if summary.get("plan_ms_mean") is None:
        return []
    return [f"planning:   {summary['plan_ms_mean']:.2f} ms mean, {summary['plan_ms_max']:.2f} ms max per step "
            f"(mean step {summary['step_seconds_mean'] * 1e3:.1f} ms)"]


def output_lines(summary: dict[str, Any], extra: Sequence[str] = ()) -> list[str]:
    """checkpoint, metrics, the run's own outputs (`extra`), HF export."""
    lines = [f"checkpoint: {summary['checkpoint']}",
             f"metrics:    {summary['metrics']} (TensorBoard: {summary['tensorboard']})", *extra]
    if summary["hf_export"]:
        lines.append(f"HF export:  {summary['hf_export']}")
    return lines


def pin_schedule_length(config, saved: dict[str, Any], log: Callable[[str], None]):
    """`config` with the learning-rate schedule's length of the run it resumes (`saved`: the checkpoint's trainer
    state). Raising `run.steps` to train longer must not move the schedule under the steps already taken (a
    cosine decay would jump back up): unless `optimizer.total_steps` is set, the schedule keeps the original
    run's length (and stays at its final value past it). Setting `optimizer.total_steps` changes it, said aloud."""
    original = saved.get("schedule_steps")
    if original is None:
        return config
    now = config.total_steps
    if config.optimizer.total_steps is not None:
        if now != original:
            log(f"note: the learning-rate schedule's length changes from {original} to {now} optimizer updates "
                "(optimizer.total_steps)")
        return config
    if now != original:
        log(f"note: the learning-rate schedule keeps the original run's length of {original} optimizer updates "
            f"(the new run.steps would make it {now}); set optimizer.total_steps to change it")
    return dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer, total_steps=original))


def check_data_fingerprint(saved: dict | None, now: dict, *, accept: bool, where: str,
                           log: Callable[[str], None]) -> None:
    """Refuses to resume on data other than the checkpoint's (`saved`, from `data.fingerprint_examples`), or only
    says so with `accept` (checkpoint.accept_changed_data). Checkpoints without a fingerprint are accepted."""
    if saved is None or now is None or saved == now:  # None: an older checkpoint, or a generated RL task
        return
    change = (f"the data differ from those checkpoint {where} was trained on ({saved.get('examples')} examples, "
              f"sha256 {str(saved.get('sha256'))[:16]}... then; {now['examples']} examples, sha256 "
              f"{now['sha256'][:16]}... now)")
    if accept:
        log(f"warning: {change}; resuming anyway (checkpoint.accept_changed_data)")
        return
    raise RuntimeError(f"{change}: resuming would silently continue on other data. Restore the data, use another "
                       "run.out_dir for a new run, or set checkpoint.accept_changed_data=true to resume anyway")
