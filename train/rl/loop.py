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

from ..core import distributed
from ..core.metrics import read_metrics
from ..core.model import hf_tokenizer_path, mesh_devices
from ..core.trainer import CHECKPOINT_DIR, Trainer, run, summary_text
from .assembly import (ShardedRollout, StepInputs, assembly_digest, exchange_step_inputs, extra_specs,
                       local_sequences, pack_local_minibatch, send_sequences, sequence_destinations)
from .batch import pack_minibatch, plan_minibatch, sequences_digest, split_minibatches, training_sequences
from .config import RLConfig
from .critic import critic_advantages, response_values
from .loss import build_advantages, build_kl_controller, build_objective, kl_shaped_rewards, summarize_metrics
from .metrics import BAR_FIELDS, CURVES_FILE, plot_curves, step_record
from .policy_weights import held_copy, policy_weights, sampler_weights_on_devices, trainer_params
from .reference import ShardedReference
from .rewards import RewardFunction, resolve_reward_function, score
from .rollout import device_shares, encode_prompts, sample_rollout, sampling_params
from .rollout_exchange import EVALUATION_TAGS, bytes_received, gather_shares
from .rollout_source import make_rollout_source
from .sampler import RolloutSampler, ScoredRollout, trainer_logprobs
from .tasks import eval_problems, fingerprint_task, make_task, training_pool
from .warmstart import run_warmstart

__all__ = ["CHECKPOINT_DIR", "RLRun", "format_summary", "run_rl"]
EVAL_SAMPLES = 4  # sampled responses per evaluation problem


def overlap_summary(records: list[dict[str, Any]], rollout) -> dict[str, Any]:
    """Means over this invocation's steps after the first (which compiles) of the rollout/trainer overlap and
    mismatch: `max_staleness`, `rollout_dtype`, `trainer_idle_fraction`, `sampler_idle_fraction`,
    `logprob_mismatch` (None without such steps)."""
    steady = records[1:] or records
    out: dict[str, Any] = {"max_staleness": rollout.max_staleness, "rollout_dtype": rollout.dtype}
    for key in ("trainer_idle_fraction", "sampler_idle_fraction", "logprob_mismatch"):
        values = [r[key] for r in steady if key in r]
        out[key] = float(np.mean(values)) if values else None
    return out


def format_summary(summary: dict[str, Any]) -> str:
    """The lines printed at the end of a run: what was done and where everything is. The held-out change (greedy
    accuracy and sampled reward on the evaluation set, from the evaluation before this invocation's first step to
    the one after its last) comes first, the training reward second: a training reward that rises while the
    held-out numbers fall is overfitting, not RL working (docs/rl.md)."""
    training = (f"training reward {summary['first_reward']:.3f} -> {summary['last_reward']:.3f}, "
                f"{summary['unstable_steps']} unstable step(s)" if summary["first_reward"] is not None else None)
    start, end = summary.get("first_eval_accuracy"), summary["final_eval_accuracy"]
    if start is not None and end is not None:
        achieved = (f"held-out greedy accuracy {start:.3f} -> {end:.3f}, sampled reward "
                    f"{summary['first_eval_sampled_reward']:.3f} -> {summary['final_eval_sampled_reward']:.3f}"
                    + (f"; {training}" if training else ""))
        evaluation = []
    else:  # no evaluation before the first step (eval_every 0, or a resume between evaluations)
        achieved = training
        evaluation = ([f"held-out evaluation at the end: greedy accuracy {end:.3f}, "
                       f"sampled reward {summary['final_eval_sampled_reward']:.3f}"] if end is not None else [])
    curves = [f"curves:     {summary['curves']}"] if summary["curves"] else []
    return summary_text(summary, achieved, evaluation + overlap_lines(summary), curves, unit="RL steps")


def overlap_lines(summary: dict[str, Any]) -> list[str]:
    """The summary's line on asynchronous / mismatched rollouts (none for synchronous fp32 ones); the log-prob
    mismatch only where it was measured (a sampler with other numerics than the trainer's)."""
    if summary.get("trainer_idle_fraction") is None or not (summary.get("max_staleness")
                                                            or summary.get("rollout_dtype") != "float32"):
        return []
    mismatch = summary.get("logprob_mismatch")
    return [f"rollouts: max_staleness {summary['max_staleness']}, sampler {summary['rollout_dtype']}; trainer "
            f"idle {summary['trainer_idle_fraction']:.0%}, sampler idle {summary['sampler_idle_fraction']:.0%} of the "
            "step" + (f"; log-prob mismatch {mismatch:.2e} per token" if mismatch is not None else "")]


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
        self.build_engine(model_section, max_length=e.token_cap, head_loss=self.objective.head_loss,
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
                                      platform=e.platform, devices=e.devices,
                                      exchange_timeout_s=e.barrier_timeout_s)
        # the responses each engine device samples: the row blocks of the per-sequence forward passes
        self.device_rows = [range(s.start * r.group_size, s.stop * r.group_size)
                            for s in device_shares(r.prompts_per_step, e.devices)]
        self.assembled: dict[str, Any] = {}  # across processes: what the last sharded step received and trained on
        self.rollouts = make_rollout_source(r, self.sampler, processes=jax.process_count(), reward_spec=reward_spec,
                                            trainer=self, callbacks=self.callbacks,
                                            process_index=jax.process_index())
        # the sampler process gets host weights (pickled to it); the trainer's own sampler copies made on device
        self.host_weights = bool(r.max_staleness) and r.sampler == "process"

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
        """The current policy on the fixed held-out evaluation set: `eval_accuracy` (greedy decoding) and
        `eval_sampled_reward` (mean reward of `EVAL_SAMPLES` responses per problem at the rollout temperature,
        fixed key: the quantity RL optimises); `step` is for error messages.

        Sampled as the rollouts are: the problems are split over the engine's devices (`RolloutSampler.local_devices`),
        each process samples and scores its devices' share, and across processes the shares' rewards (not their
        tokens) are exchanged. Response j of problem i samples with the same key wherever it runs (`response_keys`)."""
        prompts = [p.prompt for p in self.eval_set]
        mine, devices = self.sampler.local_devices(len(prompts))
        params = sampler_weights_on_devices(self.engine, devices=devices, dtype="float32")  # fp32, on device
        width = self.eval_width

        def share() -> dict[str, np.ndarray]:  # this process's rewards per measure
            rewards = {}
            for key, group_size, sampling in (("eval_accuracy", 1, self.greedy),
                                              ("eval_sampled_reward", EVAL_SAMPLES, self.eval_sampling)):
                rollout = sample_rollout(self.model_config, params, self.tokenizer, prompts[mine.start:mine.stop],
                                         group_size=group_size, sampling=sampling, prompt_indices=mine,
                                         devices=devices, prompt_width=width,
                                         key=jax.random.PRNGKey(self.config.run.seed))
                rewards[key] = score(self.reward_fn, rollout.prompts, rollout.responses, step=step,
                                     first_sample=mine.start * group_size)
            return rewards

        parts = ([share()] if jax.process_count() == 1 else
                 gather_shares(share, what=f"the evaluation at step {step}", tags=EVALUATION_TAGS,
                               timeout_s=self.config.engine.barrier_timeout_s))
        rewards = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
        return {"eval_accuracy": float(np.mean(rewards["eval_accuracy"] >= self.config.task.success_reward)),
                "eval_sampled_reward": float(np.mean(rewards["eval_sampled_reward"]))}

    def policy_version(self):
        """The current policy as this step uses it, made now (across processes every process makes it at this point
        of every step: the reshards are collectives): a `PolicyWeights` (the sampler's copies in `rollout.dtype` on
        this process's sampling devices, the fp32 copy on the device of the trainer's passes), or with a sampler
        process host fp32 group pytrees (pickled to the child: `sampler_process.py`); the KL reference gathered
        in fp32 on that device for this step's passes."""
        devices = self.sampler.local_devices()[1]
        if self.reference is not None:
            self.step_reference = self.reference.policy(devices[0])
        if self.host_weights:
            return self.engine.params()
        return policy_weights(self.engine, devices, self.config.rollout.dtype, devices[0])

    def next_rollout(self, step: int, params) -> tuple[ScoredRollout, float]:
        """(step `step`'s scored rollout, seconds the trainer waited for it), from the run's rollout source
        (rollout_source.py: sampled now from `params`, or taken from the sampler thread)."""
        return self.rollouts.get(step, params)

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

    def batch_advantages(self, rewards, response_lengths, *, kl_inputs, values):
        """(advantages: [N] or per response token arrays, returns or None, the KL-in-reward record) of the whole
        rollout: the estimator over the rewards (shaped by the KL in the reward when `kl_inputs` = (log-probs,
        reference log-probs) per response), or GAE over the critic's `values`; the KL controller moves."""
        r, loss_ = self.config.rollout, self.config.loss
        extra_record, kl_args = {}, None
        if self.kl_controller is not None:  # KL in the reward, at the policy before this step's updates
            beta = self.kl_controller.value
            kl_args = (*kl_inputs, beta, loss_.kl_in_reward_estimator)
        returns = None
        if self.objective.critic:
            advantages, returns, current_kl = critic_advantages(
                rewards, values, gamma=loss_.critic_gamma, lam=loss_.critic_lam, kl=kl_args)
        else:
            shaped, current_kl = (kl_shaped_rewards(rewards, *kl_args[:2], beta=kl_args[2], estimator=kl_args[3])
                                  if kl_args else (rewards, None))
            advantages = self.advantages(shaped, r.group_size, response_lengths)
        if self.kl_controller is not None:
            self.kl_controller = self.kl_controller.update(current_kl, len(rewards))
            extra_record = {"kl_in_reward": current_kl, "kl_in_reward_beta": beta}
        return advantages, returns, extra_record

    def replicated_minibatches(self, step: int, scored: ScoredRollout, params) -> tuple[Iterator, dict]:
        """(the step's minibatches, packed one by one as the loop asks, the KL-in-reward record) from the whole
        rollout, which this process holds (one process, or `rollout.assembly: replicated`): every pass over all of
        it, every device's rows packed."""
        e, run_, r = self.config.engine, self.config.run, self.config.rollout
        rollout = scored.rollout
        passes = self.forward_passes(rollout, params, scored, step, first=0, width=rollout.width(r.prompt_bucket))
        kl_logprobs = passes.old_logprobs if passes.old_logprobs is not None else rollout.logprobs
        advantages, returns, extra_record = self.batch_advantages(
            scored.rewards, rollout.response_lengths, kl_inputs=(kl_logprobs, passes.ref_logprobs),
            values=passes.values)
        sequences = training_sequences(rollout, advantages, with_topk=self.objective.uses_topk,
                                       ref_logprobs=passes.ref_logprobs if self.objective.kl_coef else None,
                                       trainer_logprobs=passes.old_logprobs, returns=returns, old_values=passes.values)
        distributed.check_agreement(f"step {step + 1}'s rollout, rewards and advantages",
                                    lambda: sequences_digest(sequences))  # mpirun: every process holds all of it

        def packed():
            for indices in split_minibatches(len(sequences), run_.updates_per_step, seed=run_.seed, step=step):
                yield pack_minibatch(sequences, indices, planner=self.planner, num_devices=e.devices,
                                     token_cap=e.token_cap, cost_model=self.cost_model,
                                     aggregation=self.objective.aggregation,
                                     skip_empty_microbatches=not self.engine.lockstep)[1]

        return packed(), extra_record

    def sharded_minibatches(self, step: int, scored: ShardedRollout, params) -> tuple[Iterator, dict]:
        """(the step's minibatches with only this process's devices' rows packed, the KL-in-reward record) across
        processes without replicating the rollout (assembly.py): the passes over this process's share only, what
        the advantages need exchanged, the plans computed in every process from the global lengths, each sequence
        sent to the process that trains it."""
        e, run_, r, objective = self.config.engine, self.config.run, self.config.rollout, self.objective
        timeout_s = e.barrier_timeout_s
        own = scored.own
        inputs = exchange_step_inputs(
            step, lambda: self.forward_passes(own.rollout, params, scored, step,
                                              first=scored.shares[scored.process].start,
                                              width=scored.width(r.prompt_bucket)),
            kl_in_reward=self.kl_controller is not None, critic=objective.critic,
            behaviour_logprobs=own.rollout.logprobs, timeout_s=timeout_s)
        advantages, returns, extra_record = self.batch_advantages(
            scored.rewards, scored.response_lengths, kl_inputs=(inputs.kl_logprobs_all, inputs.ref_logprobs_all),
            values=inputs.values_all)
        lengths = scored.sequence_lengths
        with self.timers("train"):  # planning, as in the replicated loop (plan_ms)
            splits = split_minibatches(len(scored), run_.updates_per_step, seed=run_.seed, step=step)
            plans = [plan_minibatch(lengths[indices], planner=self.planner, num_devices=e.devices,
                                    token_cap=e.token_cap, cost_model=self.cost_model,
                                    skip_empty_microbatches=not self.engine.lockstep) for indices in splits]
        distributed.check_agreement(f"step {step + 1}'s rewards, lengths, advantages and plans",
                                    lambda: assembly_digest(scored, advantages, splits, plans))
        flags = dict(with_topk=objective.uses_topk, with_ref=bool(objective.kl_coef), with_old=objective.recompute)
        destinations = sequence_destinations(plans, splits, self.device_processes, len(scored))
        received = send_sequences(step, scored, destinations, inputs, timeout_s=timeout_s, **flags)
        ids, sequences = local_sequences(received, advantages, returns=returns, old_values=inputs.values_all)
        specs = extra_specs(top_k=self.sampling.top_k_logprobs, critic=objective.critic, **flags)
        local_devices = [d for d, p in enumerate(self.device_processes) if p == jax.process_index()]
        self.assembled = {"received": sorted(set(received) - set(scored.shares[scored.process])),
                          "trained": ids, "forward_rows": len(own.rollout)}  # what tests and benchmarks read

        def packed():
            for indices, plan in zip(splits, plans):
                yield pack_local_minibatch(plan, indices, ids, sequences, sequence_lengths=lengths,
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
            scored, waited = self.next_rollout(step, params)
            if isinstance(scored, ShardedRollout):  # mpirun, rollout.assembly: sharded (assembly.py)
                minibatches, extra_record = self.sharded_minibatches(step, scored, params)
            else:
                minibatches, extra_record = self.replicated_minibatches(step, scored, params)
            updates, tokens, microbatches = [], 0, []
            learning_rate = float(self.lr_schedule(self.engine.steps_done))
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
        if jax.process_count() > 1:  # this process's traffic: the rollout's exchange and the step's assembly
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
        """Rewards over the whole run (this invocation's part for first/last), the evaluations before this invocation's
        first step and after its last, the curves."""
        records = read_metrics(self.logger.path) if self.primary else []  # only process 0 writes them
        curves = plot_curves(records, os.path.join(self.out_dir, CURVES_FILE), final_eval=final_eval,
                             title=f"{self.config.loss.name} on {self.config.task.name}") if records else None
        ran = [r for r in records if r["step"] > self.start_step]
        return {"rewards": [(r["step"], r["reward_mean"]) for r in records],
                "first_reward": ran[0]["reward_mean"] if ran else None,
                "last_reward": ran[-1]["reward_mean"] if ran else None,
                # the evaluation before this invocation's first step, where one ran (eval_every > 0)
                "first_eval_accuracy": ran[0].get("eval_accuracy") if ran else None,
                "first_eval_sampled_reward": ran[0].get("eval_sampled_reward") if ran else None,
                "final_eval_accuracy": final_eval["eval_accuracy"] if final_eval else None,
                "final_eval_sampled_reward": final_eval["eval_sampled_reward"] if final_eval else None,
                "unstable_steps": sum(1 for r in records if r.get("unstable")), "curves": curves,
                **overlap_summary(ran, self.config.rollout)}


def run_rl(config: RLConfig, *, reward_fn: RewardFunction | None = None, stop_at_step: int | None = None,
           log: Callable[[str], None] = print, engine_factory=None, callbacks=()) -> dict[str, Any]:
    """Trains (or resumes) the RL run described by `config`; returns the summary (see `format_summary`).

    reward_fn: a `reward(prompt, response) -> float` to use instead of the task's own / `task.reward_fn`.
    stop_at_step: stop after that global step and checkpoint it, as a preempted job would.
    engine_factory, callbacks: extension points (train/core/callbacks.py).
    """
    return run(RLRun, config, stop_at_step=stop_at_step, reward_fn=reward_fn, log=log,
               engine_factory=engine_factory, callbacks=callbacks)
