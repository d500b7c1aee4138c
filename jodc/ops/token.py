"""Ordering tokens: an int32 scalar threaded through every op so XLA keeps their program order.

``has_side_effect=True`` keeps each native call alive but does not order independent calls; a data dependency
does. Every op takes a token and returns a new one; ``after`` and ``depend_on`` tie tokens to ordinary values.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def new_token(axis_name: str | None = None) -> jax.Array:
    """A fresh token (int32 zero). Inside shard_map, pass the heap's axis to type it as a per-device value (needed
    when it is a loop carry that meets per-device data, e.g. through `after`)."""
    token = jnp.zeros((), jnp.int32)
    if axis_name is not None:
        token = lax.pcast(token, axis_name, to="varying")
    return token


def check_token(token, op: str) -> jax.Array:
    token = jnp.asarray(token)
    if token.shape != () or token.dtype != jnp.int32:
        raise ValueError(f"jodc.ops.{op}: token must be an int32 scalar, got {token.dtype}{list(token.shape)}")
    return token


def after(token, *values):
    """A token that XLA can only produce once `values` are computed (e.g. gradients whose backward pass pushed)."""
    token = check_token(token, "after")
    out = lax.optimization_barrier((token, values))
    return out[0]


def depend_on(value, token):
    """`value` unchanged, but only available after `token` (e.g. make a computation wait for a barrier)."""
    token = check_token(token, "depend_on")
    return lax.optimization_barrier((value, token))[0]
