"""Helpers for sharded engine state: per-device trees under shard_map (every leaf carries a leading device axis
of size `devices`), placement on a mesh, the shard sizes and the optimizer state of sharded parameters.

Meshes: 1-D ('d',) (flat FSDP: every device a shard) or 2-D ('r', 'd') (HSDP: parameters sharded over the 'd'
devices of a replica group, replicated over the 'r' groups). A per-device leaf [D, ...] has one row per device in
mesh order, D = replicas x shards: device (r, d) holds row r * shards + d (`device_axes`). An engine reads its mesh
once into a `MeshLayout` (replicas, shards, axes) and asks it wherever flat FSDP and HSDP differ."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jodc.ops import layout

REPLICA_AXIS = "r"  # HSDP: the axis the replica groups lie along
SHARD_AXIS = "d"  # the axis parameters are sharded over (inside a replica group)


def device_axes(mesh) -> str | tuple[str, str]:
    """The mesh axes a per-device leading axis is split over: 'd', or ('r', 'd') on an HSDP mesh."""
    return (REPLICA_AXIS, SHARD_AXIS) if REPLICA_AXIS in mesh.axis_names else SHARD_AXIS


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """How an engine's devices are arranged, read once from its mesh (`of`): `replicas` HSDP replica groups (1 on a
    flat mesh) of `shards` devices each, and `axes`, the mesh axes a per-device leading axis is split over ('d', or
    ('r', 'd') on an HSDP mesh: `device_axes`). What differs between flat FSDP and HSDP asks `hsdp`."""

    mesh: Mesh
    replicas: int
    shards: int
    axes: str | tuple[str, str]

    @classmethod
    def of(cls, mesh: Mesh, engine: str) -> MeshLayout:
        """The layout of `mesh`; ValueError naming `engine` unless its axes are ('d',) or ('r', 'd') (`check_mesh`)."""
        check_mesh(mesh, engine)
        replicas = int(mesh.shape[REPLICA_AXIS]) if REPLICA_AXIS in mesh.axis_names else 1
        return cls(mesh, replicas, int(mesh.shape[SHARD_AXIS]), device_axes(mesh))

    @property
    def hsdp(self) -> bool:
        """An ('r', 'd') mesh: every replica group is its own FSDP world, and the groups' gradients are summed."""
        return self.axes != SHARD_AXIS

    @property
    def devices(self) -> int:
        """Every device of the mesh, replicas x shards: the devices a minibatch is planned for."""
        return self.replicas * self.shards

    def rows(self) -> NamedSharding:
        """The sharding of a per-device leaf [devices, ...]: device (r, d) holds row r * shards + d."""
        return NamedSharding(self.mesh, P(self.axes))


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
    devices = list(devices)
    shards = hsdp_shards(len(devices), replicas)
    if replicas == 1:
        return Mesh(np.array(devices), (SHARD_AXIS,))
    return Mesh(np.array(devices).reshape(replicas, shards), (REPLICA_AXIS, SHARD_AXIS))


def hsdp_shards(devices: int, replicas: int) -> int:
    """Devices per replica group (shards per parameter group) when `devices` data-parallel devices form `replicas`
    HSDP replica groups; ValueError naming `replicas` unless it is a positive integer dividing `devices` (the
    trainer's config checks its `engine` section with it; `hsdp_mesh` builds the mesh)."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
    if devices % replicas:
        raise ValueError(f"replicas={replicas} does not divide the {devices} devices into equal replica groups "
                         f"(replicas x shards = devices)")
    return devices // replicas


def shard_numels(numels: dict[str, int], devices: int) -> dict[str, int]:
    """Elements per device shard of each group's flat fp32 vector: the heap's layout (`jodc.ops.layout`, the
    Python mirror of ffi/common/layout.h), so every engine splits a group exactly as the ODC heap does."""
    return {g: layout.shard_numel(n, devices, 4) for g, n in numels.items()}


def opt_state_specs(tx, shards, axes="d"):
    """PartitionSpecs of the optimizer state of sharded `shards` (1-D [devices x shard] leaves, `local_state`): every
    leaf split over `axes` (each device keeps its own moments and step count)."""
    shapes = jax.eval_shape(tx.init, shards)
    return jax.tree.map(lambda _: P(axes), shapes)


def init_opt_state(tx, mesh_layout: MeshLayout, shards):
    """`tx.init` run on every device's own shard under shard_map: moments split like `shards`, the step count with a
    leading device axis (`local_state`)."""
    axes, groups = mesh_layout.axes, tuple(shards)
    init = jax.shard_map(lambda s: stacked_state(tx.init(s), groups), mesh=mesh_layout.mesh,
                         in_specs=(device_spec(shards, axes),), out_specs=opt_state_specs(tx, shards, axes))
    return jax.jit(init)(shards)
