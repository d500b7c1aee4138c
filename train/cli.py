"""`jodc-train`: the command line of the trainers.

    jodc-train sft --config configs/sft_demo.yaml [--engine collective --devices 2 --run.steps 50 ...]
    jodc-train rl --config configs/rl_demo.yaml [--loss.name ppo --steps 20 ...]
    python -m jodc.train sft ...        (python -m jodc.train.rl.cli ...: the same as jodc-train rl ...)
    mpirun -np 2 jodc-train sft --config configs/sft_demo.yaml     (processes x devices: see train/core/distributed.py)

The config is loaded and validated first; then, for a CPU run on several devices, XLA is told to simulate
that many host devices (XLA_FLAGS) before JAX is imported. This module must therefore not import JAX at import
time; the trainer is imported only after the flags are set.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import traceback
from typing import Sequence

from .core import distributed
from .core.config import ConfigError, SFTConfig, all_keys, dump, load_config, sections
from .rl.config import RLConfig, load_rl_config

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def set_host_device_count(count: int, environ=os.environ) -> None:
    """Makes XLA's CPU backend expose at least `count` devices (a no-op if JAX was already imported, which the
    trainer then reports)."""
    flags = environ.get("XLA_FLAGS", "")
    match = re.search(rf"{DEVICE_COUNT_FLAG}=(\d+)", flags)
    if match and int(match.group(1)) >= count:
        return
    flags = re.sub(rf"{DEVICE_COUNT_FLAG}=\d+", "", flags).strip()
    environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={count}".strip()


# name: (config class, load, the trainer as module:function (imported after the XLA flags are set), label of its
# messages, help, description)
COMMANDS = {
    "sft": (SFTConfig, load_config, ".sft.loop:run_sft", "jodc-train", "supervised fine-tuning",
            "Supervised fine-tuning with the ODC, collective, XLA-SPMD or reference engine."),
    "rl": (RLConfig, load_rl_config, ".rl.loop:run_rl", "jodc-train rl", "RL post-training (DPPO by default)",
           "RL post-training (GRPO-style groups, DPPO by default) with the ODC, collective or reference engine, on a "
           "verifiable task or your own reward function."),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jodc-train", description="jodc trainers (SFT and RL).", allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (cls, *_, summary, description) in COMMANDS.items():
        command = commands.add_parser(
            name, help=summary, description=description, allow_abbrev=False,
            epilog="Overrides: --section.field value, --section.field=value, the field name alone when it is unique, "
                   "or a section for its name (--engine odc --devices 4 --steps 50). Keys: " + ", ".join(all_keys(cls)))
        command.add_argument("--config", help="YAML file with sections " + ", ".join(sections(cls)))
        command.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return parser


def run_command(args: argparse.Namespace, overrides: Sequence[str], *, label: str, load, trainer: str) -> int:
    """The flow of every subcommand: load and validate the config, print it if asked, set the host device count,
    then import the trainer (`trainer`, 'module:function': only now, JAX comes with it) and run it, under mpirun
    in every process on its share of the devices. A config error, also one only the trainer can detect (some checks
    need JAX), is printed and gives exit status 2; any other error prints its traceback and then, as the last line,
    `<label>: error: <type>: <message>`, with exit status 1."""
    try:
        config = load(args.config, overrides)
        if args.print_config:
            print(dump(config), end="")
            return 0
        processes = distributed.launched_processes()
        try:
            local = distributed.local_device_count(config.engine.devices, processes)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if config.engine.platform == "cpu" and local > 1:
            set_host_device_count(local)
        module, _, function = trainer.partition(":")
        run = getattr(importlib.import_module(module, __package__), function)
        if processes > 1:
            distributed.initialize()
        run(config)
    except ConfigError as e:
        print(f"{label}: config error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the run has closed its checkpoints and engine: nothing prints after this
        traceback.print_exc()
        sys.stderr.flush()
        print(f"{label}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    args, overrides = _parser().parse_known_args(argv)
    _, load, trainer, label, *_ = COMMANDS[args.command]
    return run_command(args, overrides, label=label, load=load, trainer=trainer)


if __name__ == "__main__":
    sys.exit(main())
