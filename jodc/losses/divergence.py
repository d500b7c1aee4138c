"""Cheap approximations of D(mu(. | s_t) || pi(. | s_t)) for DPPO's trust region (Qi et al., arXiv 2602.04879).

Both approximations coarse-grain the vocabulary into a few buckets and compute the divergence between the
bucketed distributions; by the data-processing inequality they lower-bound the true TV and KL.

* Binary: {sampled token a_t, everything else}. Needs only log mu(a_t) and log pi(a_t).
* Top-K: mu's stored top-K ids (the sampled token forced in), plus an "other" bucket holding the remaining mass
  1 - sum (floored at ``MIN_BUCKET_MASS``). pi's log-probs are gathered at the same ids.

Inputs are log-probabilities (any float dtype; fp32 or fp64 math); outputs have the shape of the positions.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

#: Floor for the mass of a "rest" / "other" bucket, so that logs stay finite when a distribution puts all of its
#: mass on the listed ids (and fp32 rounding cannot make the bucket negative).
MIN_BUCKET_MASS = 1e-12


#: Log-probabilities are clipped to [LOG_FLOOR, 0] so that 0 * log 0 terms evaluate to 0 instead of NaN.
LOG_FLOOR = -1e30


def _finite_logp(logp) -> jax.Array:
    """Log-probabilities clipped to [LOG_FLOOR, 0]: -inf becomes a huge finite negative, rounding above 0 is 0."""
    return jnp.clip(logp, LOG_FLOOR, 0.0)


def _log1mexp(logp: jax.Array) -> jax.Array:
    """log(1 - exp(logp)) for logp <= 0, accurate near both ends, floored at log(MIN_BUCKET_MASS)."""
    near_zero = logp > -0.6931471805599453
    safe_near = jnp.where(near_zero, logp, -1.0)
    safe_far = jnp.where(near_zero, -1.0, logp)
    out = jnp.where(near_zero, jnp.log(-jnp.expm1(safe_near)), jnp.log1p(-jnp.exp(safe_far)))
    return jnp.maximum(out, jnp.log(jnp.asarray(MIN_BUCKET_MASS, logp.dtype)))


def _other_bucket(logp_k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(mass, log-mass) of the bucket outside the listed ids: 1 - sum exp(logp), floored."""
    mass = jnp.maximum(1.0 - jnp.sum(jnp.exp(logp_k), axis=-1), MIN_BUCKET_MASS)
    return mass, jnp.log(mass)


def binary_tv(behaviour_logprobs, policy_logprobs) -> jax.Array:
    """TV between {a_t, rest} bucketings of mu and pi: |mu(a_t) - pi(a_t)|."""
    return jnp.abs(jnp.exp(behaviour_logprobs) - jnp.exp(policy_logprobs))


def binary_kl(behaviour_logprobs, policy_logprobs) -> jax.Array:
    """KL(mu || pi) between {a_t, rest} bucketings:
    mu(a) log(mu(a) / pi(a)) + (1 - mu(a)) log((1 - mu(a)) / (1 - pi(a)))."""
    mu_logp = _finite_logp(behaviour_logprobs)
    pi_logp = _finite_logp(policy_logprobs)
    mu_rest_logp = _log1mexp(mu_logp)
    pi_rest_logp = _log1mexp(pi_logp)
    return jnp.exp(mu_logp) * (mu_logp - pi_logp) + jnp.exp(mu_rest_logp) * (mu_rest_logp - pi_rest_logp)


def topk_tv(behaviour_topk_logprobs, policy_topk_logprobs) -> jax.Array:
    """TV between mu and pi bucketed into K listed ids + "other": 1/2 (sum_k |mu_k - pi_k| + |mu_o - pi_o|).

    Inputs [..., K] (log-probs of the same ids under mu and pi); output [...]."""
    mu_k = jnp.exp(behaviour_topk_logprobs)
    pi_k = jnp.exp(policy_topk_logprobs)
    mu_other, _ = _other_bucket(behaviour_topk_logprobs)
    pi_other, _ = _other_bucket(policy_topk_logprobs)
    return 0.5 * (jnp.sum(jnp.abs(mu_k - pi_k), axis=-1) + jnp.abs(mu_other - pi_other))


def topk_kl(behaviour_topk_logprobs, policy_topk_logprobs) -> jax.Array:
    """KL(mu || pi) bucketed into K listed ids + "other": sum_k mu_k log(mu_k / pi_k) + mu_o log(mu_o / pi_o).

    Inputs [..., K]; output [...]."""
    mu_logp = _finite_logp(behaviour_topk_logprobs)
    pi_logp = _finite_logp(policy_topk_logprobs)
    mu_other, mu_other_logp = _other_bucket(mu_logp)
    _, pi_other_logp = _other_bucket(pi_logp)
    listed = jnp.sum(jnp.exp(mu_logp) * (mu_logp - pi_logp), axis=-1)
    return listed + mu_other * (mu_other_logp - pi_other_logp)
