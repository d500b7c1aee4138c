"""group_gather: pull one slot (a device's shard of a bucket) from each member of a group named at run time."""
from __future__ import annotations

import jax

from jodc.ops._call import TOKEN_TYPE, float_dtype, native, per_device, prepare
from jodc.ops._members import check_members
from jodc.ops.heap import Bucket
from jodc.ops.replicated_heap import ReplicatedBucket


def group_gather(bucket: Bucket | ReplicatedBucket, members, token, *, dtype=None) -> tuple[jax.Array, jax.Array]:
    """Returns ([k, bucket.shard_numel] in `dtype` (default: the master dtype), new token): row i is the shard of
    device ``members[i]`` (padding included), for an int32 [k] member list that holds the calling device.

    The list is a run-time operand: one compiled program serves any grouping (context parallelism: the group of a
    long sequence is chosen per minibatch). Call inside ``shard_map`` over the heap's axis, after the members
    published their slots and met at a `group_barrier`. A list with a device out of range, twice, or without the
    caller fails (here when the list is concrete, else when the op runs).
    """
    device, token = prepare(bucket, token, "group_gather")
    members = check_members(members, bucket.heap, "group_gather")
    out_dtype = float_dtype(dtype if dtype is not None else bucket.np_dtype, "dtype", "group_gather")
    k = int(members.shape[0])
    slots, token = native(bucket, "group_gather",
                          (jax.ShapeDtypeStruct((k * bucket.shard_numel,), out_dtype), TOKEN_TYPE),
                          device, members, token)
    return per_device(slots.reshape(k, bucket.shard_numel), bucket.heap), token
