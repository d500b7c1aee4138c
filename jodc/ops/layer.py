"""The per-layer ODC pattern as a ``custom_vjp``: parameters are gathered for forward, dropped, re-gathered for
backward, and the weight gradient is pushed to its owners. Only the layer's input activations are saved, so the
full parameters of a layer are alive only while that layer computes (FSDP memory behaviour).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jodc.ops.gather import gather
from jodc.ops.heap import Bucket
from jodc.ops.scatter_accumulate import scatter_accumulate


def _is_float(leaf) -> bool:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.floating)


def _tie_to_token(tree, token):
    """Makes every float leaf of `tree` depend on `token` (so the consumer runs after the op that made it)."""
    leaves, treedef = jax.tree.flatten(tree)
    idx = [i for i, leaf in enumerate(leaves) if _is_float(leaf) and jnp.result_type(leaf) != jax.dtypes.float0]
    if not idx:
        return tree
    tied = lax.optimization_barrier(([leaves[i] for i in idx], token))[0]
    for i, leaf in zip(idx, tied):
        leaves[i] = leaf
    return jax.tree.unflatten(treedef, leaves)


def odc_layer(fn: Callable, bucket: Bucket, *, dtype=None, unflatten: Callable | None = None) -> Callable:
    """Wraps ``fn(params, x) -> y`` into ``layer(x, token) -> (y, token)`` backed by `bucket`.

    Args:
      fn: the layer computation; `params` is the gathered bucket (its shape) or ``unflatten(flat)``.
      bucket: the registered bucket holding this layer's parameters.
      dtype: compute dtype of the gathered parameters (default: the master dtype).
      unflatten: maps the gathered array to the parameter pytree `fn` expects (must be differentiable: reshapes
        and slices).

    `x` may be any pytree (activations plus integer side inputs such as positions); float leaves receive
    cotangents. In the backward pass the re-gather waits for the output cotangent, and the input cotangent is
    released only after the weight gradient was pushed, so consecutive layers' backward ops stay ordered.
    Call inside ``shard_map`` over the bucket's heap axis.
    """

    def params_of(full):
        return unflatten(full) if unflatten is not None else full

    def apply(full, x):
        return fn(params_of(full), x)

    @jax.custom_vjp
    def layer(x, token):
        full, token = gather(bucket, token, dtype=dtype)
        return apply(full, x), token

    def layer_fwd(x, token):
        full, token = gather(bucket, token, dtype=dtype)
        return (apply(full, x), token), (x, token)  # residuals: activations and the token only

    def layer_bwd(residuals, cotangents):
        x, token = residuals
        dy, _ = cotangents
        dy, token = lax.optimization_barrier((dy, token))  # re-gather only once the cotangent exists
        full, token = gather(bucket, token, dtype=dtype)
        _, vjp = jax.vjp(apply, full, x)
        dfull, dx = vjp(dy)
        token = scatter_accumulate(bucket, dfull, token)
        return _tie_to_token(dx, token), None  # None: the token (an int) has no cotangent

    layer.defvjp(layer_fwd, layer_bwd)
    return layer
