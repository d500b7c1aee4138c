"""Streaming Hugging Face export: the trained decoder written group by group into sharded safetensors, so that no
process ever holds the whole model (DESIGN.md section 10).

The engine gathers one parameter group at a time (collectively, across processes) and hands it over as that group's
canonical flat fp32 vector (`jodc.models.group_flat_layout`); one process writes. Every tensor's name, shape, file
and byte offset follow from the config alone, so the shard files and their headers are laid out before any weight
arrives, and each group's tensors are cast to the export dtype, turned to HF's [out, in] orientation and written
straight to their place: memory is one group plus one of its tensors, whatever the model's size.

Everything is written into `path + ".tmp"` and swapped into place only once complete, like
`train.core.checkpoint.export_hf`: an earlier export at `path` is replaced only by a complete one.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
from dataclasses import dataclass
from typing import Iterable

import ml_dtypes
import numpy as np

from jodc.models import DecoderConfig, group_flat_layout, group_numel, group_param_shapes, param_groups
from jodc.models.hf import CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, config_to_hf, hf_tensor_names, hf_transposed
from jodc.models.tokenizer import Tokenizer, save_tokenizer

from .interrupts import interrupts_held

#: export dtype name -> (numpy dtype, safetensors dtype name)
EXPORT_DTYPES = {"bfloat16": (np.dtype(ml_dtypes.bfloat16), "BF16"), "float32": (np.dtype(np.float32), "F32")}
#: default largest safetensors file (a tensor larger than this gets a file of its own)
DEFAULT_MAX_SHARD_BYTES = 2 << 30
_HEADER_ALIGNMENT = 8  # safetensors pads its JSON header so that the data start 8-byte aligned


@dataclass(frozen=True)
class _Tensor:
    """Where one parameter goes: its HF name and shape, its file and its byte range in that file's data."""

    group: str
    param: str
    name: str
    shape: tuple[int, ...]
    file: str
    begin: int
    end: int


@dataclass(frozen=True)
class _Shard:
    file: str
    header: bytes  # the 8-byte length and the JSON header, padded: data start at len(header)
    data_bytes: int


def plan_shards(config: DecoderConfig, dtype: str, max_shard_bytes: int) -> tuple[list[_Shard], list[_Tensor]]:
    """The files of an export and where each tensor lies in them: tensors in `param_groups` order, each group's in
    `group_param_shapes` order, packed into files of at most `max_shard_bytes` of data (a larger tensor alone).
    One file is `model.safetensors`; more are `model-0000k-of-0000n.safetensors` with an index."""
    np_dtype, st_dtype = EXPORT_DTYPES[dtype]
    names = hf_tensor_names(config)
    entries: list[tuple[str, str, str, tuple[int, ...], int]] = []
    for group in param_groups(config):
        for param, shape in group_param_shapes(config, group).items():
            hf_shape = tuple(reversed(shape)) if hf_transposed(param) else tuple(shape)
            entries.append((group, param, names[(group, param)], hf_shape, math.prod(shape) * np_dtype.itemsize))
    files: list[list[int]] = [[]]
    size = 0
    for i, entry in enumerate(entries):
        if files[-1] and size + entry[4] > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(i)
        size += entry[4]
    width = max(5, int(math.log10(len(files))) + 1)
    shards, tensors = [], []
    for k, members in enumerate(files, start=1):
        file = WEIGHTS_FILE if len(files) == 1 else f"model-{k:0{width}d}-of-{len(files):0{width}d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for i in members:
            group, param, name, hf_shape, nbytes = entries[i]
            header[name] = {"dtype": st_dtype, "shape": list(hf_shape), "data_offsets": [offset, offset + nbytes]}
            tensors.append(_Tensor(group, param, name, hf_shape, file, offset, offset + nbytes))
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % _HEADER_ALIGNMENT)
        shards.append(_Shard(file, struct.pack("<Q", len(text)) + text, offset))
    return shards, tensors


def export_hf_streaming(config: DecoderConfig, group_flats: Iterable[tuple[str, np.ndarray | None]],
                        tokenizer: Tokenizer | None, path: str, *, dtype: str = "bfloat16",
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, write: bool = True) -> str:
    """Writes a HF checkpoint directory at `path` (config.json, safetensors, the tokenizer) from parameter groups
    that arrive one at a time, and returns `path` (absolute).

    group_flats: yields (group name, that group's canonical flat fp32 vector of `group_numel(config, group)`
      elements, as `jodc.fsdp.GroupLayout.flatten` lays it out), each group of `param_groups(config)` once, in any
      order; other groups (the critic's value head) are consumed and left out. It is always iterated to the end,
      also where `write` is false: the engine gathers each group collectively, so every process must take part.
    write: false in every process but the one that writes (those may yield None for the arrays: they are not read).
    dtype: "bfloat16" (default) or "float32": the tensors' dtype and config.json's `dtype`.
    max_shard_bytes: the largest safetensors file; more files come with model.safetensors.index.json.

    Memory: the group being written and one of its tensors in the export dtype. The export is written into
    `path + ".tmp"` and swapped into place once complete; an error (a missing or repeated group, a wrong size, an
    exception raised by `group_flats`) removes the staging directory and leaves an earlier export at `path` as it was.
    Tied embeddings write no lm_head (transformers ties it to the embedding).
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    if not path:
        raise ValueError("export_hf_streaming: path is empty")
    hf_config = {**config_to_hf(config), "dtype": dtype}  # raises for a config its family cannot express
    path = os.path.abspath(path)
    if not write:
        _consume(config, group_flats)
        return path
    shards, tensors = plan_shards(config, dtype, max_shard_bytes)
    staging = path + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)  # a leftover of an interrupted export, never a finished one
    os.makedirs(staging)
    try:
        _write_weights(config, group_flats, staging, shards, tensors, EXPORT_DTYPES[dtype][0])
        with open(os.path.join(staging, CONFIG_FILE), "w") as f:
            json.dump(hf_config, f, indent=2, sort_keys=True)
        if tokenizer is not None:
            save_tokenizer(tokenizer, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _swap_into_place(staging, path)
    return path


def _consume(config: DecoderConfig, group_flats) -> None:
    """Iterates a non-writing process's groups to the end, checking the same names the writer checks."""
    expected, seen = set(param_groups(config)), set()
    for group, _ in group_flats:
        _check_new_group(group, expected, seen)
    _check_all_seen(expected, seen)


def _check_new_group(group: str, expected: set[str], seen: set[str]) -> bool:
    """Whether `group` is to be written (False for groups that are not the decoder's); ValueError on a repeat."""
    if group not in expected:
        return False
    if group in seen:
        raise ValueError(f"export_hf_streaming: group {group!r} was yielded twice")
    seen.add(group)
    return True


def _check_all_seen(expected: set[str], seen: set[str]) -> None:
    missing = [g for g in expected if g not in seen]
    if missing:
        raise ValueError(f"export_hf_streaming: groups {sorted(missing)} were never yielded; the export is "
                         "incomplete and was not written")


def _write_weights(config: DecoderConfig, group_flats, staging: str, shards: list[_Shard], tensors: list[_Tensor],
                   np_dtype: np.dtype) -> None:
    """Lays out the shard files (headers, then data space), writes each group's tensors as it arrives, then the
    index when there are several files."""
    for shard in shards:
        with open(os.path.join(staging, shard.file), "wb") as f:
            f.write(shard.header)
            f.truncate(len(shard.header) + shard.data_bytes)
    data_start = {shard.file: len(shard.header) for shard in shards}
    where = {(t.group, t.param): t for t in tensors}
    expected, seen = set(param_groups(config)), set()
    for group, flat in group_flats:
        if not _check_new_group(group, expected, seen):
            continue
        numel = group_numel(config, group)
        flat = np.asarray(flat)
        if flat.shape != (numel,):
            raise ValueError(f"export_hf_streaming: group {group!r} has shape {flat.shape}, expected its flat "
                             f"vector of ({numel},)")
        for param, shape, offset in group_flat_layout(config, group):
            tensor = where[(group, param)]
            array = flat[offset:offset + math.prod(shape)].reshape(shape).astype(np_dtype, copy=False)
            array = np.ascontiguousarray(array.T if hf_transposed(param) else array)
            with open(os.path.join(staging, tensor.file), "r+b") as f:
                f.seek(data_start[tensor.file] + tensor.begin)
                f.write(array.reshape(-1).view(np.uint8))  # bfloat16 has no buffer format: write its bytes
            del array
        del flat
    _check_all_seen(expected, seen)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(s.data_bytes for s in shards)},
                 "weight_map": {t.name: t.file for t in tensors}}
        with open(os.path.join(staging, WEIGHTS_INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)


def _swap_into_place(staging: str, path: str) -> None:
    """Renames the complete `staging` directory to `path`, replacing an earlier export only at the very end."""
    previous = path + ".old"
    with interrupts_held(f"the swap of the new export into {path}"):  # never only the earlier one under .old
        if os.path.exists(path):
            shutil.rmtree(previous, ignore_errors=True)
            os.rename(path, previous)
            os.rename(staging, path)
            shutil.rmtree(previous)
        else:
            os.rename(staging, path)
