"""jodc.train.core.model: presets sized by the tokenizer, HF checkpoints, and the planner's cost models."""
import numpy as np
import pytest

from jodc.balance import FlopsCost, LinearCost
from jodc.train.core.config import ModelConfig
from jodc.train.core.init_source import RandomInitSource, abstract_groups, decoder_host_params
from jodc.train.core.model import build_decoder, cost_model, model_shape, preset_config
from jodc.train.core.presets import MODEL_PRESETS
from jodc.models.tokenizer import byte_level_tokenizer

TOK = byte_level_tokenizer()


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_presets_take_vocabulary_and_special_tokens_from_the_tokenizer(name):
    config = preset_config(name, TOK, max_length=8192)
    assert config.vocab_size == 264 and config.num_layers == MODEL_PRESETS[name]["num_layers"]
    assert (config.bos_token_id, config.eos_token_ids, config.pad_token_id) == (257, (258,), 256)
    assert config.max_position_embeddings == 8192


def test_build_decoder_from_a_preset_is_seeded():
    a_config, a = build_decoder(ModelConfig(preset="tiny"), TOK, max_length=64, compute_dtype="float32", seed=0)
    _, b = build_decoder(ModelConfig(preset="tiny"), TOK, max_length=64, compute_dtype="float32", seed=0)
    _, c = build_decoder(ModelConfig(preset="tiny"), TOK, max_length=64, compute_dtype="float32", seed=1)
    a, b, c = (decoder_host_params(a_config, s) for s in (a, b, c))
    assert set(a) == {"embed", "layer_0", "layer_1", "head"} and a_config.hidden_size == 32
    assert isinstance(a["embed"]["embedding"], np.ndarray)
    np.testing.assert_array_equal(a["embed"]["embedding"], b["embed"]["embedding"])
    assert not np.array_equal(a["embed"]["embedding"], c["embed"]["embedding"])


def test_model_num_layers_and_vocab_size_resize_a_preset():
    """model.num_layers / model.vocab_size (bench/memory.py's two sizes of the Qwen2.5-0.5B shape); null keeps the
    preset's layers and the tokenizer's vocabulary, and a vocabulary below the tokenizer's is refused."""
    from jodc.train import load_config

    config = preset_config("qwen2.5-0.5b", TOK, max_length=64, num_layers=2, vocab_size=1024)
    assert (config.num_layers, config.vocab_size, config.hidden_size, config.num_kv_heads) == (2, 1024, 896, 2)
    assert config.tie_word_embeddings and config.qkv_bias and config.family == "qwen2"
    assert preset_config("qwen2.5-0.5b", TOK, max_length=64).num_layers == 24
    model = load_config(None, ["--preset", "tiny", "--num_layers", "3", "--vocab_size", "512"]).model
    config, source = build_decoder(model, TOK, max_length=64, compute_dtype="float32", seed=0)
    groups = decoder_host_params(config, source)
    assert set(groups) == {"embed", "layer_0", "layer_1", "layer_2", "head"}
    assert groups["embed"]["embedding"].shape == (512, 32) and config.hidden_size == 32
    with pytest.raises(ValueError, match="tokenizer has 263 ids but the model's vocabulary has 100 rows"):
        build_decoder(ModelConfig(preset="tiny", vocab_size=100), TOK, max_length=64, compute_dtype="float32", seed=0)
    with pytest.raises(ValueError, match="model.num_layers must be >= 1"):
        load_config(None, ["--num_layers", "0"])


def test_build_decoder_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        preset_config("huge", TOK, max_length=64)
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        build_decoder(ModelConfig(hf_path=str(tmp_path / "absent")), TOK, max_length=64, compute_dtype="float32",
                      seed=0)


def test_hf_checkpoint_must_cover_the_tokenizer_and_the_length(tmp_path):
    from jodc.models import Decoder, DecoderConfig, save_pretrained
    from flax import nnx

    small_vocab = DecoderConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                num_kv_heads=1, max_position_embeddings=256)
    save_pretrained(Decoder(small_vocab, rngs=nnx.Rngs(0)), str(tmp_path / "m"))
    with pytest.raises(ValueError, match="tokenizer has 263 ids but the model's vocabulary has 100 rows"):
        build_decoder(ModelConfig(hf_path=str(tmp_path / "m")), TOK, max_length=64, compute_dtype="float32", seed=0)
    fits = DecoderConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, max_position_embeddings=256)
    save_pretrained(Decoder(fits, rngs=nnx.Rngs(0)), str(tmp_path / "m2"))
    config, groups = build_decoder(ModelConfig(hf_path=str(tmp_path / "m2")), TOK, max_length=256,
                                   compute_dtype="float32", seed=0)
    groups = decoder_host_params(config, groups)
    assert config.vocab_size == 300 and groups["embed"]["embedding"].shape == (300, 16)
    with pytest.raises(ValueError, match="max_length=512 exceeds the model's max_position_embeddings=256"):
        build_decoder(ModelConfig(hf_path=str(tmp_path / "m2")), TOK, max_length=512, compute_dtype="float32",
                      seed=0)


def test_cost_models():
    config = preset_config("small", TOK, max_length=1024)
    shape = model_shape(config)
    assert (shape.num_layers, shape.hidden, shape.vocab) == (4, 64, 264)
    flops = cost_model("flops", config)
    assert isinstance(flops, FlopsCost)
    c = flops(np.array([100, 200]))
    assert c[1] > 2 * c[0]  # attention makes it superlinear
    assert isinstance(cost_model("linear", config), LinearCost)
    with pytest.raises(ValueError, match="unknown cost model 'cubic'"):
        cost_model("cubic", config)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_random_init_per_group_equals_the_whole_models_init(dtype):
    """RandomInitSource builds one group at a time, yet every group equals `init_params` of the whole model for the
    same seed bit for bit (the same key split), and its slices pad with zeros past the group's end."""
    import jax

    from jodc.fsdp import GroupLayout
    from jodc.models import init_params

    config = preset_config("tiny", TOK, max_length=64).replace(param_dtype=dtype)
    whole = init_params(config, jax.random.PRNGKey(3))
    source = RandomInitSource(config, 3)
    shapes = abstract_groups(config)
    assert list(shapes) == list(whole)
    for g, params in whole.items():
        layout = GroupLayout.of(shapes[g])
        want = np.asarray(layout.flatten(params))
        n = layout.numel
        assert source.flat_slice(g, 0, n).tobytes() == want.tobytes()
        assert np.array_equal(source.flat_slice(g, n // 3, n + 7), np.concatenate([want[n // 3:], np.zeros(7)]))
    with pytest.raises(ValueError, match="no parameter group 'nope'"):
        source.flat_slice("nope", 0, 1)


FREED_MEMORY_CHECK = """
import ctypes, sys
from jodc.train.core.host_memory import return_freed_memory_promptly

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

if not return_freed_memory_promptly():
    sys.exit(3)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
size = 8 << 20
for _ in range(3):  # glibc raises its threshold after freeing a mapped buffer: this must not
    pointer = libc.malloc(size)
    ctypes.memset(pointer, 1, size)
    before = rss()
    libc.free(pointer)
    assert before - rss() >= size * 0.9, (before, rss())
"""


def test_freed_host_memory_returns_to_the_system():
    """After return_freed_memory_promptly, a freed 8 MiB buffer leaves the process (glibc would otherwise keep
    buffers below its raised mmap threshold, up to 32 MiB, in its heap: resident). In a fresh interpreter: in a
    long-lived one, glibc may serve the buffer from a free chunk already resident in its heap (reuse, not growth)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    proc = subprocess.run([sys.executable, "-c", FREED_MEMORY_CHECK], capture_output=True, text=True, env=env,
                          timeout=120)
    if proc.returncode == 3:
        pytest.skip("not glibc")
    assert proc.returncode == 0, proc.stderr[-2000:]
