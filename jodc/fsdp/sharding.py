"""Helpers for sharded engine state: per-device trees under shard_map (every leaf carries a leading device axis
of size `devices`), placement on a mesh, the shard sizes and the optimizer state of sharded parameters."""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def device_spec(tree):
    """P('d') for every leaf: leaf [D, ...] is split so each device sees [1, ...]."""
    return jax.tree.map(lambda _: P("d"), tree)


def local(tree):
    """Inside shard_map: drop the leading device axis of size 1."""
    return jax.tree.map(lambda x: x[0], tree)


def stacked(tree):
    """Inside shard_map: add the leading device axis back."""
    return jax.tree.map(lambda x: x[None], tree)


def put_per_device(mesh: Mesh, tree):
    """Places host arrays [D, ...] so device d holds row d."""
    sharding = NamedSharding(mesh, P("d"))
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x), sharding), tree)


def put_replicated(mesh: Mesh, x):
    """Places a host value, equal in every process, on every device of `mesh` (P()). A plain `jnp.asarray` would be
    committed to nowhere / this process's first device, which a program over a mesh spanning processes refuses."""
    return jax.device_put(np.asarray(x), NamedSharding(mesh, P()))


def to_host(x) -> np.ndarray:
    """np.asarray(x), also for an array spread over several processes (jax.distributed): then every process's part
    is gathered (a collective: every process must call it at the same point)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def first_value(x) -> float:
    """Element 0 of a result every device holds the same value of (a psum'd loss), read from this process's own
    devices: no collective, also when the array spans processes."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = min(x.addressable_shards, key=lambda s: s.device.id).data
    return float(np.asarray(x).reshape(-1)[0])


def check_mesh(mesh: Mesh, engine: str) -> Mesh:
    """`mesh` when it is 1-D with axis 'd' (every engine shards over that one axis); a ValueError naming `engine`
    and the axes it got otherwise."""
    if "d" not in mesh.shape or len(mesh.shape) != 1:
        raise ValueError(f"the {engine} engine needs a 1-D mesh with axis 'd', got axes {dict(mesh.shape)}")
    return mesh


def shard_numels(numels: dict[str, int], devices: int) -> dict[str, int]:
    """Elements per device shard of each group's flat fp32 vector: the heap's layout (`jodc.ops.layout`, the
    Python mirror of ffi/common/layout.h), so every engine splits a group exactly as the ODC heap does."""
    from jodc.ops import layout

    return {g: layout.shard_numel(n, devices, 4) for g, n in numels.items()}


def opt_state_specs(tx, shards):
    """PartitionSpecs of the optimizer state of per-device `shards` ([D, shard] leaves): every leaf split over
    'd' (each device keeps its own moments and step count)."""
    shapes = jax.eval_shape(lambda s: tx.init(local(s)), shards)
    return jax.tree.map(lambda _: P("d"), shapes)


def init_opt_state(tx, mesh: Mesh, shards):
    """`tx.init` run on every device's own shard under shard_map: optimizer state with a leading device axis."""
    init = jax.shard_map(lambda s: stacked(tx.init(local(s))), mesh=mesh, in_specs=(device_spec(shards),),
                         out_specs=opt_state_specs(tx, shards))
    return jax.jit(init)(shards)
