"""Critic PPO's host side: the value head's values of a rollout's response tokens (one compiled forward pass at
the weights that sampled it), and GAE over the rollout's token rewards (`jodc.losses.gae_advantages`).

The critic shares the policy's trunk (`jodc.models.value_head`): its values come from the same parameters the
engine trains, so the "old values" of the clipped value loss are those of the step's weights before its updates,
as the old log-probs are. Rows are right-padded to a multiple of `bucket` (one compile per width), as the
reference policy's.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jodc.losses import gae_advantages, kl_reward, last_token_rewards
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


def _padded(arrays: Sequence[np.ndarray], width: int) -> np.ndarray:
    out = np.zeros((len(arrays), width), np.float32)
    for i, a in enumerate(arrays):
        out[i, :len(a)] = a
    return out


def critic_advantages(scores, values: Sequence[np.ndarray], *, gamma: float, lam: float, kl=None
                      ) -> tuple[list[np.ndarray], list[np.ndarray], float | None]:
    """(per response advantages [n_i], returns [n_i], the batch's KL or None) by GAE over token rewards: each
    response's score on its last token, minus beta x the per-token KL when `kl` = (logprobs, ref_logprobs, beta,
    estimator) is given (per response arrays). Advantages are whitened over the rollout's tokens (verl)."""
    lengths = [len(v) for v in values]
    width = max(lengths + [1])
    mask = _padded([np.ones(n) for n in lengths], width)
    current_kl = None
    if kl is None:
        rewards = last_token_rewards(np.asarray(scores, np.float32), mask)
    else:
        logprobs, ref_logprobs, beta, estimator = kl
        rewards, current_kl = kl_reward(np.asarray(scores, np.float32), _padded(logprobs, width),
                                        _padded(ref_logprobs, width), mask, beta=beta, estimator=estimator)
        current_kl = float(current_kl)
    adv, ret = gae_advantages(rewards, _padded(values, width), mask, gamma=gamma, lam=lam)
    adv, ret = np.asarray(adv), np.asarray(ret)
    return ([adv[i, :n].astype(np.float32) for i, n in enumerate(lengths)],
            [ret[i, :n].astype(np.float32) for i, n in enumerate(lengths)], current_kl)
