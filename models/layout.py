"""Flat 1-D layout of one parameter group, for engines that move a group as a single vector (a bucket).

The order is the group's own key order as given by `group_param_shapes` (fixed and documented there); each
array is flattened row-major (C order) and the pieces are concatenated with no padding. Padding a bucket so it
divides by the world size is the engine's business, not the layout's.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Where each parameter of a group lives in the group's flat vector.

    names: parameter names in flat order; shapes: their shapes; offsets: start of each in the vector.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, tuple[int, ...]]) -> "GroupLayout":
        """Layout for parameters in the mapping's order."""
        names, shape_list, offsets, offset = [], [], [], 0
        for name, shape in shapes.items():
            shape = tuple(int(s) for s in shape)
            names.append(name)
            shape_list.append(shape)
            offsets.append(offset)
            offset += math.prod(shape)
        return cls(tuple(names), tuple(shape_list), tuple(offsets), offset)

    def flatten(self, params: Mapping[str, jax.Array], dtype=None) -> jax.Array:
        """Concatenate the group's arrays into one 1-D vector (in `dtype`, default the first array's dtype)."""
        missing = [n for n in self.names if n not in params]
        extra = [n for n in params if n not in self.names]
        if missing or extra:
            raise ValueError(f"GroupLayout.flatten: missing parameters {missing}, unexpected parameters {extra}")
        pieces = []
        for name, shape in zip(self.names, self.shapes):
            value = params[name]
            if tuple(value.shape) != shape:
                raise ValueError(f"GroupLayout.flatten: {name!r} has shape {tuple(value.shape)}, layout says {shape}")
            pieces.append(jnp.ravel(value))
        if dtype is None:
            dtype = pieces[0].dtype if pieces else jnp.float32
        return jnp.concatenate([p.astype(dtype) for p in pieces]) if pieces else jnp.zeros((0,), dtype)

    def unflatten(self, flat: jax.Array, dtype=None) -> dict[str, jax.Array]:
        """Split a vector back into the group's arrays (in `dtype`, default the vector's dtype).

        `flat` may be longer than `numel` (a padded bucket); the tail is ignored.
        """
        if flat.ndim != 1:
            raise ValueError(f"GroupLayout.unflatten expects a 1-D vector, got shape {flat.shape}")
        if flat.shape[0] < self.numel:
            raise ValueError(f"GroupLayout.unflatten: vector has {flat.shape[0]} elements, layout needs {self.numel}")
        out = {}
        for name, shape, offset in zip(self.names, self.shapes, self.offsets):
            size = math.prod(shape)
            piece = jax.lax.slice_in_dim(flat, offset, offset + size).reshape(shape)
            out[name] = piece if dtype is None else piece.astype(dtype)
        return out
