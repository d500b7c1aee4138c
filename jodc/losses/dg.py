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
from jodc.losses._policy import finish, prepare


def dg_loss(
    logits,
    tokens,
    advantages,
    mask,
    *,
    eta: float = 1.0,
    aggregation: str = "token-mean",
    normalizer=None,
    segment_ids=None,
    norm_length: int | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DG loss from logits: logits [B, T, V], tokens / advantages / mask [B, T] (other arguments as ``ppo_loss``).

    Returns (loss, metrics): gate_mean, surprisal_mean, entropy."""
    fn = "dg_loss"
    check_positive(fn, "eta", eta)
    batch = prepare(
        fn, logits, tokens, mask, {"advantages": advantages},
        temperature=temperature, chunk_size=chunk_size, aggregation=aggregation, segment_ids=segment_ids,
    )
    adv = batch.fields["advantages"]
    surprisal = -lax.stop_gradient(batch.logprobs)
    gate = jax.nn.sigmoid(adv * surprisal / eta)
    per_token = -gate * adv * batch.logprobs
    metrics = {"gate_mean": gate, "surprisal_mean": surprisal}
    return finish(per_token, batch, metrics, aggregation=aggregation, normalizer=normalizer,
                  segment_ids=segment_ids, norm_length=norm_length)
