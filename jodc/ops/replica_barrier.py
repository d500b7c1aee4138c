"""replica_barrier: every device of every replica group of a `ReplicatedHeap` meets, before a cross-replica collective.

A group's own `barrier` is enough for its gradients to have landed; but a device that then enters a collective over
the replica axis (the cross-replica gradient sum) cannot be woken if a device of another group failed: XLA's
collectives wait for every participant. Meeting here first (a native barrier over all groups' devices, which an
abort or the heap's timeout ends) means a device enters the collective only once every device is past its group's
barrier, so a failure anywhere fails everyone within the timeout instead of hanging.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jodc.ops._call import TOKEN_TYPE, device_index, native_one
from jodc.ops.barrier import barrier
from jodc.ops.replicated_heap import ReplicatedHeap
from jodc.ops.token import check_token


def replica_barrier(heap: ReplicatedHeap, token) -> jax.Array:
    """Blocks until every device of every replica group of `heap` has arrived; returns a new token. Call inside
    ``shard_map`` over the heap's two axes; fails (instead of hanging) after the heap's barrier timeout, or at once
    when the heap is aborted. Where the heap has no all-groups barrier (`ReplicatedHeap.world_heap` is None: GPUs of
    several processes), this is each group's own `barrier`, and a failure in one group can leave the others waiting
    in a later cross-replica collective."""
    if not isinstance(heap, ReplicatedHeap):
        raise ValueError(f"jodc.ops.replica_barrier: expected a ReplicatedHeap, got {type(heap).__name__}")
    token = check_token(token, "replica_barrier")
    if heap.world_heap is None:
        return barrier(heap, token)
    device_index(heap, "replica_barrier")  # the checks: both axes bound, of the heap's sizes
    position = lax.axis_index(heap.device_axes).astype(jnp.int32)  # r * world + d: the world heap's position
    (token,) = native_one(heap.world_heap, "barrier", (TOKEN_TYPE,), position, token)
    return token
