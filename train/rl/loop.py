"""The RL loop (GRPO-style, DPPO by default): prompts -> rollout with the current policy -> rewards -> group
advantages -> several minibatch updates with the engine (LB-Mini plans for ODC) -> metrics / checkpoints.

`run_rl(config)` is the whole job. One *step* is one rollout and its `run.updates_per_step` optimizer updates.
The prompts, the sampling key and the minibatch split of step k are pure functions of (seed, k), and rollouts
are sampled from the engine's parameters, so a run resumed from a checkpoint continues exactly (bit for bit with
`engine.deterministic` on ODC). A step is applied as a whole or not at all as far as checkpoints go: a reward
function that fails, or a non-finite update (which the engine never applies), stops the run before anything of that
step is saved, so the latest checkpoint stays the last consistent state; with `run.skip_nonfinite_steps` a
non-finite update is skipped instead and counted (`skipped_updates`). With `warmstart.sft_steps > 0` the run first fine-tunes the model on
the task's solutions with the SFT trainer (`rl_warmstart`) and starts RL from that policy; with
`loss.kl_coef > 0` the KL penalty is taken to that initial policy.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import jax
import numpy as np

from jodc.balance import get_planner
from jodc.fsdp import NonFiniteStepError
from jodc.fsdp.decoder import decoder_staged_model
from jodc.fsdp.optim import learning_rate_schedule
from jodc.losses import grpo_advantages

from ..core.checkpoint import CheckpointStore, export_hf
from ..core.config import ConfigError, DataConfig, RunConfig, SftConfig, resume_mismatches, save_yaml, to_dict
from ..core.metrics import TENSORBOARD_DIR, read_metrics
from ..core.model import build_decoder, cost_model, hf_tokenizer_path
from .batch import pack_minibatch, split_minibatches, training_sequences
from .config import RLConfig
from .loss import build_objective, summarize_metrics
from .metrics import CURVES_FILE, RLMetricsLogger, plot_curves, rollout_metrics, update_metrics
from .reference import ReferencePolicy
from .rewards import RewardFunction, load_reward_function, score
from .rollout import sample_rollout, sampling_params
from .tasks import eval_problems, fingerprint_task, make_task, step_problems, training_pool
from .warmstart import run_warmstart
from ..core.run_common import (TimedPlanner, TrainingRun, check_data_fingerprint, output_lines, pin_schedule_length,
                         timing_lines, timing_summary)
from ..sft.loop import make_engine, nonfinite_message, optimizer_config
from ..core.tokenizer import load_tokenizer

CHECKPOINT_DIR, HF_DIR, CONFIG_FILE = "checkpoints", "hf", "config.yaml"
EVAL_SAMPLES = 4  # sampled responses per evaluation problem


def engine_settings(config: RLConfig) -> SftConfig:
    """The RL run's engine and optimizer sections as an SFT config, so the engine is built exactly as the SFT
    trainer builds it (`sft.make_engine`); the learning-rate schedule spans the run's optimizer updates."""
    return SftConfig(optimizer=dataclasses.replace(config.optimizer, total_steps=config.total_steps),
                     engine=config.engine, data=DataConfig(max_length=config.engine.token_cap),
                     run=RunConfig(seed=config.run.seed))


class RLRun(TrainingRun):
    """One invocation of an RL run (see `run_rl`); its parts are built in `__init__`, `train` runs it."""

    def __init__(self, config: RLConfig, *, reward_fn: RewardFunction | None = None,
                 log: Callable[[str], None] = print):
        self.config, self.log = config, log
        e, run, ckpt, r = config.engine, config.run, config.checkpoint, config.rollout
        self.out_dir = os.path.abspath(run.out_dir)
        os.makedirs(self.out_dir, exist_ok=True)
        self.store = CheckpointStore(os.path.join(self.out_dir, CHECKPOINT_DIR), keep=ckpt.keep_checkpoints)
        self.engine = None
        self.skipped_updates = 0  # optimizer updates not applied for a non-finite value
        self.step_times: list[tuple[float, float]] = []  # (plan_ms, step_seconds) of the steps run here
        try:
            resume_from = self._resumable_step()  # refuse a foreign checkpoint before building anything
            if resume_from is not None:
                self.config = config = pin_schedule_length(config, self.store.read_trainer_state(resume_from), log)
            self.objective = build_objective(config.loss, r)
            self.task = make_task(config.task.name, **config.task.task_options())
            self.data_fingerprint = fingerprint_task(self.task)
            if resume_from is not None:
                check_data_fingerprint(self.store.read_trainer_state(resume_from).get("data_fingerprint"),
                                       self.data_fingerprint, accept=ckpt.accept_changed_data,
                                       where=self.store.step_dir(resume_from), log=log)
            self.pool = training_pool(self.task, run.seed, config.task.pool_size) if config.task.pool_size else None
            self.eval_set = eval_problems(self.task, run.seed, config.task.eval_problems)
            if reward_fn is not None:
                self.reward_fn = reward_fn
            elif config.task.reward_fn:
                self.reward_fn = load_reward_function(config.task.reward_fn)
            elif config.task.name == "jsonl":
                raise ConfigError("task.name=jsonl has no built-in reward: set task.reward_fn ('module:function' "
                                  "or 'file.py:function'), or pass reward_fn= to run_rl")
            else:
                self.reward_fn = self.task.reward
            model_section = config.model
            if config.warmstart.sft_steps:
                model_section = dataclasses.replace(model_section,
                                                    hf_path=run_warmstart(config, self.task, log=log))
            self.tokenizer = load_tokenizer(hf_tokenizer_path(model_section))
            self.model_config, groups = build_decoder(model_section, self.tokenizer, max_length=e.token_cap,
                                                      compute_dtype=e.compute_dtype, seed=run.seed)
            self.model, groups = decoder_staged_model(self.model_config, groups, seed=run.seed,
                                                      head_loss=self.objective.head_loss,
                                                      metric_names=self.objective.metric_names)
            self.reference = (ReferencePolicy(self.model_config, groups, temperature=r.temperature,
                                              bucket=r.prompt_bucket) if config.loss.kl_coef else None)
            self.sampling = sampling_params(self.tokenizer, self.model_config, max_new_tokens=r.max_new_tokens,
                                            temperature=r.temperature,
                                            top_k=r.top_k if self.objective.uses_topk else 0,
                                            prompt_bucket=r.prompt_bucket)
            self.greedy = dataclasses.replace(self.sampling, temperature=0.0, top_k_logprobs=0)
            self.eval_sampling = dataclasses.replace(self.sampling, top_k_logprobs=0)
            self.planner = TimedPlanner(get_planner(e.planner_name))  # its wall time is the plan_ms metric
            self.cost_model = cost_model(e.cost_model, self.model_config)
            settings = engine_settings(config)
            self.lr_schedule = learning_rate_schedule(optimizer_config(settings))
            self.engine = make_engine(settings, self.model, groups)
            self.start_step = self._restore(resume_from) if resume_from is not None else 0
        except BaseException:
            self.close()
            raise
        save_yaml(config, os.path.join(self.out_dir, CONFIG_FILE))
        self.last_saved_step = self.start_step if self.start_step else None

    # -- resume ----------------------------------------------------------------------------------------------------
    def _resumable_step(self) -> int | None:
        """The latest checkpoint's step when this run may resume from it (None without checkpoints)."""
        return self.store.resumable_step(self.config.checkpoint.resume,
                                         lambda saved: resume_mismatches(saved, self.config))

    def _restore(self, step: int) -> int:
        engine_state, trainer_state = self.store.restore(step, self.engine.state_dict())
        self.skipped_updates = int(trainer_state.get("skipped_updates", 0))
        expected_updates = step * self.config.run.updates_per_step - self.skipped_updates
        if trainer_state.get("optimizer_updates") != expected_updates:
            raise RuntimeError(f"checkpoint {self.store.step_dir(step)} is inconsistent: step {step} with "
                               f"{trainer_state.get('optimizer_updates')} optimizer updates, expected "
                               f"{expected_updates}")
        engine_state["step"] = expected_updates
        self.engine.load_state_dict(engine_state)
        self.log(f"resumed from {self.store.step_dir(step)} (step {step})")
        return step

    def _trainer_state(self, done: int) -> dict[str, Any]:
        return {"config": to_dict(self.config), "optimizer_updates": self.engine.steps_done,
                "skipped_updates": self.skipped_updates, "data_fingerprint": self.data_fingerprint}

    # -- pieces of a step ------------------------------------------------------------------------------------------
    def rollout_key(self, step: int) -> jax.Array:
        """The sampling key of 0-based step `step`."""
        return jax.random.fold_in(jax.random.PRNGKey(self.config.run.seed), step)

    def evaluate(self, step: int) -> dict[str, float]:
        """The current policy on the fixed held-out evaluation set: `eval_accuracy` (greedy decoding) and
        `eval_sampled_reward` (mean reward of `EVAL_SAMPLES` responses per problem at the rollout temperature,
        fixed key: the quantity RL optimises); `step` is for error messages."""
        prompts = [p.prompt for p in self.eval_set]
        params = self.engine.params()
        out = {}
        for key, group_size, sampling in (("eval_accuracy", 1, self.greedy),
                                          ("eval_sampled_reward", EVAL_SAMPLES, self.eval_sampling)):
            rollout = sample_rollout(self.model_config, params, self.tokenizer, prompts, group_size=group_size,
                                     sampling=sampling, key=jax.random.PRNGKey(self.config.run.seed))
            rewards = score(self.reward_fn, rollout.prompts, rollout.responses, step=step)
            out[key] = float(np.mean(rewards >= self.config.task.success_reward) if group_size == 1
                             else np.mean(rewards))
        return out

    def _step(self, step: int) -> dict[str, Any]:
        """Runs 0-based step `step`; returns its metrics record."""
        e, run, r = self.config.engine, self.config.run, self.config.rollout
        started = time.perf_counter()
        record: dict[str, Any] = {"step": step + 1}
        if run.eval_every and step % run.eval_every == 0:
            eval_started = time.perf_counter()
            record.update(self.evaluate(step + 1))
            record["eval_seconds"] = time.perf_counter() - eval_started
        problems = step_problems(self.task, run.seed, step, r.prompts_per_step, pool=self.pool)
        rollout = sample_rollout(self.model_config, self.engine.params(), self.tokenizer, [p.prompt for p in problems],
                                 group_size=r.group_size, sampling=self.sampling, key=self.rollout_key(step))
        reward_started = time.perf_counter()
        rewards = score(self.reward_fn, rollout.prompts, rollout.responses, step=step + 1)
        reward_seconds = time.perf_counter() - reward_started
        advantages = np.asarray(grpo_advantages(rewards.astype(np.float32), r.group_size,
                                                normalize_std=self.config.loss.normalize_std))
        ref_started = time.perf_counter()
        ref_logprobs = self.reference.response_logprobs(rollout) if self.reference else None
        reference_seconds = time.perf_counter() - ref_started
        sequences = training_sequences(rollout, advantages, with_topk=self.objective.uses_topk,
                                       ref_logprobs=ref_logprobs)
        updates, train_seconds, tokens, microbatches = [], 0.0, 0, []
        learning_rate = float(self.lr_schedule(self.engine.steps_done))
        self.planner.take_ms()
        for indices in split_minibatches(len(sequences), run.updates_per_step, seed=run.seed, step=step):
            update_started = time.perf_counter()
            _, arrays = pack_minibatch(sequences, indices, planner=self.planner, num_devices=e.devices,
                                       token_cap=e.token_cap, cost_model=self.cost_model,
                                       aggregation=self.objective.aggregation,
                                       skip_empty_microbatches=e.name == "odc")
            try:
                result = self.engine.step(arrays)
            except NonFiniteStepError as e:  # not applied: the engine kept its previous state
                result = e.result
                self.skipped_updates += 1
                what = f"step {step + 1}, update {len(updates) + 1} of {run.updates_per_step}"
                if not run.skip_nonfinite_steps:
                    raise FloatingPointError(nonfinite_message(what, result, self.store.latest_step(),
                                                               skip=False)) from None
                self.log(nonfinite_message(what, result, None, skip=True))
                train_seconds += time.perf_counter() - update_started
                continue
            train_seconds += time.perf_counter() - update_started
            updates.append({"loss": result.loss, "grad_norm": result.grad_norm,
                            **summarize_metrics(result.metrics, self.objective)})
            tokens += arrays.num_tokens
            microbatches.append(result.microbatches)
        seconds = time.perf_counter() - started
        plan_ms = self.planner.take_ms()  # every update's plan: part of train_seconds
        self.step_times.append((plan_ms, seconds))
        record.update(rollout_metrics(rewards, r.group_size, rollout.response_lengths, rollout.finished,
                                      success_reward=self.config.task.success_reward))
        # every update of the step skipped (non-finite): no loss to report
        record.update(update_metrics(updates, unstable_kl=run.unstable_kl) if updates else
                      {"loss": float("nan"), "grad_norm": float("nan")})
        record["skipped_updates"] = self.skipped_updates
        record.update({"learning_rate": learning_rate, "tokens": tokens,
                       "tokens_per_s": tokens / train_seconds if train_seconds > 0 else 0.0,
                       "microbatches": microbatches, "rollout_seconds": rollout.seconds,
                       "reward_seconds": reward_seconds, "reference_seconds": reference_seconds,
                       "train_seconds": train_seconds, "plan_ms": plan_ms, "step_seconds": seconds,
                       "rollout_fraction": rollout.seconds / seconds, "train_fraction": train_seconds / seconds})
        return record

    # -- the loop --------------------------------------------------------------------------------------------------
    def train(self, stop_at_step: int | None = None) -> dict[str, Any]:
        """Runs steps start_step+1 .. run.steps (or stop_at_step), then finishes the run.

        Ctrl-C between steps saves a checkpoint of the last finished step before stopping; an error inside a step
        (a failing reward function, a non-finite loss) saves nothing, so the latest checkpoint stays consistent.
        """
        run, ckpt, logs = self.config.run, self.config.checkpoint, self.config.logging
        last = run.steps if stop_at_step is None else min(run.steps, stop_at_step)
        started = time.perf_counter()
        logger = RLMetricsLogger(self.out_dir, total_steps=run.steps, start_step=self.start_step, progress=logs.progress)
        done, consistent = self.start_step, True
        try:
            for step in range(self.start_step, last):
                consistent = False
                record = self._step(step)
                done, consistent = step + 1, True
                if done % logs.log_every == 0 or done == last:
                    logger.log(record)
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
            latest = self.store.latest_step()
            logger.write(f"interrupted; the latest checkpoint is {self.store.step_dir(latest)}"
                         if latest is not None else "interrupted before any checkpoint")
            raise
        finally:
            logger.close()
        return self._finish(done, time.perf_counter() - started, logger.path)

    def _finish(self, done: int, seconds: float, metrics_path: str) -> dict[str, Any]:
        run, ckpt = self.config.run, self.config.checkpoint
        records = read_metrics(metrics_path)
        final_eval = self.evaluate(done) if run.eval_every and done > self.start_step else None
        curves = plot_curves(records, os.path.join(self.out_dir, CURVES_FILE), final_eval=final_eval,
                             title=f"{self.config.loss.name} on {self.config.task.name}") if records else None
        hf_path = None
        if ckpt.export_hf and done == run.steps and done > self.start_step:
            hf_path = export_hf(self.model_config, self.engine.params(), self.tokenizer,
                                os.path.join(self.out_dir, HF_DIR))
        ran = [r for r in records if r["step"] > self.start_step]
        summary = {
            "out_dir": self.out_dir, "start_step": self.start_step, "steps_done": done, "seconds": seconds,
            "rewards": [(r["step"], r["reward_mean"]) for r in records],
            "first_reward": ran[0]["reward_mean"] if ran else None,
            "last_reward": ran[-1]["reward_mean"] if ran else None,
            "final_eval_accuracy": final_eval["eval_accuracy"] if final_eval else None,
            "final_eval_sampled_reward": final_eval["eval_sampled_reward"] if final_eval else None,
            "unstable_steps": sum(1 for r in records if r.get("unstable")),
            "checkpoint": self.store.step_dir(done) if done in self.store.steps() else None,
            "metrics": metrics_path, "tensorboard": os.path.join(self.out_dir, TENSORBOARD_DIR),
            "curves": curves, "hf_export": hf_path,
            **timing_summary([p for p, _ in self.step_times], [s for _, s in self.step_times]),
        }
        self.log(format_summary(summary))
        return summary



def format_summary(summary: dict[str, Any]) -> str:
    """The lines printed at the end of a run: what was done and where everything is."""
    lines = []
    ran = summary["steps_done"] - summary["start_step"]
    if ran:
        lines.append(f"done: {ran} RL steps (now at step {summary['steps_done']}) in {summary['seconds']:.1f} s, "
                     f"mean reward {summary['first_reward']:.3f} -> {summary['last_reward']:.3f}, "
                     f"{summary['unstable_steps']} unstable step(s)")
    else:
        lines.append(f"nothing to do: the run in {summary['out_dir']} is already at step {summary['steps_done']} "
                     "(raise run.steps to go on, or choose another run.out_dir for a new run)")
    if summary["final_eval_accuracy"] is not None:
        lines.append(f"held-out evaluation at the end: greedy accuracy {summary['final_eval_accuracy']:.3f}, "
                     f"sampled reward {summary['final_eval_sampled_reward']:.3f}")
    curves = [f"curves:     {summary['curves']}"] if summary["curves"] else []
    return "\n".join(lines + timing_lines(summary) + output_lines(summary, curves))


def run_rl(config: RLConfig, *, reward_fn: RewardFunction | None = None, stop_at_step: int | None = None,
           log: Callable[[str], None] = print) -> dict[str, Any]:
    """Trains (or resumes) the RL run described by `config`; returns the summary (see `format_summary`).

    reward_fn: a `reward(prompt, response) -> float` to use instead of the task's own / `task.reward_fn`.
    stop_at_step: stop after that global step and checkpoint it, as a preempted job would.
    """
    run = RLRun(config, reward_fn=reward_fn, log=log)
    try:
        return run.train(stop_at_step=stop_at_step)
    finally:
        run.close()
