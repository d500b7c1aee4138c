"""The trainers of jodc (installed as `jodc.train`): supervised fine-tuning and RL post-training over one shared core
(configs, the step loop, checkpoints, metrics, timelines, the HF export, multi-process launch).

    from jodc.train import load_config, run_sft
    summary = run_sft(load_config("configs/sft_demo.yaml", ["--steps", "20"]))

    from jodc.train import load_rl_config, run_rl
    summary = run_rl(load_rl_config("configs/rl_demo.yaml", ["--steps", "20"]))

From the shell: `jodc-train sft --config configs/sft_demo.yaml` or `jodc-train rl --config configs/rl_demo.yaml`
(also `python -m jodc.train ...`).
"""
from .core.config import ConfigError, SFTConfig, load_config
from .rl.config import RLConfig, load_rl_config
from .rl.loop import run_rl
from .sft.loop import run_sft

__all__ = ["ConfigError", "RLConfig", "SFTConfig", "load_config", "load_rl_config", "run_rl", "run_sft"]
