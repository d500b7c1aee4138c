"""The per-layer ODC pattern as a ``custom_vjp``: parameters are gathered for forward, dropped, re-gathered for
backward, and the weight gradient is pushed to its owners. Only the layer's input activations are saved, so the
full parameters of a layer are alive only while that layer computes (FSDP memory behaviour).
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from jodc.ops.gather import gather
from jodc.ops.heap import Bucket
from jodc.ops.replicated_heap import ReplicatedBucket
from jodc.ops.scatter_accumulate import scatter_accumulate
from jodc.ops.token import after, depend_on, varying_axes


def _is_float(leaf) -> bool:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.floating)


def odc_layer(fn: Callable, bucket: Bucket | ReplicatedBucket | Sequence[Bucket | ReplicatedBucket], *, dtype=None,
              unflatten: Callable | Sequence[Callable] | None = None, with_token: bool = False) -> Callable:
    """Wraps ``fn(params, x) -> y`` into ``layer(x, token) -> (y, token)`` backed by `bucket`.

    Args:
      fn: the layer computation; `params` is the gathered bucket (its shape) or ``unflatten(flat)``. With a
        sequence of buckets (e.g. a tied head that reads the embedding too), `params` is a tuple, one per bucket.
      bucket: the registered bucket(s) holding this layer's parameters.
      dtype: compute dtype of the gathered parameters (default: each bucket's master dtype).
      unflatten: maps a gathered array to the parameter pytree `fn` expects (must be differentiable: reshapes and
        slices); one per bucket when several.
      with_token: `fn` runs side-effecting ops of its own (a context-parallel layer's K/V exchange):
        ``fn(params, x, token, recompute) -> (y, token)`` threads the layer's token (after the parameter gather) and
        is told whether it runs in the forward pass (``recompute=False``) or again in the backward pass (True: the
        recomputation, whose own backward ops run under the layer's `jax.vjp`); the weight gradients are pushed only
        after everything the recomputation's backward produced.

    `x` may be any pytree (activations plus integer side inputs such as positions); float leaves receive
    cotangents. In the backward pass the re-gather waits for the output cotangent, and the input cotangent is
    released only after the weight gradients were pushed, so consecutive layers' backward ops stay ordered.
    Call inside ``shard_map`` over the buckets' heap axis (and replica axis, for replicated buckets).
    """
    multi = isinstance(bucket, (tuple, list))
    buckets = tuple(bucket) if multi else (bucket,)
    if not buckets:
        raise ValueError("odc_layer needs at least one bucket")
    if unflatten is None:
        unflattens = (None,) * len(buckets)
    elif multi:
        unflattens = tuple(unflatten)
        if len(unflattens) != len(buckets):
            raise ValueError(f"odc_layer: {len(buckets)} buckets but {len(unflattens)} unflatten functions")
    else:
        unflattens = (unflatten,)

    def apply(fulls, x, token=None, recompute=False):
        params = tuple(u(f) if u is not None else f for u, f in zip(unflattens, fulls))
        if with_token:
            return fn(params if multi else params[0], x, token, recompute)
        return fn(params if multi else params[0], x)

    def gather_all(token):
        fulls = []
        for b in buckets:
            full, token = gather(b, token, dtype=dtype)
            fulls.append(full)
        return tuple(fulls), token

    axes = buckets[0].heap.device_axes  # ('d',), or ('r', 'd') for a replicated heap

    def check_inputs(x, fulls):
        """Under shard_map's type checks, a float input that is the same on every device would get a cotangent
        summed over devices (a collective in every backward pass): refuse it with a clear message instead."""
        if not set(axes) <= varying_axes(fulls[0]):
            return  # check_vma=False: no axis typing
        for path, leaf in jax.tree_util.tree_leaves_with_path(x):
            if _is_float(leaf) and not set(axes) <= varying_axes(leaf):
                raise ValueError(
                    f"odc_layer: input {jax.tree_util.keystr(path)} is the same on every device (not varying over "
                    f"{axes}); pass per-device values (e.g. lax.pcast(x, {axes}, to='varying')) so its gradient "
                    f"needs no collective")

    def forward(x, token):
        # gather only once the input exists: otherwise XLA hoists every layer's gather to the start of the forward
        # pass and all full parameters are alive at once
        fulls, token = gather_all(after(token, x))
        if with_token:
            y, token = apply(fulls, x, token, False)
        else:
            y = apply(fulls, x)
        return fulls, y, token

    @jax.custom_vjp
    def layer(x, token):
        _, y, token = forward(x, token)
        return y, token

    def layer_fwd(x, token):
        fulls, y, token = forward(x, token)
        check_inputs(x, fulls)
        return (y, token), (x, token)  # residuals: activations and the token only

    def layer_bwd(residuals, cotangents):
        x, token = residuals
        dy, _ = cotangents
        token = after(token, dy)  # re-gather only once the cotangent exists (not in the forward pass)
        fulls, token = gather_all(token)
        if with_token:  # the recomputation threads the token; its backward ops run inside vjp(dy)
            _, vjp, token = jax.vjp(lambda f, xx: apply(f, xx, token, True), fulls, x, has_aux=True)
            dfulls, dx = vjp(dy)
            token = after(token, dfulls, dx)
        else:
            _, vjp = jax.vjp(apply, fulls, x)
            dfulls, dx = vjp(dy)
        for b, g in zip(buckets, dfulls):
            token = scatter_accumulate(b, g, token)
        return depend_on(dx, token), None  # dx only after the push; None: the token (an int) has no cotangent

    layer.defvjp(layer_fwd, layer_bwd)
    return layer
