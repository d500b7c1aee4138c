"""The `rl` subcommand of `jodc-train`:

    jodc-train rl --config configs/rl_demo.yaml [--loss.name ppo --steps 20 --group_size 4 ...]
    python -m jodc.train.rl.cli --config configs/rl_demo.yaml ...        (the same, standalone)

Like the SFT command, the config is loaded and validated before JAX is imported, so that a CPU run on several
devices can set XLA_FLAGS first. `train/cli.py` registers the subcommand with `add_rl_parser` and hands it to
`run_rl_command`.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..core.config import all_keys
from .config import RLConfig, load_rl_config

DESCRIPTION = ("RL post-training (GRPO-style groups, DPPO by default) with the ODC, collective or reference "
               "engine, on a verifiable task or your own reward function.")


def add_rl_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `rl` command's own arguments (everything else is a config override)."""
    parser.add_argument("--config", help="YAML file with sections model, task, rollout, loss, optimizer, engine, run, "
                                         "checkpoint, logging, warmstart")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.epilog = ("Overrides: --section.field value, --section.field=value, or the field name alone when it is "
                     "unique (--steps 20 --group_size 4 --loss.name ppo). Keys: " + ", ".join(all_keys(RLConfig)))
    return parser


def add_rl_parser(commands) -> argparse.ArgumentParser:
    """Registers `rl` on an argparse subparsers object (that of `jodc-train`)."""
    parser = commands.add_parser("rl", help="RL post-training (DPPO by default)", description=DESCRIPTION,
                                 allow_abbrev=False)
    return add_rl_arguments(parser)


def _rl_trainer():
    from .loop import run_rl

    return run_rl


def run_rl_command(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    """Loads the config (exit status 2 with the message on a config error), sets the host device count, runs."""
    from ..cli import run_command  # cli imports this module

    return run_command(args, overrides, label="jodc-train rl", load=load_rl_config, trainer=_rl_trainer)


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (`python -m jodc.train.rl.cli`)."""
    parser = add_rl_arguments(argparse.ArgumentParser(prog="jodc-train rl", description=DESCRIPTION,
                                                      allow_abbrev=False))
    args, overrides = parser.parse_known_args(argv)
    return run_rl_command(args, overrides)


if __name__ == "__main__":
    sys.exit(main())
