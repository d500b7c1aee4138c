"""Per-token KL estimators between the current policy and a frozen reference, and a KL penalty loss.

With samples a_t ~ pi and k1 = log pi(a_t) - log pi_ref(a_t) (Schulman, "Approximating KL divergence", 2020):

* ``k1`` = k1                        unbiased for KL(pi || ref), high variance, can be negative
* ``k2`` = k1^2 / 2                  biased, low variance, always >= 0
* ``k3`` = exp(-k1) + k1 - 1         unbiased, low variance, always >= 0 (GRPO's KL term, arXiv 2402.03300)

The gradient flows through log pi as in the formula (no straight-through tricks).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jodc.losses._checks import check_choice
from jodc.losses._policy import LOG_RATIO_CLAMP, TokenBatch
from jodc.losses.spec import policy_loss

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_estimate(logprobs, ref_logprobs, estimator: str = "k3") -> jax.Array:
    """Per-token estimate of KL(pi || ref) from log pi(a_t) and log ref(a_t) (same shapes, any float dtype).

    ``k3`` clamps the log-ratio to +-20 before exponentiating so a huge gap stays finite."""
    check_choice("kl_estimate", "estimator", estimator, KL_ESTIMATORS)
    if jnp.shape(logprobs) != jnp.shape(ref_logprobs):
        raise ValueError(
            f"kl_estimate: logprobs has shape {jnp.shape(logprobs)} but ref_logprobs has shape "
            f"{jnp.shape(ref_logprobs)}; they must match"
        )
    log_ratio = jnp.asarray(logprobs) - jnp.asarray(ref_logprobs)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * jnp.square(log_ratio)
    neg = jnp.clip(-log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jnp.exp(neg) - neg - 1.0


@policy_loss("kl_penalty", anchor="ref_logprobs", advantages=False)
def kl_penalty(t: TokenBatch, *, estimator: str = "k3"):
    """KL(pi || ref) penalty from logits: the aggregated per-token estimator (add beta * loss to the policy loss):
    ``kl_penalty(logits, tokens, ref_logprobs, mask, *, estimator="k3", aggregation="token-mean", ...)``.

    ``ref_logprobs`` [B, T] are the reference model's log-probs of ``tokens``; the other arguments are the policy
    losses' shared ones. Returns (loss, metrics) with kl_mean (local token mean of the estimator) and entropy."""
    check_choice("kl_penalty", "estimator", estimator, KL_ESTIMATORS)
    per_token = kl_estimate(t.logprobs, t.fields["ref_logprobs"], estimator)
    return per_token, {"kl_mean": per_token}
