"""barrier: the once-per-minibatch synchronisation of all devices of a heap."""
from __future__ import annotations

import jax
import numpy as np

from jodc.ops._call import TOKEN_TYPE, device_index, target
from jodc.ops.heap import SymmetricHeap
from jodc.ops.token import check_token


def barrier(heap: SymmetricHeap, token) -> jax.Array:
    """Blocks until every device of `heap` has reached the same barrier; returns a new token.

    Fails (instead of hanging) after ``heap.barrier_timeout_s`` (``inf``: never) with the indices of the devices that
    never arrived; the heap is then unusable. Fails at once, with the cause, when the heap is aborted: a device's op
    returned an error, or the host called ``heap.abort`` (``ops.block_until_ready`` does when a device's computation
    fails). Bound dispatch to one step in flight: many launches queued ahead can exhaust XLA's CPU threads while each
    waits here.
    """
    if not isinstance(heap, SymmetricHeap):
        raise ValueError(f"jodc.ops.barrier: expected a SymmetricHeap, got {type(heap).__name__}")
    token = check_token(token, "barrier")
    device = device_index(heap, "barrier")
    (token,) = jax.ffi.ffi_call(target(heap, "barrier"), (TOKEN_TYPE,), has_side_effect=True)(
        device, token, heap=np.int64(heap.id)
    )
    return token
