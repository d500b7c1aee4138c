"""Conversions between an engine's sharded state ([devices, shard] per group) and the canonical checkpoint form
(one unpadded flat vector per group), so checkpoints do not depend on the engine or the device count."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np


def _group_of(path, groups) -> str | None:
    for key in path:
        name = getattr(key, "key", None)
        if name in groups:
            return name
    return None


def unshard_tree(tree, numels: dict[str, int]) -> Any:
    """[D, shard] leaves under a group key -> flat [numel]; other leaves [D, ...] -> device 0's value."""
    def convert(path, leaf):
        leaf = np.asarray(leaf)
        g = _group_of(path, numels)
        if g is None:
            return leaf[0]
        return leaf.reshape(-1)[: numels[g]]

    return jax.tree_util.tree_map_with_path(convert, tree)


def shard_tree(tree, numels: dict[str, int], shard_numels: dict[str, int], devices: int) -> Any:
    """Inverse of `unshard_tree`: pads each group's flat vector and splits it into [D, shard] rows."""
    def convert(path, leaf):
        leaf = np.asarray(leaf)
        g = _group_of(path, numels)
        if g is None:
            return np.broadcast_to(leaf, (devices,) + leaf.shape).copy()
        if leaf.shape != (numels[g],):
            raise ValueError(f"checkpoint leaf for group {g!r} has shape {leaf.shape}, expected ({numels[g]},)")
        padded = np.zeros(shard_numels[g] * devices, leaf.dtype)
        padded[: numels[g]] = leaf
        return padded.reshape(devices, shard_numels[g])

    return jax.tree_util.tree_map_with_path(convert, tree)
