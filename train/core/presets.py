"""Built-in model shapes for training from scratch, as plain `DecoderConfig` keyword arguments.

They are sized for CPU runs and tests (the vocabulary comes from the tokenizer, so it is not part of a preset), except
`qwen2.5-0.5b`: the shape of Qwen2.5-0.5B (Qwen2 family, q/k/v biases, tied embeddings; 24 layers), for memory and
scale runs from random init; `model.num_layers` and `model.vocab_size` resize it (its real vocabulary is 151936).
"""
from __future__ import annotations

MODEL_PRESETS: dict[str, dict] = {
    # two layers, ~0.1M non-embedding parameters: unit tests and smoke runs
    "tiny": dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2),
    # four layers, ~0.4M non-embedding parameters: the CPU demo
    "small": dict(hidden_size=64, intermediate_size=192, num_layers=4, num_heads=4, num_kv_heads=2),
    # eight layers, ~6M non-embedding parameters: a heavier CPU job, or a first GPU smoke test
    "base": dict(hidden_size=256, intermediate_size=768, num_layers=8, num_heads=8, num_kv_heads=4),
    # Qwen2.5-0.5B's shape: ~14.9M parameters per layer, 0.36B without the embedding
    "qwen2.5-0.5b": dict(family="qwen2", hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                         num_kv_heads=2, qkv_bias=True, tie_word_embeddings=True, rope_theta=1000000.0),
}
