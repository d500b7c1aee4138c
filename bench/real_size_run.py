"""A real-size run on one CPU host: a Qwen2.5-0.5B-shaped decoder (its real vocabulary of 151936, tied embeddings,
random init: 494M parameters) trained a few SFT steps under `mpirun -np 2` (2 processes x 1 device, ODC over the MPI
transport), checkpointed, resumed in another layout (1 process x 2 devices) and exported to HF, with every process's
peak resident memory (GNU time's maximum RSS of each rank).

What it shows: no process ever holds the whole model's state. Under mpirun each process's peak is its share of the
state (fp32 parameters and two Adam moments, 12 bytes per parameter over 2 processes) plus ODC's heap (its published
shard and its gradient accumulator, 8 bytes over 2, in shared memory that both processes map, so RSS counts it in
both) and the step's transients; the one process that resumes holds the whole state and heap (it drives both devices),
nothing more; the export gathers one group at a time.

    python -m bench.real_size_run [--steps 2 --more-steps 2 --max-length 128 --sequences 8 --out FILE]

Prints a table and one JSON line; writes bench/results/real_size_run.json (and the run under --run-dir, removed
unless --keep). Needs the jodc[mpi] extra and about 16 GB of free memory; takes ~10-20 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

from bench import harness
from tools.mpirun import mpi_env, mpirun_command

HIDDEN, LAYER_PARAMS = 896, 14_912_384  # Qwen2.5-0.5B: hidden size, parameters of one decoder layer


def param_count(layers: int, vocab: int) -> int:
    """Parameters of the Qwen2.5-0.5B shape with `layers` layers and `vocab` tokens (tied embeddings, final norm):
    494,032,768 at its real 24 layers and 151936 tokens."""
    return vocab * HIDDEN + layers * LAYER_PARAMS + HIDDEN
TIME = "/usr/bin/time"
MAXRSS = re.compile(r"^JODC_MAXRSS_KB (\d+)$", re.M)


def train_args(args, out_dir: str, steps: int, devices: int) -> list[str]:
    return ["sft", "--preset", "qwen2.5-0.5b", "--vocab_size", str(args.vocab), "--num_layers", str(args.layers),
            "--max_length", str(args.max_length),
            "--attention_block_size", "64", "--embedded_examples", str(args.sequences * 16),
            "--sequences_per_minibatch", str(args.sequences), "--devices", str(devices), "--steps", str(steps),
            "--total_steps", str(args.steps + args.more_steps), "--learning_rate", "1e-4", "--save_every",
            str(args.steps), "--timeline_every", "0", "--no-progress", "--export_hf", "true", "--out_dir", out_dir]


def run(cmd: list[str], env: dict, timeout: float) -> tuple[str, float]:
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}):\n{out[-4000:]}")
    return out, time.perf_counter() - started


def peaks(out: str) -> list[float]:
    """Every rank's maximum RSS in GB, from GNU time's lines."""
    return [int(kb) * 1024 / 1e9 for kb in MAXRSS.findall(out)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="SFT steps under mpirun, then a checkpoint")
    parser.add_argument("--more-steps", type=int, default=2, help="steps after the resume, then the HF export")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--sequences", type=int, default=8, help="sequences per minibatch")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (the real model's: 24)")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary (the real model's: 151936)")
    parser.add_argument("--run-dir", default="/tmp/jodc_real_size_run")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", default=harness.results_path("real_size_run.json"))
    return parser.parse_args(argv)


def run_phases(args, out_dir: str) -> list[dict]:
    """Train and save under mpirun (2 x 1 device), then resume, train, save and export in 1 process x 2 devices:
    each phase's every process's peak RSS and its wall seconds."""
    timed = [TIME, "-f", "JODC_MAXRSS_KB %M"]
    env = mpi_env()
    env.pop("XLA_FLAGS", None)
    phases = []
    cmd = mpirun_command(2, *timed, sys.executable, "-m", "mpi4py", "-m", "jodc.train",
                         *train_args(args, out_dir, args.steps, 2))
    out, seconds = run(cmd, env, args.timeout)
    phases.append({"phase": f"mpirun -np 2 (2 x 1 device): build, {args.steps} steps, save",
                   "peak_gb_per_process": peaks(out), "seconds": seconds})
    env1 = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    cmd = [*timed, sys.executable, "-m", "jodc.train", *train_args(args, out_dir, args.steps + args.more_steps, 2)]
    out2, seconds = run(cmd, env1, args.timeout)
    if f"(step {args.steps})" not in out2:
        raise RuntimeError(f"the single process did not resume from step {args.steps}:\n{out2[-3000:]}")
    phases.append({"phase": f"1 process x 2 devices: resume, {args.more_steps} steps, save, HF export",
                   "peak_gb_per_process": peaks(out2), "seconds": seconds})
    return phases


def exported(out_dir: str) -> tuple[dict | None, int, list[float]]:
    """The HF export's index (None for one file) and bytes, and the run's losses."""
    hf = os.path.join(out_dir, "hf")
    index = json.load(open(os.path.join(hf, "model.safetensors.index.json"))) if os.path.exists(
        os.path.join(hf, "model.safetensors.index.json")) else None
    export_bytes = sum(os.path.getsize(os.path.join(hf, f)) for f in os.listdir(hf) if f.endswith(".safetensors"))
    losses = [json.loads(line)["loss"] for line in open(os.path.join(out_dir, "metrics.jsonl")) if line.strip()]
    return index, export_bytes, losses


def print_table(result: dict, index: dict | None) -> None:
    params, phases = result["params"], result["phases"]
    print(f"Qwen2.5-0.5B-shaped decoder, {result['layers']} layers, vocabulary {result['vocab']}, {params / 1e6:.0f}M "
          f"parameters; state 12 B/param = {12 * params / 1e9:.1f} GB, ODC heap 8 B/param = {8 * params / 1e9:.1f} GB")
    print(f"{'phase':<62} {'peak GB per process':>22} {'s':>7}")
    for p in phases:
        print(f"{p['phase']:<62} {', '.join(f'{g:.2f}' for g in p['peak_gb_per_process']):>22} {p['seconds']:>7.0f}")
    print(f"losses {[round(x, 4) for x in result['losses']]}; HF export {result['export_bytes'] / 1e9:.2f} GB (bf16), "
          f"{len(index['weight_map']) if index else 'one file'}")


def main(argv=None) -> None:
    args = parse_args(argv)
    params = param_count(args.layers, args.vocab)
    shutil.rmtree(args.run_dir, ignore_errors=True)
    out_dir = os.path.join(args.run_dir, "run")
    phases = run_phases(args, out_dir)
    index, export_bytes, losses = exported(out_dir)
    result = {"bench": "real_size_run", "params": params, "layers": args.layers, "vocab": args.vocab, "phases": phases,
              "losses": losses, "export_bytes": export_bytes, "steps": args.steps, "more_steps": args.more_steps,
              "max_length": args.max_length, "sequences": args.sequences,
              "real_size_peak_gb_per_process_mpirun": max(phases[0]["peak_gb_per_process"]),
              "real_size_peak_gb_single_process": max(phases[1]["peak_gb_per_process"])}
    harness.report(result, args.out, lambda: print_table(result, index))
    if not args.keep:
        shutil.rmtree(args.run_dir, ignore_errors=True)

if __name__ == "__main__":
    main()
