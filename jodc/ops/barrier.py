"""barrier: the once-per-minibatch synchronisation of all devices of a heap."""
from __future__ import annotations

import jax

from jodc.ops._call import HEAP_TYPES, TOKEN_TYPE, device_index, native
from jodc.ops.heap import SymmetricHeap
from jodc.ops.replicated_heap import ReplicatedHeap
from jodc.ops.token import check_token


def barrier(heap: SymmetricHeap | ReplicatedHeap, token) -> jax.Array:
    """Blocks until every device of `heap` has reached the same barrier; returns a new token.

    Fails (instead of hanging) after ``heap.barrier_timeout_s`` (``inf``: never) with the indices of the devices that
    never arrived; the heap is then unusable. Fails at once, with the cause, when the heap is aborted: a device's op
    returned an error, or the host called ``heap.abort`` (``ops.block_until_ready`` does when a device's computation
    fails). Bound dispatch to one step in flight: many launches queued ahead can exhaust XLA's CPU threads while each
    waits here.
    """
    if not isinstance(heap, HEAP_TYPES):
        raise ValueError(f"jodc.ops.barrier: expected a SymmetricHeap or ReplicatedHeap, got {type(heap).__name__}")
    token = check_token(token, "barrier")
    device = device_index(heap, "barrier")
    (token,) = native(heap, "barrier", (TOKEN_TYPE,), device, token)
    return token
