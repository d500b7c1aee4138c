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
from jodc.losses._policy import LOG_RATIO_CLAMP, finish, prepare

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


def kl_penalty(
    logits,
    tokens,
    ref_logprobs,
    mask,
    *,
    estimator: str = "k3",
    aggregation: str = "token-mean",
    normalizer=None,
    segment_ids=None,
    norm_length: int | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """KL(pi || ref) penalty from logits: the aggregated per-token estimator (add beta * loss to the policy loss).

    Args as the policy losses; ``ref_logprobs`` [B, T] are the reference model's log-probs of ``tokens``.
    Returns (loss, metrics) with kl_mean (local token mean of the estimator) and entropy."""
    fn = "kl_penalty"
    check_choice(fn, "estimator", estimator, KL_ESTIMATORS)
    batch = prepare(
        fn, logits, tokens, mask, {"ref_logprobs": ref_logprobs},
        temperature=temperature, chunk_size=chunk_size, aggregation=aggregation, segment_ids=segment_ids,
    )
    per_token = kl_estimate(batch.logprobs, batch.fields["ref_logprobs"], estimator)
    return finish(per_token, batch, {"kl_mean": per_token}, aggregation=aggregation, normalizer=normalizer,
                  segment_ids=segment_ids, norm_length=norm_length)
