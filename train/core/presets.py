"""Built-in model shapes for training from scratch, as plain `DecoderConfig` keyword arguments.

They are sized for CPU runs and tests (the vocabulary comes from the tokenizer, so it is not part of a preset).
"""
from __future__ import annotations

MODEL_PRESETS: dict[str, dict] = {
    # two layers, ~0.1M non-embedding parameters: unit tests and smoke runs
    "tiny": dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2),
    # four layers, ~0.4M non-embedding parameters: the CPU demo
    "small": dict(hidden_size=64, intermediate_size=192, num_layers=4, num_heads=4, num_kv_heads=2),
    # eight layers, ~6M non-embedding parameters: a heavier CPU job, or a first GPU smoke test
    "base": dict(hidden_size=256, intermediate_size=768, num_layers=8, num_heads=8, num_kv_heads=4),
}
