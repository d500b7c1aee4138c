"""scatter_accumulate: push each owner's slice of a full-size gradient into that owner's fp32 accumulator."""
from __future__ import annotations


import jax
import jax.numpy as jnp

from jodc.ops._call import TOKEN_TYPE, float_dtype, native, prepare
from jodc.ops.heap import Bucket
from jodc.ops.replicated_heap import ReplicatedBucket


def scatter_accumulate(bucket: Bucket | ReplicatedBucket, grad, token) -> jax.Array:
    """Adds `grad` (bucket shape or flat, fp32 or bf16) into the owners' accumulators; returns a new token.

    Concurrent pushes from all devices into one owner are race-free. In a deterministic heap the result is
    bit-for-bit independent of thread timing.
    """
    device, token = prepare(bucket, token, "scatter_accumulate")
    grad = jnp.asarray(grad)
    float_dtype(grad.dtype, "gradient", "scatter_accumulate")
    if grad.size != bucket.numel or (grad.ndim > 1 and tuple(grad.shape) != bucket.shape):
        raise ValueError(
            f"jodc.ops.scatter_accumulate: gradient of shape {tuple(grad.shape)} does not match bucket "
            f"{bucket.name!r} of shape {bucket.shape} ({bucket.numel} elements)"
        )
    (token,) = native(bucket, "scatter_accumulate", (TOKEN_TYPE,), device, grad.reshape(-1), token)
    return token
