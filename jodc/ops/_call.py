"""Shared front half of every op: validates its arguments in Python, finds the calling device's index, and calls
the native target of the calling device's heap (`native`: for a `ReplicatedHeap`, its replica group's heap)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jodc import dtypes
from jodc.ops.transports import target_names
from jodc.ops.heap import MASTER_DTYPE_NAMES, Bucket, SymmetricHeap
from jodc.ops.replicated_heap import ReplicatedBucket, ReplicatedHeap
from jodc.ops.token import TOKEN_TYPE, as_varying, check_token  # noqa: F401 (TOKEN_TYPE re-exported)

HEAP_TYPES = (SymmetricHeap, ReplicatedHeap)
BUCKET_TYPES = (Bucket, ReplicatedBucket)


def device_index(heap: SymmetricHeap | ReplicatedHeap, op: str) -> jax.Array:
    """The caller's position along the heap's mesh axis, as an int32 scalar operand for the native handler.

    Raises a clear error outside ``shard_map`` over that axis, or when the axis size is not the heap's world.
    A `ReplicatedHeap` also needs its replica axis, of its size.
    """
    heap.check_alive()
    try:
        size = lax.axis_size(heap.axis_name)
    except NameError as e:
        raise ValueError(
            f"jodc.ops.{op} must be called inside jax.shard_map over mesh axis {heap.axis_name!r} "
            f"(the heap's axis); it is not bound here"
        ) from e
    if int(size) != heap.world:
        raise ValueError(
            f"jodc.ops.{op}: axis {heap.axis_name!r} has {size} devices here but heap {heap.id} was created for "
            f"{heap.world}"
        )
    if isinstance(heap, ReplicatedHeap):
        try:
            replicas = int(lax.axis_size(heap.replica_axis))
        except NameError as e:
            raise ValueError(f"jodc.ops.{op}: a replicated heap's ops run inside jax.shard_map over its mesh axes "
                             f"{heap.device_axes}; {heap.replica_axis!r} is not bound here") from e
        if replicas != heap.replicas:
            raise ValueError(f"jodc.ops.{op}: axis {heap.replica_axis!r} has {replicas} devices here but the heap "
                             f"was created for {heap.replicas} replica groups")
    others = _other_axes(heap.device_axes)
    if others:
        raise ValueError(
            f"jodc.ops.{op}: the mesh here also has axes {others} of size > 1 besides the heap's {heap.axis_name!r}: "
            f"their replicas would share heap {heap.id}'s barrier counters and accumulators (wrong results); run "
            f"the ops under a mesh whose only axis of size > 1 is {heap.axis_name!r} (or give each replica group "
            f"its own heap: jodc.ops.ReplicatedHeap)"
        )
    return lax.axis_index(heap.axis_name).astype(jnp.int32)


def target(heap: SymmetricHeap, op: str) -> str:
    """The FFI target of `op` for the heap's transport: jodc_<op> in-process (and over CUDA IPC, whose kernels are the
    in-process ones), jodc_mpi_<op> / jodc_nvshmem_<op> for the MPI and NVSHMEM transports."""
    return target_names.target_name(op, getattr(heap, "transport", "local"))


def native(owner, op: str, results, *operands):
    """Calls `op`'s FFI target (side-effecting) on `operands` for `owner`: a bucket (attributes heap and bucket id)
    or a heap (attribute heap id). For a replicated bucket or heap, each device calls its own replica group's
    member, chosen by its index along the replica axis (``lax.switch``: one branch per group)."""
    if isinstance(owner, (ReplicatedBucket, ReplicatedHeap)):
        heap = owner if isinstance(owner, ReplicatedHeap) else owner.heap
        branches = [functools.partial(native_one, member, op, results) for member in owner.members()]
        return lax.switch(lax.axis_index(heap.replica_axis), branches, *operands)
    return native_one(owner, op, results, *operands)


def native_one(owner, op: str, results, *operands):
    """`op`'s FFI target called for one `SymmetricHeap` (heap-wide op) or one `Bucket`."""
    if isinstance(owner, SymmetricHeap):
        heap, kwargs = owner, {"heap": np.int64(owner.id)}
    else:
        heap, kwargs = owner.heap, attrs(owner)
    return jax.ffi.ffi_call(target(heap, op), results, has_side_effect=True)(*operands, **kwargs)


def _other_axes(allowed: tuple[str, ...]) -> dict[str, int]:
    """Axes of size > 1 of the mesh being traced (shard_map's abstract mesh) besides those `allowed`."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
        shape = dict(mesh.shape)
    except Exception:  # noqa: BLE001 - no abstract mesh API or no mesh: nothing to check
        return {}
    return {name: int(size) for name, size in shape.items() if name not in allowed and int(size) > 1}


def prepare(bucket: Bucket, token, op: str) -> tuple[jax.Array, jax.Array]:
    """Checks the bucket and token; returns (device index, token)."""
    if not isinstance(bucket, BUCKET_TYPES):
        raise ValueError(f"jodc.ops.{op}: expected a Bucket from SymmetricHeap.register, got {type(bucket).__name__}")
    bucket.check_alive()
    token = check_token(token, op)
    return device_index(bucket.heap, op), token


def attrs(bucket: Bucket) -> dict:
    return {"heap": np.int64(bucket.heap.id), "bucket": np.int64(bucket.id)}


def float_dtype(dtype, what: str, op: str) -> jnp.dtype:
    """`dtype` (any spelling, see jodc.dtypes) as float32 or bfloat16, the dtypes the native ops move."""
    return dtypes.as_dtype(dtype, MASTER_DTYPE_NAMES, f"jodc.ops.{op}: {what}")


def per_device(x, heap):
    """Marks a native op's result as varying over the heap's device axes: each device got its own value.

    Without this, shard_map's type system takes an FFI result for a device-invariant value, and autodiff would
    psum its cotangent over the axis (pushing every gradient world times).
    """
    return as_varying(x, set(heap.device_axes))
