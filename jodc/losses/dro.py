"""DRO: the policy gradient on the sampler's responses with a quadratic penalty on the log-ratio.

Direct Reward Optimization (Richemond et al. 2024, arXiv 2405.19107; the form Kimi k1.5, arXiv 2501.12599, uses
off-policy). Responses are sampled from q (the rollout's, or old, policy) and the objective is

    E_q[ A log pi(a) - beta / 2 (log pi(a) - log q(a))^2 ]

so the per-token loss is

    loss_t = -A_t log pi(a_t) + beta / 2 (log pi(a_t) - log q(a_t))^2

No ratio and no clip: the quadratic term alone keeps pi near q (its gradient beta (log pi - log q) d log pi is 0
on policy, where the loss's gradient is REINFORCE's). verl's ``dro`` and Tinker's ``dro`` loss; the penalty is
outside the advantage, so a token with A_t = 0 still feels it (only the mask removes a token).
"""
from __future__ import annotations

import jax.numpy as jnp

from jodc.losses._checks import check_nonnegative
from jodc.losses._policy import TokenBatch, clamped_exp
from jodc.losses.spec import policy_loss

#: Default weight of the quadratic penalty (verl's ``dro_beta``).
DEFAULT_DRO_BETA = 0.1


@policy_loss("dro_loss", anchor="old_logprobs")
def dro_loss(t: TokenBatch, *, dro_beta: float = DEFAULT_DRO_BETA):
    """DRO loss from logits:
    ``dro_loss(logits, tokens, old_logprobs, advantages, mask, *, dro_beta=0.1, aggregation="token-mean", ...)``.

    ``old_logprobs`` [B, T] are log q(a_t), the log-probs of the policy that sampled the tokens (the quadratic
    penalty's anchor); the other arguments are the policy losses' shared ones. The log-ratio is not clamped (no
    exponential is taken of it; the ``ratio_mean`` metric is). Returns (loss, metrics): quadratic_penalty (mean of
    (log pi - log q)^2 / 2, before beta), ratio_mean, entropy."""
    check_nonnegative("dro_loss", "dro_beta", dro_beta)
    log_ratio = t.logprobs - t.fields["old_logprobs"]
    half_square = 0.5 * jnp.square(log_ratio)
    per_token = -t.fields["advantages"] * t.logprobs + dro_beta * half_square
    return per_token, {"quadratic_penalty": half_square, "ratio_mean": clamped_exp(log_ratio)}
