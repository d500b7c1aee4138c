"""The SFT step: data -> planner -> packed minibatch -> one engine update -> its metrics record; the loop around
it (checkpoints, metrics, timelines, the end of a run) is `train.core.trainer.Trainer`'s.

`run_sft(config)` is the whole job. It resumes from the latest checkpoint in `run.out_dir` when there is one:
the engine state, the step and the data position are restored, and minibatch k is a pure function of
(seed, k), so with `engine.deterministic` a stopped and resumed run reproduces an uninterrupted one bit for bit.
A checkpoint whose model or data differ from the config is refused rather than overwritten.
"""
from __future__ import annotations

from typing import Any, Callable

from jodc.models.tokenizer import load_tokenizer

from ..core.config import EMBEDDED, SFTConfig
from ..core.metrics import step_metrics
from ..core.model import hf_tokenizer_path
from ..core.trainer import CHECKPOINT_DIR, Trainer, run, summary_text
from .batching import minibatch_arrays
from .data import fingerprint_examples, load_jsonl, load_records
from .embedded import generate_records
from .sampler import MinibatchSampler

__all__ = ["CHECKPOINT_DIR", "SFTRun", "format_summary", "run_sft"]


def format_summary(summary: dict[str, Any]) -> str:
    """The lines printed at the end of a run: what was done and where everything is."""
    losses = f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}" if summary["losses"] else None
    return summary_text(summary, losses)


class SFTRun(Trainer):
    """One invocation of an SFT run (see `run_sft`): the data, model and engine, and the step; the loop, resume and
    outputs are the `Trainer`'s."""

    written_for = "another model, data or data order"
    format_summary = staticmethod(format_summary)

    def load_data(self) -> dict:
        """The tokenizer and the examples (the generated default dataset or a JSONL file); their fingerprint."""
        data = self.config.data
        self.tokenizer = load_tokenizer(data.tokenizer or hf_tokenizer_path(self.config.model))
        if data.path == EMBEDDED:
            records = generate_records(data.embedded_examples, seed=data.embedded_seed)
            self.examples, report = load_records(records, self.tokenizer, max_length=data.max_length,
                                                 overlong=data.overlong, token_cap=self.config.token_cap,
                                                 source=f"the embedded dataset (seed {data.embedded_seed})")
        else:
            self.examples, report = load_jsonl(data.path, self.tokenizer, max_length=data.max_length,
                                               overlong=data.overlong, token_cap=self.config.token_cap)
        self.log(f"data: {report.summary()}")
        return fingerprint_examples(self.examples)

    def build(self) -> None:
        data = self.config.data
        self.sampler = MinibatchSampler(len(self.examples), data.sequences_per_minibatch, seed=self.config.run.seed)
        self.build_engine(self.config.model, max_length=data.max_length)

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
        arrays = minibatch_arrays(plan, examples, skip_empty_microbatches=not self.engine.lockstep)
        return plan, arrays, examples

    def train_step(self, step: int) -> dict[str, Any]:
        """Runs 0-based step `step` (one optimizer update, its timeline when due); returns its record."""
        done = step + 1
        with self.timers("host"):  # host_seconds: the data and the plan (plan_ms is part of it)
            plan, arrays, examples = self.minibatch(step)
        learning_rate = self.engine.learning_rate
        result = self.update(arrays, f"step {done}", timeline=(done, plan) if self.timeline_due(done) else None)
        extra = {self.SKIPPED_KEY: self.skipped, **{f"model_{k}": v for k, v in result.metrics.items()}}
        if self.config.engine.context_parallel:  # sequences split over context-parallel groups this step
            extra["cp_sequences"] = plan.num_cp_sequences
        if not result.applied:
            extra["skipped"] = True
        return step_metrics(step=done, loss=result.loss, grad_norm=result.grad_norm, seconds=result.seconds,
                            tokens=arrays.num_tokens, loss_tokens=int(arrays.normalizer), sequences=len(examples),
                            microbatches=result.microbatches, learning_rate=learning_rate, **extra)

    def summary_fields(self, done: int, final_eval) -> dict[str, Any]:
        losses = [(r["step"], r["loss"]) for r in self.records]
        return {"losses": losses, "first_loss": losses[0][1] if losses else None,
                "last_loss": losses[-1][1] if losses else None}


def run_sft(config: SFTConfig, *, stop_at_step: int | None = None, log: Callable[[str], None] = print,
            engine_factory=None, callbacks=()) -> dict[str, Any]:
    """Trains (or resumes) the run described by `config`; returns the summary (see `format_summary`).

    stop_at_step: stop after that global step and checkpoint it, as a preempted job would (the run resumes
    from there when called again with the same config).
    engine_factory, callbacks: extension points (train/core/callbacks.py).
    """
    return run(SFTRun, config, stop_at_step=stop_at_step, log=log, engine_factory=engine_factory,
               callbacks=callbacks)
