"""The member list of the group ops (group_gather, group_scatter_accumulate, group_barrier): an int32 [k] array of
positions along the heap's axis, passed to the native op as a run-time operand, so one compiled program serves every
grouping. Checked here as far as can be without running: its dtype, shape and size always; its entries (in range, no
repeats) when the list is a concrete array rather than a traced value. The native ops check every list when they run
(the calling device must be one of the members) and fail with an error, never a crash."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jodc.ops.heap import SymmetricHeap
from jodc.ops.replicated_heap import ReplicatedHeap
from jodc.ops.transports import target_names


def check_group_platform(heap: SymmetricHeap | ReplicatedHeap, op: str) -> None:
    """The group ops exist for CPU heaps (in-process and MPI) only: a clear error for others. On jaxlib 0.11 they
    also need Shardy off (`check_compiler`)."""
    platform = heap.platform if isinstance(heap, SymmetricHeap) else heap.members()[0].platform
    if platform not in target_names.GROUP_OP_PLATFORMS:
        raise ValueError(f"jodc.ops.{op}: group ops run on CPU heaps (in-process or MPI) only; this heap is on "
                         f"{platform!r} devices ({heap.transport} transport)")
    check_compiler(op)


def check_compiler(op: str) -> None:
    """RuntimeError, at trace time, where the compiler is known to crash on the group ops' programs: jaxlib 0.11
    segfaults compiling them (a `lax.switch` over the devices' roles inside `shard_map`, as the ODC engine's
    context-parallel microbatches) inside XLA's Shardy canonicalizer (`ManualComputationUnusedInputsPattern`); with
    Shardy off it compiles and runs them (docs/context_parallel.md, "Known issues")."""
    if jax.__version_info__[:2] == (0, 11) and jax.config.jax_use_shardy_partitioner:
        raise RuntimeError(
            f"jodc.ops.{op}: jaxlib {jax.__version__} crashes compiling programs with the group ops (context "
            "parallelism) while the Shardy partitioner is on; turn it off before tracing them, "
            "jax.config.update('jax_use_shardy_partitioner', False) or JAX_USE_SHARDY_PARTITIONER=false, or use "
            "jax 0.10 or 0.12")


#: jaxlib 0.11 aborts compiling the streamed K/V exchange (`jodc.ops.group.exchange.SlotStream`), Shardy on or off
STREAMING_CRASHES = ((0, 11),)


def streaming_compiles() -> bool:
    """False where the compiler is known to abort on the streamed K/V exchange's programs (jaxlib 0.11: the ODC
    engine then all-gathers a CP group's K/V by default)."""
    return jax.__version_info__[:2] not in STREAMING_CRASHES


def check_streaming(what: str) -> None:
    """RuntimeError, before anything is compiled, where the streamed K/V exchange would abort the process."""
    if not streaming_compiles():
        raise RuntimeError(
            f"{what}: jaxlib {jax.__version__} aborts compiling the streamed K/V exchange of context parallelism "
            "(with Shardy on or off; docs/context_parallel.md, \"Known issues\"); use the all-gathered exchange "
            "(cp_kv_exchange='all_gather', the ODC engine's default on this jaxlib) or jax 0.10 / 0.12")


def check_members(members, heap: SymmetricHeap | ReplicatedHeap, op: str) -> jax.Array:
    """`members` as an int32 [k] array, 1 <= k <= heap.world; for a concrete list also every entry in [0, world) and
    none twice. ValueError naming the op and the fault otherwise."""
    check_group_platform(heap, op)
    members = jnp.asarray(members) if not isinstance(members, jax.Array) else members
    if members.dtype != jnp.int32:
        raise ValueError(f"jodc.ops.{op}: the member list must be int32, got {members.dtype}")
    if members.ndim != 1:
        raise ValueError(f"jodc.ops.{op}: the member list must be one-dimensional [k], got shape "
                         f"{tuple(members.shape)}")
    k = int(members.shape[0])
    if not 1 <= k <= heap.world:
        raise ValueError(f"jodc.ops.{op}: the member list has {k} entries, expected 1 to {heap.world} (the heap's "
                         f"devices)")
    try:
        values = np.asarray(members)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return members  # traced: the native op checks the entries when it runs
    outside = [int(m) for m in values if not 0 <= m < heap.world]
    if outside:
        raise ValueError(f"jodc.ops.{op}: member list {values.tolist()} has entries {outside} outside "
                         f"[0, {heap.world})")
    unique, counts = np.unique(values, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"jodc.ops.{op}: member list {values.tolist()} names device(s) "
                         f"{unique[counts > 1].tolist()} more than once")
    return members
