"""Critic PPO's host side: the value head's values of a rollout's response tokens (one compiled forward pass at
the weights that sampled it); GAE over them is `advantages.critic_advantages`.

The critic shares the policy's trunk (`jodc.models.value_head`): its values come from the same parameters the
engine trains, so the "old values" of the clipped value loss are those of the step's weights before its updates,
as the old log-probs are. Rows are right-padded to a multiple of `bucket` (one compile per width), as the
reference policy's.
"""
from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
import numpy as np

from jodc.models import DecoderConfig, values_forward

from .rollout import Rollout


@functools.partial(jax.jit, static_argnums=(0,))
def _row_values(config: DecoderConfig, params, tokens_bt, segment_ids_bt):
    """V at every position that predicts a next token: [B, T - 1]."""
    return values_forward(config, params, tokens_bt[:, :-1], segment_ids_bt[:, :-1])


def response_values(config: DecoderConfig, params, rollout: Rollout, *, bucket: int,
                    width: int = 0) -> list[np.ndarray]:
    """Per response, fp32 [n_i]: the value of the state before each response token (the position predicting it),
    under `params` (group pytrees with the value head); rows padded to at least `width`."""
    rows = [np.concatenate([p, r]) for p, r in zip(rollout.prompt_ids, rollout.response_ids)]
    width = max(width, -(-max(len(r) for r in rows) // bucket) * bucket)
    tokens = np.zeros((len(rows), width), np.int32)
    segments = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        tokens[i, :len(row)], segments[i, :len(row)] = row, 1
    values = np.asarray(_row_values(config, params, jnp.asarray(tokens), jnp.asarray(segments)))
    return [values[i, len(p) - 1:len(p) - 1 + len(r)].astype(np.float32)
            for i, (p, r) in enumerate(zip(rollout.prompt_ids, rollout.response_ids))]
