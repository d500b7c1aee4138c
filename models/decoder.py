"""`Decoder`: the Flax NNX model object users hold, optimise and checkpoint.

Its state is organised exactly like the layer-wise view: one `ParamGroup` module per parameter group
(`embed`, `layers[i]`, `head`), each holding one `nnx.Param` per entry of `group_param_shapes`. Calling the
model runs `layerwise.forward` on those arrays, so the plain model and the per-group functions the FSDP engines
use are one implementation. `split_params` / `merge_params` convert between the module and the plain
{group name: {param name: array}} dict.
"""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from .config import DecoderConfig
from .layerwise import EMBED, HEAD, check_group_params, forward, init_params, layer_group_name, param_groups


# Compiled once per (config, shapes); inside an outer jit / nnx transform it is simply inlined.
_forward_jit = jax.jit(forward, static_argnums=0)


class ParamGroup(nnx.Module):
    """The parameters of one group, one `nnx.Param` attribute per name, in the group's fixed order."""

    def __init__(self, arrays: Mapping[str, jax.Array]):
        for name, value in arrays.items():
            setattr(self, name, nnx.Param(jnp.asarray(value)))
        self.param_names = tuple(arrays)

    def arrays(self) -> dict[str, jax.Array]:
        """The current values as a plain dict (traced values inside nnx transforms)."""
        return {name: getattr(self, name)[...] for name in self.param_names}


class Decoder(nnx.Module):
    """Llama 3 / Qwen2 / Qwen3 decoder-only language model.

    Build it with random parameters (`Decoder(config, rngs=nnx.Rngs(0))`) or from group arrays
    (`Decoder(config, params=groups)`, see `merge_params`); `load_pretrained` builds it from a HF checkpoint.
    """

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs | None = None,
                 params: Mapping[str, Mapping[str, jax.Array]] | None = None):
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"Decoder needs a DecoderConfig, got {type(config).__name__}")
        if (rngs is None) == (params is None):
            raise ValueError("Decoder: pass exactly one of rngs= (random init) or params= (group arrays)")
        if params is None:
            params = init_params(config, rngs.params())
        names = param_groups(config)
        missing = [n for n in names if n not in params]
        extra = [n for n in params if n not in names]
        if missing or extra:
            raise ValueError(f"Decoder: missing parameter groups {missing}, unexpected groups {extra}")
        for name in names:
            check_group_params(config, name, params[name])
        self.config = config
        self.embed = ParamGroup(params[EMBED])
        self.layers = nnx.List([ParamGroup(params[layer_group_name(i)]) for i in range(config.num_layers)])
        self.head = ParamGroup(params[HEAD])

    def __call__(self, tokens_bt: jax.Array, positions_bt: jax.Array | None = None,
                 segment_ids_bt: jax.Array | None = None) -> jax.Array:
        """fp32 logits [B, T, V] for int tokens [B, T] (optionally packed: see attention.py for segment ids)."""
        return _forward_jit(self.config, split_params(self), tokens_bt, positions_bt, segment_ids_bt)


def split_params(model: Decoder) -> dict[str, dict[str, jax.Array]]:
    """The model's parameters as {group name: {param name: array}}, groups in `param_groups` order."""
    groups = {EMBED: model.embed.arrays()}
    for i, layer in enumerate(model.layers):
        groups[layer_group_name(i)] = layer.arrays()
    groups[HEAD] = model.head.arrays()
    return groups


def merge_params(config: DecoderConfig, groups: Mapping[str, Mapping[str, jax.Array]]) -> Decoder:
    """A `Decoder` holding the given group arrays (the inverse of `split_params`)."""
    return Decoder(config, params=groups)
