"""Where the trainers' initial decoder parameters come from, one group at a time (`jodc.fsdp.state.GroupSource`):
random initialisation from the run's seed, or a HF checkpoint (read by byte range). The engines ask each source only
for their own devices' ranges, so no process ever builds the whole model (DESIGN.md section 10)."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jodc.fsdp.stages import GroupLayout
from jodc.fsdp.state import GroupSource, PytreeSource, pad_slice
from jodc.models.config import DecoderConfig
from jodc.models.layerwise import group_param_shapes, init_group_params, param_groups


def abstract_groups(config: DecoderConfig) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
    """The decoder's parameter groups as shapes and dtypes (no data): what a `StagedModel`'s layouts are built from."""
    dtype = config.params_dtype
    return {g: {p: jax.ShapeDtypeStruct(shape, dtype) for p, shape in group_param_shapes(config, g).items()}
            for g in param_groups(config)}


def flatten_group(params) -> np.ndarray:
    """A group pytree as its canonical flat fp32 vector (leaves in pytree order, row-major: `GroupLayout.flatten`)."""
    return np.concatenate([np.asarray(x, np.float32).reshape(-1) for x in jax.tree.leaves(params)])


class RandomInitSource:
    """The decoder's random initialisation, one group at a time: group g equals
    ``models.layerwise.init_params(config, PRNGKey(seed))[g]`` bit for bit (each group draws from its own key of the
    same split), but only the group asked for is ever built (the last one is kept while the devices ask for their
    ranges of it in turn)."""

    def __init__(self, config: DecoderConfig, seed: int):
        self.config = config
        names = param_groups(config)
        self.keys = dict(zip(names, jax.random.split(jax.random.PRNGKey(seed), len(names))))
        self._last: tuple[str, np.ndarray] | None = None

    def flat_slice(self, group: str, begin: int, end: int) -> np.ndarray:
        if group not in self.keys:
            raise ValueError(f"the decoder has no parameter group {group!r}; its groups are {list(self.keys)}")
        if self._last is None or self._last[0] != group:
            self._last = None  # the previous group goes before the next one is built
            self._last = (group, flatten_group(init_group_params(self.config, group, self.keys[group])))
        return pad_slice(self._last[1], begin, end)


class WithGroups:
    """`source` with more groups given as (small) pytrees, e.g. the critic's value head."""

    def __init__(self, source: GroupSource, layouts: dict[str, Any], extra: dict[str, Any]):
        self.source, self.extra = source, PytreeSource(layouts, extra)
        self.names = frozenset(extra)

    def flat_slice(self, group: str, begin: int, end: int) -> np.ndarray:
        if group in self.names:
            return self.extra.flat_slice(group, begin, end)
        return self.source.flat_slice(group, begin, end)


def host_groups(source: GroupSource, layouts: dict[str, Any]) -> dict[str, Any]:
    """Every group of `source` as a host pytree (the whole model in this process: for benchmarks and tests of
    small models, never for training)."""
    out = {}
    for g, layout in layouts.items():
        flat = np.asarray(source.flat_slice(g, 0, layout.numel))
        out[g] = jax.tree.map(np.asarray, layout.unflatten(flat))
    return out


def decoder_host_params(config: DecoderConfig, source: GroupSource) -> dict[str, Any]:
    """The decoder's groups of `source` as host pytrees (see `host_groups`: benchmarks and small models only)."""
    return host_groups(source, {g: GroupLayout.of(v) for g, v in abstract_groups(config).items()})
