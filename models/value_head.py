"""A value head on the decoder (critic PPO with a shared trunk): one scalar per token, V(s_t) = w . norm(h_t) + b.

It reads the trunk's last hidden state through the head group's final RMS norm (the same normalised state the
LM head projects), so the policy and the critic share every decoder parameter and the head adds D + 1 numbers.
Its parameters are their own group (`VALUE_HEAD`), so every FSDP engine shards them like any other group; they
start at zero (V = 0 everywhere, the critic learns from the first returns). The value at position t is the value
of the state that predicts token t + 1, the same alignment as the log-probs (verl's critic values).
"""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from .config import DecoderConfig
from .layerwise import EMBED, HEAD, embed_apply, layer_apply, layer_group_name, resolve_positions_and_segments
from .norm import rms_norm

VALUE_HEAD = "value_head"


def init_value_head(config: DecoderConfig) -> dict[str, jax.Array]:
    """The value head's parameters, zero: {"weight": [D], "bias": [1]} in the parameter dtype."""
    dtype = config.params_dtype
    return {"weight": jnp.zeros((config.hidden_size,), dtype), "bias": jnp.zeros((1,), dtype)}


def value_apply(config: DecoderConfig, head_params: Mapping[str, jax.Array], value_params: Mapping[str, jax.Array],
                h_btd: jax.Array) -> jax.Array:
    """fp32 values [B, T] from the trunk's hidden state [B, T, D] (through the head group's final norm)."""
    x = rms_norm(h_btd.astype(config.activation_dtype), head_params["final_norm"], config.rms_norm_eps)
    weight = value_params["weight"].astype(jnp.float32)
    return jnp.einsum("btd,d->bt", x.astype(jnp.float32), weight) + value_params["bias"].astype(jnp.float32)[0]


def values_forward(config: DecoderConfig, params: Mapping[str, Mapping[str, jax.Array]], tokens_bt: jax.Array,
                   segment_ids_bt: jax.Array) -> jax.Array:
    """Values [B, T] of the whole model from group params (which must include `VALUE_HEAD`); positions restart
    at every segment as in the engines' packed microbatches."""
    positions_bt, segment_ids_bt = resolve_positions_and_segments(tokens_bt.shape, None, segment_ids_bt)
    h = embed_apply(config, params[EMBED], tokens_bt)
    for i in range(config.num_layers):
        h = layer_apply(config, params[layer_group_name(i)], h, positions_bt, segment_ids_bt)
    return value_apply(config, params[HEAD], params[VALUE_HEAD], h)
