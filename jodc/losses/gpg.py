"""GPG: the plain policy gradient with group-relative advantages, no ratio, no clip, no KL.

Chu et al., "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning" (arXiv 2504.02546).
The loss is REINFORCE on the current policy's samples,

    loss_t = -A_t log pi(a_t)

with the advantages of ``jodc.losses.gpg_advantages`` (group-centred rewards rescaled by the fraction of
responses with a non-zero reward). Like DG it needs no behaviour or old log-probs. verl's ``gpg`` loss.
"""
from __future__ import annotations

from jodc.losses._policy import TokenBatch
from jodc.losses.spec import policy_loss


@policy_loss("gpg_loss", anchor=None)
def gpg_loss(t: TokenBatch):
    """GPG loss from logits: ``gpg_loss(logits, tokens, advantages, mask, *, aggregation="token-mean", ...)``.

    Returns (loss, metrics): entropy."""
    return -t.fields["advantages"] * t.logprobs, {}
