"""Reading and zeroing the calling device's own fp32 gradient accumulator of a bucket."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jodc.ops._call import TOKEN_TYPE, native, per_device, prepare
from jodc.ops.heap import Bucket
from jodc.ops.replicated_heap import ReplicatedBucket


def read_accumulator(bucket: Bucket | ReplicatedBucket, token) -> tuple[jax.Array, jax.Array]:
    """Returns (this device's accumulated gradient shard, fp32 [shard_numel] including padding, new token).

    Read after the minibatch barrier, when every device's pushes have landed.
    """
    device, token = prepare(bucket, token, "read_accumulator")
    acc, token = native(bucket, "read_accumulator",
                        (jax.ShapeDtypeStruct((bucket.shard_numel,), jnp.float32), TOKEN_TYPE), device, token)
    return per_device(acc, bucket.heap), token


def zero_accumulator(bucket: Bucket | ReplicatedBucket, token) -> jax.Array:
    """Zeroes this device's accumulator shard of `bucket`; returns a new token."""
    device, token = prepare(bucket, token, "zero_accumulator")
    (token,) = native(bucket, "zero_accumulator", (TOKEN_TYPE,), device, token)
    return token
