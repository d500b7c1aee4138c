"""The decoder as pure functions over parameter groups: the single implementation behind both the plain model
(`Decoder.__call__`) and the FSDP engines, which apply one group (one bucket) at a time.

Parameter groups, in order: "embed" (token embedding), "layer_0" ... "layer_{L-1}" (one per decoder layer),
"head" (final norm, plus the lm_head matrix when embeddings are untied; with tied embeddings the head
computation takes the embedding group as an extra argument). Each group is a flat dict name -> array; the names,
shapes and their order are given by `group_param_shapes` (an engine that moves a group as one flat vector uses
`jodc.fsdp.GroupLayout`, whose order is jax's tree order, dict keys sorted: `group_flat_layout` gives it).
Matrices are stored [in, out] so a projection is `x @ w`.

Every function here is pure jnp (no Python-side state) and can be traced under jit, vjp and shard_map.
Parameters may be stored in any float dtype (fp32 masters, bf16 copies); they are cast to
`config.compute_dtype` at use. Norm statistics, softmax and the logits are fp32.
"""
from __future__ import annotations

import math
from typing import Mapping

import jax
import jax.numpy as jnp

from .attention import attention
from .config import DecoderConfig
from .norm import rms_norm
from .rope import apply_rope, rope_cos_sin

EMBED = "embed"
HEAD = "head"
_LAYER_PREFIX = "layer_"

Params = Mapping[str, jax.Array]


def layer_group_name(index: int) -> str:
    """Name of decoder layer `index`'s group ("layer_3")."""
    return f"{_LAYER_PREFIX}{index}"


def _as_config(model_or_config) -> DecoderConfig:
    config = getattr(model_or_config, "config", model_or_config)
    if not isinstance(config, DecoderConfig):
        raise TypeError(f"expected a DecoderConfig or a model with .config, got {type(model_or_config).__name__}")
    return config


def param_groups(model_or_config) -> list[str]:
    """Ordered group names: ["embed", "layer_0", ..., "layer_{L-1}", "head"]."""
    config = _as_config(model_or_config)
    return [EMBED] + [layer_group_name(i) for i in range(config.num_layers)] + [HEAD]


def _group_kind(config: DecoderConfig, name: str) -> str:
    if name in (EMBED, HEAD):
        return name
    if name.startswith(_LAYER_PREFIX) and name[len(_LAYER_PREFIX):].isdigit():
        if int(name[len(_LAYER_PREFIX):]) < config.num_layers:
            return "layer"
    raise ValueError(f"unknown parameter group {name!r}; the groups are {param_groups(config)[0]}, "
                     f"layer_0..layer_{config.num_layers - 1}, {HEAD}")


def group_param_shapes(config: DecoderConfig, name: str) -> dict[str, tuple[int, ...]]:
    """The parameters of group `name` and their shapes, in the group's fixed order (HF's; a flat vector of the
    group sorts them: `group_flat_layout`).

    embed: embedding [V, D].
    layer: input_norm [D]; q_proj [D, H*hd], q_bias?; k_proj [D, KV*hd], k_bias?; v_proj, v_bias?;
      q_norm [hd]?, k_norm [hd]?; o_proj [H*hd, D], o_bias?; post_attention_norm [D];
      gate_proj [D, F], gate_bias?; up_proj [D, F], up_bias?; down_proj [F, D], down_bias?
      (? = only when the config enables it).
    head: final_norm [D]; lm_head [D, V] unless embeddings are tied.
    """
    kind = _group_kind(config, name)
    d, f, v, hd = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    if kind == EMBED:
        return {"embedding": (v, d)}
    if kind == HEAD:
        shapes = {"final_norm": (d,)}
        if not config.tie_word_embeddings:
            shapes["lm_head"] = (d, v)
        return shapes
    shapes: dict[str, tuple[int, ...]] = {"input_norm": (d,)}
    for proj, width in (("q", config.q_size), ("k", config.kv_size), ("v", config.kv_size)):
        shapes[f"{proj}_proj"] = (d, width)
        if config.qkv_bias:
            shapes[f"{proj}_bias"] = (width,)
    if config.qk_norm:
        shapes["q_norm"] = (hd,)
        shapes["k_norm"] = (hd,)
    shapes["o_proj"] = (config.q_size, d)
    if config.o_bias:
        shapes["o_bias"] = (d,)
    shapes["post_attention_norm"] = (d,)
    for proj, shape in (("gate", (d, f)), ("up", (d, f)), ("down", (f, d))):
        shapes[f"{proj}_proj"] = shape
        if config.mlp_bias:
            shapes[f"{proj}_bias"] = (shape[1],)
    return shapes


def group_flat_layout(config: DecoderConfig, name: str) -> list[tuple[str, tuple[int, ...], int]]:
    """(param, shape, offset) of every parameter of group `name` in the group's canonical flat vector: the order
    `jodc.fsdp.GroupLayout.of` gives a group dict (jax's tree order, which sorts dict keys: not the order of
    `group_param_shapes`), each parameter row-major ([in, out] for matrices) at `offset` elements from the start.
    Lets a reader fill any element range of a group's flat vector without building the group (HF loading by slice,
    streaming export)."""
    shapes = group_param_shapes(config, name)
    paths, _ = jax.tree_util.tree_flatten_with_path({param: 0 for param in shapes})
    layout, offset = [], 0
    for path, _ in paths:
        param = path[0].key
        layout.append((param, shapes[param], offset))
        offset += math.prod(shapes[param])
    return layout


def group_numel(config: DecoderConfig, name: str) -> int:
    """Elements of group `name`'s flat vector (the sum of its parameters' sizes)."""
    return sum(math.prod(shape) for shape in group_param_shapes(config, name).values())


def check_group_params(config: DecoderConfig, name: str, params: Params) -> None:
    """Raise ValueError naming missing / unexpected / mis-shaped parameters of group `name`."""
    expected = group_param_shapes(config, name)
    missing = [k for k in expected if k not in params]
    extra = [k for k in params if k not in expected]
    if missing or extra:
        raise ValueError(f"group {name!r}: missing parameters {missing}, unexpected parameters {extra}")
    for key, shape in expected.items():
        got = tuple(params[key].shape)
        if got != shape:
            raise ValueError(f"group {name!r}: parameter {key!r} has shape {got}, expected {shape}")


def init_group_params(config: DecoderConfig, name: str, key: jax.Array, init_std: float = 0.02) -> dict:
    """Random parameters for one group: normal(0, init_std) matrices, zero biases, unit norm scales."""
    shapes = group_param_shapes(config, name)
    keys = jax.random.split(key, len(shapes))
    dtype = config.params_dtype
    params = {}
    for k, (pname, shape) in zip(keys, shapes.items()):
        if pname.endswith("_norm"):
            params[pname] = jnp.ones(shape, dtype)
        elif pname.endswith("_bias"):
            params[pname] = jnp.zeros(shape, dtype)
        else:
            params[pname] = (init_std * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
    return params


def init_params(config: DecoderConfig, key: jax.Array, init_std: float = 0.02) -> dict[str, dict]:
    """Random parameters for every group, keyed by group name."""
    names = param_groups(config)
    keys = jax.random.split(key, len(names))
    return {name: init_group_params(config, name, k, init_std) for name, k in zip(names, keys)}


# ----------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------


def positions_from_segment_ids(segment_ids_bt: jax.Array) -> jax.Array:
    """Positions that restart at 0 at the start of every segment (contiguous segments; padding counts too)."""
    b, t = segment_ids_bt.shape
    column = jnp.arange(t, dtype=jnp.int32)[None, :]
    previous = jnp.concatenate([jnp.full((b, 1), -1, segment_ids_bt.dtype), segment_ids_bt[:, :-1]], axis=1)
    is_start = segment_ids_bt != previous
    segment_start = jax.lax.cummax(jnp.where(is_start, column, 0), axis=1)
    return (column - segment_start).astype(jnp.int32)


def resolve_positions_and_segments(
    shape_bt: tuple[int, int], positions_bt: jax.Array | None, segment_ids_bt: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Fill in defaults: one segment per row, and positions that restart at each segment's start."""
    if segment_ids_bt is None:
        segment_ids_bt = jnp.ones(shape_bt, jnp.int32)
    elif tuple(segment_ids_bt.shape) != tuple(shape_bt):
        raise ValueError(f"segment_ids shape {tuple(segment_ids_bt.shape)} does not match tokens {tuple(shape_bt)}")
    if positions_bt is None:
        positions_bt = positions_from_segment_ids(segment_ids_bt)
    elif tuple(positions_bt.shape) != tuple(shape_bt):
        raise ValueError(f"positions shape {tuple(positions_bt.shape)} does not match tokens {tuple(shape_bt)}")
    return positions_bt.astype(jnp.int32), segment_ids_bt.astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------------
# Group functions
# ----------------------------------------------------------------------------------------------------------


def _dense(x, params: Params, name: str, bias: str | None = None):
    """x @ params[name] (+ params[bias]) in x's dtype.

    The leading axes are flattened into one for the matmul: the weight gradient then contracts a single
    token axis, which XLA:CPU runs as a plain GEMM (with [B, T, D] operands its backward was ~2x slower).
    """
    w = params[name].astype(x.dtype)
    y = (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[-1])
    if bias is not None and bias in params:
        y = y + params[bias].astype(x.dtype)
    return y


def embed_apply(config: DecoderConfig, embed_params: Params, tokens_bt: jax.Array) -> jax.Array:
    """Token embedding lookup: int tokens [B, T] -> hidden states [B, T, D] in the compute dtype."""
    check_group_params(config, EMBED, embed_params)
    if tokens_bt.ndim != 2 or not jnp.issubdtype(tokens_bt.dtype, jnp.integer):
        raise ValueError(f"tokens must be an integer array [B, T], got {tokens_bt.dtype} {tuple(tokens_bt.shape)}")
    return jnp.take(embed_params["embedding"], tokens_bt, axis=0).astype(config.activation_dtype)


def attention_inputs(config: DecoderConfig, layer_params: Params, h_btd: jax.Array, positions_bt: jax.Array):
    """Pre-norm, q/k/v projections, optional per-head q/k norm, RoPE.

    Returns q [B, T, H, hd], k and v [B, T, KV, hd] in the compute dtype.
    """
    b, t, _ = h_btd.shape
    x = rms_norm(h_btd, layer_params["input_norm"], config.rms_norm_eps)
    q = _dense(x, layer_params, "q_proj", "q_bias").reshape(b, t, config.num_heads, config.head_dim)
    k = _dense(x, layer_params, "k_proj", "k_bias").reshape(b, t, config.num_kv_heads, config.head_dim)
    v = _dense(x, layer_params, "v_proj", "v_bias").reshape(b, t, config.num_kv_heads, config.head_dim)
    if config.qk_norm:
        q = rms_norm(q, layer_params["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, layer_params["k_norm"], config.rms_norm_eps)
    cos, sin = rope_cos_sin(config, positions_bt)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def layer_output(config: DecoderConfig, layer_params: Params, h_btd: jax.Array, attn_bthd: jax.Array) -> jax.Array:
    """Output projection and residual, then the pre-norm SwiGLU MLP and its residual."""
    b, t, _ = h_btd.shape
    h = h_btd + _dense(attn_bthd.reshape(b, t, config.q_size), layer_params, "o_proj", "o_bias")
    x = rms_norm(h, layer_params["post_attention_norm"], config.rms_norm_eps)
    gated = jax.nn.silu(_dense(x, layer_params, "gate_proj", "gate_bias")) * _dense(x, layer_params, "up_proj", "up_bias")
    return h + _dense(gated, layer_params, "down_proj", "down_bias")


def layer_apply(
    config: DecoderConfig,
    layer_params: Params,
    h_btd: jax.Array,
    positions_bt: jax.Array | None = None,
    segment_ids_bt: jax.Array | None = None,
) -> jax.Array:
    """One decoder layer on hidden states [B, T, D] of packed rows (see attention.py for the segment convention).

    positions default to restarting at each segment; segment ids default to one sequence per row.
    """
    if h_btd.ndim != 3 or h_btd.shape[-1] != config.hidden_size:
        raise ValueError(f"hidden states must be [B, T, {config.hidden_size}], got {tuple(h_btd.shape)}")
    check_group_params(config, layer_group_name(0), layer_params)  # every layer has the same parameters
    positions_bt, segment_ids_bt = resolve_positions_and_segments(h_btd.shape[:2], positions_bt, segment_ids_bt)
    h_btd = h_btd.astype(config.activation_dtype)
    q, k, v = attention_inputs(config, layer_params, h_btd, positions_bt)
    attn = attention(q, k, v, segment_ids_bt, impl=config.attention_impl, block_size=config.attention_block_size)
    return layer_output(config, layer_params, h_btd, attn)


def head_apply(
    config: DecoderConfig, head_params: Params, h_btd: jax.Array, embed_params: Params | None = None
) -> jax.Array:
    """Final norm and output projection: hidden [B, T, D] -> fp32 logits [B, T, V].

    With tied embeddings the projection is the embedding matrix, passed as `embed_params`.
    """
    check_group_params(config, HEAD, head_params)
    x = rms_norm(h_btd.astype(config.activation_dtype), head_params["final_norm"], config.rms_norm_eps)
    if config.tie_word_embeddings:
        if embed_params is None:
            raise ValueError("head_apply: the config ties embeddings, so embed_params (the 'embed' group) is required")
        check_group_params(config, EMBED, embed_params)
        contract, weight = ((1,), (1,)), embed_params["embedding"]  # [V, D]
    else:
        contract, weight = ((1,), (0,)), head_params["lm_head"]  # [D, V]
    b, t, d = x.shape
    logits = jax.lax.dot_general(x.reshape(b * t, d), weight.astype(x.dtype), (contract, ((), ())),
                                 preferred_element_type=jnp.float32)  # 2-D: see _dense
    return logits.reshape(b, t, config.vocab_size)


def forward(
    config: DecoderConfig,
    params: Mapping[str, Params],
    tokens_bt: jax.Array,
    positions_bt: jax.Array | None = None,
    segment_ids_bt: jax.Array | None = None,
) -> jax.Array:
    """Whole model from group params: embed_apply -> layer_apply for each layer -> head_apply (fp32 logits)."""
    missing = [name for name in param_groups(config) if name not in params]
    if missing:
        raise ValueError(f"forward: parameter groups {missing} are missing")
    positions_bt, segment_ids_bt = resolve_positions_and_segments(tokens_bt.shape, positions_bt, segment_ids_bt)
    h = embed_apply(config, params[EMBED], tokens_bt)
    for i in range(config.num_layers):
        h = layer_apply(config, params[layer_group_name(i)], h, positions_bt, segment_ids_bt)
    return head_apply(config, params[HEAD], h, params[EMBED])

