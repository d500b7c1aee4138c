"""HF interop, offline: parity with transformers on tiny random checkpoints, save/load round trips, errors,
and tokenizers. The tests that compare against transformers take the `hf_reference` fixture (tests/conftest.py: they
skip where torch / transformers are not installed); the checkpoint error tests run everywhere."""
import json
import os

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from safetensors.numpy import load_file, save_file

from jodc.models import (
    config_from_hf,
    config_to_hf,
    load_pretrained,
    load_tokenizer,
    save_pretrained,
    split_params,
)

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
