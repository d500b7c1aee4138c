"""SFT trainer for jodc (installed as `jodc.train`): config, data, checkpoints, metrics, timelines, the loop.

    from jodc.train import load_config, run_sft
    summary = run_sft(load_config("configs/sft_demo.yaml", ["--steps", "20"]))

From the shell: `jodc-train sft --config configs/sft_demo.yaml` or `python -m jodc.train sft ...`.
Importing this package does not import JAX (the CLI sets XLA flags first); `run_sft` is loaded on first use.
"""
from .core.config import ConfigError, SFTConfig, load_config

__all__ = ["ConfigError", "SFTConfig", "load_config", "run_sft"]


def __getattr__(name):
    if name == "run_sft":
        from .sft.loop import run_sft

        return run_sft
    raise AttributeError(f"module 'jodc.train' has no attribute {name!r}")
