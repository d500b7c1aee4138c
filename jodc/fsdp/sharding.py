"""Helpers for per-device state under shard_map: every leaf carries a leading device axis of size `devices`."""
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
