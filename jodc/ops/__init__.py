"""ODC point-to-point ops as XLA FFI custom calls (C++ on CPU, CUDA kernels on GPU).

A :class:`SymmetricHeap` holds buckets: each device owns one padded shard of every bucket and an fp32 gradient
accumulator for it. Inside ``jax.shard_map`` over the heap's mesh axis, a device pulls full parameters with
:func:`gather`, pushes gradients to their owners with :func:`scatter_accumulate`, meets the others once per
minibatch at :func:`barrier`, then reads its accumulated shard (:func:`read_accumulator`), updates it and
:func:`publish` es the result. The group ops (:func:`group_gather`, :func:`group_scatter_accumulate`,
:func:`group_barrier`) do the same among a group of devices named at run time (context parallelism). Every op takes and returns an int32 token that keeps them in program order.
Wait for results with :func:`block_until_ready` (``heap.block_until_ready``): a device that fails aborts the heap,
so the others fail at once instead of waiting in the barrier for its timeout.
"""
from jodc.ops.accumulator import read_accumulator, zero_accumulator
from jodc.ops.barrier import barrier
from jodc.ops.failure import DeviceFailed, block_until_ready
from jodc.ops.gather import gather
from jodc.ops.group_barrier import group_barrier
from jodc.ops.group_gather import group_gather
from jodc.ops.group_scatter_accumulate import group_scatter_accumulate
from jodc.ops.heap import Bucket, SymmetricHeap
from jodc.ops.layer import odc_layer
from jodc.ops.publish import publish
from jodc.ops.replica_barrier import replica_barrier
from jodc.ops.replicated_heap import ReplicatedBucket, ReplicatedHeap
from jodc.ops.scatter_accumulate import scatter_accumulate
from jodc.ops.token import after, depend_on, new_token

__all__ = [
    "Bucket",
    "DeviceFailed",
    "ReplicatedBucket",
    "ReplicatedHeap",
    "SymmetricHeap",
    "after",
    "barrier",
    "block_until_ready",
    "depend_on",
    "gather",
    "group_barrier",
    "group_gather",
    "group_scatter_accumulate",
    "new_token",
    "odc_layer",
    "publish",
    "read_accumulator",
    "replica_barrier",
    "scatter_accumulate",
    "zero_accumulator",
]
