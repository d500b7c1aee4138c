"""Conversions between an engine's sharded state ([devices, shard] per group) and the canonical checkpoint form
(one unpadded flat vector per group), so checkpoints do not depend on the engine, the device count or the HSDP
layout (replicas x shards: the rows of replica 0 hold one whole copy, the other replicas repeat it)."""
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
    """[D, shard] leaves under a group key -> flat [numel]; other leaves [D, ...] -> device 0's value. With
    replicas, the first rows (replica 0's shards) hold the whole vector; the copies after them are not read."""
    from jodc.fsdp import sharding

    def convert(path, leaf):
        leaf = sharding.to_host(leaf)
        g = _group_of(path, numels)
        if g is None:
            return leaf[0]
        return leaf.reshape(-1)[: numels[g]]

    return jax.tree_util.tree_map_with_path(convert, tree)


def shard_tree(tree, numels: dict[str, int], shard_numels: dict[str, int], devices: int, replicas: int = 1) -> Any:
    """Inverse of `unshard_tree`: pads each group's flat vector and splits it into [devices, shard] rows, repeated
    for each of `replicas` replica groups ([replicas * devices, shard]); other leaves are repeated on every row."""
    from jodc.fsdp import sharding

    def convert(path, leaf):
        leaf = sharding.to_host(leaf)
        g = _group_of(path, numels)
        if g is None:
            return np.broadcast_to(leaf, (replicas * devices,) + leaf.shape).copy()
        if leaf.shape != (numels[g],):
            raise ValueError(f"checkpoint leaf for group {g!r} has shape {leaf.shape}, expected ({numels[g]},)")
        padded = np.zeros(shard_numels[g] * devices, leaf.dtype)
        padded[: numels[g]] = leaf
        return np.tile(padded.reshape(devices, shard_numels[g]), (replicas, 1))

    return jax.tree_util.tree_map_with_path(convert, tree)


class ShardedStateMixin:
    """State for engines whose parameters are `shards` and `opt_state` with a leading device axis ([D, shard] per
    group, D = replicas x shards on an HSDP mesh) on `mesh`, given `numels` and `shard_numels` per group: building
    it, flat_params, state_dict and load_state_dict."""

    def _sharded(self, tree) -> Any:
        """Canonical flat `tree` -> per-device rows placed on the mesh (every replica group a whole copy)."""
        from jodc.fsdp import sharding

        return sharding.put_per_device(self.mesh, shard_tree(tree, self.numels, self.shard_numels,
                                                             sharding.shards(self.mesh), sharding.replicas(self.mesh)))

    def _init_sharded_state(self, params: dict[str, np.ndarray]) -> None:
        """Shards the canonical flat fp32 `params` over the devices and initialises the optimizer on each shard."""
        from jodc.fsdp import sharding

        self._params_loaded(params)
        self.shards = self._sharded(params)
        self.opt_state = sharding.init_opt_state(self.tx, self.mesh, self.shards)

    def flat_params(self) -> dict[str, np.ndarray]:
        from jodc.fsdp import sharding

        return {g: sharding.to_host(self.shards[g]).reshape(-1)[: self.numels[g]].copy()
                for g in self.model.group_names}

    def state_dict(self) -> dict[str, Any]:
        return {"params": self.flat_params(), "opt_state": unshard_tree(self.opt_state, self.numels),
                "step": self.steps_done}

    def _params_loaded(self, params: dict[str, np.ndarray]) -> None:
        """Hook: the canonical flat parameters were just loaded (the ODC engine republishes them)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        params = {g: np.asarray(state["params"][g], np.float32) for g in self.model.group_names}
        self._params_loaded(params)
        self.shards = self._sharded(params)
        template = unshard_tree(self.opt_state, self.numels)
        loaded = jax.tree.unflatten(jax.tree.structure(template), jax.tree.leaves(state["opt_state"]))
        self.opt_state = self._sharded(loaded)
        self.steps_done = int(state["step"])
