"""group_scatter_accumulate: push slice i into the fp32 accumulator of member i of a group named at run time."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jodc.ops._call import TOKEN_TYPE, float_dtype, native, prepare
from jodc.ops._members import check_members
from jodc.ops.heap import Bucket
from jodc.ops.replicated_heap import ReplicatedBucket


def group_scatter_accumulate(bucket: Bucket | ReplicatedBucket, members, slices, token) -> jax.Array:
    """Adds ``slices[i]`` ([k, bucket.shard_numel], fp32 or bf16) into the accumulator shard of device ``members[i]``
    (an int32 [k] list holding the calling device); returns a new token.

    The transpose of `group_gather`: concurrent pushes into one member are race-free (bit-for-bit reproducible in a
    deterministic heap). Members read their sum with `read_accumulator` after a `group_barrier`, then zero it with
    `zero_accumulator`.
    """
    device, token = prepare(bucket, token, "group_scatter_accumulate")
    members = check_members(members, bucket.heap, "group_scatter_accumulate")
    slices = jnp.asarray(slices)
    float_dtype(slices.dtype, "slices", "group_scatter_accumulate")
    k = int(members.shape[0])
    if tuple(slices.shape) != (k, bucket.shard_numel):
        raise ValueError(
            f"jodc.ops.group_scatter_accumulate: slices of shape {tuple(slices.shape)} do not match {k} members' "
            f"slots of bucket {bucket.name!r}: expected ({k}, {bucket.shard_numel})")
    (token,) = native(bucket, "group_scatter_accumulate", (TOKEN_TYPE,), device, members, slices.reshape(-1), token)
    return token
