"""The RL step (GRPO-style, DPPO by default): prompts -> rollout with the current policy -> rewards -> group
advantages -> several minibatch updates with the engine (LB-Mini plans for ODC) -> the step's metrics record.

`run_rl(config)` is the whole job; `RLRun` supplies the data, model, evaluation and step to the `Trainer` core,
which owns the loop, checkpoints, metrics, the evaluation cadence and the summary. One *step* is one rollout and
its `run.updates_per_step` optimizer updates. The prompts, the sampling key and the minibatch split of step k are
pure functions of (seed, k), and rollouts are sampled from the engine's parameters, so a run resumed from a
checkpoint continues exactly (bit for bit with `engine.deterministic` on ODC). A step is applied as a whole or not
at all as far as checkpoints go: a reward function that fails, or a non-finite update (which the engine never
applies), stops the run before anything of that step is saved; with `run.skip_nonfinite_steps` a non-finite
update is skipped instead and counted (`skipped_updates`). With `warmstart.sft_steps > 0` the run first fine-tunes
the model on the task's solutions with the SFT trainer (`warmstart.py`) and starts RL from that policy; with
`loss.kl_coef > 0` the KL penalty is taken to that initial policy. With `loss.kl_in_reward_coef > 0` the KL to
that policy is taken out of the rewards instead (per token, beta from a fixed or adaptive controller, whose state
is part of every checkpoint so a resumed run continues with the same beta); `loss.entropy_coeff > 0` adds an
entropy bonus to the loss. With `loss.advantage: gae` the run is critic PPO with a shared trunk: a value head on
the decoder (its own parameter group), GAE over token rewards with its values (`critic.py`), and the clipped value
loss added to the policy loss (`loss.critic_*`).

With `rollout.max_staleness: k > 0` the rollouts come from a sampler thread (`async_rollouts.py`) that samples
step s from the weights of step max(0, s - k) while the trainer trains (computing them itself, or in a child
process at a low OS priority with `rollout.sampler: process`, `sampler_process.py`); a checkpoint also holds the
k rollouts sampled ahead, so a resumed asynchronous run continues exactly too. With `rollout.dtype: bfloat16` the
sampler runs in bf16 (`sampler.py`), and every step logs its per-token log-prob mismatch with the fp32 trainer at
the same weights. Losses that read old / proximal log-probs get them recomputed (one forward pass per rollout)
whenever the rollouts are stale or mismatched (`loss.py`).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Iterator

import jax
import numpy as np

from jodc.losses import kl_controller_from_state
from jodc.models.tokenizer import load_tokenizer
from jodc.models.layerwise import param_groups

from ..core.metrics import read_metrics
from ..core.model import hf_tokenizer_path, mesh_devices
from ..core.trainer import CHECKPOINT_DIR, Trainer, run
from .advantages import step_advantages
from .assembly import StepInputs
from .batch import extra_specs, local_sequences, pack_local_minibatch, plan_step, travelling_fields
from .config import RLConfig
from .critic import response_values
from .evaluation import EVAL_SAMPLES, evaluate_policy
from .layout import RolloutLayout
from .loss import build_advantages, build_kl_controller, build_objective, summarize_metrics
from .metrics import BAR_FIELDS, CURVES_FILE, format_summary, run_summary_fields, step_record
from .policy_weights import held_copy, policy_weights, trainer_params
from .reference import ShardedReference
from .rewards import RewardFunction, resolve_reward_function
from .rollout import device_shares, encode_prompts, sampling_params
from .rollout_exchange import bytes_received
from .rollout_source import make_rollout_source
from .sampler import RolloutSampler, trainer_logprobs
from .scored import StepRollout
from .tasks import eval_problems, fingerprint_task, make_task, training_pool
from .warmstart import run_warmstart

__all__ = ["CHECKPOINT_DIR", "EVAL_SAMPLES", "RLRun", "format_summary", "run_rl"]


class RLRun(Trainer):
    """One invocation of an RL run (see `run_rl`): the task, rewards, policy and engine, the evaluation and the
    step; the loop, resume and outputs are the `Trainer`'s."""

    bar_fields = BAR_FIELDS
    format_summary = staticmethod(format_summary)

    def __init__(self, config: RLConfig, *, reward_fn: RewardFunction | None = None,
                 log: Callable[[str], None] = print, **extensions):
        self.reward_fn = reward_fn
        self.rollouts = None  # where each step's rollout comes from (rollout_source.py), chosen in `build`
        super().__init__(config, log=log, **extensions)  # engine_factory, callbacks (train/core/callbacks.py)

    def load_data(self) -> dict | None:
        config = self.config
        self.objective = build_objective(config.loss, config.rollout)
        self.advantages = build_advantages(config.loss)
        self.kl_controller = build_kl_controller(config.loss)  # KL in the reward; its beta moves with the run
        self.task = make_task(config.task.name, **config.task.task_options())
        return fingerprint_task(self.task)

    def build(self) -> None:
        config, e, seed, r = self.config, self.config.engine, self.config.run.seed, self.config.rollout
        self.pool = training_pool(self.task, seed, config.task.pool_size) if config.task.pool_size else None
        self.eval_set = eval_problems(self.task, seed, config.task.eval_problems, exclude=self.pool or ())
        if len(self.eval_set) < config.task.eval_problems:
            self.log(f"evaluating on the {len(self.eval_set)} distinct problems outside the training pool "
                     f"(task.eval_problems={config.task.eval_problems})")
        self.reward_fn, reward_spec = resolve_reward_function(self.reward_fn, config.task, self.task)
        # where a step's rollout lives (layout.py): decided here, once
        self.layout = RolloutLayout.of_run(replicated=r.assembly == "replicated", timeout_s=e.barrier_timeout_s)
        # the process of each engine device (mesh order = the minibatch arrays' rows): where sequences are trained;
        # a config asking for more devices than exist fails here, before a warm start has run
        self.device_processes = [d.process_index for d in mesh_devices(e.platform, e.devices)]
        model_section = config.model
        if config.warmstart.sft_steps:
            model_section = dataclasses.replace(model_section, hf_path=run_warmstart(config, self.task, log=self.log))
        self.tokenizer = load_tokenizer(hf_tokenizer_path(model_section))
        # the evaluation set's prompt width, to which every device's share of it pads (the same shapes in any layout)
        self.eval_width = max((len(ids) for ids in encode_prompts(self.tokenizer, [p.prompt for p in self.eval_set])),
                              default=0)
        # context parallelism: a prompt + response may reach the world's capacity (split over groups of devices)
        max_length = e.token_cap * (e.devices if e.context_parallel else 1)
        self.build_engine(model_section, max_length=max_length, head_loss=self.objective.head_loss,
                          metric_names=self.objective.metric_names, value_head=self.objective.critic)
        # the KL reference (the initial policy): a sharded copy of the engine's decoder groups now, before any resume
        self.reference = (ShardedReference(self.model_config, held_copy(self.engine, param_groups(self.model_config)),
                                           self.model.layouts, temperature=r.temperature, bucket=r.prompt_bucket)
                          if config.loss.kl_coef or config.loss.kl_in_reward_coef else None)
        self.step_reference = None  # the reference gathered for the current step's passes
        self.sampling = sampling_params(self.tokenizer, self.model_config, max_new_tokens=r.max_new_tokens,
                                        temperature=r.temperature, top_k=r.top_k if self.objective.uses_topk else 0,
                                        prompt_bucket=r.prompt_bucket)
        self.greedy = dataclasses.replace(self.sampling, temperature=0.0, top_k_logprobs=0)
        self.eval_sampling = dataclasses.replace(self.sampling, top_k_logprobs=0)
        self.sampler = RolloutSampler(task=self.task, seed=seed, pool=self.pool, rollout=r,
                                      model_config=self.model_config, tokenizer=self.tokenizer,
                                      sampling=self.sampling, reward_fn=self.reward_fn,
                                      # fresh problems every step: never the evaluation set's (held out)
                                      held_out=frozenset(p.prompt for p in self.eval_set) if self.pool is None
                                      else frozenset(),
                                      # every engine device samples a share; processes exchange theirs
                                      platform=e.platform, devices=e.devices, layout=self.layout)
        # the responses each engine device samples: the row blocks of the per-sequence forward passes
        self.device_rows = [range(s.start * r.group_size, s.stop * r.group_size)
                            for s in device_shares(r.prompts_per_step, e.devices)]
        self.rollouts = make_rollout_source(r, self.sampler, reward_spec=reward_spec, trainer=self,
                                            callbacks=self.callbacks, deterministic=e.deterministic)

    def restored(self, step: int, state: dict[str, Any]) -> int:
        self.rollouts.restore(step, state, self.store.step_dir(step))
        if self.kl_controller is not None:
            if "kl_controller" not in state:
                raise RuntimeError(f"checkpoint {self.store.step_dir(step)} has no KL controller state, but "
                                   "loss.kl_in_reward_coef > 0 needs it to continue with the same beta")
            self.kl_controller = kl_controller_from_state(state["kl_controller"])
        expected_updates = step * self.config.run.updates_per_step - self.skipped
        if state.get("optimizer_updates") != expected_updates:
            raise RuntimeError(f"checkpoint {self.store.step_dir(step)} is inconsistent: step {step} with "
                               f"{state.get('optimizer_updates')} optimizer updates, expected {expected_updates}")
        return expected_updates

    def checkpoint_state(self, done: int) -> dict[str, Any]:
        state = {"optimizer_updates": self.engine.steps_done}
        if self.kl_controller is not None:  # the beta the next step uses
            state["kl_controller"] = self.kl_controller.state()
        state.update(self.rollouts.checkpoint_state(done))  # asynchronous: the rollouts sampled ahead
        return state

    def close(self) -> None:
        """Stops the rollout source (a sampler thread and process), then releases the engine and the checkpoints."""
        try:
            rollouts, self.rollouts = getattr(self, "rollouts", None), None
            if rollouts is not None:
                rollouts.close()
        finally:
            super().close()

    # -- the step ----------------------------------------------------------------------------------------------
    def evaluate(self, step: int) -> dict[str, float]:
        """The current policy on the held-out set (evaluation.py); `step` is for error messages."""
        return evaluate_policy(self.engine, [p.prompt for p in self.eval_set], step=step, sampler=self.sampler,
                               model_config=self.model_config, tokenizer=self.tokenizer, greedy=self.greedy,
                               sampled=self.eval_sampling, reward_fn=self.reward_fn, seed=self.config.run.seed,
                               prompt_width=self.eval_width, success_reward=self.config.task.success_reward)

    def policy_version(self):
        """The current policy as this step uses it, made now (across processes every process makes it at this point
        of every step: the reshards are collectives): a `PolicyWeights` (the sampler's copies in `rollout.dtype` on
        this process's sampling devices, the fp32 copy on the device of the trainer's passes), or with a sampler
        process host fp32 group pytrees (pickled to the child: `sampler_process.py`); the KL reference gathered
        in fp32 on that device for this step's passes."""
        devices = self.sampler.local_devices()[1]
        if self.reference is not None:
            self.step_reference = self.reference.policy(devices[0])
        if self.rollouts.host_weights:  # a sampler process: pickled to it
            return self.engine.params()
        return policy_weights(self.engine, devices, self.config.rollout.dtype, devices[0])

    def forward_passes(self, rollout, params, scored, step: int, *, first: int, width: int) -> StepInputs:
        """The per-sequence forward passes of `rollout`, the step's responses `first` .. (the whole rollout, or
        across processes this process's share): the reference's log-probs (KL penalty / KL in the reward), the
        trainer's recomputed old / proximal log-probs (`objective.recompute`; reused from the sampler when it
        measured them at these weights) and the critic's values.

        Each pass runs once per engine device's sampling share (`device_shares`, the rows one device sampled) with
        rows of the whole rollout's `width`: XLA's CPU kernels round a row differently with the batch's row count,
        so passes over whole shares of fixed shapes give every layout (one process driving every device, or
        processes each holding their devices' shares) the same bits."""
        r, timers = self.config.rollout, self.timers
        chunks = [range(max(c.start, first) - first, min(c.stop, first + len(rollout)) - first)
                  for c in self.device_rows if c.start < first + len(rollout) and c.stop > first]

        def per_share(fn) -> list[np.ndarray]:
            return [x for c in chunks if len(c) for x in fn(rollout.select(c))]

        with timers("reference"):
            ref_logprobs = (per_share(lambda part: self.step_reference.response_logprobs(part, width=width))
                            if self.reference else None)
        params = trainer_params(params)  # fp32 on the trainer's device (host pytrees with a sampler process)
        old_logprobs = None
        if self.objective.recompute:  # one extra forward pass: the trainer's log-probs before the updates
            with timers("recompute"):
                reuse = scored.trainer_logprobs is not None and (scored.versions == step).all()
                old_logprobs = (scored.trainer_logprobs if reuse else per_share(
                    lambda part: trainer_logprobs(self.model_config, params, part, temperature=r.temperature,
                                                  bucket=r.prompt_bucket, width=width)))
        values = None
        if self.objective.critic:  # GAE over token rewards with the value head's values at these weights
            with timers("values"):
                values = per_share(lambda part: response_values(self.model_config, params, part,
                                                                bucket=r.prompt_bucket, width=width))
        return StepInputs(ref_logprobs=ref_logprobs, old_logprobs=old_logprobs, values=values)

    def minibatches(self, step: int, scored: StepRollout, params) -> tuple[Iterator, dict]:
        """(the step's minibatches with this process's devices' rows packed, one by one as the loop asks; the
        KL-in-reward record): the passes over the responses this process holds, what the advantages need of the
        others' (exchanged only where the layout shards the rollout), the plans computed in every process from the
        global lengths, each sequence placed with the process that trains it (assembly.py)."""
        e, run_, r, objective = self.config.engine, self.config.run, self.config.rollout, self.objective
        own = scored.own
        inputs = self.layout.step_inputs(
            step, lambda: self.forward_passes(own.rollout, params, scored, step, first=scored.held.start,
                                              width=scored.width(r.prompt_bucket)),
            kl_in_reward=self.kl_controller is not None, critic=objective.critic,
            behaviour_logprobs=own.rollout.logprobs)
        advantages, returns, self.kl_controller, extra_record = step_advantages(
            scored.rewards, scored.response_lengths, loss=self.config.loss, group_size=r.group_size,
            critic=objective.critic, estimator=self.advantages, kl_controller=self.kl_controller,
            kl_inputs=(inputs.kl_logprobs_all, inputs.ref_logprobs_all), values=inputs.values_all)
        with self.timers("train"):  # planning (plan_ms), as every update's packing
            splits, plans = plan_step(scored, advantages, updates=run_.updates_per_step, seed=run_.seed, step=step,
                                      planner=self.planner, num_devices=e.devices, token_cap=e.token_cap,
                                      cost_model=self.cost_model, skip_empty_microbatches=not self.engine.lockstep)
        if e.context_parallel:  # responses split over context-parallel groups this step (every update's)
            extra_record["cp_sequences"] = sum(plan.num_cp_sequences for plan in plans)
        received = self.layout.training_arrays(step, scored, plans, splits, self.device_processes, inputs,
                                               fields=travelling_fields(objective.extras))
        ids, sequences = local_sequences(received, advantages, returns=returns, old_values=inputs.values_all)
        specs = extra_specs(objective.extras, self.sampling.top_k_logprobs)
        local_devices = [d for d, p in enumerate(self.device_processes) if p == jax.process_index()]

        def packed():
            for indices, plan in zip(splits, plans):
                yield pack_local_minibatch(plan, indices, ids, sequences, sequence_lengths=scored.sequence_lengths,
                                           response_lengths=scored.response_lengths, local_devices=local_devices,
                                           specs=specs, aggregation=objective.aggregation)

        return packed(), extra_record

    def train_step(self, step: int) -> dict[str, Any]:
        """Runs 0-based step `step`: rollout, rewards, advantages, then `updates_per_step` optimizer updates;
        returns its record (the timers add step/reward/reference/train seconds and plan_ms)."""
        run_, r, timers = self.config.run, self.config.rollout, self.timers
        started = time.perf_counter()
        received = bytes_received()
        with timers("step"):
            with timers("params"):  # the policy resharded onto the devices once per version: `params_seconds`
                params = self.policy_version()
            scored, waited = self.rollouts.get(step, params)  # sampled now, or by the sampler thread
            minibatches, extra_record = self.minibatches(step, scored, params)
            updates, tokens, microbatches = [], 0, []
            learning_rate = self.engine.learning_rate
            for i in range(run_.updates_per_step):
                with timers("train"):  # planning (plan_ms) and packing are part of it
                    arrays = next(minibatches)
                    result = self.update(arrays, f"step {step + 1}, update {i + 1} of {run_.updates_per_step}")
                if result.applied:
                    updates.append({"loss": result.loss, "grad_norm": result.grad_norm,
                                    **summarize_metrics(result.metrics, self.objective)})
                    tokens += arrays.num_tokens
                    microbatches.append(result.microbatches)
        self.step_reference = params = None  # this step's copies go (an asynchronous sampler keeps its versions)
        # this process's traffic: the rollout's exchange and the step's assembly (0 when the layout exchanges nothing)
        extra_record["bytes_received"] = bytes_received() - received
        seconds = timers["step"]
        return step_record(scored, step, updates, group_size=r.group_size,
                           success_reward=self.config.task.success_reward, unstable_kl=run_.unstable_kl,
                           seconds=seconds, train_seconds=timers["train"], waited=waited, tokens=tokens,
                           sampler_busy=self.rollouts.sampler_busy(started, started + seconds, scored),
                           **{self.SKIPPED_KEY: self.skipped}, learning_rate=learning_rate,
                           microbatches=microbatches, **extra_record)

    # -- the end of a run --------------------------------------------------------------------------------------
    def summary_fields(self, done: int, final_eval: dict[str, float] | None) -> dict[str, Any]:
        records = read_metrics(self.logger.path) if self.primary else []  # only process 0 writes them
        curves = os.path.join(self.out_dir, CURVES_FILE)
        return run_summary_fields(records, self.start_step, final_eval, self.config, curves_path=curves)


def run_rl(config: RLConfig, *, reward_fn: RewardFunction | None = None, stop_at_step: int | None = None,
           log: Callable[[str], None] = print, engine_factory=None, callbacks=()) -> dict[str, Any]:
    """Trains (or resumes) the RL run described by `config`; returns the summary (see `format_summary`).

    reward_fn: a `reward(prompt, response) -> float` to use instead of the task's own / `task.reward_fn`.
    stop_at_step: stop after that global step and checkpoint it, as a preempted job would.
    engine_factory, callbacks: extension points (train/core/callbacks.py).
    """
    return run(RLRun, config, stop_at_step=stop_at_step, reward_fn=reward_fn, log=log,
               engine_factory=engine_factory, callbacks=callbacks)
