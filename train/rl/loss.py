"""The RL objective as the decoder's head loss: a `jodc.losses` policy loss chosen by name, an optional KL
penalty to the initial policy, and diagnostics that are the same whatever the loss.

The head sees one packed microbatch (`jodc.train.core.staged_decoder.decoder_staged_model`): `targets` are the sampled tokens,
`loss_mask` marks response tokens, and the minibatch extras carry per token `behaviour_logprobs` (the rollout's
log-probs under its sampling distribution), `advantages` (the response's group advantage), and when needed
`topk_ids` / `topk_logprobs` [.., K] (DPPO Top-K) and `ref_logprobs` (KL penalty). Losses aggregate with the
minibatch's global normaliser and the microbatch's `segment_ids`, so the sum over microbatches and devices is the
minibatch loss.

The loss is chosen through `jodc.losses`' registry metadata (no signature inspection): `anchor` and
`required_arrays` say which per-token arrays to pass, `default_aggregation` the aggregation when the config sets
none. Advantages come from `jodc.losses.ADVANTAGE_ESTIMATORS` (`loss.advantage`).

Anchor: DPPO's ratio is taken against the behaviour log-probs (its definition). The PPO family's "old policy",
decoupled PPO's proximal policy and TIS's trainer-side log-probs (the arrays `old_logprobs` / `proximal_logprobs`,
`needs_trainer_logprobs` in the registry) are the trainer's log-probs at the weights before the step's first
update. With synchronous fp32 rollouts those *are* the behaviour log-probs (the weights that sampled the rollout,
and the kernels agree to float rounding), so nothing is recomputed and decoupled PPO is PPO, TIS's weight 1. With
stale rollouts (`rollout.max_staleness > 0`) or a bf16 sampler (`rollout.dtype`) they differ, and the objective
is built with `recompute=True`: the trainer runs one extra forward pass per rollout (`trainer_logprobs`, carried
as the minibatch extra of that name) for the losses that need it, and only for those.

Metrics come back from the engine summed over microbatches and devices, so the head reports token-weighted sums
(a loss metric m averaged over a microbatch's n valid tokens is reported as m * n, plus n as `tokens`); the
trainer divides by the total. Loss metrics that are maxima (`divergence_max`) cannot be summed and are left out.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jodc.losses import (
    LOG_RATIO_CLAMP,
    PolicyInputs,
    clipped_value_loss,
    entropy_bonus,
    get_advantage_estimator,
    get_policy_loss,
    kl_controller,
    kl_penalty,
    token_logprobs,
)

from ..core.config import ConfigError
from .batch import EXTRA_FIELDS, extra_specs
from .config import LossConfig, RolloutConfig

#: Per-token arrays a loss may ask for (its anchor or extras) that the trainer fills with the behaviour log-probs
#: (see the module docstring), and the ones it passes through from the minibatch.
BEHAVIOUR_ARRAYS = ("behaviour_logprobs", "old_logprobs", "rollout_logprobs", "proximal_logprobs")
#: The arrays that are the trainer's log-probs before the step's updates (recomputed when `recompute`).
TRAINER_ARRAYS = ("old_logprobs", "proximal_logprobs")
MINIBATCH_ARRAYS = ("topk_ids", "topk_logprobs")
#: Diagnostics every objective reports (token sums): ratio r = pi(a) / mu(a) of the sampled token, its square,
#: binary TV |pi(a) - mu(a)|, and r - 1 - log r, whose mean estimates KL(mu || pi) from the rollout's samples.
DIAGNOSTICS = ("tokens", "ratio_sum", "ratio_sq_sum", "policy_tv_sum", "policy_kl_sum")
#: Critic PPO's metrics: the value loss (partial sums of the minibatch's), its clip fraction and the mean
#: prediction (token sums).
CRITIC_METRICS = ("vf_loss_sum", "vf_clipfrac_sum", "vpred_sum")


@dataclasses.dataclass(frozen=True)
class PolicyObjective:
    """A policy loss bound to its options; `head_loss` is the decoder head's loss for a packed microbatch."""

    name: str
    loss_fn: Any
    options: dict
    aggregation: str
    temperature: float
    norm_length: int
    arrays: tuple[str, ...]
    kl_coef: float
    kl_estimator: str
    loss_metric_names: tuple[str, ...]
    recompute: bool = False  # old / proximal log-probs come from the `trainer_logprobs` extra (see above)
    entropy_coeff: float = 0.0  # entropy bonus: loss - entropy_coeff * aggregated entropy (gradient flows)
    critic: bool = False  # critic PPO, shared trunk: loss + vf_coef * clipped value loss of the value head
    vf_coef: float = 0.0
    value_clip: float | None = None

    @property
    def metric_names(self) -> tuple[str, ...]:
        """Every metric the head reports (sums over valid tokens; see the module docstring)."""
        extra = ("ref_kl_sum",) if self.kl_coef else ()
        extra += ("entropy_bonus_sum",) if self.entropy_coeff else ()
        extra += CRITIC_METRICS if self.critic else ()
        return DIAGNOSTICS + tuple(f"{m}_sum" for m in self.loss_metric_names) + extra

    @property
    def uses_topk(self) -> bool:
        """Whether the loss reads the behaviour top-k (the rollout must then store it)."""
        return "topk_ids" in self.arrays

    @property
    def behaviour_arrays(self) -> tuple[str, ...]:
        """The loss's keyword arrays besides its anchor that the behaviour log-probs stand in for."""
        return tuple(n for n in self.arrays if n in BEHAVIOUR_ARRAYS and n != self.loss_fn.anchor)

    @property
    def extras(self) -> tuple[str, ...]:
        """The per-token minibatch extras the head reads (names of `batch.EXTRA_FIELDS`): the one statement of them,
        which the training sequences, the placeholders of rows packed elsewhere and the arrays sent between
        processes follow."""
        names = ("behaviour_logprobs", "advantages")
        if self.uses_topk:
            names += ("topk_ids", "topk_logprobs")
        if self.kl_coef:
            names += ("ref_logprobs",)
        if self.recompute:
            names += ("trainer_logprobs",)
        if self.critic:
            names += ("returns", "old_values")
        return names

    def source(self, name: str) -> str:
        """The minibatch extra that supplies the loss's per-token array `name`."""
        return "trainer_logprobs" if self.recompute and name in TRAINER_ARRAYS else "behaviour_logprobs"

    def policy_loss(self, logits_btv, mb) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The chosen policy loss on a microbatch: (partial loss, its local metric means)."""
        inputs = PolicyInputs(
            tokens=mb["targets"], anchor_logprobs=mb[self.source(self.loss_fn.anchor)] if self.loss_fn.anchor else None,
            advantages=mb["advantages"], mask=mb["loss_mask"], aggregation=self.aggregation,
            normalizer=mb["normalizer"], segment_ids=mb["segment_ids"], temperature=self.temperature,
            norm_length=self.norm_length if self.aggregation == "seq-mean-token-sum-norm" else None)
        arrays = {n: mb[self.source(n)] for n in self.behaviour_arrays}
        arrays.update((n, mb[n]) for n in self.arrays if n in MINIBATCH_ARRAYS)
        return self.loss_fn.apply(logits_btv, inputs, **self.options, **arrays)

    def head_loss(self, logits_btv, mb, values_bt=None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(loss, {metric: token-weighted sum}) of one packed microbatch; `values_bt` are the value head's
        predictions (critic PPO only)."""
        loss, loss_metrics = self.policy_loss(logits_btv, mb)
        valid = (mb["loss_mask"] != 0) & (mb["segment_ids"] > 0)
        count = jnp.sum(valid).astype(jnp.float32)
        metrics = {f"{m}_sum": lax.stop_gradient(loss_metrics[m]).astype(jnp.float32) * count
                   for m in self.loss_metric_names}
        if self.kl_coef:
            kl_loss, kl_metrics = kl_penalty(
                logits_btv, mb["targets"], mb["ref_logprobs"], mb["loss_mask"], estimator=self.kl_estimator,
                aggregation=self.aggregation, normalizer=mb["normalizer"], segment_ids=mb["segment_ids"],
                temperature=self.temperature,
                norm_length=self.norm_length if self.aggregation == "seq-mean-token-sum-norm" else None)
            loss = loss + self.kl_coef * kl_loss
            metrics["ref_kl_sum"] = lax.stop_gradient(kl_metrics["kl_mean"]) * count
        if self.entropy_coeff:
            bonus, _ = entropy_bonus(
                logits_btv, mb["targets"], mb["loss_mask"], entropy_coeff=self.entropy_coeff,
                aggregation=self.aggregation, normalizer=mb["normalizer"], segment_ids=mb["segment_ids"],
                temperature=self.temperature,
                norm_length=self.norm_length if self.aggregation == "seq-mean-token-sum-norm" else None)
            loss = loss + bonus
            metrics["entropy_bonus_sum"] = lax.stop_gradient(bonus)  # a partial sum of the minibatch's term
        if self.critic:
            value_loss, value_metrics = clipped_value_loss(
                values_bt, mb["returns"], mb["old_values"], mb["loss_mask"], clip_range=self.value_clip,
                aggregation=self.aggregation, normalizer=mb["normalizer"], segment_ids=mb["segment_ids"],
                norm_length=self.norm_length if self.aggregation == "seq-mean-token-sum-norm" else None)
            loss = loss + self.vf_coef * value_loss
            metrics.update(vf_loss_sum=lax.stop_gradient(value_loss),  # partial sums of the minibatch's loss
                           vf_clipfrac_sum=value_metrics["vf_clipfrac"] * count,
                           vpred_sum=value_metrics["vpred_mean"] * count)
        metrics.update(policy_diagnostics(logits_btv, mb, valid, self.temperature))
        return loss, metrics


def policy_diagnostics(logits_btv, mb, valid, temperature: float) -> dict[str, jax.Array]:
    """Token sums of the sampled-token ratio, its square, binary TV and the k3 estimate of KL(mu || pi)
    (no gradient); see DIAGNOSTICS."""
    logprobs = lax.stop_gradient(token_logprobs(logits_btv, mb["targets"], temperature=temperature))
    behaviour = jnp.where(valid, mb["behaviour_logprobs"].astype(jnp.float32), 0.0)
    logprobs = jnp.where(valid, logprobs, 0.0)
    log_ratio = jnp.clip(logprobs - behaviour, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)

    def total(x):
        return jnp.sum(jnp.where(valid, x, 0.0))

    return {"tokens": jnp.sum(valid).astype(jnp.float32), "ratio_sum": total(ratio),
            "ratio_sq_sum": total(ratio * ratio),
            "policy_tv_sum": total(jnp.abs(jnp.exp(logprobs) - jnp.exp(behaviour))),
            "policy_kl_sum": total(ratio - 1.0 - log_ratio)}


def _provided_arrays(fn, options: dict) -> tuple[str, ...]:
    """The per-token arrays the loss needs with these options; ConfigError when the trainer cannot provide one."""
    try:
        names = fn.required_arrays(**options)
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"loss {fn.name}: {e}") from None
    for name in names:
        if name not in BEHAVIOUR_ARRAYS + MINIBATCH_ARRAYS:
            raise ConfigError(f"loss: the policy loss needs the array {name!r}, which the RL trainer does not provide")
    return names


def build_objective(loss: LossConfig, rollout: RolloutConfig) -> PolicyObjective:
    """The objective of the `loss` section; ConfigError when the loss is unknown or rejects an option (checked
    by tracing the loss once on a tiny dummy microbatch, which also names its metrics). It recomputes old /
    proximal log-probs (`recompute`) when the loss reads them and the rollouts are stale or mismatched."""
    try:
        fn = get_policy_loss(loss.name)
    except ValueError as e:
        raise ConfigError(f"loss.name: {e}") from None
    aggregation = loss.aggregation or fn.default_aggregation
    options = loss.options()
    arrays = _provided_arrays(fn, options)
    # the loss reads old / proximal log-probs, and they differ from the behaviour's (stale or non-fp32 rollouts)
    off_policy = rollout.max_staleness > 0 or rollout.dtype != "float32"
    objective = PolicyObjective(
        name=loss.name, loss_fn=fn, options=options, aggregation=aggregation, temperature=rollout.temperature,
        norm_length=rollout.max_new_tokens, arrays=arrays, kl_coef=loss.kl_coef, kl_estimator=loss.kl_estimator,
        loss_metric_names=(), recompute=off_policy and bool(set(TRAINER_ARRAYS) & set(arrays)),
        entropy_coeff=loss.entropy_coeff, critic=loss.critic, vf_coef=loss.critic_vf_coef,
        value_clip=loss.critic_value_clip or None)
    try:
        metrics = jax.eval_shape(lambda mb: objective.policy_loss(mb["logits"], mb)[1], _dummy_microbatch(rollout))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"loss {loss.name!r} rejects the loss section's options {objective.options} "
                          f"(aggregation {aggregation!r}): {e}") from None
    names = tuple(sorted(m for m, v in metrics.items() if v.shape == () and not m.endswith("_max")))
    return dataclasses.replace(objective, loss_metric_names=names)


def build_advantages(loss: LossConfig) -> Callable[[np.ndarray, int, np.ndarray], np.ndarray] | None:
    """`advantages(rewards [N], group_size, lengths [N]) -> [N]` for `loss.advantage` (verl's estimator names);
    None for `gae`, which needs the critic's per-token values (`critic_advantages`),
    reading the estimator's metadata for what it needs; ConfigError for an estimator the trainer cannot feed:
    ReMax needs a greedy response per prompt, which the trainer does not sample; GDPO several reward functions'
    rewards per response, where the trainer scores a response with one; the optimal token baseline per-token
    sum pi^2 of the sampling policy, which the rollout does not record, and it gives per-token advantages, where
    the trainer's batch carries one per response."""
    estimator = get_advantage_estimator(loss.advantage)
    if estimator.reward_columns:
        raise ConfigError(f"loss.advantage={loss.advantage!r} normalises the rewards of several reward functions "
                          "separately ([N, D] rewards), but the RL trainer scores each response with one reward "
                          "function (the task's, or task.reward_fn); with one it would be GRPO followed by batch "
                          "whitening. Use grpo or reinforce_plus_plus_baseline, or call jodc.losses.gdpo_advantages "
                          "directly")
    if estimator.token_rewards:  # gae: the trainer computes it with the critic's values (`critic_advantages`)
        return None
    if set(estimator.inputs) - {"lengths"}:
        per_token = (" and gives per-token advantages, where the trainer's batch carries one per response"
                     if estimator.per_token else "")
        raise ConfigError(f"loss.advantage={loss.advantage!r} needs {list(estimator.inputs)}{per_token}; the RL "
                          "trainer's rollouts do not provide them (call jodc.losses directly)")
    options = {"normalize_std": loss.normalize_std} if "normalize_std" in estimator.options else {}

    def advantages(rewards, group_size: int, lengths) -> np.ndarray:
        inputs = {"lengths": np.asarray(lengths)} if "lengths" in estimator.inputs else {}
        return np.asarray(estimator(np.asarray(rewards, np.float32), group_size, **inputs, **options))

    return advantages


def build_kl_controller(loss: LossConfig):
    """The KL-in-reward controller of the `loss` section (`jodc.losses.kl_controller`), None when the KL is not
    in the reward (`loss.kl_in_reward_coef: 0`)."""
    if not loss.kl_in_reward_coef:
        return None
    return kl_controller(loss.kl_in_reward_controller, loss.kl_in_reward_coef, target=loss.kl_in_reward_target,
                         horizon=loss.kl_in_reward_horizon)


def _dummy_microbatch(rollout: RolloutConfig) -> dict[str, Any]:
    """Shapes of a one-row microbatch of 4 tokens over a vocabulary of 8 with every extra (for tracing the loss
    only)."""
    b, t, k, v = 1, 4, min(rollout.top_k, 8), 8
    extras = {name: jax.ShapeDtypeStruct((b, t) + trailing, dtype)
              for name, (dtype, trailing) in extra_specs(list(EXTRA_FIELDS), k).items()}
    return {"logits": jax.ShapeDtypeStruct((b, t, v), jnp.float32), "targets": jax.ShapeDtypeStruct((b, t), jnp.int32),
            "loss_mask": jax.ShapeDtypeStruct((b, t), jnp.float32),
            "segment_ids": jax.ShapeDtypeStruct((b, t), jnp.int32), "normalizer": jax.ShapeDtypeStruct((), jnp.float32),
            **extras}


def summarize_metrics(sums: dict[str, float], objective: PolicyObjective) -> dict[str, float]:
    """Token means from one update's summed head metrics: every loss metric as `loss_<name>`, `entropy`, the
    sampled-token ratio's mean and std, the policy's TV and KL to the behaviour policy, the KL to the reference,
    and `trust_region_fraction` (the fraction of tokens whose gradient the trust region removed: DPPO's masked
    fraction, or the PPO family's clipped fraction; absent for losses without either)."""
    tokens = max(sums["tokens"], 1.0)
    out = {f"loss_{m}": sums[f"{m}_sum"] / tokens for m in objective.loss_metric_names}
    ratio_mean = sums["ratio_sum"] / tokens
    out.update(ratio_mean=ratio_mean,
               ratio_std=float(np.sqrt(max(sums["ratio_sq_sum"] / tokens - ratio_mean ** 2, 0.0))),
               policy_tv=sums["policy_tv_sum"] / tokens, policy_kl=sums["policy_kl_sum"] / tokens)
    if objective.kl_coef:
        out["ref_kl"] = sums["ref_kl_sum"] / tokens
    if objective.entropy_coeff:
        out["entropy_bonus"] = sums["entropy_bonus_sum"]  # the update's -entropy_coeff * aggregated entropy
    if objective.critic:
        out.update(vf_loss=sums["vf_loss_sum"], vf_clipfrac=sums["vf_clipfrac_sum"] / tokens,
                   vpred_mean=sums["vpred_sum"] / tokens)
    if "loss_entropy" in out:
        out["entropy"] = out["loss_entropy"]
    for name in ("loss_masked_fraction", "loss_clip_fraction"):
        if name in out:
            out["trust_region_fraction"] = out[name]
            break
    return out
