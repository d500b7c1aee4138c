"""The frozen reference policy of the KL penalty: the run's initial weights (after the warm start), scoring each
response token with one compiled forward pass over the rollout.

The trainer holds it sharded (`ShardedReference`: a copy of the engine's fp32 state at the start of the run, 1 /
devices of the model per device) and gathers it in fp32 onto the device of its forward passes for each step's
pass (`policy`), dropped after the step: the same fp32 forward as with host weights, so the same log-probs.

Rows are right-padded to a width rounded up to `bucket` (padding is segment 0, attended by nothing), so a run
compiles one shape per prompt bucket. Log-probs are of softmax(logits / temperature), like the behaviour's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jodc.losses import token_logprobs
from jodc.models import DecoderConfig, forward

from .policy_weights import policy_on_device
from .rollout import Rollout


@functools.partial(jax.jit, static_argnums=(0, 1))
def _row_logprobs(config: DecoderConfig, temperature: float, params, tokens_bt, segment_ids_bt):
    """log p(tokens[:, t + 1] | tokens[:, :t + 1]) for every t: [B, T - 1]."""
    logits = forward(config, params, tokens_bt[:, :-1], segment_ids_bt=segment_ids_bt[:, :-1])
    return token_logprobs(logits, tokens_bt[:, 1:], temperature=temperature)


class ReferencePolicy:
    """Log-probs of response tokens under fixed parameters (host group pytrees, copied in)."""

    def __init__(self, config: DecoderConfig, params, *, temperature: float, bucket: int = 16):
        if bucket < 1:
            raise ValueError(f"bucket must be >= 1, got {bucket}")
        self.config, self.temperature, self.bucket = config, float(temperature), bucket
        self.params = jax.tree.map(jnp.asarray, params)

    def response_logprobs(self, rollout: Rollout, *, width: int = 0) -> list[np.ndarray]:
        """Per response, fp32 [n_i]: the reference's log-prob of each response token; rows padded to at least
        `width` (a whole rollout's width when this is a process's share of it)."""
        rows = [np.concatenate([p, r]) for p, r in zip(rollout.prompt_ids, rollout.response_ids)]
        width = max(width, -(-max(len(r) for r in rows) // self.bucket) * self.bucket)
        tokens = np.zeros((len(rows), width), np.int32)
        segments = np.zeros((len(rows), width), np.int32)
        for i, row in enumerate(rows):
            tokens[i, :len(row)] = row
            segments[i, :len(row)] = 1
        logprobs = np.asarray(_row_logprobs(self.config, self.temperature, self.params, jnp.asarray(tokens),
                                            jnp.asarray(segments)))
        out = []
        for i, (prompt, response) in enumerate(zip(rollout.prompt_ids, rollout.response_ids)):
            start = len(prompt) - 1  # position predicting the first response token
            out.append(logprobs[i, start:start + len(response)].astype(np.float32))
        return out


class ShardedReference:
    """The reference's fp32 flat group vectors held sharded as the engine holds its state (`policy_weights.held_copy`);
    `policy(device)` is a `ReferencePolicy` with them gathered onto `device` (across processes a collective: every
    process asks at the same point of every step)."""

    def __init__(self, config: DecoderConfig, flats: dict, layouts: dict, *, temperature: float, bucket: int = 16):
        self.config, self.flats, self.layouts = config, flats, layouts
        self.temperature, self.bucket = temperature, bucket

    def policy(self, device) -> ReferencePolicy:
        return ReferencePolicy(self.config, policy_on_device(self.flats, device, self.layouts),
                               temperature=self.temperature, bucket=self.bucket)
