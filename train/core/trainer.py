"""The training loop of both trainers (levanter's shape: one core owns the loop, SFT and RL supply the step).

`Trainer` owns everything around a step: resuming (a foreign checkpoint is refused before anything is built, the
learning-rate schedule keeps the original run's length, changed data are refused, the engine is restored), the step
loop with its Ctrl-C and SIGTERM semantics (preemption.py), the checkpoint cadence, the metrics logger, non-finite
updates (stop, or skip and count), step timers, per-device timelines, evaluation, the HF export and the end-of-run
summary. A subclass supplies the hooks:

* `load_data()` -> the data fingerprint (checked against the checkpoint before the model is built);
* `build()`: tokenizer, model, planner, engine (`self.engine`, `self.model_config`, `self.tokenizer`), the
  shared part through `build_engine`;
* `train_step(step)` -> the step's metrics record (it calls `self.update(...)` for each optimizer update);
* `checkpoint_state(done)` and `restored(step, state)` -> the engine's applied-update count;
* `evaluate(step)` (runs when the config has `eval_every`), `summary_fields(...)`, `format_summary(summary)`.

Under mpirun only process 0 prints and writes outputs; every process runs the same steps and checkpoints.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Sequence

import jax

from jodc.train.core.staged_decoder import decoder_staged_model
from jodc.balance.cp_plan import CPPlan
from jodc.fsdp.engine import nonfinite_cause
from jodc.fsdp.timeline_analysis import events_from_plan, label_cp_groups, plot_timeline, save_events

from .callbacks import Callback, EngineFactory, emit
from .checkpoint import NUMELS_KEY, CheckpointStore
from .export import export_hf_streaming
from .host_memory import return_freed_memory_promptly
from .config import resume_mismatches, save_yaml, to_dict
from .metrics import BAR_FIELDS, TENSORBOARD_DIR, MetricsLogger
from .model import build_decoder, cost_model, make_engine, make_planner
from .preemption import Preempted, PreemptionWatch
from .timers import Timers, step_times, timing_lines, timing_summary

CHECKPOINT_DIR, HF_DIR, TIMELINE_DIR, CONFIG_FILE = "checkpoints", "hf", "timeline", "config.yaml"


class Trainer:
    """One invocation of a training run: `__init__` resumes or starts it, `train` runs its steps and finishes it,
    `close` releases the engine and the checkpoint manager (also when `__init__` fails)."""

    #: The count of non-finite updates not applied, in checkpoints and records (both trainers: an SFT step is one
    #: update). LEGACY_SKIPPED_KEY is what SFT checkpoints written before one name existed call it.
    SKIPPED_KEY, LEGACY_SKIPPED_KEY = "skipped_updates", "skipped_steps"
    written_for = "another run"    # what a refused checkpoint was written for, in the error
    logger_class = MetricsLogger
    bar_fields = BAR_FIELDS  # what the progress bar shows of a step's record

    def __init__(self, config, *, log: Callable[[str], None] = print, engine_factory: EngineFactory | None = None,
                 callbacks: Sequence[Callback] = ()):
        """`engine_factory` builds the engine (default `make_engine`); `callbacks` observe the steps, rollouts and
        updates (train/core/callbacks.py)."""
        return_freed_memory_promptly()  # a resume or a step must not leave the state resident twice (host_memory.py)
        self.engine_factory = engine_factory or make_engine
        self.callbacks = tuple(callbacks)
        self.config = config
        self.primary = jax.process_index() == 0
        self.log = log if self.primary else (lambda *_: None)
        ckpt = config.checkpoint
        self.out_dir = os.path.abspath(config.run.out_dir)
        os.makedirs(self.out_dir, exist_ok=True)
        self.store = CheckpointStore(os.path.join(self.out_dir, CHECKPOINT_DIR), keep=ckpt.keep_checkpoints)
        self.engine = self.logger = self.timeline = None
        self.skipped = 0
        self.records: list[dict[str, Any]] = []  # every step this invocation ran, logged or not
        self.timers = Timers()
        try:
            resume_from = self.store.resumable_step(
                ckpt.resume, lambda saved: resume_mismatches(saved, self.config),
                written_for=self.written_for)
            saved = self.store.read_trainer_state(resume_from) if resume_from is not None else None
            if saved is not None:
                self.config = pin_schedule_length(self.config, saved, self.log)
            self.data_fingerprint = self.load_data()
            if saved is not None:
                check_data_fingerprint(saved.get("data_fingerprint"), self.data_fingerprint,
                                       accept=ckpt.accept_changed_data, where=self.store.step_dir(resume_from),
                                       log=self.log)
            self.build()
            self.start_step = self._restore(resume_from) if resume_from is not None else 0
        except BaseException:
            self.close()
            raise
        if self.primary:
            save_yaml(self.config, os.path.join(self.out_dir, CONFIG_FILE))
        self.last_saved_step = self.start_step or None

    # -- hooks with defaults (load_data, build, train_step and evaluate have none: see the module docstring) --------
    def checkpoint_state(self, done: int) -> dict[str, Any]:
        return {}

    def restored(self, step: int, state: dict[str, Any]) -> int:
        """Checks checkpoint `step`'s trainer state; returns the optimizer updates the engine had applied."""
        return step - self.skipped

    def summary_fields(self, done: int, final_eval: dict[str, float] | None) -> dict[str, Any]:
        return {}

    def format_summary(self, summary: dict[str, Any]) -> str:
        return summary_text(summary, None)

    def build_engine(self, model, *, max_length: int, **head) -> dict:
        """What `build` makes the same way in both trainers: the decoder of `model` (a ModelConfig) for
        `self.tokenizer`, staged with `head` (`decoder_staged_model`'s head_loss / metric_names), the planner (timed:
        plan_ms), its cost model and the engine (which runs, and reports, the learning-rate schedule); returns the
        staged group parameters."""
        config, seed = self.config, self.config.run.seed
        self.model_config, groups = build_decoder(model, self.tokenizer, max_length=max_length,
                                                  compute_dtype=config.engine.compute_dtype, seed=seed)
        self.model, groups = decoder_staged_model(self.model_config, groups, seed=seed, **head)
        self.planner = self.timers.timed("plan", make_planner(config))
        self.cost_model = cost_model(config.engine.cost_model, self.model_config,
                                     context_parallel=config.engine.context_parallel)
        self.engine = self.engine_factory(config, self.model, groups)
        return groups

    # -- resume and checkpoints ------------------------------------------------------------------------------------
    @classmethod
    def skipped_in(cls, state: dict) -> int:
        """The skipped-update count a checkpoint's state holds, under either name (0 when it has none)."""
        return int(state.get(cls.SKIPPED_KEY, state.get(cls.LEGACY_SKIPPED_KEY, 0)))

    def _restore(self, step: int) -> int:
        """Loads checkpoint `step` into the engine; returns the number of steps already done."""
        targets = self.engine.state_targets()
        self.store.check_restorable(step, targets, self.engine.numels)  # before the initial state is dropped
        self.engine.drop_state()  # the restored state never lies beside the one it replaces
        engine_state, state = self.store.restore(step, targets)  # (sizes checked above, from the metadata)
        self.skipped = self.skipped_in(state)
        engine_state.pop("step")
        self.engine.load_sharded_state(engine_state, self.restored(step, state))  # the engine counts applied updates
        self.log(f"resumed from {self.store.step_dir(step)} (step {step})")
        return step

    def save(self, done: int) -> None:
        """Checkpoints step `done` (once: a step saved on schedule is not saved again at the end); parameters that
        are not all finite are never saved."""
        if self.last_saved_step == done:
            return
        e = self.config.engine
        state = {**self.checkpoint_state(done), "config": to_dict(self.config), self.SKIPPED_KEY: self.skipped,
                 "data_fingerprint": self.data_fingerprint, "engine": e.name, "devices": e.devices,
                 "schedule_steps": self.config.total_steps, NUMELS_KEY: self.engine.numels}
        bad = self.engine.nonfinite_groups()  # checked on the devices
        if bad:  # the engines never apply a non-finite step; this is the last line of defence for checkpoints
            raise FloatingPointError(f"step {done}: parameter groups {bad} hold NaN or inf values; refusing to save "
                                     f"them (latest checkpoint: step {self.store.latest_step()})")
        self.store.save(done, self.engine.sharded_state(), state)  # each process writes its own shards
        self.last_saved_step = done

    def close(self) -> None:
        """Releases the engine's native resources and the checkpoint manager."""
        try:
            if self.engine is not None:
                engine, self.engine = self.engine, None
                getattr(self.engine_factory, "release", type(engine).close)(engine)
        finally:
            self.store.close()  # also when the engine fails to close: no orbax thread outlives the run

    # -- the loop --------------------------------------------------------------------------------------------------
    def train(self, stop_at_step: int | None = None) -> dict[str, Any]:
        """Runs steps start_step+1 .. run.steps (or stop_at_step), then finishes the run.

        Ctrl-C between steps saves a checkpoint of the last finished step before stopping; during a step the
        engine state is not known to be consistent, so the latest earlier checkpoint stays the one; during a save
        it lets the save finish first (interrupts.py), and the run stops naming that checkpoint the latest. An
        error inside a step (a failing reward function, a non-finite update) saves nothing of that step.
        SIGTERM (a scheduler's notice) lets the step under way finish, checkpoints it and raises `Preempted`;
        across processes every process stops at the same step (preemption.py). A stopped run skips the final
        evaluation and export: the resumed run does them.
        """
        steps, ckpt, logs = self.config.run.steps, self.config.checkpoint, self.config.logging
        last = steps if stop_at_step is None else min(steps, stop_at_step)
        started = time.perf_counter()
        self.logger = logger = (self.logger_class(self.out_dir, total_steps=steps, start_step=self.start_step,
                                                  progress=logs.progress, bar_fields=self.bar_fields)
                                if self.primary else _SilentLogger())
        done, consistent = self.start_step, True
        try:
            with PreemptionWatch() as preemption:
                for step in range(self.start_step, last):
                    consistent = False
                    record = self._run_step(step)
                    done, consistent = step + 1, True
                    if done % logs.log_every == 0 or done == last:
                        logger.log(record)
                    logger.advance()
                    stop = preemption.reached(done)  # every process asks after every step
                    if stop or (ckpt.save_every and done % ckpt.save_every == 0):
                        consistent = False
                        self.save(done)
                        consistent = True
                    if stop:
                        raise Preempted(done, self.store.step_dir(done))
                consistent = False
                self.save(done)
        except KeyboardInterrupt:
            if consistent and done > (self.last_saved_step or 0):
                try:
                    self.save(done)
                except KeyboardInterrupt:  # Ctrl-C again during this save: the run is stopping already
                    pass
            latest = self.store.latest_step()
            logger.write(f"interrupted; the latest checkpoint is {self.store.step_dir(latest)}"
                         if latest is not None else "interrupted before any checkpoint")
            raise
        except Preempted as stop:
            logger.write(str(stop))
            raise
        finally:
            logger.close()
        return self._finish(done, time.perf_counter() - started)

    def _run_step(self, step: int) -> dict[str, Any]:
        """Step `step` (0-based): the evaluation due before it, the subclass's step, and the step's timers."""
        self.timers.take()
        record: dict[str, Any] = {"step": step + 1}
        if self._eval_every() and step % self._eval_every() == 0:
            with self.timers("eval"):
                record.update(self.evaluate(step + 1))
        emit(self.callbacks, "on_step_start", self, step)
        record.update(self.train_step(step))
        emit(self.callbacks, "on_step_end", self, step, record)
        if self.timeline and self.timeline["step"] == step + 1:  # the step drew one
            record["bubble_rate"] = self.timeline["bubble_rate"]
        times = step_times(self.timers.take())
        record.update({k: v for k, v in times.items() if k not in record})  # what the step set itself wins
        self.records.append(record)
        return record

    def _eval_every(self) -> int:
        return getattr(self.config.run, "eval_every", 0)

    # -- one optimizer update --------------------------------------------------------------------------------------
    def update(self, arrays, what: str, *, timeline: tuple[int, Any] | None = None):
        """One optimizer update with the run's non-finite policy: a non-finite update is never applied, and it
        stops the run (FloatingPointError; nothing of the step is saved) or, with run.skip_nonfinite_steps,
        is counted and skipped (`result.applied` is False). `what` names the update in messages.

        timeline: (step, plan) to record and plot this update's per-device timeline: measured by the engine where
        it can (`engine.supports_timeline`, one process), else estimated from the plan's costs."""
        # every process must run the same program
        record = timeline is not None and jax.process_count() == 1 and self.engine.supports_timeline
        # the engine's own non-finite path: such an update comes back not applied (the engine kept its state)
        emit(self.callbacks, "on_update_start", self)
        result = self.engine.step(arrays, skip_nonfinite=True, **({"record_timeline": True} if record else {}))
        emit(self.callbacks, "on_update_end", self, result)
        if not result.applied:
            if not self.config.run.skip_nonfinite_steps:
                raise FloatingPointError(nonfinite_message(what, result, self.store.latest_step(), skip=False))
            self.skipped += 1
            self.logger.write(nonfinite_message(what, result, None, skip=True))
        if timeline is not None:
            self._plot_timeline(*timeline, result)
        return result

    def timeline_due(self, done: int) -> bool:
        """Whether step `done` draws a timeline (logging.timeline_every; the same steps whether resumed or not)."""
        every = self.config.logging.timeline_every
        return self.primary and every > 0 and (done % every == 0 or done == self.config.run.steps)

    def _plot_timeline(self, done: int, plan, result) -> None:
        events, source = result.timeline, "engine"
        if not events:
            events = events_from_plan(plan, result.seconds, lockstep=self.engine.lockstep)
            source = "planner-cost estimate"
        if isinstance(plan, CPPlan):  # context-parallel rows drawn with their group
            events = label_cp_groups(events, plan)
        directory = os.path.join(self.out_dir, TIMELINE_DIR)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"step_{done:06d}.png")
        e = self.config.engine
        rate = plot_timeline(events, path, num_devices=e.devices,
                             title=f"{e.name} / {e.planner_name}, step {done} ({source})")
        save_events(events, path[:-4] + ".json")
        self.timeline = {"path": path, "bubble_rate": rate, "step": done, "source": source}

    # -- the end of a run ------------------------------------------------------------------------------------------
    def _finish(self, done: int, seconds: float) -> dict[str, Any]:
        """Final evaluation, HF export, summary (printed and returned)."""
        final_eval = self.evaluate(done) if self._eval_every() and done > self.start_step else None
        hf_path = None
        if self.config.checkpoint.export_hf and done == self.config.run.steps:
            # one group at a time, gathered by every process (a collective), written by process 0
            groups = ((g, self.engine.group_to_host(g)) for g in self.model.group_names)
            hf_path = export_hf_streaming(self.model_config, groups, self.tokenizer, os.path.join(self.out_dir, HF_DIR),
                                          dtype=self.config.checkpoint.export_dtype, write=self.primary)
            hf_path = hf_path if self.primary else None
        timeline = self.timeline or {}
        summary = {
            "out_dir": self.out_dir, "start_step": self.start_step, "steps_done": done, "seconds": seconds,
            "checkpoint": self.store.step_dir(done) if done in self.store.steps() else None,
            "metrics": self.logger.path, "tensorboard": os.path.join(self.out_dir, TENSORBOARD_DIR),
            "hf_export": hf_path, "timeline": timeline.get("path"), "bubble_rate": timeline.get("bubble_rate"),
            **timing_summary(self.records), **self.summary_fields(done, final_eval),
        }
        if self.primary:  # the others' summaries lack what only process 0 writes (metrics, exports)
            self.log(self.format_summary(summary))
        return summary


def run(trainer_class, config, *, stop_at_step: int | None = None, **kwargs) -> dict[str, Any]:
    """Builds a `trainer_class` run of `config`, trains it and closes it; returns the summary."""
    trainer = trainer_class(config, **kwargs)
    try:
        return trainer.train(stop_at_step=stop_at_step)
    finally:
        trainer.close()


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


class _SilentLogger:
    """The metrics logger of processes other than 0 in a multi-process run: they write nothing."""

    path = None

    def __getattr__(self, name: str):  # log, advance, write, close: do nothing
        return lambda *args, **kwargs: None


def nonfinite_message(what: str, result, latest_checkpoint: int | None, *, skip: bool) -> str:
    """The line of an update that was not applied (non-finite loss, grad norm or update)."""
    head = f"{what}: {nonfinite_cause(result)}; the update was not applied"
    if skip:
        return f"{head}; skipped (run.skip_nonfinite_steps)"
    latest = f"step {latest_checkpoint}" if latest_checkpoint is not None else "none yet"
    return (f"{head}; stopping without saving (latest checkpoint: {latest}, which holds only finite parameters). "
            "Lower the learning rate or check the data; run.skip_nonfinite_steps=true skips such steps instead")


def summary_text(summary: dict[str, Any], achieved: str | None, extra=(), outputs=(), *, unit: str = "steps") -> str:
    """The lines printed at the end of a run: how many `unit` ran and `achieved` (what they achieved, if given),
    `extra`, the planning time, then where everything is: checkpoint, metrics, the last timeline, the run's own
    `outputs`, HF export."""
    done_line = (f"done: {summary['steps_done'] - summary['start_step']} {unit} (now at step {summary['steps_done']}) "
                 f"in {summary['seconds']:.1f} s" + (f", {achieved}" if achieved else ""))
    if summary["steps_done"] == summary["start_step"]:
        done_line = (f"nothing to do: the run in {summary['out_dir']} is already at step {summary['steps_done']} "
                     "(raise run.steps to go on, or choose another run.out_dir for a new run)")
    lines = [done_line, *extra, *timing_lines(summary), f"checkpoint: {summary['checkpoint']}",
             f"metrics:    {summary['metrics']} (TensorBoard: {summary['tensorboard']})", *outputs]
    if summary.get("timeline"):
        lines.append(f"timeline:   {summary['timeline']} (bubble rate {summary['bubble_rate']:.1%})")
    if summary["hf_export"]:
        lines.append(f"HF export:  {summary['hf_export']}")
    return "\n".join(lines)
