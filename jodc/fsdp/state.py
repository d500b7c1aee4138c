"""Engine state in its canonical, layout-independent form, and building it shard by shard.

Canonical state (what checkpoints hold and every engine loads): ``{"params": {group: flat}, "opt_state": tree}``.
Every leaf under a parameter group (the parameters, Adam's moments) is a 1-D fp32 vector: the group's flat parameters
in layout order (`GroupLayout`), then zeros. Its length depends on the layout that wrote it (>= the group's numel: an
engine pads a group so that it splits evenly over its devices); the zero tail is what lets a checkpoint load into any
layout (orbax pads or truncates it on restore). Every other leaf (optax's step count) is a scalar.

As `jax.Array`s the group leaves are split over the mesh's 'd' axis and replicated over the replica groups 'r' of an
HSDP mesh (`canonical_sharding`), so a save writes each byte once, from the process whose device holds it, and a
restore reads only the byte ranges of this process's devices. Going between an engine's own layout and this form
moves no data (`rows_to_canonical`, `canonical_to_rows`: the same device buffers under another sharding).

Nothing here assembles a whole model on a host: initial parameters come from a `GroupSource`, asked one group and
one device's range at a time (`place_groups`)."""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from jodc.fsdp import sharding
from jodc.fsdp.sharding import MeshLayout


@runtime_checkable
class GroupSource(Protocol):
    """Where an engine's initial parameters come from: ``flat_slice(group, begin, end)`` returns elements
    [begin, end) of the group's canonical flat fp32 vector (its leaves in layout order, row-major), zeros past the
    group's numel. An engine asks for its own devices' ranges only, one group at a time (random initialisation per
    group, a HF checkpoint read by byte range, a dict of host pytrees)."""

    def flat_slice(self, group: str, begin: int, end: int) -> np.ndarray: ...


class PytreeSource:
    """A `GroupSource` over host (or device) group pytrees, e.g. ``{"embed": {...}, "layer_0": {...}}``: a group is
    flattened when first asked for (the last one is kept, as the devices of a process ask for it in turn)."""

    def __init__(self, layouts: dict[str, Any], groups: dict[str, Any]):
        self.layouts, self.groups = layouts, groups
        self._last: tuple[str, np.ndarray] | None = None

    def flat_slice(self, group: str, begin: int, end: int) -> np.ndarray:
        if self._last is None or self._last[0] != group:
            self._last = None  # the previous group's vector goes before the next one is built
            self._last = (group, np.asarray(self.layouts[group].flatten(self.groups[group]), np.float32))
        return pad_slice(self._last[1], begin, end)


def pad_slice(flat: np.ndarray, begin: int, end: int) -> np.ndarray:
    """flat[begin:end] as fp32, with zeros where [begin, end) runs past the end of `flat`."""
    out = np.zeros(max(0, end - begin), np.float32)
    stop = min(end, flat.size)
    if stop > begin:
        out[: stop - begin] = flat[begin:stop]
    return out


def as_source(groups, layouts: dict[str, Any]) -> GroupSource:
    """`groups` when it is a `GroupSource`, else a `PytreeSource` over it (a dict of group pytrees)."""
    return groups if isinstance(groups, GroupSource) else PytreeSource(layouts, groups)


def canonical_sharding(mesh) -> NamedSharding:
    """The sharding of a canonical group leaf on `mesh`: split over 'd', replicated over 'r' (HSDP)."""
    return NamedSharding(mesh, P(sharding.SHARD_AXIS))


def _slice_bounds(index, length: int) -> tuple[int, int]:
    s = index[0] if index else slice(None)
    begin, end, _ = s.indices(length)
    return begin, end


def place_flat(shape: tuple[int], sharding_, fill) -> jax.Array:
    """A 1-D array of `shape` placed by `sharding_`, each of this process's devices filled with ``fill(begin, end)``
    (its range of the vector): nothing but those ranges is ever built on this host."""
    (length,) = shape
    return jax.make_array_from_callback(shape, sharding_, lambda index: fill(*_slice_bounds(index, length)))


def place_groups(source: GroupSource, lengths: dict[str, int], sharding_) -> dict[str, jax.Array]:
    """Every group's flat fp32 vector of `lengths[group]` elements (the numel plus the layout's zero padding), placed
    by `sharding_`, group by group: each process builds only its own devices' ranges (`GroupSource.flat_slice`)."""
    return {g: place_flat((n,), sharding_, lambda b, e, g=g: np.ascontiguousarray(source.flat_slice(g, b, e),
                                                                                  np.float32))
            for g, n in lengths.items()}


def _relabel(x: jax.Array, shape: tuple[int, ...], target) -> jax.Array:
    """`x`'s device buffers, unchanged, as an array of `shape` with sharding `target` (each device's buffer must be
    exactly its block under `target`)."""
    by_device = {s.device: s.data for s in x.addressable_shards}
    arrays = [by_device[d] for d in target.addressable_devices_indices_map(shape)]
    return jax.make_array_from_single_device_arrays(shape, target, arrays)


def _rows_to_value(x: jax.Array, mesh) -> jax.Array:
    """Per-device rows [devices, ...] of a value every device holds equally (a step count) as that value,
    replicated: each device's row reshaped (tiny leaves; the copy costs nothing)."""
    shape = tuple(x.shape[1:])
    target = NamedSharding(mesh, P())
    by_device = {s.device: s.data for s in x.addressable_shards}
    arrays = [by_device[d].reshape(shape) for d in target.addressable_devices_indices_map(shape)]
    return jax.make_array_from_single_device_arrays(shape, target, arrays)


def rows_to_canonical(tree, layout: MeshLayout, groups) -> Any:
    """A sharded engine's state (group leaves 1-D, one block per device in mesh order; other leaves [devices, ...])
    on `layout`'s mesh as canonical leaves: group leaves split over 'd' only (on an HSDP mesh device (r, d) holds
    block d, which it already does), other leaves as one replicated value (every device holds the same step count).
    No data move."""

    def convert(path, x):
        if sharding.group_of(path, groups) is None:
            return _rows_to_value(x, layout.mesh)
        if layout.replicas == 1:
            return x
        return _relabel(x, (x.shape[0] // layout.replicas,), canonical_sharding(layout.mesh))

    return jax.tree_util.tree_map_with_path(convert, tree)


def canonical_to_rows(tree, layout: MeshLayout, groups) -> Any:
    """Inverse of `rows_to_canonical`: canonical leaves (as `state_targets` placed them) in a sharded engine's own
    layout. No data move for the group leaves."""
    rows = layout.rows()

    def convert(path, x):
        if sharding.group_of(path, groups) is not None:
            if layout.replicas == 1:
                return x
            return _relabel(x, (x.shape[0] * layout.replicas,), rows)
        shape = (layout.devices,) + tuple(np.shape(x))
        by_device = {s.device: s.data for s in x.addressable_shards}
        arrays = [by_device[d].reshape((1,) + tuple(np.shape(x))) for d in rows.addressable_devices_indices_map(shape)]
        return jax.make_array_from_single_device_arrays(shape, rows, arrays)

    return jax.tree_util.tree_map_with_path(convert, tree)


def rows_targets(tree, layout: MeshLayout, groups) -> Any:
    """`jax.ShapeDtypeStruct`s of the canonical form of a sharded engine's state `tree` (its shapes and placement on
    `layout`'s mesh): what a checkpoint is restored into."""
    replicated = NamedSharding(layout.mesh, P())

    def target(path, x):
        if sharding.group_of(path, groups) is not None:
            return jax.ShapeDtypeStruct((x.shape[0] // layout.replicas,), x.dtype,
                                        sharding=canonical_sharding(layout.mesh))
        return jax.ShapeDtypeStruct(tuple(x.shape[1:]), x.dtype, sharding=replicated)

    return jax.tree_util.tree_map_with_path(target, tree)


def targets_of(tree) -> Any:
    """`jax.ShapeDtypeStruct`s (shape, dtype, sharding) of arrays that are canonical as they are."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


# -- host copies (tests, small models; never on the training path) -------------------------------------------------

def host_copy(x) -> np.ndarray:
    """A fresh host copy of `x`. Built from this process's shards when it holds the whole array, so no host copy is
    cached on the live array (``np.asarray`` of a `jax.Array` keeps one there until the array dies); across processes
    every process's part is gathered (a collective: every process must call it at the same point)."""
    if not isinstance(x, jax.Array):
        return np.array(x)
    if not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    out = np.empty(x.shape, x.dtype)
    for s in x.addressable_shards:
        if s.replica_id == 0:
            out[s.index] = np.asarray(s.data)
    return out


def to_host_canonical(state, numels: dict[str, int]) -> dict[str, Any]:
    """A canonical state on the host: group leaves cut to the group's numel (no padding), other leaves as numpy."""

    def convert(path, x):
        x = host_copy(x)
        g = sharding.group_of(path, numels)
        return x[: numels[g]] if g is not None else x

    return jax.tree_util.tree_map_with_path(convert, state)


def from_host_canonical(state, targets, numels: dict[str, int]) -> Any:
    """Host canonical leaves (any zero-padded length >= numel) placed as `targets` (ShapeDtypeStructs with their
    shardings): each process builds only its devices' ranges."""

    def place(path, x, target):
        g = sharding.group_of(path, numels)
        if g is None:
            return jax.make_array_from_callback(target.shape, target.sharding,
                                                lambda index: np.asarray(x, target.dtype).reshape(target.shape)[index])
        flat = np.asarray(x).reshape(-1)
        if flat.size < numels[g]:
            raise ValueError(f"group {g!r}: {flat.size} elements, the model has {numels[g]}")
        return place_flat(target.shape, target.sharding,
                          lambda b, e: pad_slice(flat[: numels[g]], b, e).astype(target.dtype))

    return jax.tree_util.tree_map_with_path(place, state, targets)


class ShardedStateMixin:
    """State for engines whose parameters are `shards` ({group: 1-D [devices x shard]}, one block per device in mesh
    order, HSDP replicas repeating the blocks) and `opt_state` (moments split the same way, the step count with a
    leading device axis) on the mesh of `layout` (a `MeshLayout`), given `numels` and `shard_numels` per group."""

    layout: MeshLayout

    def _row_lengths(self) -> dict[str, int]:
        return {g: self.shard_numels[g] * self.layout.devices for g in self.model.group_names}

    def _init_sharded_state(self, groups) -> None:
        """Places the initial parameters (a `GroupSource` or group pytrees), each process building only its own
        devices' blocks, and initialises the optimizer on each shard."""
        source = as_source(groups, self.model.layouts)
        rows = self.layout.rows()
        shard_numels = self.shard_numels
        shards = self.layout.shards

        def block(g):  # a device's block of the rows = its range of the group's padded vector (replica-independent)
            def fill(begin, end):
                d = (begin // shard_numels[g]) % shards
                return np.ascontiguousarray(source.flat_slice(g, d * shard_numels[g], (d + 1) * shard_numels[g]),
                                            np.float32)
            return fill

        self.shards = {g: place_flat((n,), rows, block(g)) for g, n in self._row_lengths().items()}
        self.opt_state = sharding.init_opt_state(self.tx, self.layout, self.shards)
        self._params_loaded()

    def _canonical(self) -> dict[str, Any]:
        groups = self.model.group_names
        return {"params": rows_to_canonical(self.shards, self.layout, groups),
                "opt_state": rows_to_canonical(self.opt_state, self.layout, groups)}

    def _targets(self) -> dict[str, Any]:
        groups = self.model.group_names
        return {"params": rows_targets(self.shards, self.layout, groups),
                "opt_state": rows_targets(self.opt_state, self.layout, groups)}

    def _load_canonical(self, state) -> None:
        groups = self.model.group_names
        self.shards = canonical_to_rows(state["params"], self.layout, groups)
        self.opt_state = canonical_to_rows(state["opt_state"], self.layout, groups)
        self._params_loaded()

    def _params_loaded(self) -> None:
        """Hook: new parameters were just placed (the ODC engine publishes them into its heap)."""
