"""The SFT step: data -> planner -> packed minibatch -> one engine update -> its metrics record; the loop around
it (checkpoints, metrics, timelines, the end of a run) is `train.core.trainer.Trainer`'s.

`run_sft(config)` is the whole job. It resumes from the latest checkpoint in `run.out_dir` when there is one:
the engine state, the step and the data position are restored, and minibatch k is a pure function of
(seed, k), so with `engine.deterministic` a stopped and resumed run reproduces an uninterrupted one bit for bit.
A checkpoint whose model or data differ from the config is refused rather than overwritten.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jodc.balance import get_planner, lb_mini
from jodc.fsdp import CollectiveEngine, ODCEngine, OptimizerConfig, ReferenceEngine, SPMDEngine
from jodc.fsdp.decoder import decoder_staged_model
from jodc.fsdp.optim import learning_rate_schedule
from jodc.models.tokenizer import load_tokenizer

from ..core.config import EMBEDDED, SFTConfig, parse_length_buckets
from ..core.metrics import step_metrics
from ..core.model import build_decoder, cost_model, hf_tokenizer_path
from ..core.trainer import CHECKPOINT_DIR, Trainer, run, summary_text
from .batching import minibatch_arrays
from .data import Example, LoadReport, fingerprint_examples, load_jsonl, load_records
from .embedded import generate_records
from .sampler import MinibatchSampler

__all__ = ["CHECKPOINT_DIR", "SFTRun", "format_summary", "make_engine", "optimizer_config", "run_sft"]


def optimizer_config(config: SFTConfig) -> OptimizerConfig:
    """The engines' OptimizerConfig: the optimizer section with the schedule's length in effect."""
    return dataclasses.replace(config.optimizer, total_steps=config.total_steps)


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
    common = {"optimizer": optimizer_config(config), "compute_dtype": jnp.dtype(e.compute_dtype)}
    if e.name == "reference":
        return ReferenceEngine(model, groups, num_devices=e.devices, device=mesh_devices(e.platform, 1)[0], **common)
    mesh = jax.sharding.Mesh(np.array(mesh_devices(e.platform, e.devices)), ("d",))
    common["length_buckets"] = parse_length_buckets(e.length_buckets) if e.length_buckets else None
    if e.name == "odc":
        timeout = float("inf") if e.barrier_timeout_s is None else e.barrier_timeout_s
        return ODCEngine(model, groups, mesh, deterministic=e.deterministic, barrier_timeout_s=timeout, **common)
    return {"xla_spmd": SPMDEngine, "collective": CollectiveEngine}[e.name](model, groups, mesh, **common)


def make_planner(config: SFTConfig):
    """The planner of `engine.planner_name`; LB-Mini is told the engine's length buckets (it then balances what
    microbatches cost at their padded lengths)."""
    e = config.engine
    planner = get_planner(e.planner_name)
    if planner is lb_mini and e.length_buckets:
        return functools.partial(lb_mini, length_buckets=parse_length_buckets(e.length_buckets))
    return planner


class SFTRun(Trainer):
    """One invocation of an SFT run (see `run_sft`): the data, model and engine, and the step; the loop, resume and
    outputs are the `Trainer`'s."""

    written_for = "another model, data or data order"

    def load_data(self) -> dict:
        config = self.config
        self.tokenizer = load_tokenizer(config.data.tokenizer or hf_tokenizer_path(config.model))
        self.examples, report = load_dataset(config, self.tokenizer)
        self.log(f"data: {report.summary()}")
        return fingerprint_examples(self.examples)

    def build(self) -> None:
        config, seed = self.config, self.config.run.seed
        self.model_config, groups = build_decoder(config.model, self.tokenizer, max_length=config.data.max_length,
                                                  compute_dtype=config.engine.compute_dtype, seed=seed)
        self.model, groups = decoder_staged_model(self.model_config, groups, seed=seed)
        self.sampler = MinibatchSampler(len(self.examples), config.data.sequences_per_minibatch, seed=seed)
        self.planner = self.timers.timed("plan", make_planner(config))  # its wall time is the plan_ms metric
        self.cost_model = cost_model(config.engine.cost_model, self.model_config)
        self.lr_schedule = learning_rate_schedule(optimizer_config(config))
        self.engine = make_engine(config, self.model, groups)

    def restored(self, step: int, state: dict[str, Any]) -> int:
        next_minibatch = self.sampler.check_state(state["sampler"])
        if next_minibatch != step:
            raise RuntimeError(f"checkpoint {step} is inconsistent: its sampler is at minibatch {next_minibatch}")
        return step - self.skipped

    def checkpoint_state(self, done: int) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(done)}

    def minibatch(self, step: int):
        """(plan, arrays, examples) of 0-based step `step`."""
        examples = [self.examples[i] for i in self.sampler.minibatch(step)]
        plan = self.planner([e.length for e in examples], self.config.engine.devices, self.config.token_cap,
                            cost_model=self.cost_model)
        arrays = minibatch_arrays(plan, examples, skip_empty_microbatches=self.config.engine.name == "odc")
        return plan, arrays, examples

    def train_step(self, step: int) -> dict[str, Any]:
        """Runs 0-based step `step` (one optimizer update, its timeline when due); returns its record."""
        done = step + 1
        with self.timers("host"):  # host_seconds: the data and the plan (plan_ms is part of it)
            plan, arrays, examples = self.minibatch(step)
        learning_rate = float(self.lr_schedule(self.engine.steps_done))
        result = self.update(arrays, f"step {done}", timeline=(done, plan) if self.timeline_due(done) else None)
        extra = {self.skipped_key: self.skipped, **{f"model_{k}": v for k, v in result.metrics.items()}}
        if not result.applied:
            extra["skipped"] = True
        if self.timeline and self.timeline["step"] == done:
            extra["bubble_rate"] = self.timeline["bubble_rate"]
        return step_metrics(step=done, loss=result.loss, grad_norm=result.grad_norm, seconds=result.seconds,
                            tokens=arrays.num_tokens, loss_tokens=int(arrays.normalizer), sequences=len(examples),
                            microbatches=result.microbatches, learning_rate=learning_rate, **extra)

    def summary_fields(self, done: int, final_eval) -> dict[str, Any]:
        losses = [(r["step"], r["loss"]) for r in self.records]
        timeline = self.timeline or {}
        return {"losses": losses, "first_loss": losses[0][1] if losses else None,
                "last_loss": losses[-1][1] if losses else None, "timeline": timeline.get("path"),
                "bubble_rate": timeline.get("bubble_rate")}

    def format_summary(self, summary: dict[str, Any]) -> str:
        return format_summary(summary)


def format_summary(summary: dict[str, Any]) -> str:
    """The lines printed at the end of a run: what was done and where everything is."""
    done = (f"done: {summary['steps_done'] - summary['start_step']} steps (now at step {summary['steps_done']}) in "
            f"{summary['seconds']:.1f} s, loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}"
            if summary["losses"] else None)
    timeline = ([f"timeline:   {summary['timeline']} (bubble rate {summary['bubble_rate']:.1%})"]
                if summary["timeline"] else [])
    return summary_text(summary, done, outputs=timeline)


def run_sft(config: SFTConfig, *, stop_at_step: int | None = None, log: Callable[[str], None] = print
            ) -> dict[str, Any]:
    """Trains (or resumes) the run described by `config`; returns the summary (see `format_summary`).

    stop_at_step: stop after that global step and checkpoint it, as a preempted job would (the run resumes
    from there when called again with the same config).
    """
    return run(SFTRun, config, stop_at_step=stop_at_step, log=log)
