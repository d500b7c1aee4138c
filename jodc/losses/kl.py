"""Per-token KL estimators between the current policy and a frozen reference, and a KL penalty loss.

With samples a_t ~ pi and k1 = log pi(a_t) - log pi_ref(a_t) (Schulman, "Approximating KL divergence", 2020):

* ``k1`` = k1                        unbiased for KL(pi || ref), high variance, can be negative
* ``k2`` = k1^2 / 2                  biased, low variance, always >= 0
* ``k3`` = exp(-k1) + k1 - 1         unbiased, low variance, always >= 0 (GRPO's KL term, arXiv 2402.03300)
* ``abs`` = |k1|                     verl's ``abs`` penalty (gradient sign(k1): 0 at k1 = 0, as torch's abs)

verl's (and TRL's) other spellings are accepted as aliases: ``kl`` = k1, ``mse`` = k2, ``low_var_kl`` = k3.

The gradient flows through log pi as in the formula, except for the straight-through variants ``k1+``, ``k3+``
and ``abs+`` (verl's names, also ``kl+`` / ``low_var_kl+``): the value of k1 / k3 / |k1| with the gradient of
k2, k2 - sg(k2) + sg(k_n). The expected gradient of k1 and k3 under samples of pi is not the gradient of the
KL; that of k2 is (``k2+`` / ``mse+`` are k2).

The k3 log-ratio is clamped to +-20 before ``exp`` (as in verl); verl also clamps the k3 *value* to [-10, 10],
jodc does not (a value above 10 is reported as it is, and its gradient is not cut).
"""
from __future__ import annotations

from types import MappingProxyType

import jax
import jax.numpy as jnp
from jax import lax

from jodc.losses._checks import check_choice
from jodc.losses._policy import LOG_RATIO_CLAMP, TokenBatch, abs_zero_subgradient
from jodc.losses.spec import policy_loss

#: Estimator names: jodc's (k1, k2, k3, abs), verl's aliases (kl, mse, low_var_kl), and each with a "+" suffix for
#: the straight-through form (value of the estimator, gradient of k2).
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "abs", "kl", "mse", "low_var_kl",
                                  "k1+", "k2+", "k3+", "abs+", "kl+", "mse+", "low_var_kl+")
#: verl's names for jodc's estimators.
KL_ALIASES = MappingProxyType({"kl": "k1", "mse": "k2", "low_var_kl": "k3"})


def kl_estimate(logprobs, ref_logprobs, estimator: str = "k3") -> jax.Array:
    """Per-token estimate of KL(pi || ref) from log pi(a_t) and log ref(a_t) (same shapes, any float dtype).

    ``k3`` clamps the log-ratio to +-20 before exponentiating so a huge gap stays finite; ``k1+`` / ``k3+`` /
    ``abs+`` have the value of k1 / k3 / |k1| and the gradient of k2; ``kl`` / ``mse`` / ``low_var_kl`` (and their
    ``+`` forms) are verl's names for k1 / k2 / k3 (see the module docstring)."""
    check_choice("kl_estimate", "estimator", estimator, KL_ESTIMATORS)
    if jnp.shape(logprobs) != jnp.shape(ref_logprobs):
        raise ValueError(
            f"kl_estimate: logprobs has shape {jnp.shape(logprobs)} but ref_logprobs has shape "
            f"{jnp.shape(ref_logprobs)}; they must match"
        )
    log_ratio = jnp.asarray(logprobs) - jnp.asarray(ref_logprobs)
    base = estimator.rstrip("+")
    base = KL_ALIASES.get(base, base)
    if base == "k1":
        value = log_ratio
    elif base == "abs":
        value = abs_zero_subgradient(log_ratio)
    elif base == "k2":
        value = 0.5 * jnp.square(log_ratio)
    else:
        neg = jnp.clip(-log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        value = jnp.exp(neg) - neg - 1.0
    if not estimator.endswith("+") or base == "k2":
        return value
    k2 = 0.5 * jnp.square(log_ratio)
    return k2 - lax.stop_gradient(k2) + lax.stop_gradient(value)


@policy_loss("kl_penalty", anchor="ref_logprobs", advantages=False)
def kl_penalty(t: TokenBatch, *, estimator: str = "k3"):
    """KL(pi || ref) penalty from logits: the aggregated per-token estimator (add beta * loss to the policy loss):
    ``kl_penalty(logits, tokens, ref_logprobs, mask, *, estimator="k3", aggregation="token-mean", ...)``.

    ``ref_logprobs`` [B, T] are the reference model's log-probs of ``tokens``; the other arguments are the policy
    losses' shared ones. Returns (loss, metrics) with kl_mean (local token mean of the estimator) and entropy."""
    check_choice("kl_penalty", "estimator", estimator, KL_ESTIMATORS)
    per_token = kl_estimate(t.logprobs, t.fields["ref_logprobs"], estimator)
    return per_token, {"kl_mean": per_token}
