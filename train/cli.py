"""`jodc-train`: the command line of the trainers.

    jodc-train sft --config configs/sft_demo.yaml [--engine collective --devices 2 --run.steps 50 ...]
    jodc-train rl --config configs/rl_demo.yaml [--loss.name ppo --steps 20 ...]
    python -m jodc.train sft ...        (the same as jodc-train sft ...)
    mpirun -np 2 jodc-train sft --config configs/sft_demo.yaml     (processes x devices: see train/core/distributed.py)

The config is loaded and validated first; then, for a CPU run on several devices, JAX's CPU backend is told to
simulate that many devices (`jax_num_cpu_devices`), which must happen before the backend first starts: nothing
imported here starts it.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import traceback
from typing import Sequence

import jax

from jodc.fsdp import ENGINES

from .core import distributed, preemption
from .core.config import ConfigError, SFTConfig, all_keys, dump, load_config, sections
from .rl.config import RLConfig, load_rl_config
from .rl.loop import run_rl
from .sft.loop import run_sft


def use_cpu_devices(count: int) -> None:
    """Makes JAX's CPU backend expose at least `count` devices: never fewer than XLA_FLAGS'
    --xla_force_host_platform_device_count or an earlier call asked for, and a no-op once the backend has started
    (the trainer then reports too few devices)."""
    flag = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    if max(jax.config.jax_num_cpu_devices, int(flag.group(1)) if flag else 1) < count:
        try:
            jax.config.update("jax_num_cpu_devices", count)
        except RuntimeError:  # the backend has started
            pass


def any_engine() -> str:
    """'the odc, collective, xla_spmd or reference engine': every engine of the registry (`jodc.fsdp.ENGINES`), which
    both trainers take."""
    *others, last = ENGINES
    return f"the {', '.join(others)} or {last} engine" if others else f"the {last} engine"


# name: (config class, load, trainer, label of its messages, help, description)
COMMANDS = {
    "sft": (SFTConfig, load_config, run_sft, "jodc-train", "supervised fine-tuning",
            f"Supervised fine-tuning with {any_engine()}."),
    "rl": (RLConfig, load_rl_config, run_rl, "jodc-train rl", "RL post-training (DPPO by default)",
           f"RL post-training (GRPO-style groups, DPPO by default) with {any_engine()}, on a verifiable task or "
           "your own reward function."),
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


def run_command(args: argparse.Namespace, overrides: Sequence[str], *, label: str, load, trainer) -> int:
    """The flow of every subcommand: load and validate the config, print it if asked, set the CPU device count,
    then run `trainer` on the config, under mpirun in every process on its share of the devices. A config error,
    also one only the trainer can detect, is printed and gives exit status 2; a stop on SIGTERM (the step under way
    finished and checkpointed) gives 143 after a last line naming the checkpoint; any other error prints its
    traceback and then, as the last line, `<label>: error: <type>: <message>`, with exit status 1."""
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
        if config.engine.platform == "cpu":
            use_cpu_devices(local)
        if processes > 1:
            distributed.initialize()
        with preemption.PreemptionWatch():  # a SIGTERM while the run is built stops it after its first step
            trainer(config)
    except ConfigError as e:
        print(f"{label}: config error: {e}", file=sys.stderr)
        return 2
    except preemption.Preempted as e:  # checkpointed: the run resumes from it when started again
        print(f"{label}: {e}", file=sys.stderr)
        return preemption.EXIT_STATUS
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
