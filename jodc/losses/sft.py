"""The SFT loss over a packed microbatch's logits: next-token cross-entropy of the trained tokens, normalised by the
minibatch's global loss-token count so that the sum over microbatches and devices is the minibatch mean."""
from __future__ import annotations

import jax.numpy as jnp

from jodc.losses.logprobs import token_logprobs


def sft_loss_from_logits(logits_btv, microbatch, *, chunk_size: int | None = None):
    """sum over trained tokens of -log p(target) / normalizer. `microbatch` holds `targets` [B, T] (the next
    tokens), `loss_mask` [B, T] (1 where trained) and `normalizer` (the minibatch's count of trained tokens);
    `chunk_size` bounds the fp32 log-softmax's working set (`token_logprobs`)."""
    logp_bt = token_logprobs(logits_btv, microbatch["targets"], chunk_size=chunk_size)
    return -jnp.sum(logp_bt * microbatch["loss_mask"]) / microbatch["normalizer"]
