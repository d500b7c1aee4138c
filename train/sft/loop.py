"""The SFT loop: data -> planner -> packed minibatch -> engine step -> metrics / checkpoints, and the end of a run
(final checkpoint, HF export, timeline plot, summary).

`run_sft(config)` is the whole job. It resumes from the latest checkpoint in `run.out_dir` when there is one:
the engine state, the step and the data position are restored, and minibatch k is a pure function of
(seed, k), so with `engine.deterministic` a stopped and resumed run reproduces an uninterrupted one bit for bit.
A checkpoint whose model or data differ from the config is refused rather than overwritten.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jodc.balance import get_planner, lb_mini
from jodc.fsdp import CollectiveEngine, NonFiniteStepError, ODCEngine, OptimizerConfig, ReferenceEngine, SPMDEngine
from jodc.fsdp.decoder import decoder_staged_model
from jodc.fsdp.optim import learning_rate_schedule

from ..core import config as config_lib
from .batching import minibatch_arrays
from ..core.checkpoint import CheckpointStore, export_hf
from ..core.config import EMBEDDED, SFTConfig, parse_length_buckets
from .data import Example, LoadReport, fingerprint_examples, load_jsonl, load_records
from .embedded import generate_records
from ..core.metrics import TENSORBOARD_DIR, MetricsLogger, step_metrics
from ..core.model import build_decoder, cost_model, hf_tokenizer_path
from ..core.run_common import (TimedPlanner, TrainingRun, check_data_fingerprint, output_lines, pin_schedule_length,
                         timing_lines, timing_summary)
from .sampler import MinibatchSampler
from ..core.timeline import events_from_plan, plot_timeline, save_events
from ..core.tokenizer import load_tokenizer

CHECKPOINT_DIR, HF_DIR, TIMELINE_DIR, CONFIG_FILE = "checkpoints", "hf", "timeline", "config.yaml"


def optimizer_config(config: SFTConfig) -> OptimizerConfig:
    """The engines' OptimizerConfig from the optimizer section (total_steps defaults to the run's steps)."""
    fields = dataclasses.asdict(config.optimizer)
    fields["total_steps"] = config.total_steps
    return OptimizerConfig(**fields)


def mesh_devices(platform: str, count: int) -> list:
    """The first `count` devices of `platform`; a clear error when there are fewer."""
    try:
        devices = jax.devices(platform)
    except RuntimeError as e:
        raise RuntimeError(f"engine.platform={platform!r} has no devices here: {e}") from None
    if len(devices) < count:
        hint = (f" On a CPU host, set XLA_FLAGS=--xla_force_host_platform_device_count={count} before JAX is "
                "imported (the jodc-train CLI does this).") if platform == "cpu" else ""
        raise RuntimeError(f"engine.devices={count} but only {len(devices)} {platform} device(s) exist.{hint}")
    return devices[:count]


def load_dataset(config: SFTConfig, tokenizer) -> tuple[list[Example], LoadReport]:
    """The run's examples: the generated default dataset or a JSONL file."""
    data = config.data
    if data.path == EMBEDDED:
        records = generate_records(data.embedded_examples, seed=data.embedded_seed)
        return load_records(records, tokenizer, max_length=data.max_length, overlong=data.overlong,
                            source=f"the embedded dataset (seed {data.embedded_seed})")
    return load_jsonl(data.path, tokenizer, max_length=data.max_length, overlong=data.overlong)


def make_engine(config: SFTConfig, model, groups):
    """The engine of `engine.name` on a 1-D mesh of `engine.devices` devices."""
    e = config.engine
    optimizer = optimizer_config(config)
    dtype = jnp.dtype(e.compute_dtype)
    if e.name == "reference":
        return ReferenceEngine(model, groups, optimizer=optimizer, compute_dtype=dtype, num_devices=e.devices,
                               device=mesh_devices(e.platform, 1)[0])
    mesh = jax.sharding.Mesh(np.array(mesh_devices(e.platform, e.devices)), ("d",))
    buckets = parse_length_buckets(e.length_buckets) if e.length_buckets else None
    if e.name == "odc":
        timeout = float("inf") if e.barrier_timeout_s is None else e.barrier_timeout_s
        return ODCEngine(model, groups, mesh, optimizer=optimizer, compute_dtype=dtype, deterministic=e.deterministic,
                         barrier_timeout_s=timeout, length_buckets=buckets)
    if e.name == "xla_spmd":
        return SPMDEngine(model, groups, mesh, optimizer=optimizer, compute_dtype=dtype, length_buckets=buckets)
    return CollectiveEngine(model, groups, mesh, optimizer=optimizer, compute_dtype=dtype, length_buckets=buckets)


def make_planner(config: SFTConfig):
    """The planner of `engine.planner_name`; LB-Mini is told the engine's length buckets (it then balances what
    microbatches cost at their padded lengths)."""
    e = config.engine
    planner = get_planner(e.planner_name)
    if planner is lb_mini and e.length_buckets:
        return functools.partial(lb_mini, length_buckets=parse_length_buckets(e.length_buckets))
    return planner


def _engine_records_timelines(engine) -> bool:
    return "record_timeline" in inspect.signature(engine.step).parameters


class SFTRun(TrainingRun):
    """One invocation of a training run (see `run_sft`); its parts are built in `__init__`, `train` runs it."""

    def __init__(self, config: SFTConfig, *, log: Callable[[str], None] = print):
        self.config = config
        self.primary = jax.process_index() == 0  # under mpirun only process 0 prints and writes outputs
        self.log = log if self.primary else (lambda *_: None)
        e, run, ckpt = config.engine, config.run, config.checkpoint
        self.out_dir = os.path.abspath(run.out_dir)
        os.makedirs(self.out_dir, exist_ok=True)
        self.store = CheckpointStore(os.path.join(self.out_dir, CHECKPOINT_DIR), keep=ckpt.keep_checkpoints)
        self.engine = None
        self.skipped_steps = 0  # steps not applied for a non-finite value (run.skip_nonfinite_steps)
        self.step_times: list[tuple[float, float]] = []  # (plan_ms, step_seconds) of the steps run here
        try:
            resume_from = self._resumable_step()  # refuse a foreign checkpoint before building anything
            saved = self.store.read_trainer_state(resume_from) if resume_from is not None else None
            if saved is not None:
                self.config = config = pin_schedule_length(config, saved, log)
            self.tokenizer = load_tokenizer(config.data.tokenizer or hf_tokenizer_path(config.model))
            self.examples, report = load_dataset(config, self.tokenizer)
            self.log(f"data: {report.summary()}")
            self.data_fingerprint = fingerprint_examples(self.examples)
            if saved is not None:
                check_data_fingerprint(saved.get("data_fingerprint"), self.data_fingerprint,
                                       accept=ckpt.accept_changed_data, where=self.store.step_dir(resume_from), log=log)
            self.model_config, groups = build_decoder(config.model, self.tokenizer,
                                                      max_length=config.data.max_length,
                                                      compute_dtype=e.compute_dtype, seed=run.seed)
            self.model, groups = decoder_staged_model(self.model_config, groups, seed=run.seed)
            self.sampler = MinibatchSampler(len(self.examples), config.data.sequences_per_minibatch, seed=run.seed)
            self.planner = TimedPlanner(make_planner(config))  # its wall time is the plan_ms metric
            self.cost_model = cost_model(e.cost_model, self.model_config)
            self.lr_schedule = learning_rate_schedule(optimizer_config(config))
            self.engine = make_engine(config, self.model, groups)
            self.start_step = self._restore(resume_from) if resume_from is not None else 0
        except BaseException:
            self.close()
            raise
        if self.primary:
            config_lib.save_yaml(config, os.path.join(self.out_dir, CONFIG_FILE))
        self.last_saved_step = self.start_step if self.start_step else None
        self.timeline: dict[str, Any] | None = None

    # -- resume ----------------------------------------------------------------------------------------------------
    def _resumable_step(self) -> int | None:
        """The latest checkpoint's step when this run may resume from it (None without checkpoints)."""
        return self.store.resumable_step(self.config.checkpoint.resume,
                                         lambda saved: config_lib.resume_mismatches(saved, self.config),
                                         written_for="another model, data or data order")

    def _restore(self, step: int) -> int:
        """Loads checkpoint `step` into the engine; returns the number of steps already done."""
        engine_state, trainer_state = self.store.restore(step, self.engine.state_dict())
        next_minibatch = self.sampler.check_state(trainer_state["sampler"])
        if next_minibatch != step:
            raise RuntimeError(f"checkpoint {step} is inconsistent: its sampler is at minibatch {next_minibatch}")
        self.skipped_steps = int(trainer_state.get("skipped_steps", 0))
        engine_state["step"] = step - self.skipped_steps  # the engine counts applied updates
        self.engine.load_state_dict(engine_state)
        self.log(f"resumed from {self.store.step_dir(step)} (step {step})")
        return step

    # -- one step ----------------------------------------------------------------------------------------------
    def minibatch(self, step: int):
        """(plan, arrays, examples) of 0-based step `step`."""
        examples = [self.examples[i] for i in self.sampler.minibatch(step)]
        plan = self.planner([e.length for e in examples], self.config.engine.devices, self.config.token_cap,
                            cost_model=self.cost_model)
        arrays = minibatch_arrays(plan, examples, skip_empty_microbatches=self.config.engine.name == "odc")
        return plan, arrays, examples

    def _wants_timeline(self, done: int, last: int) -> bool:
        every = self.config.logging.timeline_every
        return every > 0 and (done % every == 0 or done == last)

    def _record_timeline(self, done: int, plan, result) -> None:
        events = getattr(result, "timeline", None)
        source = "engine"
        if not events:
            events = events_from_plan(plan, result.seconds, lockstep=self.config.engine.name == "collective")
            source = "planner-cost estimate"
        directory = os.path.join(self.out_dir, TIMELINE_DIR)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"step_{done:06d}.png")
        e = self.config.engine
        rate = plot_timeline(events, path, num_devices=e.devices,
                             title=f"{e.name} / {e.planner_name}, step {done} ({source})")
        save_events(events, path[:-4] + ".json")
        self.timeline = {"path": path, "bubble_rate": rate, "step": done, "source": source}

    def _trainer_state(self, done: int) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(done), "config": config_lib.to_dict(self.config),
                "skipped_steps": self.skipped_steps, "data_fingerprint": self.data_fingerprint}

    # -- the loop ----------------------------------------------------------------------------------------------
    def train(self, stop_at_step: int | None = None) -> dict[str, Any]:
        """Runs steps start_step+1 .. run.steps (or stop_at_step), then finishes the run.

        Ctrl-C between steps saves a checkpoint of the last finished step before stopping; during a step or a
        save the engine state is not known to be consistent, so the latest earlier checkpoint stays the one.
        """
        run, ckpt, logs = self.config.run, self.config.checkpoint, self.config.logging
        last = run.steps if stop_at_step is None else min(run.steps, stop_at_step)
        losses: list[tuple[int, float]] = []
        started = time.perf_counter()
        logger = (MetricsLogger(self.out_dir, total_steps=run.steps, start_step=self.start_step, progress=logs.progress)
                  if self.primary else _SilentLogger())
        done, consistent = self.start_step, True
        try:
            for step in range(self.start_step, last):
                consistent = False
                loss = self._step(step, last, logger)
                done, consistent = step + 1, True
                losses.append((done, loss))
                logger.advance()
                if ckpt.save_every and done % ckpt.save_every == 0:
                    consistent = False
                    self._save(done)
                    consistent = True
            consistent = False
            self._save(done)
        except KeyboardInterrupt:
            if consistent and done > (self.last_saved_step or 0):
                self._save(done)
            logger.write(f"interrupted; the latest checkpoint is {self.store.step_dir(self.store.latest_step())}"
                         if self.store.latest_step() is not None else "interrupted before any checkpoint")
            raise
        finally:
            logger.close()
        return self._finish(done, losses, time.perf_counter() - started, logger.path)

    def _step(self, step: int, last: int, logger: MetricsLogger) -> float:
        """Runs 0-based step `step`, logs it, draws its timeline if due; returns the loss."""
        run, logs = self.config.run, self.config.logging
        host_start = time.perf_counter()
        self.planner.take_ms()
        plan, arrays, examples = self.minibatch(step)
        host_seconds = time.perf_counter() - host_start
        plan_ms = self.planner.take_ms()  # part of host_seconds
        want_timeline = self._wants_timeline(step + 1, run.steps) and self.primary  # same steps if resumed or not
        kwargs = ({"record_timeline": True} if want_timeline and _engine_records_timelines(self.engine)
                  and jax.process_count() == 1 else {})  # every process runs the same program
        learning_rate = float(self.lr_schedule(self.engine.steps_done))
        done = step + 1
        try:
            result = self.engine.step(arrays, **kwargs)
        except NonFiniteStepError as e:  # the engine kept its previous state: nothing non-finite was applied
            result = e.result
            if not run.skip_nonfinite_steps:
                raise FloatingPointError(nonfinite_message(f"step {done}", result, self.store.latest_step(),
                                                           skip=False)) from None
            self.skipped_steps += 1
            logger.write(nonfinite_message(f"step {done}", result, None, skip=True))
        self.step_times.append((plan_ms, result.seconds))
        extra = {"host_seconds": host_seconds, "plan_ms": plan_ms, "skipped_steps": self.skipped_steps}
        if not getattr(result, "applied", True):
            extra["skipped"] = True
        extra.update({f"model_{k}": v for k, v in (getattr(result, "metrics", None) or {}).items()})
        if want_timeline:
            self._record_timeline(done, plan, result)
            extra["bubble_rate"] = self.timeline["bubble_rate"]
        if done % logs.log_every == 0 or done == last:
            logger.log(step_metrics(
                step=done, loss=result.loss, grad_norm=result.grad_norm, seconds=result.seconds,
                tokens=arrays.num_tokens, loss_tokens=int(arrays.normalizer), sequences=len(examples),
                microbatches=result.microbatches, learning_rate=learning_rate, **extra))
        return result.loss

    def _finish(self, done: int, losses, seconds: float, metrics_path: str) -> dict[str, Any]:
        hf_path = None
        if self.config.checkpoint.export_hf and done == self.config.run.steps:
            params = self.engine.params()  # every process: it gathers from all of them
            if self.primary:
                hf_path = export_hf(self.model_config, params, self.tokenizer, os.path.join(self.out_dir, HF_DIR))
        summary = {
            "out_dir": self.out_dir, "start_step": self.start_step, "steps_done": done,
            "losses": losses, "first_loss": losses[0][1] if losses else None,
            "last_loss": losses[-1][1] if losses else None, "seconds": seconds,
            "checkpoint": self.store.step_dir(done) if done in self.store.steps() else None,
            "metrics": metrics_path, "tensorboard": os.path.join(self.out_dir, TENSORBOARD_DIR),
            "timeline": self.timeline["path"] if self.timeline else None,
            "bubble_rate": self.timeline["bubble_rate"] if self.timeline else None,
            "hf_export": hf_path,
            **timing_summary([p for p, _ in self.step_times], [s for _, s in self.step_times]),
        }
        self.log(format_summary(summary))
        return summary



class _SilentLogger:
    """The metrics logger of processes other than 0 in a multi-process run: they write nothing."""

    path = None

    def log(self, record) -> None: ...

    def advance(self, steps: int = 1) -> None: ...

    def write(self, message: str) -> None: ...

    def close(self) -> None: ...


def nonfinite_message(what: str, result, latest_checkpoint: int | None, *, skip: bool) -> str:
    """The line of a step that was not applied (non-finite loss, grad norm or update), for SFT and RL."""
    cause = "loss" if not np.isfinite(result.loss) else "gradients or updated parameters"
    head = (f"{what}: non-finite {cause} (loss {result.loss}, global grad norm {result.grad_norm}); the update was "
            "not applied")
    if skip:
        return f"{head}; skipped (run.skip_nonfinite_steps)"
    latest = f"step {latest_checkpoint}" if latest_checkpoint is not None else "none yet"
    return (f"{head}; stopping without saving (latest checkpoint: {latest}, which holds only finite parameters). "
            "Lower the learning rate or check the data; run.skip_nonfinite_steps=true skips such steps instead")


def format_summary(summary: dict[str, Any]) -> str:
    """The lines printed at the end of a run: what was done and where everything is."""
    lines = []
    ran = summary["steps_done"] - summary["start_step"]
    if summary["losses"]:
        lines.append(f"done: {ran} steps (now at step {summary['steps_done']}) in {summary['seconds']:.1f} s, loss "
                     f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f}")
    else:
        lines.append(f"nothing to do: the run in {summary['out_dir']} is already at step {summary['steps_done']} "
                     "(raise run.steps to go on, or choose another run.out_dir for a new run)")
    timeline = ([f"timeline:   {summary['timeline']} (bubble rate {summary['bubble_rate']:.1%})"]
                if summary["timeline"] else [])
    return "\n".join(lines + timing_lines(summary) + output_lines(summary, timeline))


def run_sft(config: SFTConfig, *, stop_at_step: int | None = None, log: Callable[[str], None] = print
            ) -> dict[str, Any]:
    """Trains (or resumes) the run described by `config`; returns the summary (see `format_summary`).

    stop_at_step: stop after that global step and checkpoint it, as a preempted job would (the run resumes
    from there when called again with the same config).
    """
    run = SFTRun(config, log=log)
    try:
        return run.train(stop_at_step=stop_at_step)
    finally:
        run.close()
