"""Helpers for sharded engine state: per-device trees under shard_map (every leaf carries a leading device axis
of size `devices`), placement on a mesh, the shard sizes and the optimizer state of sharded parameters.

Meshes: 1-D ('d',) (flat FSDP: every device a shard) or 2-D ('r', 'd') (HSDP: parameters sharded over the 'd'
devices of a replica group, replicated over the 'r' groups). A per-device leaf [D, ...] has one row per device in
mesh order, D = replicas x shards: device (r, d) holds row r * shards + d (`device_axes`)."""
from __future__ import annotations

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

REPLICA_AXIS = "r"  # HSDP: the axis the replica groups lie along
SHARD_AXIS = "d"  # the axis parameters are sharded over (inside a replica group)


def device_axes(mesh) -> str | tuple[str, str]:
    """The mesh axes a per-device leading axis is split over: 'd', or ('r', 'd') on an HSDP mesh."""
    return (REPLICA_AXIS, SHARD_AXIS) if REPLICA_AXIS in mesh.axis_names else SHARD_AXIS


def replicas(mesh) -> int:
    """Replica groups of `mesh` (1 on a 1-D mesh)."""
    return int(mesh.shape[REPLICA_AXIS]) if REPLICA_AXIS in mesh.axis_names else 1


def shards(mesh) -> int:
    """Devices of one replica group: the number of shards each parameter group is split into."""
    return int(mesh.shape[SHARD_AXIS])


def device_position():
    """Inside shard_map: this device's row in per-device leaves (r * shards + d on an HSDP mesh)."""
    return lax.axis_index(device_axes(jax.sharding.get_abstract_mesh()))


def device_spec(tree, axes="d"):
    """P(axes) for every leaf: leaf [D, ...] is split so each device sees [1, ...] (`axes`: `device_axes(mesh)`)."""
    return jax.tree.map(lambda _: P(axes), tree)


def local(tree):
    """Inside shard_map: drop the leading device axis of size 1."""
    return jax.tree.map(lambda x: x[0], tree)


def stacked(tree):
    """Inside shard_map: add the leading device axis back."""
    return jax.tree.map(lambda x: x[None], tree)


def group_of(path, groups) -> str | None:
    """The parameter group a pytree leaf belongs to (the first key on its `path` that names one of `groups`), or
    None (optax's step count, a schedule's state)."""
    for key in path:
        name = getattr(key, "key", None)
        if name in groups:
            return name
    return None


def local_state(tree, groups):
    """Inside shard_map: a sharded engine's state as one device sees it. Group leaves are 1-D vectors split over the
    devices ([devices x shard] globally, this device's [shard] here: no device axis to drop); the other leaves
    (optax's step count) carry a leading device axis of size 1, dropped."""
    return jax.tree_util.tree_map_with_path(lambda p, x: x if group_of(p, groups) else x[0], tree)


def stacked_state(tree, groups):
    """Inverse of `local_state`: the device axis put back on the leaves that are not a group's."""
    return jax.tree_util.tree_map_with_path(lambda p, x: x if group_of(p, groups) else x[None], tree)


def put_per_device(mesh: Mesh, tree):
    """Places host arrays [D, ...] so device d holds row d (device (r, d) row r * shards + d on an HSDP mesh).
    Across processes only this process's devices' rows are read (`put_sharded`): the others may be placeholders."""
    sharding = NamedSharding(mesh, P(device_axes(mesh)))
    return jax.tree.map(lambda x: put_sharded(np.asarray(x), sharding), tree)


def put_sharded(x: np.ndarray, sharding):
    """A host array placed by `sharding`. On a sharding over several processes each process reads only the slices of
    its own devices (`jax.make_array_from_callback`), so the parts of `x` other processes hold need not be equal
    here, or filled; `jax.device_put` would instead all-gather `x` to check that every process passed the same
    value (a collective over the whole array, every step)."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def put_replicated(mesh: Mesh, x):
    """Places a host value, equal in every process, on every device of `mesh` (P()). A plain `jnp.asarray` would be
    committed to nowhere / this process's first device, which a program over a mesh spanning processes refuses."""
    return jax.device_put(np.asarray(x), NamedSharding(mesh, P()))


def first_value(x) -> float:
    """Element 0 of a result every device holds the same value of (a psum'd loss), read from this process's own
    devices: no collective, also when the array spans processes."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = min(x.addressable_shards, key=lambda s: s.device.id).data
    return float(np.asarray(x).reshape(-1)[0])


def check_mesh(mesh: Mesh, engine: str) -> Mesh:
    """`mesh` when its axes are ('d',) (flat FSDP) or ('r', 'd') (HSDP: replica groups along 'r', shards along 'd');
    a ValueError naming `engine` and the axes it got otherwise."""
    if tuple(mesh.axis_names) not in ((SHARD_AXIS,), (REPLICA_AXIS, SHARD_AXIS)):
        raise ValueError(f"the {engine} engine needs a mesh with axes ('d',) or ('r', 'd') (replicas, shards), got "
                         f"axes {dict(mesh.shape)}")
    return mesh


def hsdp_mesh(devices, replicas: int) -> Mesh:
    """The mesh of `devices` (a flat sequence) for `replicas` replica groups: 1-D ('d',) when `replicas` is 1, else
    ('r', 'd') with consecutive devices in one group (devices r * shards .. r * shards + shards - 1 form group r: a
    process's or a node's devices, listed together, share the fast link). ValueError naming `replicas` when it is
    not a positive divisor of the device count."""
    from jodc.engine_facts import hsdp_shards

    devices = list(devices)
    shards = hsdp_shards(len(devices), replicas)
    if replicas == 1:
        return Mesh(np.array(devices), (SHARD_AXIS,))
    return Mesh(np.array(devices).reshape(replicas, shards), (REPLICA_AXIS, SHARD_AXIS))


def shard_numels(numels: dict[str, int], devices: int) -> dict[str, int]:
    """Elements per device shard of each group's flat fp32 vector: the heap's layout (`jodc.ops.layout`, the
    Python mirror of ffi/common/layout.h), so every engine splits a group exactly as the ODC heap does."""
    from jodc.ops import layout

    return {g: layout.shard_numel(n, devices, 4) for g, n in numels.items()}


def opt_state_specs(tx, shards, axes="d"):
    """PartitionSpecs of the optimizer state of sharded `shards` (1-D [devices x shard] leaves, `local_state`): every
    leaf split over `axes` (each device keeps its own moments and step count)."""
    shapes = jax.eval_shape(tx.init, shards)
    return jax.tree.map(lambda _: P(axes), shapes)


def init_opt_state(tx, mesh: Mesh, shards, out_shardings=None):
    """`tx.init` run on every device's own shard under shard_map: moments split like `shards`, the step count with a
    leading device axis (`local_state`)."""
    axes = device_axes(mesh)
    groups = tuple(shards)
    init = jax.shard_map(lambda s: stacked_state(tx.init(s), groups), mesh=mesh,
                         in_specs=(device_spec(shards, axes),), out_specs=opt_state_specs(tx, shards, axes))
    return jax.jit(init)(shards)
