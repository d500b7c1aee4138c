"""Token-level returns and advantages from per-token rewards: GAE (critic PPO) and REINFORCE++'s discounted form.

Rows are responses [N, T]; ``mask`` marks the response's tokens (nonzero = valid). Rewards are per token
(``token_rewards`` [N, T]): with an outcome reward, the score on the response's last valid token, minus
beta * KL per token when the KL penalty is in the reward (``jodc.losses.kl_reward``).

* ``gae_advantages``: generalised advantage estimation (Schulman et al. 2016, arXiv 1506.02438), as verl's
  ``compute_gae_advantage_return``: a reverse scan over the *valid* tokens only,
  delta_t = r_t + gamma V_{t'} - V_t (t' the next valid token, V = 0 past the last), A_t = delta_t +
  gamma lam A_{t'}; returns R_t = A_t + V_t (the value head's target, *before* whitening); then the advantages
  (not the returns) are whitened over every valid token of the batch (``masked_whiten``).
* ``reinforce_pp_token_advantages``: REINFORCE++ as verl's ``compute_reinforce_plus_plus_outcome_advantage``:
  the discounted return G_t = r_t + gamma G_{t'} over valid tokens, whitened over the batch's valid tokens. With
  gamma = 1 and only an outcome reward it equals the per-response ``reinforce_pp_advantages(baseline=False)``.

Invalid positions (padding, or tokens inside a response that are not trained on) are skipped by the scan: they
neither receive a value nor cut the recursion; whatever they hold (NaN included) is ignored. Unlike verl (whose
padding keeps the carried value), jodc returns 0 at invalid positions. Advantages and returns are data for the
losses, computed on the host's whole batch (the whitening statistics are global), in fp64 for fp64 inputs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jodc.losses._checks import check_nonnegative, shape_of
from jodc.losses.advantages import WHITEN_EPS
from jodc.losses.logprobs import compute_dtype


def _token_arrays(fn: str, mask, **arrays) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(valid [N, T] bool, the named [N, T] arrays in the compute dtype with 0 at invalid positions)."""
    shape = shape_of(mask)
    if len(shape) != 2:
        raise ValueError(f"{fn}: mask must have shape [N, T], got shape {shape}")
    for name, x in arrays.items():
        if shape_of(x) != shape:
            raise ValueError(f"{fn}: {name} has shape {shape_of(x)} but mask has shape {shape}; they must match")
    dtype = compute_dtype(jnp.result_type(*(jnp.asarray(x).dtype for x in arrays.values())))
    valid_nt = jnp.asarray(mask) != 0
    return valid_nt, {n: jnp.where(valid_nt, jnp.asarray(x).astype(dtype), 0.0) for n, x in arrays.items()}


def _check_discount(fn: str, name: str, value: float) -> None:
    check_nonnegative(fn, name, value)
    if value > 1:
        raise ValueError(f"{fn}: {name} must be in [0, 1], got {value!r}")


def masked_whiten(values, mask) -> jax.Array:
    """``values`` [N, T] whitened over the valid positions of ``mask``, as verl's ``masked_whiten``: mean and
    unbiased variance over valid tokens, (x - mean) / sqrt(var + 1e-8); 0 at invalid positions (and everywhere
    when there are none). With a single valid token the variance is taken as 0 (verl raises)."""
    valid_nt, arrays = _token_arrays("masked_whiten", mask, values=values)
    x_nt = arrays["values"]
    count = jnp.sum(valid_nt).astype(x_nt.dtype)
    mean = jnp.sum(x_nt) / jnp.maximum(count, 1)
    var = jnp.sum(jnp.where(valid_nt, jnp.square(x_nt - mean), 0.0)) / jnp.maximum(count - 1, 1)
    return jnp.where(valid_nt, (x_nt - mean) * lax.rsqrt(var + WHITEN_EPS), 0.0)


def _reverse_scan(step, init_n, xs_tn):
    """Scan ``step`` over time from the last column to the first; outputs back in [N, T] order."""
    _, out_tn = lax.scan(step, init_n, xs_tn, reverse=True)
    return out_tn.T


# The scans below are jitted with their discounts static: called eagerly (as the RL loop does, once per step), a
# `lax.scan` over a fresh closure is traced and compiled again at every call (a backend compile per RL step).
@functools.partial(jax.jit, static_argnames=("gamma",))
def discounted_returns(token_rewards, mask, *, gamma: float = 1.0) -> jax.Array:
    """G_t = r_t + gamma G_{t'} over the valid tokens of each row (t' the next valid one); [N, T], 0 at invalid
    positions."""
    fn = "discounted_returns"
    _check_discount(fn, "gamma", gamma)
    valid_nt, a = _token_arrays(fn, mask, token_rewards=token_rewards)

    def step(running_n, x):
        r_n, v_n = x
        new = jnp.where(v_n, r_n + gamma * running_n, running_n)
        return new, jnp.where(v_n, new, 0.0)

    return _reverse_scan(step, jnp.zeros(valid_nt.shape[0], a["token_rewards"].dtype),
                         (a["token_rewards"].T, valid_nt.T))


@functools.partial(jax.jit, static_argnames=("gamma", "lam", "whiten"))
def gae_advantages(token_rewards, values, mask, *, gamma: float = 1.0, lam: float = 1.0,
                   whiten: bool = True) -> tuple[jax.Array, jax.Array]:
    """(advantages [N, T], returns [N, T]) by GAE over the valid tokens (see the module docstring).

    Args:
      token_rewards: [N, T] reward per token (the score on the last valid token, minus any per-token KL).
      values: [N, T] the critic's value V(s_t) at each token (the old values, before the update).
      mask: [N, T] nonzero at the tokens being trained on.
      gamma, lam: discount and GAE's lambda, in [0, 1] (verl's defaults: 1 and 1).
      whiten: whiten the advantages over the batch's valid tokens (verl always does); the returns never are.

    Returns are A + V before whitening: the value loss's target. Both are 0 at invalid positions."""
    fn = "gae_advantages"
    _check_discount(fn, "gamma", gamma)
    _check_discount(fn, "lam", lam)
    valid_nt, a = _token_arrays(fn, mask, token_rewards=token_rewards, values=values)

    def step(carry, x):
        next_value_n, last_adv_n = carry
        r_n, v_n, ok_n = x
        adv_n = r_n + gamma * next_value_n - v_n + gamma * lam * last_adv_n
        carry = (jnp.where(ok_n, v_n, next_value_n), jnp.where(ok_n, adv_n, last_adv_n))
        return carry, jnp.where(ok_n, adv_n, 0.0)

    zeros_n = jnp.zeros(valid_nt.shape[0], a["values"].dtype)
    adv_nt = _reverse_scan(step, (zeros_n, zeros_n), (a["token_rewards"].T, a["values"].T, valid_nt.T))
    returns_nt = jnp.where(valid_nt, adv_nt + a["values"], 0.0)
    return (masked_whiten(adv_nt, valid_nt) if whiten else adv_nt), returns_nt


def reinforce_pp_token_advantages(token_rewards, mask, *, gamma: float = 1.0) -> jax.Array:
    """REINFORCE++ advantages [N, T]: the discounted returns (``discounted_returns``) whitened over the batch's
    valid tokens (``masked_whiten``); 0 at invalid positions."""
    return masked_whiten(discounted_returns(token_rewards, mask, gamma=gamma), mask)


def gae_estimator_advantages(token_rewards, group_size: int, *, values, mask, gamma: float = 1.0,
                             lam: float = 1.0) -> jax.Array:
    """``gae_advantages``' advantages under the estimator registry's calling convention (``group_size`` is not
    used: the critic's values are the baseline); the returns come from ``gae_advantages`` itself."""
    return gae_advantages(token_rewards, values, mask, gamma=gamma, lam=lam)[0]
