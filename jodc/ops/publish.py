"""publish: overwrite the calling device's own master shard (after its optimizer step) for peers to gather."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jodc.ops._call import TOKEN_TYPE, attrs, prepare, target
from jodc.ops.heap import Bucket


def publish(bucket: Bucket, shard, token) -> jax.Array:
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
    (token,) = jax.ffi.ffi_call(target(bucket.heap, "publish"), (TOKEN_TYPE,), has_side_effect=True)(
        device, shard.astype(bucket.np_dtype), token, **attrs(bucket)
    )
    return token
