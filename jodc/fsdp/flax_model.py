"""Bring your own Flax model: a user's `flax.nnx` Module as a `StagedModel` every engine can train.

`from_nnx` splits the module (`nnx.split`) into parameter groups and stages: one group and stage for the embedding
attribute(s), one per layer of a homogeneous layer list, one for the head attribute(s). Each stage re-creates its
submodule from the group's parameters (`nnx.merge`) inside the engine's compiled step and calls it, so the engines
see plain pytrees of arrays and the user's module code runs unchanged. `NNXStagedModel.update` writes trained
parameters back into the module.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jodc.fsdp.stages import Stage, StagedModel
from jodc.losses import sft_loss_from_logits

EMBED, HEAD = "embed", "head"


def _names(value, what: str) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"from_nnx: {what} must name one attribute or a sequence of them, got {value!r}")
    return names


def _resolve(module: nnx.Module, path: str):
    """module.a.b for path 'a.b'; an AttributeError naming the module's class and the missing attribute."""
    obj = module
    for i, part in enumerate(path.split(".")):
        if not hasattr(obj, part):
            have = sorted(k for k in vars(obj) if not k.startswith("_"))
            missing = ".".join(path.split(".")[:i + 1])
            raise AttributeError(f"from_nnx: {type(module).__name__} has no attribute {missing!r} (its attributes: "
                                 f"{have})")
        obj = getattr(obj, part)
    return obj


def _layer_list(module: nnx.Module, path: str) -> list[nnx.Module]:
    """The layers at `path`: an nnx.List / list / tuple / nnx.Sequential of modules of one class with parameters
    of one structure and shape (one group per layer, interchangeable)."""
    obj = _resolve(module, path)
    if isinstance(obj, nnx.Sequential):
        obj = obj.layers
    if not isinstance(obj, (nnx.List, list, tuple)):
        raise TypeError(f"from_nnx: layers={path!r} is a {type(obj).__name__}; it must be a homogeneous sequence of "
                        "layers (nnx.List, list, tuple or nnx.Sequential of nnx.Module)")
    layers = list(obj)
    if not layers:
        raise ValueError(f"from_nnx: layers={path!r} is empty")
    first = layers[0]
    if not isinstance(first, nnx.Module):
        raise TypeError(f"from_nnx: {path}[0] is a {type(first).__name__}, not an nnx.Module")
    shapes = jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(first, nnx.Param)))
    for i, layer in enumerate(layers[1:], start=1):
        if type(layer) is not type(first):
            raise TypeError(f"from_nnx: layers={path!r} is not homogeneous: {path}[{i}] is a {type(layer).__name__}, "
                            f"{path}[0] a {type(first).__name__}")
        other = jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
        if other != shapes:
            raise ValueError(f"from_nnx: layers={path!r} is not homogeneous: the parameters of {path}[{i}] "
                             f"{other} differ from those of {path}[0] {shapes}")
    return layers


@dataclasses.dataclass(frozen=True)
class _Part:
    """One submodule: how to rebuild it from its parameters (graph, a parameter template, frozen other state)."""

    path: str           # the attribute (dotted) of the user's module
    index: int | None   # the layer's index in that attribute; None for embed / head attributes
    graphdef: Any
    params: Any  # nnx.State of its nnx.Param variables (the template the group's arrays are poured into)
    rest: Any    # its other variables (RNG streams, counters): constants in the engines' programs

    @staticmethod
    def of(module: nnx.Module, path: str, index: int | None = None) -> "_Part":
        sub = _resolve(module, path) if index is None else _layer_list(module, path)[index]
        where = path if index is None else f"{path}[{index}]"
        if not isinstance(sub, nnx.Module):
            raise TypeError(f"from_nnx: {where!r} is a {type(sub).__name__}, not an nnx.Module")
        graphdef, params, rest = nnx.split(sub, nnx.Param, ...)
        if not jax.tree.leaves(params):
            raise ValueError(f"from_nnx: {where!r} holds no nnx.Param to train")
        # `merge` pours the group's leaves into the State in its own order: both flatten by sorted keys
        if [np.shape(x) for x in jax.tree.leaves(params)] != [
                np.shape(x) for x in jax.tree.leaves(nnx.to_pure_dict(params))]:
            raise RuntimeError(f"from_nnx: {where!r}: this Flax version orders State leaves unlike plain dicts")
        return _Part(path, index, graphdef, params, rest)

    def find(self, module: nnx.Module):
        """This submodule in `module` (the user's model, or one built the same way)."""
        return _resolve(module, self.path) if self.index is None else _layer_list(module, self.path)[self.index]

    def pure(self) -> dict:
        """Its parameters as a plain nested dict of fp32 numpy arrays (what the engines shard)."""
        return jax.tree.map(lambda x: np.asarray(x, np.float32), nnx.to_pure_dict(self.params))

    def merge(self, pure: dict):
        """The submodule with parameters `pure` (arrays, possibly traced, in the compute dtype)."""
        leaves = jax.tree.leaves(pure)
        state = jax.tree.unflatten(jax.tree.structure(self.params), leaves)
        return nnx.merge(self.graphdef, state, self.rest)


def _apply_in_turn(modules, x):
    for m in modules:
        x = m(x)
    return x


def _default_embed(modules, microbatch):
    return _apply_in_turn(modules if isinstance(modules, tuple) else (modules,), microbatch["tokens"])


def _default_layer(layer, h, microbatch):
    return layer(h)


def _default_head(modules, h, microbatch):
    return _apply_in_turn(modules if isinstance(modules, tuple) else (modules,), h)


@dataclasses.dataclass(frozen=True)
class NNXStagedModel:
    """What `from_nnx` returns: `model` and `groups` (initial fp32 parameters) for an engine, and `update` to write
    an engine's parameters back into the module."""

    model: StagedModel
    groups: dict[str, Any]
    parts: dict[str, tuple[_Part, ...]]  # group -> the submodules it holds, in order

    def update(self, module: nnx.Module, params: dict[str, Any]) -> nnx.Module:
        """Writes `params` (e.g. `engine.params()`: group -> parameter tree) into `module` in place, each array cast
        to the dtype of the parameter it replaces; returns `module`."""
        for group, parts in self.parts.items():
            for part in parts:
                sub = part.find(module)
                pure = params[group] if part.index is not None else params[group][part.path]
                state = nnx.state(sub, nnx.Param)
                new = jax.tree.map(lambda old, new: jnp.asarray(new, jnp.asarray(old).dtype),
                                   nnx.to_pure_dict(state), pure)
                nnx.replace_by_pure_dict(state, new)
                nnx.update(sub, state)
        return module


def from_nnx(module: nnx.Module, *, embed: str | Sequence[str] = "embed", layers: str = "layers",
             head: str | Sequence[str] = "head", loss_fn: Callable | None = None,
             embed_call: Callable | None = None, layer_call: Callable | None = None,
             head_call: Callable | None = None, metric_names: Sequence[str] = ()) -> NNXStagedModel:
    """Splits a Flax NNX model into groups and stages for the FSDP engines: embed, one per layer, head.

    Args:
      module: the model (its current parameters are the initial ones; it is not modified).
      embed, head: the attribute (dotted paths allowed, e.g. ``"transformer.wte"``) or attributes holding the input
        embedding and the output head. An attribute named in both (or the same module object under two names) is a
        tied embedding: it stays in the embed group and the head stage reads that group too.
      layers: the attribute holding the layers, an ``nnx.List`` (or list / tuple / ``nnx.Sequential``) of modules
        of one class with parameters of one shape; each layer becomes a group and a stage.
      loss_fn: ``loss_fn(logits, microbatch) -> loss`` (or ``(loss, {metric: value})`` with `metric_names`), the
        microbatch's loss already divided by ``microbatch["normalizer"]`` (the minibatch's global loss-token count)
        so that losses add up over microbatches and devices. Default: next-token cross-entropy on
        ``targets`` / ``loss_mask``.
      embed_call, layer_call, head_call: how to call the submodules on a microbatch (fields ``tokens``,
        ``targets``, ``loss_mask``, ``positions``, ``segment_ids`` [1, T], ``normalizer``, plus extras):
        ``embed_call(embed, microbatch) -> h``, ``layer_call(layer, h, microbatch) -> h``,
        ``head_call(head, h, microbatch) -> logits``, with a tuple of modules where several attributes are named.
        Defaults: ``embed(tokens)``, ``layer(h)``, ``head(h)`` (several modules: applied in the order named).

    Only ``nnx.Param`` variables are trained; other variables (RNG streams, counters) are frozen at their current
    values. Every parameter of the module must belong to embed, layers or head (a ValueError names the others).
    """
    if not isinstance(module, nnx.Module):
        raise TypeError(f"from_nnx needs an nnx.Module, got {type(module).__name__}")
    embed_names, head_names = _names(embed, "embed"), _names(head, "head")
    if not isinstance(layers, str) or not layers:
        raise ValueError(f"from_nnx: layers must name one attribute, got {layers!r}")
    embed_parts = tuple(_Part.of(module, n) for n in embed_names)
    embed_objects = [id(_resolve(module, n)) for n in embed_names]
    # each head attribute: ("head", i) its own i-th part, or ("embed", j) the embed part it is tied to
    head_parts, head_sources = [], []
    for n in head_names:
        obj = id(_resolve(module, n))
        if obj in embed_objects:
            head_sources.append((EMBED, embed_objects.index(obj)))
        else:
            head_sources.append((HEAD, len(head_parts)))
            head_parts.append(_Part.of(module, n))
    head_parts = tuple(head_parts)
    tied = any(src == EMBED for src, _ in head_sources)
    layer_parts = tuple(_Part.of(module, layers, i) for i in range(len(_layer_list(module, layers))))
    _check_coverage(module, embed_names, layers, head_names)

    embed_call = embed_call or _default_embed
    layer_call = layer_call or _default_layer
    head_call = head_call or _default_head
    loss_fn = loss_fn or sft_loss_from_logits

    def single(mods):  # one module as itself, several as a tuple
        return mods[0] if len(mods) == 1 else mods

    def embed_stage(params, h, mb):
        (tree,) = params
        return embed_call(single(tuple(p.merge(tree[p.path]) for p in embed_parts)), mb)

    def layer_stage(part):
        def fn(params, h, mb):
            return layer_call(part.merge(params[0]), h, mb)
        return fn

    def head_stage(params, h, mb):
        trees = dict(zip(head_groups, params))  # the head group and, when tied, the embed group
        parts = {HEAD: head_parts, EMBED: embed_parts}
        modules = tuple(parts[src][i].merge(trees[src][parts[src][i].path]) for src, i in head_sources)
        return loss_fn(head_call(single(modules), h, mb), mb)

    head_groups = ((HEAD,) if head_parts else ()) + ((EMBED,) if tied else ())
    groups = {EMBED: {p.path: p.pure() for p in embed_parts}}
    stages = [Stage(EMBED, (EMBED,), embed_stage)]
    parts: dict[str, tuple[_Part, ...]] = {EMBED: embed_parts}
    for i, part in enumerate(layer_parts):
        name = f"layer_{i}"
        groups[name] = part.pure()
        stages.append(Stage(name, (name,), layer_stage(part)))
        parts[name] = (part,)
    if head_parts:
        groups[HEAD] = {p.path: p.pure() for p in head_parts}
        parts[HEAD] = head_parts
    stages.append(Stage(HEAD, head_groups, head_stage))
    return NNXStagedModel(StagedModel.build(groups, stages, metric_names), groups, parts)


def _check_coverage(module: nnx.Module, embed: tuple[str, ...], layers: str, head: tuple[str, ...]) -> None:
    """A ValueError naming the parameters that neither embed, layers nor head holds (they would never train)."""
    owned = [tuple(n.split(".")) for n in embed + (layers,) + head]
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(module, nnx.Param)))[0]
    stray = set()
    for path, _ in flat:
        keys = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        if not any(keys[:len(o)] == o for o in owned):
            stray.add(".".join(keys[:-1]) or keys[0])
    if stray:
        raise ValueError(f"from_nnx: parameters outside embed={embed}, layers={layers!r} and head={head} would not be "
                         f"trained: {sorted(stray)}; name their attributes in embed= or head= (a tuple is allowed)")


__all__ = ["NNXStagedModel", "from_nnx"]
