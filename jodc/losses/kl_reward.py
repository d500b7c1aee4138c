"""The KL penalty in the reward (InstructGPT / verl's ``algorithm.use_kl_in_reward``), and its KL controllers.

Instead of adding beta * KL to the loss (``kl_penalty``), the per-token KL to the reference policy is taken out
of the reward before the advantages are computed:

    token_rewards[i, t] = score_i * [t is the last valid token of row i] - beta * kl_t

with kl_t a per-token estimator (``kl_estimate``: ``k1`` = verl's default ``kl``, ``k2``, ``k3``, ``abs``...) of
the *sampling-time* policy's log-probs against the reference's (verl takes the old policy's log-probs). The
rewards are data: no gradient flows through them. Outcome estimators (GRPO, RLOO, ...) then see each row's sum of
token rewards, score - beta * sum_t kl_t (as verl's GRPO sums ``token_level_rewards``); GAE and REINFORCE++'s
discounted form see them per token.

beta comes from a KL controller (Ziegler et al. 2019, arXiv 1909.08593; verl's ``FixedKLController`` /
``AdaptiveKLController``). A controller is an immutable value: ``update(current_kl, n_steps)`` returns the next
controller, and ``state()`` / ``kl_controller_from_state`` round-trip it through a checkpoint. The adaptive one
moves beta towards a target KL: e = clip(current_kl / target - 1, -0.2, 0.2), beta <- beta (1 + e n_steps /
horizon), where ``current_kl`` is the batch mean of each row's token-mean KL and ``n_steps`` the rows in the
batch (verl passes the batch size).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jodc.losses._checks import check_nonnegative, check_positive, shape_of
from jodc.losses.kl import kl_estimate
from jodc.losses.logprobs import compute_dtype

#: The adaptive controller's proportional error is clipped to +-this (verl, OpenAI's lm-human-preferences).
ADAPTIVE_ERROR_CLIP = 0.2
KL_CONTROLLERS = ("fixed", "adaptive")


def last_token_rewards(scores, mask) -> jax.Array:
    """[N, T]: ``scores`` [N] placed on each row's last valid token of ``mask`` [N, T], 0 elsewhere (a row with
    no valid token carries no reward)."""
    fn = "last_token_rewards"
    shape = shape_of(mask)
    if len(shape) != 2 or shape_of(scores) != shape[:1]:
        raise ValueError(f"{fn}: scores must be [N] and mask [N, T] with the same N, got {shape_of(scores)} and "
                         f"{shape}")
    valid_nt = jnp.asarray(mask) != 0
    scores = jnp.asarray(scores)
    dtype = compute_dtype(scores.dtype) if jnp.issubdtype(scores.dtype, jnp.floating) else jnp.float32
    positions_nt = jnp.where(valid_nt, jnp.arange(shape[1])[None, :], -1)
    last_n1 = jnp.max(positions_nt, axis=1, keepdims=True)
    at_last_nt = (jnp.arange(shape[1])[None, :] == last_n1) & valid_nt
    return jnp.where(at_last_nt, scores.astype(dtype)[:, None], 0.0)


def kl_reward(scores, logprobs, ref_logprobs, mask, *, beta: float, estimator: str = "k1"
              ) -> tuple[jax.Array, jax.Array]:
    """(token_rewards [N, T], current_kl scalar): the scores on the last valid tokens minus beta times the
    per-token KL estimate of ``logprobs`` (the sampling policy's) to ``ref_logprobs``, 0 at invalid positions;
    ``current_kl`` is the batch mean of the rows' token-mean KL (rows with a valid token), what a controller's
    ``update`` takes."""
    fn = "kl_reward"
    check_nonnegative(fn, "beta", beta)
    shape = shape_of(mask)
    for name, x in (("logprobs", logprobs), ("ref_logprobs", ref_logprobs)):
        if shape_of(x) != shape:
            raise ValueError(f"{fn}: {name} has shape {shape_of(x)} but mask has shape {shape}; they must match")
    rewards_nt = last_token_rewards(scores, mask)
    valid_nt = jnp.asarray(mask) != 0
    dtype = compute_dtype(jnp.result_type(rewards_nt.dtype, jnp.asarray(logprobs).dtype))

    def clean(x):
        return jnp.where(valid_nt, jnp.asarray(x).astype(dtype), 0.0)

    kl_nt = jnp.where(valid_nt, kl_estimate(clean(logprobs), clean(ref_logprobs), estimator), 0.0)
    kl_nt = jax.lax.stop_gradient(kl_nt)
    counts_n = jnp.sum(valid_nt, axis=1).astype(dtype)
    rows = jnp.sum(counts_n > 0).astype(dtype)
    current_kl = jnp.sum(jnp.sum(kl_nt, axis=1) / jnp.maximum(counts_n, 1)) / jnp.maximum(rows, 1)
    return rewards_nt.astype(dtype) - beta * kl_nt, current_kl


@dataclasses.dataclass(frozen=True)
class FixedKLController:
    """beta stays ``value``."""

    value: float

    def __post_init__(self):
        check_nonnegative("FixedKLController", "value", self.value)

    def update(self, current_kl: float, n_steps: int) -> "FixedKLController":
        """The next controller: this one."""
        return self

    def state(self) -> dict[str, Any]:
        """What a checkpoint stores (``kl_controller_from_state`` reads it back)."""
        return {"kind": "fixed", "value": float(self.value)}


@dataclasses.dataclass(frozen=True)
class AdaptiveKLController:
    """beta = ``value``, moved towards KL ``target`` over ``horizon`` samples (see the module docstring)."""

    value: float
    target: float
    horizon: int

    def __post_init__(self):
        check_nonnegative("AdaptiveKLController", "value", self.value)
        check_positive("AdaptiveKLController", "target", self.target)
        check_positive("AdaptiveKLController", "horizon", self.horizon)

    def update(self, current_kl: float, n_steps: int) -> "AdaptiveKLController":
        """The next controller after a batch of ``n_steps`` samples whose KL was ``current_kl``."""
        error = float(np.clip(float(current_kl) / self.target - 1.0, -ADAPTIVE_ERROR_CLIP, ADAPTIVE_ERROR_CLIP))
        return dataclasses.replace(self, value=self.value * (1.0 + error * n_steps / self.horizon))

    def state(self) -> dict[str, Any]:
        """What a checkpoint stores (``kl_controller_from_state`` reads it back)."""
        return {"kind": "adaptive", "value": float(self.value), "target": float(self.target),
                "horizon": int(self.horizon)}


def kl_controller(kind: str, value: float, *, target: float | None = None, horizon: int | None = None
                  ) -> FixedKLController | AdaptiveKLController:
    """A controller by name (``fixed`` or ``adaptive``, verl's ``kl_ctrl.type``) with initial beta ``value``."""
    if kind == "fixed":
        return FixedKLController(value)
    if kind == "adaptive":
        if target is None or horizon is None:
            raise ValueError("kl_controller: the adaptive controller needs target and horizon")
        return AdaptiveKLController(value, target, horizon)
    raise ValueError(f"kl_controller: unknown kind {kind!r}; expected one of {list(KL_CONTROLLERS)}")


def kl_controller_from_state(state: Mapping[str, Any]) -> FixedKLController | AdaptiveKLController:
    """The controller whose ``state()`` is ``state``."""
    state = dict(state)
    return kl_controller(state.pop("kind", None), state.pop("value"), **state)
