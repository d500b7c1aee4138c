"""The streaming HF export (train/core/export.py): transformers loads what it writes and holds exactly our
parameters (bf16-rounded in bf16), our loader round-trips it, several shards come with an index, an interrupted or
incomplete export leaves the previous one intact, and memory stays at one group, not the model."""
import json
import os
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

from safetensors import safe_open

from jodc.models import (
    DecoderConfig,
    byte_level_tokenizer,
    group_numel,
    group_param_shapes,
    load_pretrained,
    load_tokenizer,
    param_groups,
    split_params,
)
from jodc.models.hf import hf_tensor_names, hf_transposed
from jodc.train.core.export import DEFAULT_MAX_SHARD_BYTES, export_hf_streaming, plan_shards
from jodc.train.core.staged_decoder import decoder_staged_model

CONFIGS = {
    "qwen2_tied": dict(family="qwen2", qkv_bias=True, tie_word_embeddings=True),
    "qwen3_untied": dict(family="qwen3", qk_norm=True, head_dim=24),
}


def small_config(name: str, **changes) -> DecoderConfig:
    fields = dict(vocab_size=272, hidden_size=64, intermediate_size=80, num_layers=2, num_heads=4, num_kv_heads=2,
                  **CONFIGS[name])
    return DecoderConfig(**{**fields, **changes})


def random_groups(config: DecoderConfig, seed: int = 0) -> dict:
    """Every parameter random (no unit norms or zero biases that would hide a misplaced tensor)."""
    rng = np.random.default_rng(seed)
    return {g: {p: rng.standard_normal(shape, np.float32) for p, shape in group_param_shapes(config, g).items()}
            for g in param_groups(config)}


def engine_flats(config: DecoderConfig, groups: dict, *, extra=("value_head",)):
    """(group, flat) as an engine hands them over: its own layout's flat fp32 vector, one group at a time, and a
    critic's value head that is not exported."""
    staged, ordered = decoder_staged_model(config, groups)
    for g in staged.group_names:
        yield g, np.asarray(staged.layouts[g].flatten(ordered[g]))
    for g in extra:
        yield g, np.ones(65, np.float32)


def hf_view(config: DecoderConfig, groups: dict, dtype: str) -> dict[str, np.ndarray]:
    """What the export should hold: HF name -> tensor in HF orientation, rounded to `dtype`, as float32."""
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    return {name: np.asarray((groups[g][p].T if hf_transposed(p) else groups[g][p]).astype(np_dtype), np.float32)
            for (g, p), name in hf_tensor_names(config).items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_export_loads_in_transformers_with_our_parameters(name, dtype, tmp_path, hf_reference):
    config = small_config(name)
    groups = random_groups(config)
    path = export_hf_streaming(config, engine_flats(config, groups), byte_level_tokenizer(), str(tmp_path / "hf"),
                               dtype=dtype, max_shard_bytes=40_000)
    assert path == str(tmp_path / "hf")
    files = sorted(os.listdir(path))
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 2 and "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert not os.path.exists(path + ".tmp")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == dtype
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    expected = hf_view(config, groups, dtype)
    assert sorted(index["weight_map"]) == sorted(expected)
    assert ("lm_head.weight" in expected) == (not config.tie_word_embeddings)
    itemsize = 2 if dtype == "bfloat16" else 4
    assert index["metadata"]["total_size"] == sum(v.size for v in expected.values()) * itemsize
    for shard in shards:
        with safe_open(str(tmp_path / "hf" / shard), "np") as f:
            data = sum(expected[key].size * itemsize for key in f.keys())
            assert data <= 40_000 or len(f.keys()) == 1  # a tensor larger than a shard has a file of its own
            for key in f.keys():
                assert index["weight_map"][key] == shard
                assert f.get_slice(key).get_dtype() == ("BF16" if dtype == "bfloat16" else "F32")
                np.testing.assert_array_equal(np.asarray(f.get_tensor(key), np.float32), expected[key])

    model = hf_reference.transformers.AutoModelForCausalLM.from_pretrained(path)
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        np.testing.assert_array_equal(state.pop("lm_head.weight"), expected["model.embed_tokens.weight"])
    assert sorted(state) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(state[key], value, err_msg=key)

    ours = split_params(load_pretrained(path))
    for (g, p), key in hf_tensor_names(config).items():
        as_hf = np.asarray(ours[g][p]).T if hf_transposed(p) else np.asarray(ours[g][p])
        np.testing.assert_array_equal(as_hf, expected[key], err_msg=key)
    assert load_tokenizer(path).vocab_size == byte_level_tokenizer().vocab_size


def test_one_file_without_an_index_when_the_model_fits_and_groups_in_any_order(tmp_path):
    config = small_config("qwen3_untied")
    groups = random_groups(config, seed=1)
    flats = list(engine_flats(config, groups, extra=()))[::-1]  # head first
    export_hf_streaming(config, iter(flats), None, str(tmp_path / "hf"), dtype="float32")
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    ours = split_params(load_pretrained(str(tmp_path / "hf")))
    for g in param_groups(config):
        for p, value in groups[g].items():
            np.testing.assert_array_equal(ours[g][p], value)


def test_plan_shards_lays_out_every_tensor_once_within_the_size():
    config = small_config("qwen3_untied")
    shards, tensors = plan_shards(config, "bfloat16", 30_000)
    assert [s.file for s in shards] == [f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                                        for k in range(1, len(shards) + 1)]
    assert sorted(t.name for t in tensors) == sorted(hf_tensor_names(config).values())
    for shard in shards:
        members = sorted((t for t in tensors if t.file == shard.file), key=lambda t: t.begin)
        assert members[0].begin == 0 and members[-1].end == shard.data_bytes
        assert all(a.end == b.begin for a, b in zip(members, members[1:]))  # contiguous, no gaps
        assert shard.data_bytes <= 30_000 or len(members) == 1
        assert len(shard.header) % 8 == 0
    assert sum(s.data_bytes for s in shards) == sum(group_numel(config, g) for g in param_groups(config)) * 2
    [one], _ = plan_shards(config, "float32", DEFAULT_MAX_SHARD_BYTES)
    assert one.file == "model.safetensors"
    _, tied = plan_shards(small_config("qwen2_tied"), "float32", 30_000)
    assert "lm_head.weight" not in {t.name for t in tied}
    alone, _ = plan_shards(config, "float32", 10)  # every tensor larger than a shard: one file each
    assert len(alone) == len(tensors)


def test_non_writing_processes_consume_every_group_and_write_nothing(tmp_path):
    config = small_config("qwen2_tied")
    seen = []

    def groups_gathered():
        for g, flat in engine_flats(config, random_groups(config)):
            seen.append(g)
            yield g, None  # a process that does not write may not even hold the gathered group

    path = export_hf_streaming(config, groups_gathered(), byte_level_tokenizer(), str(tmp_path / "hf"), write=False)
    assert path == str(tmp_path / "hf")
    assert seen == param_groups(config) + ["value_head"]
    assert os.listdir(tmp_path) == []


def _tree_bytes(path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in sorted(os.listdir(path))}


def test_an_interrupted_or_incomplete_export_leaves_the_previous_one(tmp_path):
    config = small_config("qwen2_tied")
    target = tmp_path / "hf"
    export_hf_streaming(config, engine_flats(config, random_groups(config)), byte_level_tokenizer(), str(target),
                        max_shard_bytes=40_000)
    before = _tree_bytes(target)

    class Preempted(Exception):
        pass

    def interrupted():
        for i, item in enumerate(engine_flats(config, random_groups(config, seed=5))):
            if i == 2:
                raise Preempted("killed mid-export")
            yield item

    with pytest.raises(Preempted):
        export_hf_streaming(config, interrupted(), byte_level_tokenizer(), str(target), max_shard_bytes=40_000)
    assert _tree_bytes(target) == before and sorted(os.listdir(tmp_path)) == ["hf"]

    new = list(engine_flats(config, random_groups(config, seed=6), extra=()))
    with pytest.raises(ValueError, match=r"groups \['head'\] were never yielded; the export is incomplete"):
        export_hf_streaming(config, iter(new[:-1]), None, str(target))
    with pytest.raises(ValueError, match="group 'layer_0' was yielded twice"):
        export_hf_streaming(config, iter(new[:2] + new[1:]), None, str(target))
    with pytest.raises(ValueError, match=r"group 'embed' has shape \(10,\), expected its flat vector"):
        export_hf_streaming(config, iter([("embed", np.zeros(10, np.float32))] + new[1:]), None, str(target))
    with pytest.raises(ValueError, match=r"groups \['head'\] were never yielded"):  # non-writers check names too
        export_hf_streaming(config, iter(new[:-1]), None, str(target), write=False)
    assert _tree_bytes(target) == before and sorted(os.listdir(tmp_path)) == ["hf"]

    export_hf_streaming(config, iter(new), None, str(target), dtype="float32")  # a complete export replaces it
    assert _tree_bytes(target) != before and sorted(os.listdir(tmp_path)) == ["hf"]
    assert "tokenizer.json" not in os.listdir(target)  # the directory was replaced, not merged


def test_bad_arguments_are_refused_before_any_group_is_gathered(tmp_path):
    config = small_config("qwen2_tied")
    started = []

    def flats():
        started.append(True)
        yield from engine_flats(config, random_groups(config))

    for kwargs, message in [(dict(dtype="float16"), "export dtype must be one of \\['bfloat16', 'float32'\\]"),
                            (dict(max_shard_bytes=0), "max_shard_bytes must be a positive integer, got 0"),
                            (dict(max_shard_bytes=2.5), "max_shard_bytes must be a positive integer")]:
        with pytest.raises(ValueError, match=message):
            export_hf_streaming(config, flats(), None, str(tmp_path / "hf"), **kwargs)
    with pytest.raises(ValueError, match="cannot be saved as Qwen2ForCausalLM"):
        export_hf_streaming(config.replace(qkv_bias=False), flats(), None, str(tmp_path / "hf"))
    with pytest.raises(ValueError, match="path is empty"):
        export_hf_streaming(config, flats(), None, "")
    assert started == [] and os.listdir(tmp_path) == []


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_export_memory_is_one_group_not_the_model(dtype, tmp_path):
    """Python-side allocations (numpy's included) while exporting a 12-layer model whose groups are made one at a
    time, as an engine gathers them: the peak stays near one group, far below the model."""
    config = DecoderConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_layers=12, num_heads=4,
                           num_kv_heads=2)
    sizes = {g: group_numel(config, g) for g in param_groups(config)}
    group_bytes, model_bytes = 4 * max(sizes.values()), 4 * sum(sizes.values())

    def gathered():
        rng = np.random.default_rng(0)
        for g in param_groups(config):
            yield g, rng.standard_normal(sizes[g], np.float32)

    tracemalloc.start()
    try:
        export_hf_streaming(config, gathered(), None, str(tmp_path / "hf"), dtype=dtype, max_shard_bytes=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len([f for f in os.listdir(tmp_path / "hf") if f.startswith("model-")]) > 2
    assert peak < 2.5 * group_bytes < model_bytes / 4, (peak, group_bytes, model_bytes)
