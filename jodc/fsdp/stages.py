"""A model as the FSDP engines see it: parameter groups (one bucket each) and stages applied in sequence.

A stage reads one or more groups' parameters, takes the running activation and the microbatch, and returns the
next activation; the last stage returns the microbatch's (already normalised) loss. Tied embeddings are a head
stage that reads both the `head` group and the `embed` group.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Stage:
    """One step of the forward pass. ``fn(params, h, microbatch) -> h`` with `params` a tuple of the pytrees of
    the groups named in `groups` (in that order); the first stage gets ``h=None``, the last returns a scalar loss."""

    name: str
    groups: tuple[str, ...]
    fn: Callable[[tuple, Any, dict], Any]
    # the stage on a context-parallel row (`StagedModel.context_parallel`): ``context_parallel(params, h, microbatch,
    # exchange) -> h`` with `exchange` a `jodc.models.context_parallel.GroupExchange` among the group's members and
    # ``microbatch["cp_keys"]`` what `ContextParallel.keys` made. None: the stage is per token (embeddings, the head
    # and its loss) and runs `fn` on a CP row unchanged. It must make exactly one floating exchange per call (the ODC
    # engine alternates the exchange's slots from one such stage to the next).
    context_parallel: Callable[[tuple, Any, dict, Any], Any] | None = None


#: The microbatch entry through which an engine tells `ContextParallel.keys` how many split sequences each CP row
#: holds: int32 [B], segments 1..n of row b are pieces of split sequences (`jodc.balance.zigzag.zigzag_row`), 0 none.
CP_SPLIT_SEGMENTS = "cp_split_segments"


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """What a model offers to run a sequence split over a group of devices (docs/context_parallel.md).

    `keys(microbatch, exchange)`: computed once per CP microbatch before the first stage (it may exchange integer
    arrays with the group, no gradient), stored as ``microbatch["cp_keys"]`` for the stages' `context_parallel` fns;
    the engine adds ``microbatch[CP_SPLIT_SEGMENTS]`` (the rows' counts of split sequences) for it.
    `slot_numel(token_cap)`: the elements of the largest array one exchange moves for a [1, token_cap] row (what the
    engine registers its exchange slots for)."""

    keys: Callable[[dict, Any], Any]
    slot_numel: Callable[[int], int]


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """How one group's parameter pytree maps to a flat vector (leaves in tree order, row-major)."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]

    @staticmethod
    def of(tree) -> "GroupLayout":
        leaves, treedef = jax.tree.flatten(tree)
        return GroupLayout(treedef, tuple(tuple(np.shape(x)) for x in leaves),
                           tuple(jnp.result_type(x) for x in leaves))

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def flatten(self, tree, dtype=jnp.float32) -> jax.Array:
        leaves = jax.tree.leaves(tree)
        if len(leaves) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} leaves, got {len(leaves)}")
        return jnp.concatenate([jnp.asarray(x, dtype).reshape(-1) for x in leaves])

    def unflatten(self, flat):
        """Slices and reshapes (differentiable); keeps the dtype of `flat` (the compute dtype)."""
        out, offset = [], 0
        for shape in self.shapes:
            n = math.prod(shape)
            out.append(flat[offset:offset + n].reshape(shape))
            offset += n
        return jax.tree.unflatten(self.treedef, out)


def split_loss(out, metric_names: tuple[str, ...]):
    """The last stage returns a loss, or (loss, {metric: scalar}) when the model declares metric names."""
    if not metric_names:
        return out, {}
    loss, metrics = out
    missing = [m for m in metric_names if m not in metrics]
    if missing:
        raise ValueError(f"the last stage did not return the declared metrics {missing}")
    return loss, {m: jnp.asarray(metrics[m], jnp.float32) for m in metric_names}


@dataclasses.dataclass(frozen=True)
class StagedModel:
    """Parameter groups (ordered) with their layouts, and the stages that consume them.

    `metric_names`: scalars the last stage returns next to the loss (``(loss, {name: value})``); the engines sum
    them over microbatches and devices and report them with the step (e.g. an RL loss's masked-token count).
    """

    group_names: tuple[str, ...]
    layouts: dict[str, GroupLayout]
    stages: tuple[Stage, ...]
    metric_names: tuple[str, ...] = ()
    context_parallel: ContextParallel | None = None  # None: the model runs no context-parallel rows

    def __post_init__(self):
        known = set(self.group_names)
        for st in self.stages:
            unknown = [g for g in st.groups if g not in known]
            if unknown:
                raise ValueError(f"stage {st.name!r} reads unknown groups {unknown}; groups are {self.group_names}")
        if self.context_parallel is not None and not any(st.context_parallel for st in self.stages):
            raise ValueError("a model with context_parallel needs at least one stage with a context_parallel fn")
        used = {g for st in self.stages for g in st.groups}
        if used != known:
            raise ValueError(f"groups {sorted(known - used)} are read by no stage")

    @staticmethod
    def build(groups: dict[str, Any], stages: Sequence[Stage], metric_names: Sequence[str] = (),
              context_parallel: ContextParallel | None = None) -> "StagedModel":
        return StagedModel(tuple(groups), {k: GroupLayout.of(v) for k, v in groups.items()}, tuple(stages),
                           tuple(metric_names), context_parallel)

    def flatten_groups(self, groups: dict[str, Any]) -> dict[str, np.ndarray]:
        return {g: np.asarray(self.layouts[g].flatten(groups[g])) for g in self.group_names}

    def unflatten_groups(self, flats: dict[str, Any]) -> dict[str, Any]:
        return {g: self.layouts[g].unflatten(jnp.asarray(flats[g])) for g in self.group_names}

    def loss(self, groups: dict[str, Any], microbatch: dict, *, remat: bool = False):
        """The plain (unsharded) forward pass: what every engine must reproduce. With `remat`, every stage is
        rematerialised in the backward pass (the activation memory policy of the sharded engines). Returns what
        the last stage returns (see `loss_and_metrics`)."""
        h = None
        for st in self.stages:
            params = tuple(groups[g] for g in st.groups)
            if remat:
                h = jax.checkpoint(lambda p, h, st=st: st.fn(p, h, microbatch))(params, h)
            else:
                h = st.fn(params, h, microbatch)
        return h

    def loss_and_metrics(self, groups: dict[str, Any], microbatch: dict, *, remat: bool = False):
        """(loss, {metric: value}) of one microbatch."""
        return split_loss(self.loss(groups, microbatch, remat=remat), self.metric_names)
