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
from .layerwise import EMBED, HEAD, group_flat_layout, group_numel, group_param_shapes, param_groups

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


def hf_transposed(param: str) -> bool:
    """Whether HF stores parameter `param` transposed relative to jodc: projection matrices (HF [out, in], jodc
    [in, out]) are; embeddings, norms and biases are not."""
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


# Bytes of a safetensors file one read maps at a time when it gathers a column range of a matrix: the file is
# memory-mapped, and the pages a strided read touches stay resident (counted in the process's RSS) until the file is
# closed, so such a read goes through blocks of whole rows, each in its own open.
_READ_BLOCK_BYTES = 32 << 20


class HFGroupSource:
    """A local HF checkpoint directory, read by slices of the parameter groups' canonical flat vectors: what a
    process needs to place its own shards of a pretrained model without ever holding the whole model.

    Opening validates everything `load_pretrained` does (config.json, the architecture, every tensor's name and shape,
    that each file is readable) from the files' headers, without reading tensor data, and raises the same errors.

    Contract of `flat_slice(group, begin, end)`: the float32 elements [begin, end) of group `group`'s canonical flat
    vector, the one `jodc.fsdp.GroupLayout.of(groups[group]).flatten(groups[group])` builds from the group dict of
    `load_pretrained(path)` (parameters in `jodc.models.group_flat_layout` order, each row-major in jodc's [in, out]
    orientation). Elements at or past `numel(group)` are zeros (an engine's padding), so `begin` and `end` may lie
    past the end; 0 <= begin <= end. Only the bytes of the tensors that overlap the range are read (a matrix's
    rows in jodc's view are columns of HF's [out, in] tensor: those are read in blocks of at most 32 MiB of the
    file, each mapped and released in turn); each call opens the files it needs and closes them before returning,
    so a source holds no file handles or mappings between calls and may be used from any thread of a process.
    Groups are those of `param_groups(config)`; the critic's value head is not part of a HF checkpoint.

    dtype / compute_dtype / config_overrides: as `load_pretrained` (they shape `.config`; `dtype` is the config's
    parameter dtype, slices are float32 whatever it is).
    """

    def __init__(self, path: str, *, dtype="float32", compute_dtype=None, **config_overrides):
        dtype = dtype_name(dtype, DTYPES, "HFGroupSource: dtype")
        if compute_dtype is not None:
            compute_dtype = dtype_name(compute_dtype, DTYPES, "HFGroupSource: compute_dtype")
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
        self.path, self.config = path, config
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
        # (group, param) -> (file, HF tensor name); shapes checked from the headers, one open per file
        self._tensors = {key: (files[name], name) for key, name in wanted.items()}
        self._itemsizes: dict[tuple[str, str], int] = {}  # bytes per stored element
        by_file: dict[str, list[tuple[str, str, str]]] = {}
        for (group, param), name in wanted.items():
            by_file.setdefault(files[name], []).append((group, param, name))
        for file, entries in by_file.items():
            with _open_safetensors(file) as f:
                present = set(f.keys())
                for group, param, name in entries:
                    if name not in present:
                        raise ValueError(f"{file}: tensor {name} is listed in {WEIGHTS_INDEX_FILE} but is not in "
                                         "this file; the checkpoint is corrupt")
                    view = f.get_slice(name)
                    stored = tuple(view.get_shape())
                    self._itemsizes[(group, param)] = _itemsize(view.get_dtype())
                    shape = group_param_shapes(config, group)[param]
                    as_jodc = stored[::-1] if hf_transposed(param) else stored
                    if as_jodc != shape:
                        raise ValueError(f"{path}: tensor {name} has shape {as_jodc} "
                                         f"(as [in, out] for matrices), expected {shape}")

    def numel(self, group: str) -> int:
        """Elements of `group`'s flat vector."""
        return group_numel(self.config, self._group(group))

    def read_param(self, group: str, param: str) -> np.ndarray:
        """One whole parameter in jodc's orientation ([in, out] for matrices), in its stored dtype."""
        file, name = self._tensor(group, param)
        with _open_safetensors(file) as f:
            tensor = _get_tensor(f, file, name)
        return np.ascontiguousarray(tensor.T) if hf_transposed(param) else tensor

    def flat_slice(self, group: str, begin: int, end: int) -> np.ndarray:
        """float32 elements [begin, end) of `group`'s canonical flat vector; zeros past its end (see the class)."""
        group = self._group(group)
        if isinstance(begin, bool) or isinstance(end, bool) or not (
                isinstance(begin, (int, np.integer)) and isinstance(end, (int, np.integer))):
            raise TypeError(f"flat_slice: begin and end must be integers, got {begin!r}, {end!r}")
        if not 0 <= begin <= end:
            raise ValueError(f"flat_slice: need 0 <= begin <= end, got begin={begin}, end={end}")
        begin, end = int(begin), int(end)
        out = np.zeros(end - begin, np.float32)
        for param, shape, offset in group_flat_layout(self.config, group):
            lo, hi = max(begin, offset), min(end, offset + math.prod(shape))
            if lo < hi:
                out[lo - begin:hi - begin] = self._leaf_range(group, param, shape, lo - offset, hi - offset)
        return out

    def _group(self, group: str) -> str:
        if group not in param_groups(self.config):
            raise ValueError(f"{self.path}: no parameter group {group!r}; a HF checkpoint holds groups "
                             f"{param_groups(self.config)[0]}, layer_0..layer_{self.config.num_layers - 1}, {HEAD}")
        return group

    def _tensor(self, group: str, param: str) -> tuple[str, str]:
        key = (self._group(group), param)
        if key not in self._tensors:
            raise ValueError(f"group {group!r} has no parameter {param!r}; it has "
                             f"{list(group_param_shapes(self.config, group))}")
        return self._tensors[key]

    def _leaf_range(self, group: str, param: str, shape: tuple[int, ...], a: int, b: int) -> np.ndarray:
        """Elements [a, b) of one parameter's row-major jodc view, as float32, reading only the rows (of jodc's
        view) that hold them."""
        file, name = self._tensor(group, param)
        if len(shape) == 1:
            return _read_slice(file, name, (slice(a, b),)).astype(np.float32)
        cols = shape[1]
        r0, r1 = a // cols, -(-b // cols)  # jodc rows holding [a, b)
        if not hf_transposed(param):  # stored as jodc sees it: the rows are contiguous in the file
            rows = _read_slice(file, name, (slice(r0, r1),))
        else:  # jodc rows r0:r1 are the columns r0:r1 of the [out, in] tensor: gather them by row blocks
            rows = np.empty((r1 - r0, cols), np.float32)
            out_rows, in_cols = cols, shape[0]
            step = max(1, _READ_BLOCK_BYTES // (in_cols * self._itemsizes[(group, param)]))
            for o0 in range(0, out_rows, step):
                o1 = min(out_rows, o0 + step)
                rows[:, o0:o1] = _read_slice(file, name, (slice(o0, o1), slice(r0, r1))).T
        return rows.reshape(-1)[a - r0 * cols:b - r0 * cols].astype(np.float32)


_ITEMSIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
              "F8_E4M3": 1, "F8_E5M2": 1}


def _itemsize(dtype: str) -> int:
    """Bytes per element of a safetensors dtype name (unknown names count as 8: blocks only get smaller)."""
    return _ITEMSIZES.get(dtype, 8)


def _read_slice(file: str, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """tensor[index] of one safetensors file, opening and closing the file around the read (its mapping, and the
    pages the read touched, are released on return)."""
    with _open_safetensors(file) as f:
        try:
            return f.get_slice(name)[index]
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file}: tensor {name} cannot be read ({e}); the file is corrupt or truncated"
                             ) from None


def load_pretrained(path: str, *, dtype="float32", compute_dtype=None, **config_overrides) -> Decoder:
    """Load a local HF checkpoint directory into a `Decoder` (the whole model in memory: to place an engine's
    shards, read slices with `HFGroupSource` instead).

    dtype: parameter dtype, a name ("float32", "bfloat16", "float16") or a dtype object (jnp.bfloat16);
      compute_dtype (the same spellings) defaults to dtype.
    config_overrides: other `DecoderConfig` fields (attention_impl, attention_block_size, ...).
    Raises ValueError naming unsupported architectures / features, missing tensors, unexpected tensors or
    shape mismatches, and FileNotFoundError for absent files.
    """
    dtype = dtype_name(dtype, DTYPES, "load_pretrained: dtype")
    if compute_dtype is not None:
        compute_dtype = dtype_name(compute_dtype, DTYPES, "load_pretrained: compute_dtype")
    source = HFGroupSource(path, dtype=dtype, compute_dtype=compute_dtype, **config_overrides)
    config = source.config
    np_dtype = np.dtype(jnp.dtype(config.param_dtype))
    groups = {g: {p: source.read_param(g, p).astype(np_dtype, copy=False) for p in group_param_shapes(config, g)}
              for g in param_groups(config)}
    return Decoder(config, params=groups)


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
        tensors[name] = np.ascontiguousarray(array.T if hf_transposed(param) else array)
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
