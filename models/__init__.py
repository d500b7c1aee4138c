"""Flax NNX decoders of the Llama 3 / Qwen2 / Qwen3 family for post-training (installed as `jodc.models`).

- `DecoderConfig` / `RopeScaling`: the model description (config.py).
- `Decoder`: the NNX model; `split_params` / `merge_params` convert to and from per-group arrays (decoder.py).
- The layer-wise functional view used by the FSDP engines (layerwise.py): `param_groups`, `group_param_shapes`,
  `embed_apply`, `layer_apply`, `head_apply`, `forward` (flat buckets of a group: `jodc.fsdp.GroupLayout`, whose
  order `group_flat_layout` gives).
- Segment-aware attention (attention.py): `attention`, `blockwise_attention`, `dense_attention`.
- Context parallelism (context_parallel.py, over keyed_attention.py): one sequence's attention split over a group of
  devices in the zigzag layout of `jodc.balance.zigzag`: `group_keys`, `context_parallel_attention`,
  `context_parallel_layer_apply`, the exchange `AxisExchange` (a mesh axis); the engines bring their own (the
  collective engine's `MemberAxisExchange`, ODC's `jodc.ops.group.exchange.OdcGroupExchange`: docs/context_parallel.md).
- HF checkpoints (hf.py): `load_pretrained`, `save_pretrained`, `HFGroupSource` (a checkpoint read by group
  slices, for sharded init); tokenizers (tokenizer.py): `load_tokenizer`,
  `save_tokenizer`, the built-in `byte_level_tokenizer`.
- The critic's value head on the decoder (value_head.py): `VALUE_HEAD`, `init_value_head`, `value_apply`,
  `values_forward`.
- Sampling with a KV cache for rollouts (generate.py): `generate`, `SamplingParams`, `Generation`; continuous
  batching over a paged KV cache (stream.py): `ContinuousSampler`, `StreamShape`, `stream_generate`.
"""
from .attention import attention, blockwise_attention, dense_attention
from .config import DecoderConfig, RopeScaling
from .context_parallel import (
    AxisExchange,
    GroupKeys,
    context_parallel_attention,
    context_parallel_layer_apply,
    group_keys,
)
from .decoder import Decoder, ParamGroup, merge_params, split_params
from .generate import Generation, SamplingParams, generate, sampling_logprobs
from .stream import Completion, ContinuousSampler, StreamShape, StreamStats, stream_generate
from .hf import HFGroupSource, config_from_hf, config_to_hf, load_pretrained, save_pretrained
from .layerwise import (
    EMBED,
    HEAD,
    check_group_params,
    embed_apply,
    forward,
    group_flat_layout,
    group_numel,
    group_param_shapes,
    head_apply,
    init_params,
    layer_apply,
    layer_group_name,
    param_groups,
    positions_from_segment_ids,
)
from .value_head import VALUE_HEAD, init_value_head, value_apply, values_forward
from .tokenizer import Tokenizer, byte_level_tokenizer, load_tokenizer, save_tokenizer

__all__ = [
    "AxisExchange", "EMBED", "GroupKeys", "HEAD", "Completion", "ContinuousSampler", "Decoder", "DecoderConfig", "Generation", "HFGroupSource", "ParamGroup", "RopeScaling",
    "SamplingParams", "Tokenizer", "attention", "blockwise_attention", "byte_level_tokenizer",
    "check_group_params", "config_from_hf", "context_parallel_attention", "context_parallel_layer_apply", "config_to_hf", "dense_attention", "embed_apply", "forward",
    "generate", "group_flat_layout", "group_keys", "group_numel", "group_param_shapes", "head_apply", "init_params", "layer_apply",
    "layer_group_name", "load_pretrained", "load_tokenizer", "merge_params", "param_groups",
    "positions_from_segment_ids", "sampling_logprobs", "save_pretrained", "save_tokenizer", "split_params",
    "StreamShape", "StreamStats", "stream_generate",
    "VALUE_HEAD", "init_value_head", "value_apply", "values_forward",
]
