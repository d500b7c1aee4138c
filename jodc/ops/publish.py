"""publish: overwrite the calling device's own master shard (after its optimizer step) for peers to gather."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jodc.ops._call import TOKEN_TYPE, native, prepare
from jodc.ops.heap import Bucket
from jodc.ops.replicated_heap import ReplicatedBucket


def publish(bucket: Bucket | ReplicatedBucket, shard, token) -> jax.Array:
    """Writes `shard` ([shard_numel], cast to the master dtype) as this device's shard; returns a new token.

    Publish only between two barriers: peers must not be gathering this bucket meanwhile.
    """
    device, token = prepare(bucket, token, "publish")
    shard = jnp.asarray(shard)
    if shard.shape != (bucket.shard_numel,):
        raise ValueError(
            f"jodc.ops.publish: shard of shape {tuple(shard.shape)} does not match bucket {bucket.name!r} whose "
            f"shards are ({bucket.shard_numel},)"
        )
    if not jnp.issubdtype(shard.dtype, jnp.floating):
        raise ValueError(f"jodc.ops.publish: shard must be floating point, got {shard.dtype}")
    (token,) = native(bucket, "publish", (TOKEN_TYPE,), device, shard.astype(bucket.np_dtype), token)
    return token
