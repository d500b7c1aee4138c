"""SFT trainer for jodc (installed as `jodc.train`): config, data, checkpoints, metrics, timelines, the loop.

    from jodc.train import load_config, run_sft
    summary = run_sft(load_config("configs/sft_demo.yaml", ["--steps", "20"]))

From the shell: `jodc-train sft --config configs/sft_demo.yaml` or `python -m jodc.train sft ...`.
"""
from .core.config import ConfigError, SFTConfig, load_config
from .sft.loop import run_sft

__all__ = ["ConfigError", "SFTConfig", "load_config", "run_sft"]
