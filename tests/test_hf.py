"""HF interop, offline: parity with transformers on tiny random checkpoints, save/load round trips, errors,
and tokenizers. The tests that compare against transformers take the `hf_reference` fixture (tests/conftest.py: they
skip where torch / transformers are not installed); the checkpoint error tests run everywhere."""
import json
import os
import tracemalloc

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from safetensors.numpy import load_file, save_file

from jodc.models import (
    Decoder,
    DecoderConfig,
    HFGroupSource,
    config_from_hf,
    config_to_hf,
    group_flat_layout,
    group_param_shapes,
    load_pretrained,
    load_tokenizer,
    param_groups,
    save_pretrained,
    split_params,
)
from jodc.models import hf as hf_module

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}

# name -> the transformers config of that tiny model, given the transformers module
HF_CONFIGS = {
    "llama3": lambda transformers: transformers.LlamaConfig(**SMALL, rope_parameters=dict(LLAMA3_ROPE)),
    "qwen2_tied": lambda transformers: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),
    "qwen3": lambda transformers: transformers.Qwen3Config(**SMALL, head_dim=24, tie_word_embeddings=False),
}


def make_hf_model(ref, name: str, path, seed: int = 0):
    """A tiny transformers model with every weight randomised (norms around 1), saved to `path` (`ref`: the
    hf_reference fixture)."""
    torch = ref.torch
    torch.manual_seed(seed)
    model = ref.transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[name](ref.transformers)).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def hf_logits(ref, model, tokens: np.ndarray) -> np.ndarray:
    with ref.torch.no_grad():
        return model(ref.torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


@pytest.fixture(autouse=True)
def exact_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_logits_match_transformers_and_saved_files_load_in_transformers(name, tmp_path, hf_reference):
    theirs = make_hf_model(hf_reference, name, tmp_path / "hf")
    tokens = np.random.default_rng(0).integers(0, 128, (2, 40))
    reference = hf_logits(hf_reference, theirs, tokens)
    ours = load_pretrained(str(tmp_path / "hf"))
    assert ours.config.family == theirs.config.model_type
    logits = np.asarray(ours(jnp.asarray(tokens)))
    assert np.abs(logits - reference).max() <= 1e-4
    assert np.abs(reference).max() > 0.1  # the comparison is not between two near-zero arrays

    save_pretrained(ours, str(tmp_path / "ours"))
    reloaded = hf_reference.transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours")).eval()
    assert np.abs(hf_logits(hf_reference, reloaded, tokens) - reference).max() <= 1e-5
    again = split_params(load_pretrained(str(tmp_path / "ours")))
    for group, params in split_params(ours).items():
        for pname, value in params.items():
            np.testing.assert_array_equal(again[group][pname], value)


def test_sharded_checkpoint_round_trip(tmp_path, hf_reference):
    theirs = make_hf_model(hf_reference, "qwen3", tmp_path / "hf")
    ours = load_pretrained(str(tmp_path / "hf"))
    save_pretrained(ours, str(tmp_path / "sharded"), max_shard_bytes=60_000)
    files = sorted(os.listdir(tmp_path / "sharded"))
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files and "model.safetensors" not in files
    tokens = np.random.default_rng(1).integers(0, 128, (1, 17))
    reloaded_hf = hf_reference.transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "sharded")).eval()
    np.testing.assert_allclose(hf_logits(hf_reference, reloaded_hf, tokens), hf_logits(hf_reference, theirs, tokens),
                               atol=1e-5)
    reloaded = load_pretrained(str(tmp_path / "sharded"))
    np.testing.assert_array_equal(reloaded(jnp.asarray(tokens)), ours(jnp.asarray(tokens)))
    save_pretrained(reloaded, str(tmp_path / "sharded"))  # saving again as one file removes the old shards
    assert sorted(os.listdir(tmp_path / "sharded")) == ["config.json", "model.safetensors"]


def test_bf16_load_and_save(tmp_path, hf_reference):
    theirs = make_hf_model(hf_reference, "llama3", tmp_path / "hf")
    ours = load_pretrained(str(tmp_path / "hf"), dtype="bfloat16")
    assert ours.config.compute_dtype == "bfloat16"
    assert split_params(ours)["layer_0"]["q_proj"].dtype == jnp.bfloat16
    tokens = np.random.default_rng(2).integers(0, 128, (1, 20))
    reference = hf_logits(hf_reference, theirs, tokens)
    logits = np.asarray(ours(jnp.asarray(tokens)))
    assert np.abs(logits - reference).max() < 0.05 * np.abs(reference).max() + 0.05
    save_pretrained(ours, str(tmp_path / "bf16"))
    assert json.load(open(tmp_path / "bf16" / "config.json"))["dtype"] == "bfloat16"
    assert load_file(str(tmp_path / "bf16" / "model.safetensors"))["model.norm.weight"].dtype.name == "bfloat16"
    # JAX dtype objects are accepted as well as names (issue 12); the config holds the names
    masters = load_pretrained(str(tmp_path / "hf"), dtype=jnp.float32, compute_dtype=jnp.dtype("bfloat16"))
    assert masters.config.param_dtype == "float32" and masters.config.compute_dtype == "bfloat16"
    assert split_params(masters)["layer_0"]["q_proj"].dtype == jnp.float32


def test_config_round_trip_and_unsupported_features(hf_reference):
    hf = HF_CONFIGS["llama3"](hf_reference.transformers).to_dict()
    config = config_from_hf(hf, attention_block_size=32)
    assert config.rope_scaling.kind == "llama3" and config.rope_theta == 500000.0
    assert config.attention_block_size == 32
    assert config_from_hf(config_to_hf(config), attention_block_size=32) == config
    legacy = dict(hf, rope_parameters=None, rope_theta=10000.0,
                  rope_scaling={"type": "linear", "factor": 2.0})  # transformers 4.x style keys
    assert config_from_hf(legacy).rope_scaling.factor == 2.0 and config_from_hf(legacy).rope_theta == 10000.0
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        config_from_hf({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="unsupported architectures \\['LlamaForSequenceClassification'\\]"):
        config_from_hf(dict(hf, architectures=["LlamaForSequenceClassification"]))
    with pytest.raises(ValueError, match="RoPE type 'yarn'"):
        config_from_hf(dict(hf, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}))
    with pytest.raises(ValueError, match="sliding-window"):
        config_from_hf(dict(HF_CONFIGS["qwen2_tied"](hf_reference.transformers).to_dict(), use_sliding_window=True))
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        config_from_hf(dict(hf, hidden_act="gelu"))
    with pytest.raises(ValueError, match=r"missing fields \['intermediate_size'\]"):
        config_from_hf({k: v for k, v in hf.items() if k != "intermediate_size"})
    with pytest.raises(ValueError, match="cannot be saved as Qwen2ForCausalLM"):
        config_to_hf(config.replace(family="qwen2"))


def test_missing_unexpected_and_misshaped_tensors_are_named(tmp_path, hf_reference):
    make_hf_model(hf_reference, "qwen2_tied", tmp_path / "hf")
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    config_json = (tmp_path / "hf" / "config.json").read_text()

    def write(name, tensors):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(config_json)
        save_file(tensors, str(tmp_path / name / "model.safetensors"), metadata={"format": "pt"})
        return str(tmp_path / name)

    missing = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.self_attn.k_proj.bias'\]"):
        load_pretrained(write("missing", missing))
    extra = dict(weights, **{"model.layers.0.self_attn.q_norm.weight": np.ones(16, np.float32)})
    with pytest.raises(ValueError, match=r"unexpected tensors \['model.layers.0.self_attn.q_norm.weight'\]"):
        load_pretrained(write("extra", extra))
    bad = dict(weights, **{"model.norm.weight": np.ones(63, np.float32)})
    with pytest.raises(ValueError, match="model.norm.weight has shape \\(63,\\)"):
        load_pretrained(write("bad", bad))
    tolerated = dict(weights, **{"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32),
                                 "lm_head.weight": weights["model.embed_tokens.weight"]})
    load_pretrained(write("tolerated", tolerated))  # old buffers and a tied head copy are ignored
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(config_json)
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_pretrained(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_pretrained(str(tmp_path / "hf"), dtype="int8")


def test_tokenizer_matches_transformers_fast_tokenizer(tmp_path, hf_reference):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, processors, trainers

    corpus = ["the quick brown fox jumps over the lazy dog", "packed sequences attend within their segment",
              "on demand communication for post training"] * 20
    backend = HFTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200,
                                                            special_tokens=["<unk>", "<s>", "</s>", "<pad>"]))
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>"}))

    ours = load_tokenizer(str(tmp_path))
    theirs = hf_reference.transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    text = "the lazy fox attends within the segment"
    assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.encode(text)[0] == ours.bos_token_id == 1
    assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.encode_batch([text, "dog"]) == [theirs(text)["input_ids"], theirs("dog")["input_ids"]]
    assert ours.decode(ours.encode(text)) == theirs.decode(theirs(text)["input_ids"], skip_special_tokens=True)
    assert (ours.eos_token_id, ours.pad_token_id) == (2, 3)
    assert ours.vocab_size == theirs.vocab_size and ours.token_to_id("<pad>") == 3
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path / "nowhere"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<end>"}))
    with pytest.raises(ValueError, match="eos token '<end>' is not in the vocabulary"):
        load_tokenizer(str(tmp_path))


def _tiny_checkpoint(path):
    from jodc.models import Decoder, DecoderConfig
    import flax.nnx as nnx

    config = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                           num_kv_heads=2, family="llama")
    save_pretrained(Decoder(config, rngs=nnx.Rngs(0)), str(path))
    return path


@pytest.mark.parametrize("damage, message", [
    ("empty", r"model.safetensors: the safetensors file is empty \(0 bytes\)"),
    ("garbage", r"model.safetensors: not a readable safetensors file \(.*\); it is corrupt or truncated"),
    ("truncated", r"model.safetensors: .*corrupt or truncated"),
    ("config_empty", r"config.json: the file is empty"),
    ("config_garbage", r"config.json: not valid JSON \(Expecting value at line 1 column 1\)"),
    ("config_list", r"config.json: expected a JSON object, got list"),
    ("config_field", r"config.json: hidden_size must be an integer, got 'big'"),
    ("config_missing", r"config.json: missing fields \['vocab_size'\]"),
    ("config_latin1", r"config.json: not valid UTF-8 \(byte 0xe9"),
])
def test_damaged_checkpoint_files_are_named_with_what_is_wrong(tmp_path, damage, message):
    path = _tiny_checkpoint(tmp_path / "hf")
    weights, config = path / "model.safetensors", path / "config.json"
    data, hf = weights.read_bytes(), json.loads(config.read_text())
    if damage == "empty":
        weights.write_bytes(b"")
    elif damage == "garbage":
        weights.write_bytes(b"this is not a safetensors file at all" * 10)
    elif damage == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "config_empty":
        config.write_text("")
    elif damage == "config_garbage":
        config.write_text("<html>not found</html>")
    elif damage == "config_list":
        config.write_text("[1, 2]")
    elif damage == "config_field":
        config.write_text(json.dumps(dict(hf, hidden_size="big")))
    elif damage == "config_missing":
        config.write_text(json.dumps({k: v for k, v in hf.items() if k != "vocab_size"}))
    else:
        config.write_bytes(json.dumps(dict(hf, name="caf_")).encode().replace(b"caf_", b"caf\xe9"))
    with pytest.raises(ValueError, match=message) as caught:
        load_pretrained(str(path))
    assert str(path) in str(caught.value)  # the full path, not just the file name


def test_a_missing_checkpoint_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"absent: no such HF checkpoint directory"):
        load_pretrained(str(tmp_path / "absent"))


# ---------------------------------------------------------------------------------------------- reading by slices

SOURCE_CONFIGS = {  # (DecoderConfig fields, stored dtype)
    "qwen2_tied": (dict(family="qwen2", qkv_bias=True, tie_word_embeddings=True), "float32"),
    "qwen3_untied": (dict(family="qwen3", qk_norm=True, head_dim=24), "float32"),
    "llama_untied_bf16": (dict(family="llama"), "bfloat16"),
}


def random_checkpoint(path, name: str, *, max_shard_bytes=None, num_layers=2, seed=0):
    """A checkpoint of config SOURCE_CONFIGS[name] with every parameter random (no zero biases or unit norms that
    would hide a misplaced leaf), written by save_pretrained; returns its config."""
    fields, dtype = SOURCE_CONFIGS[name]
    config = DecoderConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_layers=num_layers, num_heads=4,
                           num_kv_heads=2, param_dtype=dtype, **fields)
    rng = np.random.default_rng(seed)
    groups = {g: {p: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
                  for p, shape in group_param_shapes(config, g).items()} for g in param_groups(config)}
    save_pretrained(Decoder(config, params=groups), str(path), max_shard_bytes=max_shard_bytes)
    return config


@pytest.mark.parametrize("name", sorted(SOURCE_CONFIGS))
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("block_bytes", [None, 200])
def test_group_source_slices_are_the_engines_flat_groups(name, sharded, block_bytes, tmp_path, monkeypatch):
    """HFGroupSource.flat_slice over ranges crossing parameter boundaries and the group's end equals the slice of
    the flat vector the engines build (StagedModel.layouts[g].flatten) from load_pretrained's groups, zeros past
    the end; with 200-byte read blocks a matrix's columns are gathered over many blocks."""
    from jodc.train.core.staged_decoder import decoder_staged_model

    if block_bytes is not None:
        monkeypatch.setattr(hf_module, "_READ_BLOCK_BYTES", block_bytes)
    random_checkpoint(tmp_path / "hf", name, max_shard_bytes=30_000 if sharded else None)
    assert ("model.safetensors.index.json" in os.listdir(tmp_path / "hf")) == sharded
    loaded = load_pretrained(str(tmp_path / "hf"))
    staged, groups = decoder_staged_model(loaded.config, jax.tree.map(np.asarray, split_params(loaded)))
    source = HFGroupSource(str(tmp_path / "hf"))
    assert source.config == loaded.config
    assert list(staged.group_names) == param_groups(source.config)
    rng = np.random.default_rng(1)
    for group in staged.group_names:
        flat = np.asarray(staged.layouts[group].flatten(groups[group]))
        numel = source.numel(group)
        assert flat.dtype == np.float32 and flat.size == numel
        padded = np.concatenate([flat, np.zeros(100, np.float32)])
        np.testing.assert_array_equal(source.flat_slice(group, 0, numel), flat)
        boundaries = [offset for _, _, offset in group_flat_layout(source.config, group)] + [numel]
        ranges = [(b - 37, b + 41) for b in boundaries[1:]]  # across every parameter boundary and the end
        ranges += [tuple(sorted(rng.integers(0, numel + 100, 2))) for _ in range(6)]
        ranges += [(numel + 3, numel + 9), (5, 5), (0, numel + 100)]
        for begin, end in ranges:
            begin = max(0, int(begin))
            got = source.flat_slice(group, begin, int(end))
            assert got.dtype == np.float32 and got.shape == (end - begin,)
            np.testing.assert_array_equal(got, padded[begin:end], err_msg=f"{group}[{begin}:{end}]")


def test_group_source_validates_without_reading_and_names_bad_requests(tmp_path):
    """Opening checks names and shapes from the headers (load_pretrained's errors); a wrong group or range is
    named; a shard that lacks a tensor its index lists is named."""
    random_checkpoint(tmp_path / "hf", "qwen2_tied", max_shard_bytes=30_000)
    source = HFGroupSource(str(tmp_path / "hf"), compute_dtype="bfloat16")
    assert source.config.compute_dtype == "bfloat16" and source.config.param_dtype == "float32"
    with pytest.raises(ValueError, match="no parameter group 'value_head'"):
        source.flat_slice("value_head", 0, 4)
    with pytest.raises(ValueError, match="need 0 <= begin <= end, got begin=5, end=4"):
        source.flat_slice("embed", 5, 4)
    with pytest.raises(ValueError, match="begin=-1"):
        source.flat_slice("embed", -1, 4)
    with pytest.raises(TypeError, match="begin and end must be integers"):
        source.flat_slice("embed", 0, 4.0)
    with pytest.raises(ValueError, match="group 'head' has no parameter 'lm_head'"):
        source.read_param("head", "lm_head")  # tied: the head holds only the final norm
    np.testing.assert_array_equal(source.read_param("layer_1", "q_proj"),
                                  split_params(load_pretrained(str(tmp_path / "hf")))["layer_1"]["q_proj"])

    index_file = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    moved = "model.layers.1.self_attn.q_proj.bias"
    others = sorted(set(index["weight_map"].values()) - {index["weight_map"][moved]})
    index["weight_map"][moved] = others[0]
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"tensor {moved} is listed in model.safetensors.index.json but is not in"):
        HFGroupSource(str(tmp_path / "hf"))

    random_checkpoint(tmp_path / "one", "qwen2_tied")
    weights = load_file(str(tmp_path / "one" / "model.safetensors"))
    weights["model.layers.0.mlp.up_proj.weight"] = np.zeros((80, 63), np.float32)  # [out, in] with in wrong
    save_file(weights, str(tmp_path / "one" / "model.safetensors"), metadata={"format": "pt"})
    for load in (HFGroupSource, load_pretrained):
        with pytest.raises(ValueError, match=r"up_proj.weight has shape \(63, 80\) \(as \[in, out\] for matrices\), "
                                             r"expected \(64, 80\)"):
            load(str(tmp_path / "one"))
    with pytest.raises(FileNotFoundError, match="no such HF checkpoint directory"):
        HFGroupSource(str(tmp_path / "absent"))


def _untied_big_head_checkpoint(path, vocab_size: int, hidden_size: int = 64):
    """A one-layer float32 checkpoint whose lm_head ([vocab, hidden] in the file) dwarfs everything but the
    embedding; returns the lm_head's bytes."""
    config = DecoderConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=64, num_layers=1,
                           num_heads=4, num_kv_heads=2)
    groups = {g: {p: np.full(shape, 0.5, np.float32) for p, shape in group_param_shapes(config, g).items()}
              for g in param_groups(config)}
    groups["head"]["lm_head"] = np.arange(hidden_size * vocab_size, dtype=np.float32).reshape(hidden_size, vocab_size)
    save_pretrained(Decoder(config, params=groups), str(path))
    return groups["head"]["lm_head"].nbytes


def test_a_slice_of_a_big_matrix_does_not_read_the_whole_tensor(tmp_path):
    """Python-side allocations while reading two rows of jodc's [in, out] lm_head (two columns of the file's
    [out, in] tensor) stay far below the tensor's size."""
    tensor_bytes = _untied_big_head_checkpoint(tmp_path / "hf", vocab_size=1 << 15)  # 8 MiB
    source = HFGroupSource(str(tmp_path / "hf"))
    _, shape, offset = next(e for e in group_flat_layout(source.config, "head") if e[0] == "lm_head")
    begin, end = offset + 3 * shape[1] + 5, offset + 5 * shape[1] - 7  # rows 3 and 4, partly
    tracemalloc.start()
    try:
        got = source.flat_slice("head", begin, end)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    expected = np.arange(3 * shape[1] + 5, 5 * shape[1] - 7, dtype=np.float32)
    np.testing.assert_array_equal(got, expected)
    assert peak < tensor_bytes / 8, (peak, tensor_bytes)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def test_a_column_slice_maps_at_most_one_read_block_of_the_file(tmp_path, monkeypatch):
    """safetensors memory-maps the file and a column read touches every page of the tensor: those pages count in
    the process's resident memory while the file is open. Reading by blocks of rows, each in its own open, keeps
    the resident peak (the kernel's high-water mark, reset first) near one block, not the tensor."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
    except OSError as e:
        pytest.skip(f"the kernel's peak-RSS reset is not available here: {e}")
    monkeypatch.setattr(hf_module, "_READ_BLOCK_BYTES", 1 << 20)
    tensor_bytes = _untied_big_head_checkpoint(tmp_path / "hf", vocab_size=1 << 17)  # 32 MiB
    source = HFGroupSource(str(tmp_path / "hf"))
    _, shape, offset = next(e for e in group_flat_layout(source.config, "head") if e[0] == "lm_head")
    source.flat_slice("head", offset, offset + 10)  # warm the code path
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kb("VmRSS")
    got = source.flat_slice("head", offset + 2 * shape[1], offset + 3 * shape[1])  # one row: one column of the file
    grown = (_status_kb("VmHWM") - before) * 1024
    np.testing.assert_array_equal(got, np.arange(2 * shape[1], 3 * shape[1], dtype=np.float32))
    assert grown < tensor_bytes / 4, (grown, tensor_bytes)
