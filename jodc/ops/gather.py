"""gather: pull every owner's shard of a bucket into the full parameters, in the compute dtype."""
from __future__ import annotations

import jax

from jodc.ops._call import TOKEN_TYPE, float_dtype, native, per_device, prepare
from jodc.ops.heap import Bucket
from jodc.ops.replicated_heap import ReplicatedBucket


def gather(bucket: Bucket | ReplicatedBucket, token, *, dtype=None) -> tuple[jax.Array, jax.Array]:
    """Returns (full bucket of `bucket.shape` in `dtype` (default: the master dtype), new token).

    Call inside ``shard_map`` over the heap's axis. Point to point: it waits for no other device, so shards must
    not be republished while a peer may be gathering (the minibatch barrier guarantees that).
    """
    device, token = prepare(bucket, token, "gather")
    out_dtype = float_dtype(dtype if dtype is not None else bucket.np_dtype, "dtype", "gather")
    full, token = native(bucket, "gather", (jax.ShapeDtypeStruct((bucket.numel,), out_dtype), TOKEN_TYPE),
                         device, token)
    return per_device(full.reshape(bucket.shape), bucket.heap), token
