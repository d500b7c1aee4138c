"""The one configuration object for the Llama 3 / Qwen2 / Qwen3 decoder family.

`DecoderConfig` is a frozen (hashable) dataclass so it can be a static argument of `jax.jit`; every pure function
in `jodc.models` takes it as its first argument. The HF `config.json` <-> `DecoderConfig` mapping lives in `hf.py`.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jodc.dtypes import dtype_name

from .attention import ATTENTION_IMPLS

FAMILIES = ("llama", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16", "float16")
ROPE_KINDS = ("llama3", "linear")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Frequency scaling applied to the RoPE inverse frequencies.

    kind "linear": every inverse frequency is divided by `factor`.
    kind "llama3": Llama 3.1's piecewise rule: wavelengths longer than
    original_max_position_embeddings / low_freq_factor are divided by `factor`, shorter than
    original_max_position_embeddings / high_freq_factor are kept, and the band in between is interpolated.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"RopeScaling.kind must be one of {ROPE_KINDS}, got {self.kind!r}")
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor}")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"llama3 RoPE scaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Shape, numerics and attention settings of one decoder.

    family: which HF architecture the weights map to ("llama", "qwen2", "qwen3"); it decides the checkpoint
      format only, the math is fully described by the flags below.
    head_dim: defaults to hidden_size // num_heads (Qwen3 sets it explicitly).
    qkv_bias / o_bias / mlp_bias: biases on the q,k,v projections / the output projection / the MLP.
    qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3).
    param_dtype: dtype parameters are created and stored in (fp32 masters or bf16).
    compute_dtype: dtype activations and matmuls run in; parameters are cast to it at use.
      Both take a name or a dtype object (jnp.bfloat16); the config holds the name.
      Norm statistics, softmax and logits are always fp32.
    attention_impl: "auto" (the default: "flash" on a GPU backend, else "blockwise"), "blockwise" (segment-aware,
        skips blocks), "flash" (the fused Pallas kernel) or "dense" (reference, O(T^2)); see attention.py.
    attention_block_size: query/key block length of the blockwise attention.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    family: str = "llama"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    attention_impl: str = "auto"
    attention_block_size: int = 128
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "attention_block_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DecoderConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads}); "
                    "set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even number (RoPE rotates pairs), got {self.head_dim}")
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        for name in ("param_dtype", "compute_dtype"):  # any spelling (jnp.bfloat16, "bfloat16"), stored as the name
            object.__setattr__(self, name, dtype_name(getattr(self, name), DTYPES, f"DecoderConfig.{name}"))
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError("rms_norm_eps and rope_theta must be > 0")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"rope_scaling must be a RopeScaling or None, got {type(self.rope_scaling).__name__}")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    @property
    def params_dtype(self) -> jnp.dtype:
        """`param_dtype` as a JAX dtype."""
        return jnp.dtype(self.param_dtype)

    @property
    def activation_dtype(self) -> jnp.dtype:
        """`compute_dtype` as a JAX dtype."""
        return jnp.dtype(self.compute_dtype)

    @property
    def q_size(self) -> int:
        """Width of the concatenated query heads (num_heads * head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the concatenated key (or value) heads (num_kv_heads * head_dim)."""
        return self.num_kv_heads * self.head_dim

    def replace(self, **changes) -> "DecoderConfig":
        """A copy with some fields changed (e.g. compute_dtype, attention_impl)."""
        return dataclasses.replace(self, **changes)
