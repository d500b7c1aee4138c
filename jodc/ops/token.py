"""Ordering tokens: an int32 scalar threaded through every op so XLA keeps their program order.

``has_side_effect=True`` keeps each native call alive but does not order independent calls; a data dependency
does. Every op takes a token and returns a new one. `after` and `depend_on` tie tokens to ordinary values; they are
native calls too, because XLA removes optimization barriers before it schedules (a dependency expressed only
through `lax.optimization_barrier` does not survive compilation).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jodc.ops.transports import registration, target_names

TOKEN_TYPE = jax.ShapeDtypeStruct((), jnp.int32)


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


def varying_axes(x) -> frozenset:
    """The mesh axes over which `x` is typed as varying inside shard_map (empty outside, or without type checks)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))  # later releases


def as_varying(x, axes):
    """`x` typed as varying over every axis in `axes` (a no-op for axes it already varies over)."""
    missing = tuple(a for a in sorted(axes) if a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def _float_leaves(tree) -> list:
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
    return [x for x in leaves if x.dtype != jax.dtypes.float0]


def _register() -> None:
    registration.ensure_token_ops()


def after(token, *values):
    """A token that exists only once `values` exist (e.g. the gradients whose backward pass pushed, so a barrier
    waits for every push). Values are not read; no gradient flows through."""
    token = check_token(token, "after")
    leaves = [lax.stop_gradient(x) for x in _float_leaves(values) if x.size > 0]
    _register()
    (out,) = jax.ffi.ffi_call(target_names.target_name("after"), (TOKEN_TYPE,), has_side_effect=True)(token, *leaves)
    axes = set(varying_axes(token))
    for leaf in leaves:
        axes |= varying_axes(leaf)
    return as_varying(out, axes)


@jax.custom_jvp
def _depend_leaves(leaves: tuple, token):
    _register()
    results = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves)
    outs = jax.ffi.ffi_call(target_names.target_name("depend_on"), results, has_side_effect=True,
                            input_output_aliases={i + 1: i for i in range(len(leaves))})(token, *leaves)
    return tuple(as_varying(o, varying_axes(x)) for o, x in zip(outs, leaves))


@_depend_leaves.defjvp
def _depend_leaves_jvp(primals, tangents):
    leaves, token = primals
    leaf_tangents, _ = tangents
    return _depend_leaves(leaves, token), leaf_tangents  # the identity on values: tangents pass through


def depend_on(value, token):
    """`value` (any pytree) unchanged, but only available after `token` (e.g. results that must wait for a
    barrier). Differentiable: the identity for gradients."""
    token = check_token(token, "depend_on")
    leaves, treedef = jax.tree.flatten(value)
    arrays = [jnp.asarray(x) for x in leaves]
    index = [i for i, x in enumerate(arrays) if x.dtype != jax.dtypes.float0 and x.size > 0]
    if not index:
        return value
    tied = _depend_leaves(tuple(arrays[i] for i in index), token)
    for i, x in zip(index, tied):
        arrays[i] = x
    return jax.tree.unflatten(treedef, arrays)
