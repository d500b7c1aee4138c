"""group_barrier: only the members of a group named at run time meet; the heap's other devices go on."""
from __future__ import annotations

import jax

from jodc.ops._call import HEAP_TYPES, TOKEN_TYPE, device_index, native
from jodc.ops._members import check_members
from jodc.ops.heap import SymmetricHeap
from jodc.ops.replicated_heap import ReplicatedHeap
from jodc.ops.token import check_token


def group_barrier(heap: SymmetricHeap | ReplicatedHeap, members, token) -> jax.Array:
    """Blocks until every device of `members` (an int32 [k] list holding the calling device) has reached a barrier
    with the same list; returns a new token.

    Generations are counted per pair of devices, so consecutive barriers of one group never mix, the group may
    change from one call to the next (every member must pass the same list), and disjoint groups meet at the same
    time independently. Bounded like `barrier`: after ``heap.barrier_timeout_s`` it fails naming the members that
    never arrived (the heap is then unusable), and an abort (``heap.abort``, a failed device) ends the wait at once.
    """
    if not isinstance(heap, HEAP_TYPES):
        raise ValueError(f"jodc.ops.group_barrier: expected a SymmetricHeap or ReplicatedHeap, got "
                         f"{type(heap).__name__}")
    token = check_token(token, "group_barrier")
    device = device_index(heap, "group_barrier")
    members = check_members(members, heap, "group_barrier")
    (token,) = native(heap, "group_barrier", (TOKEN_TYPE,), device, members, token)
    return token
