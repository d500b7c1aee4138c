"""Hugging Face checkpoint interop, offline: read and write a local directory in the transformers format.

A HF directory holds `config.json` and either `model.safetensors` or a sharded set described by
`model.safetensors.index.json` (its "weight_map" names the shard of every tensor). Supported architectures:
LlamaForCausalLM ("llama"), Qwen2ForCausalLM ("qwen2"), Qwen3ForCausalLM ("qwen3"). HF stores projection
weights [out, in]; `jodc.models` stores them [in, out], so matrices are transposed on the way in and out.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jodc.dtypes import dtype_name

from .config import DTYPES, DecoderConfig, RopeScaling
from .decoder import Decoder, split_params
from .layerwise import EMBED, HEAD, group_param_shapes, param_groups

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_SHARD_FILE = re.compile(r"model-\d+-of-\d+\.safetensors")
_IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; recomputed here

# jodc layer parameter name -> HF tensor name inside "model.layers.{i}."
_LAYER_TENSORS = {
    "input_norm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_proj": "self_attn.k_proj.weight",
    "k_bias": "self_attn.k_proj.bias",
    "v_proj": "self_attn.v_proj.weight",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "o_proj": "self_attn.o_proj.weight",
    "o_bias": "self_attn.o_proj.bias",
    "post_attention_norm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "gate_bias": "mlp.gate_proj.bias",
    "up_proj": "mlp.up_proj.weight",
    "up_bias": "mlp.up_proj.bias",
    "down_proj": "mlp.down_proj.weight",
    "down_bias": "mlp.down_proj.bias",
}
_OTHER_TENSORS = {
    (EMBED, "embedding"): "model.embed_tokens.weight",
    (HEAD, "final_norm"): "model.norm.weight",
    (HEAD, "lm_head"): "lm_head.weight",
}


def hf_tensor_names(config: DecoderConfig) -> dict[tuple[str, str], str]:
    """(group, param) -> HF tensor name, for every parameter the config has."""
    names = {}
    for group in param_groups(config):
        for param in group_param_shapes(config, group):
            if group in (EMBED, HEAD):
                names[(group, param)] = _OTHER_TENSORS[(group, param)]
            else:
                names[(group, param)] = f"model.layers.{group[len('layer_'):]}.{_LAYER_TENSORS[param]}"
    return names


def _is_matrix(param: str) -> bool:
    """Projection matrices are stored transposed relative to HF; embeddings, norms and biases are not."""
    return param.endswith("_proj") or param == "lm_head"


# ----------------------------------------------------------------------------------------------------------
# config.json
# ----------------------------------------------------------------------------------------------------------


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE theta and scaling from either transformers 5 `rope_parameters` or the older rope_theta/rope_scaling."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"config.json: partial_rotary_factor={partial} is not supported (only full RoPE)")
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                   if k not in params]
        if missing:
            raise ValueError(f"config.json: llama3 RoPE scaling is missing {missing}")
        return theta, RopeScaling(
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise ValueError(f"config.json: RoPE type {kind!r} is not supported (supported: default, linear, llama3)")


def config_from_hf(hf: Mapping[str, Any], *, dtype="float32", compute_dtype=None, **overrides) -> DecoderConfig:
    """A `DecoderConfig` from a HF config.json dict. `overrides` set other DecoderConfig fields
    (e.g. attention_impl, attention_block_size). Unsupported architectures or features raise ValueError.
    dtype / compute_dtype: a name or a dtype object (jnp.bfloat16); compute_dtype defaults to dtype."""
    dtype = dtype_name(dtype, DTYPES, "config_from_hf: dtype")
    family = hf.get("model_type")
    if family not in ARCHITECTURES:
        raise ValueError(
            f"config.json: unsupported model_type {family!r} (architectures {hf.get('architectures')}); "
            f"supported: {sorted(ARCHITECTURES)}"
        )
    architectures = hf.get("architectures") or [ARCHITECTURES[family]]
    if ARCHITECTURES[family] not in architectures:
        raise ValueError(
            f"config.json: unsupported architectures {architectures} for model_type {family!r}; "
            f"expected {ARCHITECTURES[family]}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
    if hf.get("use_sliding_window", False):
        raise ValueError("config.json: use_sliding_window=true (sliding-window attention) is not supported")
    required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
    missing = [k for k in required if k not in hf]
    if missing:
        raise ValueError(f"config.json: missing fields {missing}")
    theta, scaling = _rope_from_hf(hf)
    attention_bias = bool(hf.get("attention_bias", False))
    eos = hf.get("eos_token_id")
    eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
    def integer(key, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise ValueError(f"config.json: {key} must be an integer, got {value!r}")
        return int(value)

    fields = dict(
        vocab_size=integer("vocab_size", hf["vocab_size"]),
        hidden_size=integer("hidden_size", hf["hidden_size"]),
        intermediate_size=integer("intermediate_size", hf["intermediate_size"]),
        num_layers=integer("num_hidden_layers", hf["num_hidden_layers"]),
        num_heads=integer("num_attention_heads", hf["num_attention_heads"]),
        num_kv_heads=integer("num_key_value_heads", hf.get("num_key_value_heads") or hf["num_attention_heads"]),
        head_dim=hf.get("head_dim"),
        family=family,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=integer("max_position_embeddings", hf.get("max_position_embeddings", 4096)),
        qkv_bias=True if family == "qwen2" else attention_bias,
        o_bias=False if family == "qwen2" else attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)) if family == "llama" else False,
        qk_norm=family == "qwen3",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        param_dtype=dtype,
        compute_dtype=compute_dtype or dtype,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=hf.get("pad_token_id"),
    )
    fields.update(overrides)
    return DecoderConfig(**fields)


def config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    """The HF config.json dict for `config` (readable by transformers 4.50+ and 5.x).

    Raises ValueError when the config uses a feature combination its family cannot express.
    """
    family = config.family
    expected = {
        "llama": dict(qk_norm=False, qkv_bias=config.o_bias),
        "qwen2": dict(qk_norm=False, qkv_bias=True, o_bias=False, mlp_bias=False),
        "qwen3": dict(qk_norm=True, qkv_bias=config.o_bias, mlp_bias=False),
    }[family]
    wrong = {k: getattr(config, k) for k, v in expected.items() if getattr(config, k) != v}
    if wrong:
        raise ValueError(f"config cannot be saved as {ARCHITECTURES[family]}: unsupported settings {wrong}")
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    rope_scaling = None
    if config.rope_scaling is not None:
        s = config.rope_scaling
        rope_scaling = {"rope_type": s.kind, "factor": s.factor}
        if s.kind == "llama3":
            rope_scaling.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                                original_max_position_embeddings=s.original_max_position_embeddings)
        rope_parameters = {**rope_scaling, "rope_theta": config.rope_theta}
    eos = list(config.eos_token_ids)
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": config.pad_token_id,
        "dtype": config.param_dtype,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if family in ("llama", "qwen3"):
        hf["attention_bias"] = config.o_bias
    if family == "llama":
        hf["mlp_bias"] = config.mlp_bias
    if family in ("qwen2", "qwen3"):
        hf["use_sliding_window"] = False
        hf["sliding_window"] = None
        hf["max_window_layers"] = config.num_layers
    return hf


# ----------------------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------------------


def _read_json_object(file: str) -> dict[str, Any]:
    """The JSON object in `file`; ValueError naming the file when it is empty, not UTF-8, not JSON or not an
    object (a half-copied or hand-edited config.json / index)."""
    try:
        with open(file, "rb") as f:
            raw = f.read()
        if not raw.strip():
            raise ValueError("the file is empty")
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not valid UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


@contextlib.contextmanager
def _open_safetensors(file: str):
    """`safe_open(file)`, with errors that name the file: empty, not a safetensors file, truncated."""
    if os.path.getsize(file) == 0:
        raise ValueError(f"{file}: the safetensors file is empty (0 bytes); re-download or re-export it")
    try:
        handle = safe_open(file, framework="np")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e}); it is corrupt or truncated: "
                         "re-download or re-export it") from None
    with handle as f:
        yield f


def _get_tensor(f, file: str, name: str) -> np.ndarray:
    try:
        return f.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: tensor {name} cannot be read ({e}); the file is corrupt or truncated") from None


def _weight_files(path: str) -> dict[str, str]:
    """HF tensor name -> safetensors file path, for a single-file or sharded checkpoint."""
    single = os.path.join(path, WEIGHTS_FILE)
    index = os.path.join(path, WEIGHTS_INDEX_FILE)
    if os.path.exists(index):
        weight_map = _read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        shards = {os.path.join(path, shard) for shard in weight_map.values()}
        absent = sorted(os.path.basename(s) for s in shards if not os.path.exists(s))
        if absent:
            raise FileNotFoundError(f"{path}: shards listed in {WEIGHTS_INDEX_FILE} are missing: {absent}")
        return {name: os.path.join(path, shard) for name, shard in weight_map.items()}
    if os.path.exists(single):
        with _open_safetensors(single) as f:
            return {name: single for name in f.keys()}
    present = sorted(os.listdir(path))
    raise FileNotFoundError(
        f"{path}: no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} (found {present}); only safetensors checkpoints "
        "are supported"
    )


def load_pretrained(path: str, *, dtype="float32", compute_dtype=None, **config_overrides) -> Decoder:
    """Load a local HF checkpoint directory into a `Decoder`.

    dtype: parameter dtype, a name ("float32", "bfloat16", "float16") or a dtype object (jnp.bfloat16);
      compute_dtype (the same spellings) defaults to dtype.
    config_overrides: other `DecoderConfig` fields (attention_impl, attention_block_size, ...).
    Raises ValueError naming unsupported architectures / features, missing tensors, unexpected tensors or
    shape mismatches, and FileNotFoundError for absent files.
    """
    dtype = dtype_name(dtype, DTYPES, "load_pretrained: dtype")
    if compute_dtype is not None:
        compute_dtype = dtype_name(compute_dtype, DTYPES, "load_pretrained: compute_dtype")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such HF checkpoint directory")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{path}: no {CONFIG_FILE}")
    hf_config = _read_json_object(config_path)
    try:
        config = config_from_hf(hf_config, dtype=dtype, compute_dtype=compute_dtype, **config_overrides)
    except (ValueError, TypeError) as e:  # unsupported features, missing or malformed fields
        message = str(e).removeprefix(f"{CONFIG_FILE}: ")
        raise ValueError(f"{config_path}: {message}") from None
    files = _weight_files(path)
    wanted = hf_tensor_names(config)
    missing = sorted(name for name in wanted.values() if name not in files)
    if missing:
        raise ValueError(f"{path}: missing tensors {missing}")
    known = set(wanted.values())
    if config.tie_word_embeddings:
        known.add(_OTHER_TENSORS[(HEAD, "lm_head")])  # some tied checkpoints store a copy; it is ignored
    unexpected = sorted(n for n in files if n not in known and not n.endswith(_IGNORED_TENSOR_SUFFIXES))
    if unexpected:
        raise ValueError(f"{path}: unexpected tensors {unexpected} (not part of a {config.family} model "
                         "with this config)")
    np_dtype = np.dtype(jnp.dtype(dtype))
    groups: dict[str, dict[str, np.ndarray]] = {g: {} for g in param_groups(config)}
    by_file: dict[str, list[tuple[str, str, str]]] = {}
    for (group, param), name in wanted.items():
        by_file.setdefault(files[name], []).append((group, param, name))
    for file, entries in by_file.items():
        with _open_safetensors(file) as f:
            for group, param, name in entries:
                tensor = _get_tensor(f, file, name)
                if _is_matrix(param):
                    tensor = tensor.T
                shape = group_param_shapes(config, group)[param]
                if tuple(tensor.shape) != shape:
                    raise ValueError(f"{path}: tensor {name} has shape {tuple(tensor.shape)} "
                                     f"(as [in, out] for matrices), expected {shape}")
                groups[group][param] = np.ascontiguousarray(tensor.astype(np_dtype))
    ordered = {g: {p: groups[g][p] for p in group_param_shapes(config, g)} for g in groups}
    return Decoder(config, params=ordered)


def save_pretrained(model: Decoder, path: str, *, max_shard_bytes: int | None = None) -> None:
    """Write `model` as a HF checkpoint directory (config.json + safetensors) that transformers can load.

    Tensors are written in the model's parameter dtype. With max_shard_bytes, weights larger than that are
    split into model-0000k-of-0000n.safetensors shards plus model.safetensors.index.json.
    """
    config = model.config
    hf = config_to_hf(config)
    os.makedirs(path, exist_ok=True)
    groups = split_params(model)
    tensors: dict[str, np.ndarray] = {}
    for (group, param), name in hf_tensor_names(config).items():
        array = np.asarray(jax.device_get(groups[group][param]))
        tensors[name] = np.ascontiguousarray(array.T if _is_matrix(param) else array)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    for stale in os.listdir(path):  # weights of an earlier save would shadow or mix with the new ones
        if stale in (WEIGHTS_FILE, WEIGHTS_INDEX_FILE) or _SHARD_FILE.fullmatch(stale):
            os.remove(os.path.join(path, stale))
    metadata = {"format": "pt"}
    total = sum(t.nbytes for t in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata=metadata)
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        if shards[-1] and size + tensors[name].nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += tensors[name].nbytes
    width = max(5, int(math.log10(len(shards))) + 1)
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        file = f"model-{k:0{width}d}-of-{len(shards):0{width}d}.safetensors"
        save_file(shard, os.path.join(path, file), metadata=metadata)
        weight_map.update({name: file for name in shard})
    with open(os.path.join(path, WEIGHTS_INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
