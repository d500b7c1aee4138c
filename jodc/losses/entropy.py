"""The entropy bonus: -entropy_coeff times the aggregated per-token entropy of the policy, added to the policy
loss so that minimising the loss raises the entropy (verl's ``entropy_coeff``: policy_loss = pg_loss -
entropy_coeff * agg_loss(entropy)).

The entropy H(pi(. | s_t)) comes from ``token_logprobs_and_entropy``; with ``chunk_size`` it runs over blocks of
token positions with a custom VJP, so neither pass materialises an fp32 [B, T, V] copy of the logits. The
gradient flows into the logits.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jodc.losses._checks import check_bt, check_choice, check_logits, check_nonnegative
from jodc.losses.aggregation import AGGREGATIONS, aggregate, valid_tokens
from jodc.losses.logprobs import token_logprobs_and_entropy


def entropy_bonus(logits, tokens, mask, *, entropy_coeff: float, aggregation: str = "token-mean",
                  normalizer=None, segment_ids=None, norm_length: int | None = None, temperature: float = 1.0,
                  chunk_size: int | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(-entropy_coeff * aggregate(H), {"entropy": aggregate(H)}) over the valid tokens of ``mask``; add the
    first to the policy loss. ``logits`` [B, T, V]; ``tokens`` [B, T] (only for the shared log-softmax pass);
    aggregation, normaliser and segments as ``jodc.losses.aggregate``; temperature and chunking as
    ``token_logprobs``."""
    fn = "entropy_bonus"
    bt = tuple(check_logits(fn, logits)[:2])
    check_bt(fn, "mask", mask, bt)
    check_choice(fn, "aggregation", aggregation, AGGREGATIONS)
    check_nonnegative(fn, "entropy_coeff", entropy_coeff)
    _, entropy_bt = token_logprobs_and_entropy(logits, tokens, temperature=temperature, chunk_size=chunk_size)
    valid_bt = valid_tokens(mask, segment_ids)
    entropy = aggregate(jnp.where(valid_bt, entropy_bt, 0.0), valid_bt, aggregation, normalizer=normalizer,
                        segment_ids=segment_ids, norm_length=norm_length)
    return -entropy_coeff * entropy, {"entropy": lax.stop_gradient(entropy)}
