"""Delightful Policy Gradient: gate each policy-gradient term by a sigmoid of its "delight".

Osband, "Delightful Policy Gradient" (arXiv 2603.14608). Delight is advantage times surprisal under the learner,
chi_t = A_t * (-log pi(a_t)); each REINFORCE term is weighted by sigmoid(chi_t / eta) (no gradient through the
gate), which amplifies rare successes and suppresses rare failures:

    loss_t = -sg(sigmoid(A_t * (-log pi(a_t)) / eta)) A_t log pi(a_t),    eta = 1

No importance ratio and no behaviour probabilities are needed, which makes it robust to stale or buggy actors.
"""
from __future__ import annotations

import jax
from jax import lax

from jodc.losses._checks import check_positive
from jodc.losses._policy import TokenBatch
from jodc.losses.spec import policy_loss


@policy_loss("dg_loss", anchor=None)
def dg_loss(t: TokenBatch, *, eta: float = 1.0):
    """DG loss from logits: ``dg_loss(logits, tokens, advantages, mask, *, eta=1.0)`` (no anchor log-probs;
    other arguments as ``ppo_loss``).

    Returns (loss, metrics): gate_mean, surprisal_mean, entropy."""
    check_positive("dg_loss", "eta", eta)
    adv = t.fields["advantages"]
    surprisal = -lax.stop_gradient(t.logprobs)
    gate = jax.nn.sigmoid(adv * surprisal / eta)
    return -gate * adv * t.logprobs, {"gate_mean": gate, "surprisal_mean": surprisal}
