"""The warm start: supervised fine-tuning on the task's own solutions with the SFT trainer, so RL starts from a
policy whose reward is not zero (a randomly initialised model never samples a correct answer, and a group whose
rewards are all equal has no advantage to learn from).

The solved problems are written as prompt/completion records to `out_dir/warmstart/data.jsonl` (the SFT
layout `[bos] prompt completion [eos]` is the rollout's layout), `run_sft` trains on them in
`out_dir/warmstart/` with the RL run's model, engine and devices, and its HF export `out_dir/warmstart/hf` is
the RL run's initial policy. A finished warm start is reused when the run is resumed; one made for another
model, task, seed or warm-start setting is refused (`identity.json` records what it was made for).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

from jodc.fsdp import OptimizerConfig

from ..core import distributed
from ..core.config import CheckpointConfig, DataConfig, LoggingConfig, RunConfig, SFTConfig
from ..sft.loop import run_sft
from .config import RLConfig
from .tasks import Task, warmstart_records

WARMSTART_DIR, IDENTITY_FILE, DATA_FILE, HF_DIR = "warmstart", "identity.json", "data.jsonl", "hf"


def warmstart_identity(config: RLConfig) -> dict:
    """What decides the warm-started weights (compared when a finished warm start is reused)."""
    return {"model": dataclasses.asdict(config.model), "task": {"name": config.task.name, **config.task.task_options()},
            "warmstart": dataclasses.asdict(config.warmstart), "seed": config.run.seed,
            "token_cap": config.engine.token_cap}


def warmstart_sft_config(config: RLConfig, directory: str) -> SFTConfig:
    """The SFT job of the warm start: the RL run's model, engine and devices on the task's solutions."""
    e, w = config.engine, config.warmstart
    return SFTConfig(
        model=config.model,
        data=DataConfig(path=os.path.join(directory, DATA_FILE), max_length=e.token_cap, overlong="drop",
                        sequences_per_minibatch=w.sft_sequences_per_minibatch),
        optimizer=OptimizerConfig(learning_rate=w.sft_learning_rate, schedule="cosine",
                                  warmup_steps=min(10, w.sft_steps // 10)),
        engine=dataclasses.replace(e, planner=None, token_cap=None, length_buckets=None),  # SFT's defaults for these
        run=RunConfig(steps=w.sft_steps, seed=config.run.seed, out_dir=directory),
        checkpoint=CheckpointConfig(save_every=0, keep_checkpoints=1, export_hf=True,
                                    export_dtype="float32"),  # RL starts from the fp32 weights themselves
        logging=LoggingConfig(timeline_every=0, progress=config.logging.progress))


def run_warmstart(config: RLConfig, task: Task, *, log: Callable[[str], None] = print) -> str:
    """Runs (or reuses) the warm start of `config`; returns the HF directory of the warm-started model."""
    if config.warmstart.sft_steps < 1:
        raise ValueError("run_warmstart: warmstart.sft_steps is 0 (no warm start configured)")
    directory = os.path.join(os.path.abspath(config.run.out_dir), WARMSTART_DIR)
    hf_dir = os.path.join(directory, HF_DIR)
    identity_path = os.path.join(directory, IDENTITY_FILE)
    identity = warmstart_identity(config)
    if os.path.exists(identity_path):
        with open(identity_path) as f:
            saved = json.load(f)
        if saved != identity:
            changed = sorted(k for k in identity if saved.get(k) != identity[k])
            raise RuntimeError(f"{directory} holds a warm start made for another {', '.join(changed)}; use another "
                               "run.out_dir for a new run")
        if os.path.exists(os.path.join(hf_dir, "config.json")):
            log(f"warm start: reusing {hf_dir}")
            return hf_dir
    # mpirun: every process has read the directory before process 0 writes it, and reads it after
    distributed.barrier("jodc warm start checked")
    primary = distributed.is_primary()
    records = warmstart_records(task, config.run.seed, config.warmstart.sft_examples)
    data_path = os.path.join(directory, DATA_FILE)
    if primary:
        os.makedirs(directory, exist_ok=True)
        with open(identity_path, "w") as f:
            json.dump(identity, f, indent=1)
        with open(data_path + ".tmp", "w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        os.replace(data_path + ".tmp", data_path)
    distributed.barrier("jodc warm start data written")
    log(f"warm start: SFT for {config.warmstart.sft_steps} steps on {len(records)} solved {task.name} problems")
    summary = run_sft(warmstart_sft_config(config, directory), log=log)
    distributed.barrier("jodc warm start exported")  # process 0 wrote the export the others load next
    if not primary:
        return hf_dir
    if not summary["hf_export"]:
        raise RuntimeError(f"the warm start in {directory} finished without an HF export")
    return summary["hf_export"]
