"""Reading and zeroing the calling device's own fp32 gradient accumulator of a bucket."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jodc.ops._call import TOKEN_TYPE, attrs, per_device, prepare, target
from jodc.ops.heap import Bucket


def read_accumulator(bucket: Bucket, token) -> tuple[jax.Array, jax.Array]:
    """Returns (this device's accumulated gradient shard, fp32 [shard_numel] including padding, new token).

    Read after the minibatch barrier, when every device's pushes have landed.
    """
    device, token = prepare(bucket, token, "read_accumulator")
    acc, token = jax.ffi.ffi_call(
        target(bucket.heap, "read_accumulator"),
        (jax.ShapeDtypeStruct((bucket.shard_numel,), jnp.float32), TOKEN_TYPE),
        has_side_effect=True,
    )(device, token, **attrs(bucket))
    axis = bucket.heap.axis_name
    return per_device(acc, axis), token


def zero_accumulator(bucket: Bucket, token) -> jax.Array:
    """Zeroes this device's accumulator shard of `bucket`; returns a new token."""
    device, token = prepare(bucket, token, "zero_accumulator")
    (token,) = jax.ffi.ffi_call(target(bucket.heap, "zero_accumulator"), (TOKEN_TYPE,), has_side_effect=True)(
        device, token, **attrs(bucket)
    )
    return token
