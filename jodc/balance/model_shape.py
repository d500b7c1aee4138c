"""The shape of a decoder-only transformer, and the parameter and FLOP counts that follow from it.

Both the ``flops`` cost model (which balances sequences by compute) and the schedule simulator (which turns compute
and bytes into seconds) read these counts, so they live here, in plain Python.

FLOP conventions (forward pass, one multiply-add = 2 FLOPs):

* a matmul with a ``[n_in, n_out]`` weight costs ``2 * n_in * n_out`` per token;
* causal attention over one sequence of ``s`` tokens costs ``2 * width * s * (s + 1)`` per layer, where
  ``width = num_heads * head_dim``: query ``i`` attends to ``i + 1`` keys, and QK^T and AV each cost
  ``2 * head_dim`` per (query, key) pair per head. Attention is segment-aware (DESIGN.md section 5), so a packed
  microbatch costs the sum over its sequences, never ``T^2``;
* norms, activations, biases, softmax and the embedding lookup are ignored (a few percent at most).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jodc.balance.validation import positive_int


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Sizes of a Llama / Qwen2-style decoder (grouped-query attention, gated MLP).

    Attributes:
      name: a label for reports.
      num_layers: decoder layers.
      hidden: model width.
      intermediate: MLP width (the gated MLP has three ``hidden x intermediate`` matrices).
      num_heads: query heads.
      num_kv_heads: key / value heads (grouped-query attention).
      vocab: vocabulary size (embedding rows and LM-head columns).
      head_dim: per-head width; ``hidden // num_heads`` when not given.
      tie_embeddings: whether the LM head reuses the embedding matrix (then it adds no parameters).
      qkv_bias: whether the q, k and v projections have biases (Qwen2 does).
    """

    name: str
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    vocab: int
    head_dim: int | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False

    def __post_init__(self):
        for field in ("num_layers", "hidden", "intermediate", "num_heads", "num_kv_heads", "vocab"):
            positive_int(getattr(self, field), field)
        if self.head_dim is None:
            if self.hidden % self.num_heads:
                raise ValueError(
                    f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}; give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.num_heads)
        positive_int(self.head_dim, "head_dim")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")

    # ---- parameter counts -------------------------------------------------------------------------------------

    @property
    def attention_width(self) -> int:
        """Total query width ``num_heads * head_dim`` (the ``width`` in the attention FLOP formula)."""
        return self.num_heads * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer that take part in matmuls: q, k, v, o projections and the gated MLP."""
        kv_width = self.num_kv_heads * self.head_dim
        attention = self.hidden * self.attention_width * 2 + self.hidden * kv_width * 2
        mlp = 3 * self.hidden * self.intermediate
        return attention + mlp

    @property
    def layer_params(self) -> int:
        """All parameters of one decoder layer: matmul weights, q/k/v biases if any, two RMSNorm scales."""
        bias = (self.attention_width + 2 * self.num_kv_heads * self.head_dim) if self.qkv_bias else 0
        return self.layer_matmul_params + bias + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        """The token embedding matrix."""
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """Final RMSNorm plus the LM head matrix (zero extra rows when tied to the embedding)."""
        return self.hidden + (0 if self.tie_embeddings else self.vocab * self.hidden)

    @property
    def total_params(self) -> int:
        """Every parameter of the model."""
        return self.embedding_params + self.num_layers * self.layer_params + self.head_params

    # ---- forward FLOPs -----------------------------------------------------------------------------------------

    def layer_forward_flops(self, num_tokens, sum_squared_plus_length):
        """Forward FLOPs of one decoder layer on a packed microbatch.

        Args:
          num_tokens: tokens in the microbatch (sum of its sequence lengths); scalar or array.
          sum_squared_plus_length: ``sum_i s_i * (s_i + 1)`` over its sequences; same shape.
        """
        linear = 2.0 * self.layer_matmul_params * np.asarray(num_tokens, dtype=np.float64)
        attention = 2.0 * self.attention_width * np.asarray(sum_squared_plus_length, dtype=np.float64)
        return linear + attention

    def head_forward_flops(self, num_tokens):
        """Forward FLOPs of the LM head (``hidden x vocab`` matmul) on ``num_tokens`` tokens."""
        return 2.0 * self.vocab * self.hidden * np.asarray(num_tokens, dtype=np.float64)

    def sequence_forward_flops(self, lengths) -> np.ndarray:
        """Forward FLOPs of each whole sequence (every layer and the LM head), as a float64 array."""
        s = np.asarray(lengths, dtype=np.float64)
        return self.num_layers * self.layer_forward_flops(s, s * (s + 1.0)) + self.head_forward_flops(s)


# DeepSeek-R1-Distill-Qwen-1.5B, read from its published config.json (Qwen2ForCausalLM): hidden_size 1536,
# intermediate_size 8960, num_hidden_layers 28, num_attention_heads 12, num_key_value_heads 2, vocab_size 151936,
# tie_word_embeddings false; Qwen2 puts biases on q, k and v. About 1.78e9 parameters in all.
DEEPSEEK_R1_DISTILL_QWEN_1_5B = ModelShape(
    name="DeepSeek-R1-Distill-Qwen-1.5B", num_layers=28, hidden=1536, intermediate=8960, num_heads=12, num_kv_heads=2,
    vocab=151936, tie_embeddings=False, qkv_bias=True)
