"""What both trainers build from their config: the decoder (a built-in preset initialised from the seed, or a local
HF checkpoint), the planner and its cost model for that decoder's shape, and the engine with its optimizer."""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from jodc.balance import ModelShape, get_planner, lb_mini, make_cost_model
from jodc.balance.cp_cost import ContextParallelCost
from jodc.balance.cp_planners import CP_PLANNERS, lb_mini_cp, lockstep_cp
from jodc import fsdp
from jodc.fsdp.state import GroupSource
from jodc.models import DecoderConfig, HFGroupSource
from jodc.models.tokenizer import TOKENIZER_FILE, Tokenizer, model_vocab_size

from .config import ModelConfig, parse_length_buckets
from .init_source import RandomInitSource
from .presets import MODEL_PRESETS


def preset_config(name: str, tokenizer: Tokenizer, *, max_length: int, compute_dtype: str = "float32",
                  attention_impl: str = "auto", attention_block_size: int = 128, num_layers: int | None = None,
                  vocab_size: int | None = None) -> DecoderConfig:
    """The DecoderConfig of preset `name` with the tokenizer's vocabulary and special tokens; `num_layers` and
    `vocab_size` (model.num_layers / model.vocab_size) resize it (a vocabulary smaller than the tokenizer's is
    refused by `build_decoder`)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets are {', '.join(MODEL_PRESETS)}")
    eos = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    shape = {**MODEL_PRESETS[name], **({"num_layers": num_layers} if num_layers is not None else {})}
    return DecoderConfig(vocab_size=vocab_size or model_vocab_size(tokenizer), **shape,
                         max_position_embeddings=max(4096, max_length), compute_dtype=compute_dtype,
                         attention_impl=attention_impl, attention_block_size=attention_block_size,
                         bos_token_id=tokenizer.bos_token_id, eos_token_ids=eos,
                         pad_token_id=tokenizer.pad_token_id)


def hf_tokenizer_path(model: ModelConfig) -> str | None:
    """The HF model directory when it ships a tokenizer.json (the tokenizer to use by default)."""
    if model.hf_path and os.path.exists(os.path.join(model.hf_path, TOKENIZER_FILE)):
        return model.hf_path
    return None


def build_decoder(model: ModelConfig, tokenizer: Tokenizer, *, max_length: int, compute_dtype: str, seed: int
                  ) -> tuple[DecoderConfig, GroupSource]:
    """(config, where its initial parameters come from) of the model to train: a `GroupSource` the engine asks for
    its own devices' ranges, one group at a time (random initialisation from `seed`, or the HF checkpoint)."""
    if model.hf_path:
        if not os.path.isdir(model.hf_path):
            raise FileNotFoundError(f"model.hf_path {model.hf_path} is not a directory")
        groups = HFGroupSource(model.hf_path, dtype="float32", compute_dtype=compute_dtype,
                               attention_impl=model.attention_impl, attention_block_size=model.attention_block_size)
        config = groups.config  # tensors are read later, by byte range, for each device's own part
    else:
        config = preset_config(model.preset, tokenizer, max_length=max_length, compute_dtype=compute_dtype,
                               attention_impl=model.attention_impl,
                               attention_block_size=model.attention_block_size, num_layers=model.num_layers,
                               vocab_size=model.vocab_size)
        groups = RandomInitSource(config, seed)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary has "
                         f"{config.vocab_size} rows")
    if max_length > config.max_position_embeddings:
        raise ValueError(f"data.max_length={max_length} exceeds the model's max_position_embeddings="
                         f"{config.max_position_embeddings}")
    return config, groups


def model_shape(config: DecoderConfig) -> ModelShape:
    """The decoder's shape as the balance package's FLOP counter sees it."""
    return ModelShape(name="decoder", num_layers=config.num_layers, hidden=config.hidden_size,
                      intermediate=config.intermediate_size, num_heads=config.num_heads,
                      num_kv_heads=config.num_kv_heads, vocab=config.vocab_size, head_dim=config.head_dim,
                      tie_embeddings=config.tie_word_embeddings, qkv_bias=config.qkv_bias)


def cost_model(name: str, config: DecoderConfig, *, context_parallel: bool = False):
    """The planner's cost model: 'flops' (forward FLOPs of this decoder: attention makes it quadratic) or
    'linear' (token count). With `context_parallel`, the CP planner's `ContextParallelCost` of this decoder's shape
    (its FLOPs and K/V exchange bytes; `name` is not used)."""
    if context_parallel:
        return ContextParallelCost.from_shape(model_shape(config))
    return make_cost_model(name, **({"shape": model_shape(config)} if name == "flops" else {}))


def mesh_devices(platform: str, count: int) -> list:
    """The first `count` devices of `platform`; a clear error when there are fewer."""
    try:
        devices = jax.devices(platform)
    except RuntimeError as e:
        raise RuntimeError(f"engine.platform={platform!r} has no devices here: {e}") from None
    if len(devices) < count:
        hint = (f" On a CPU host, call jax.config.update('jax_num_cpu_devices', {count}) before JAX first runs "
                "(the jodc-train CLI does this).") if platform == "cpu" else ""
        raise RuntimeError(f"engine.devices={count} but only {len(devices)} {platform} device(s) exist.{hint}")
    return devices[:count]


def make_engine(config, model, groups):
    """The engine of `engine.name` on `engine.devices` devices (an SFT or RL config): a 1-D mesh, or with
    `engine.replicas` > 1 an HSDP mesh of that many replica groups (`jodc.fsdp.sharding.hsdp_mesh`), with the
    options of the engine section that engine takes (`Engine.options`)."""
    e = config.engine
    mesh = fsdp.sharding.hsdp_mesh(mesh_devices(e.platform, e.devices), e.replicas)
    return fsdp.make_engine(e.name, model, groups, mesh, optimizer=config.schedule_optimizer,
                            compute_dtype=jnp.dtype(e.compute_dtype),
                            length_buckets=parse_length_buckets(e.length_buckets) if e.length_buckets else None,
                            deterministic=e.deterministic,
                            **({"cp_kv_exchange": e.cp_kv_exchange} if e.cp_kv_exchange else {}),
                            barrier_timeout_s=float("inf") if e.barrier_timeout_s is None else e.barrier_timeout_s)


def make_planner(config):
    """The planner of `engine.planner_name`; LB-Mini is told the engine's length buckets (it then balances what
    microbatches cost at their padded lengths). With `engine.context_parallel`, whatever `engine.planner` says:
    `engine.cp_planner`, by default `lb_mini_cp` (sequences longer than the token cap split over groups of devices,
    the rest balanced around them) for ODC, `lockstep_cp` (groups in waves, every device the same number of steps)
    for a lock-step engine; `fixed_cp` splits every sequence over all devices."""
    e = config.engine
    if e.context_parallel:  # sequences over the cap split over groups of devices
        if e.cp_planner is not None:
            return CP_PLANNERS[e.cp_planner]
        return lockstep_cp if fsdp.ENGINES[e.name].lockstep else lb_mini_cp
    planner = get_planner(e.planner_name)
    if planner is lb_mini and e.length_buckets:
        return functools.partial(lb_mini, length_buckets=parse_length_buckets(e.length_buckets))
    return planner
