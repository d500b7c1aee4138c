"""Rollout-phase scaling of the RL sampler: data-parallel over devices in one process, sharded across processes.

`python -m bench.rl_sampling` (or `--quick`) measures the rollout phase of an RL step (`RolloutSampler`: the step's
prompts, sampling, rewards; across processes the exchange of the shares), as the trainer runs it:

1. One process with 4 simulated CPU devices: the step's prompts split in whole groups over 1, 2 and 4 devices (one
   compiled sampler dispatched per device, concurrently: what the trainer does). Beside it, for 2 and 4 devices,
   the other way to sample data-parallel, one SPMD program (`shard_map` of the same sampler over the devices), on
   the same prompts and keys, at the `generate` level (`dispatch_vs_shard_map_<D>dev`: dispatch's wall over
   shard_map's; > 1 means shard_map was faster).
2. `mpirun -np 2`, 1 CPU device per process: *sharded* (each process samples and scores its half, the halves'
   metadata is exchanged: the trainer now) against *replicated* (each process samples and scores the whole rollout
   on its device: the trainer before), alternating. The rollout's wall is the slower process's.

The model is the config's preset with random weights (sampling cost does not depend on them; a random policy rarely
emits eos, so every response runs to `max_new_tokens`). Rollouts after the first (which compiles) are timed.

Prints a table and one JSON line (also written to bench/results/rl_sampling.json unless --no-save). Keys:
`rollout_seconds_<D>dev` and `tokens_per_s_<D>dev` (one process), `rollout_seconds_2proc_sharded` /
`_replicated`, `rollout_sharded_vs_replicated_2proc` (sharded wall / replicated wall: below 1 is faster; the issue's
target is <= 0.6), `reward_calls_per_response` (sharded, over both processes: 1.0) and
`reward_calls_per_response_replicated` (2.0). Alongside (`--full-steps N`, 0 to skip), whole RL steps with the
trainer (configs/rl_demo.yaml without warm start, evaluation, checkpoints or export; the same model and rollout
sizes), one process x 2 devices (`1proc_2dev`) and `mpirun -np 2` x 1 device with the minibatches assembled without
replication (`2proc`: each sequence sent only to the process that trains it, the forward passes over each process's
share) and all-gathered (`2proc_replicated`: the trainer before), launched alternately `--full-step-pairs` times:
`step_seconds_<layout>`, `step_rollout_seconds_<layout>`, `step_samples_per_s_<layout>` (responses per second of
the whole step), `step_params_seconds_<layout>` (the policy resharded onto the devices for the sampler, once
per step: once per policy version; the host before) and `params_vs_rollout_<layout>` (that over the rollout phase: what sampling
from sharded parameters could at most save), `bytes_received_per_step_<2proc layout>` (process 0's, the rollout's and the assembly's
exchanges), `step_sharded_vs_replicated_2proc` (samples/s ratio: above 1 is faster) and
`bytes_sharded_vs_replicated_2proc`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
from bench import harness  # noqa: E402
from tools.mpirun import kill_session, mpi_env, mpirun_command  # noqa: E402

DEFAULTS = dict(preset="small", prompts=32, group=8, new_tokens=16, repeats=5, full_steps=6, full_step_pairs=2)
QUICK = dict(preset="tiny", prompts=4, group=2, new_tokens=4, repeats=2, full_steps=3, full_step_pairs=1)


class CountingReward:
    """The task's reward, counting its calls."""

    def __init__(self, reward):
        self.reward, self.calls = reward, 0

    def __call__(self, prompt: str, response: str) -> float:
        self.calls += 1
        return self.reward(prompt, response)


def build(args, devices: int):
    """(sampler over the first `devices` CPU devices, host params, counting reward) of the benchmark's rollouts."""
    from jodc.models.tokenizer import byte_level_tokenizer
    from jodc.train.core.config import ModelConfig
    from jodc.train.core.init_source import decoder_host_params
    from jodc.train.core.model import build_decoder
    from jodc.train.rl.config import RolloutConfig
    from jodc.train.rl.rollout import sampling_params
    from jodc.train.rl.layout import RolloutLayout
    from jodc.train.rl.sampler import RolloutSampler
    from jodc.train.rl.tasks import make_task

    tokenizer = byte_level_tokenizer()
    model_config, source = build_decoder(ModelConfig(preset=args.preset), tokenizer, max_length=128,
                                         compute_dtype="float32", seed=0)
    params = decoder_host_params(model_config, source)  # the sampler's host weights
    task = make_task("arithmetic", max_digits=1, min_terms=2, max_terms=3)
    rollout = RolloutConfig(prompts_per_step=args.prompts, group_size=args.group, max_new_tokens=args.new_tokens)
    reward = CountingReward(task.reward)
    sampler = RolloutSampler(task=task, seed=0, pool=None, rollout=rollout, model_config=model_config,
                             tokenizer=tokenizer, reward_fn=reward, devices=devices,
                             layout=RolloutLayout.of_run(timeout_s=600.0),
                             sampling=sampling_params(tokenizer, model_config, max_new_tokens=args.new_tokens,
                                                      temperature=1.0, prompt_bucket=rollout.prompt_bucket))
    return sampler, params, reward


def replicated_rollout(sampler, step: int, params):
    """The rollout as every process sampled it before (the whole of it, on this process's first device, scored
    here): the replicated baseline."""
    import jax

    from jodc.train.rl.rewards import score
    from jodc.train.rl.rollout import sample_rollout
    from jodc.train.rl.tasks import step_problems

    prompts = [p.prompt for p in step_problems(sampler.task, sampler.seed, step, sampler.rollout.prompts_per_step)]
    rollout = sample_rollout(sampler.model_config, params, sampler.tokenizer, prompts,
                             group_size=sampler.rollout.group_size, sampling=sampler.sampling,
                             key=sampler.rollout_key(step), devices=jax.local_devices()[:1])
    score(sampler.reward_fn, rollout.prompts, rollout.responses, step=step + 1)
    return rollout


def shard_map_seconds(sampler, params, devices: int, repeats: int) -> tuple[float, float]:
    """(median wall of per-device dispatch, of one shard_map program) sampling step 1's rows over `devices`
    devices at the `generate` level: the same prompts, keys and prompt width (RuntimeError if their tokens
    differ)."""
    from functools import partial

    import jax
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from jodc.models import generate
    from jodc.models.generate import _generate_padded, left_pad_prompts
    from jodc.train.rl.rollout import encode_prompts, response_keys
    from jodc.train.rl.tasks import step_problems

    r, sampling = sampler.rollout, sampler.sampling
    prompts = [p.prompt for p in step_problems(sampler.task, sampler.seed, 1, r.prompts_per_step)]
    ids = [x for x in encode_prompts(sampler.tokenizer, prompts) for _ in range(r.group_size)]
    keys = response_keys(sampler.rollout_key(1), range(len(prompts)), r.group_size)
    tokens, lengths = left_pad_prompts(ids, sampling.prompt_bucket, sampling.pad_token_id)
    used = jax.devices()[:devices]
    rows = len(ids) // devices  # prompts x group divides by 2 and 4 here

    def dispatch():
        outs = [generate(sampler.model_config, ids[d * rows:(d + 1) * rows], key=keys[d * rows:(d + 1) * rows],
                         sampling=sampling, params=params, prompt_width=tokens.shape[1], device=device)
                for d, device in enumerate(used)]
        return jax.device_get(outs)

    spmd = jax.jit(jax.shard_map(partial(_generate_padded, sampler.model_config, sampling),
                                 mesh=Mesh(np.array(used), ("d",)), in_specs=(P(), P("d"), P("d"), P("d")),
                                 out_specs=P("d"), check_vma=False))

    def sharded():
        return jax.device_get(spmd(params, tokens, lengths, keys))

    walls, sampled = {}, {}
    for name, fn in (("dispatch", dispatch), ("shard_map", sharded)):
        out = fn()  # compiles
        sampled[name] = np.concatenate([o.tokens for o in out]) if isinstance(out, list) else np.asarray(out.tokens)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        walls[name] = statistics.median(times)
    if not np.array_equal(sampled["dispatch"], sampled["shard_map"]):
        raise RuntimeError(f"per-device dispatch and shard_map sampled different tokens on {devices} devices")
    return walls["dispatch"], walls["shard_map"]


def single_worker(args) -> dict:
    """Part 1: one process, 4 CPU devices."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    out = {}
    for devices in (1, 2, 4):
        sampler, params, reward = build(args, devices)
        sampler(0, params, 0)  # compiles
        walls, tokens = [], 0
        for step in range(1, args.repeats + 1):
            started = time.perf_counter()
            scored = sampler(step, params, step)
            walls.append(time.perf_counter() - started)
            tokens += int(scored.response_lengths.sum())
        out[f"rollout_seconds_{devices}dev"] = statistics.median(walls)
        out[f"tokens_per_s_{devices}dev"] = tokens / sum(walls)
        out[f"reward_calls_per_response_{devices}dev"] = reward.calls / ((args.repeats + 1) * len(scored))
        if devices > 1:
            dispatch, spmd = shard_map_seconds(sampler, params, devices, args.repeats)
            out[f"dispatch_seconds_{devices}dev"], out[f"shard_map_seconds_{devices}dev"] = dispatch, spmd
            out[f"dispatch_vs_shard_map_{devices}dev"] = dispatch / spmd
    return out


def mp_worker(args) -> dict | None:
    """Part 2, under `mpirun -np 2`: sharded vs replicated, alternating; process 0 returns the results."""
    from mpi4py import MPI

    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax

    jax.distributed.initialize(cluster_detection_method="mpi4py")
    comm = MPI.COMM_WORLD
    sampler, params, reward = build(args, jax.device_count())
    sampler(0, params, 0)  # compiles (the sharded share and, on the first device, the replicated batch)
    replicated_rollout(sampler, 0, params)
    walls = {"sharded": [], "replicated": []}
    calls, responses, tokens = {"sharded": 0, "replicated": 0}, 0, {"sharded": 0, "replicated": 0}
    for step in range(1, args.repeats + 1):
        for mode in ("sharded", "replicated"):
            comm.Barrier()
            before = reward.calls
            started = time.perf_counter()
            # sharded: this process's share and every response's metadata (a StepRollout); replicated: a Rollout
            rollout = sampler(step, params, step) if mode == "sharded" else replicated_rollout(sampler, step, params)
            wall = comm.allreduce(time.perf_counter() - started, op=MPI.MAX)  # the slower process's
            walls[mode].append(wall)
            calls[mode] += comm.allreduce(reward.calls - before, op=MPI.SUM)
            tokens[mode] += int(rollout.response_lengths.sum())
        responses += args.prompts * args.group
    if comm.Get_rank():
        return None
    return {"rollout_seconds_2proc_sharded": statistics.median(walls["sharded"]),
            "rollout_seconds_2proc_replicated": statistics.median(walls["replicated"]),
            "tokens_per_s_2proc_sharded": tokens["sharded"] / sum(walls["sharded"]),
            "tokens_per_s_2proc_replicated": tokens["replicated"] / sum(walls["replicated"]),
            "rollout_sharded_vs_replicated_2proc": statistics.median(walls["sharded"])
            / statistics.median(walls["replicated"]),
            "reward_calls_per_response": calls["sharded"] / responses,
            "reward_calls_per_response_replicated": calls["replicated"] / responses}


def trainer_run(cmd: list[str], env: dict, timeout: float) -> list[dict]:
    """Runs the trainer `cmd` (its --out_dir is added); the step records of its metrics.jsonl."""
    import tempfile

    with tempfile.TemporaryDirectory() as out_dir:
        cmd = [*cmd, "--out_dir", out_dir]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=ROOT, start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_session(proc.pid)
            raise RuntimeError(f"{' '.join(cmd)} did not finish within {timeout} s") from None
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{log[-3000:]}")
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]


def full_steps(args) -> dict:
    """Whole RL steps with the trainer (configs/rl_demo.yaml without warm start, evaluation, checkpoints or export;
    the benchmark's model and rollout sizes): one process driving 2 CPU devices, and `mpirun -np 2` with 1 device
    each, the minibatches assembled without replication (`rollout.assembly: sharded`, `2proc`) and all-gathered
    (`replicated`, `2proc_replicated`), the two launched alternately `--full-step-pairs` times. Median step and
    rollout seconds over the steps after the first two (which compile) of every launch of a layout, samples
    (responses) per second of the whole step, and across processes the bytes process 0 received per step (the
    rollout's exchange and the assembly's; the step record's `bytes_received`)."""
    common = ["rl", "--config", os.path.join(ROOT, "configs", "rl_demo.yaml"), "--warmstart.sft_steps", "0",
              "--run.eval_every", "0", "--checkpoint.save_every", "0", "--no-export_hf", "--no-progress",
              "--run.steps", str(args.full_steps), "--model.preset", args.preset,
              "--rollout.prompts_per_step", str(args.prompts), "--rollout.group_size", str(args.group),
              "--rollout.max_new_tokens", str(args.new_tokens), "--engine.devices", "2",
              "--run.updates_per_step", "4"]  # the demo's setting when the results were recorded (now 2)
    mpi = mpirun_command(2, sys.executable, "-m", "mpi4py", "-m", "jodc.train")
    runs = [("1proc_2dev", [sys.executable, "-m", "jodc.train", *common], dict(os.environ))]
    for _ in range(args.full_step_pairs):
        runs += [("2proc", [*mpi, *common, "--rollout.assembly", "sharded"], mpi_env()),
                 ("2proc_replicated", [*mpi, *common, "--rollout.assembly", "replicated"], mpi_env())]
    steady: dict[str, list[dict]] = {}
    for name, cmd, env in runs:
        records = trainer_run(cmd, env, args.timeout)
        steady.setdefault(name, []).extend(records[2:] or records[-1:])
    out = {}
    for name, records in steady.items():
        step = statistics.median(r["step_seconds"] for r in records)
        out[f"step_seconds_{name}"] = step
        out[f"step_rollout_seconds_{name}"] = statistics.median(r["rollout_seconds"] for r in records)
        # the sampler's parameters: gathered to the host once per policy version (each step), against the rollout
        out[f"step_params_seconds_{name}"] = statistics.median(r["params_seconds"] for r in records)
        out[f"params_vs_rollout_{name}"] = out[f"step_params_seconds_{name}"] / out[f"step_rollout_seconds_{name}"]
        out[f"step_samples_per_s_{name}"] = args.prompts * args.group / step
        if name != "1proc_2dev":
            out[f"bytes_received_per_step_{name}"] = statistics.median(r["bytes_received"] for r in records)
    out["step_sharded_vs_replicated_2proc"] = (out["step_samples_per_s_2proc"]
                                               / out["step_samples_per_s_2proc_replicated"])
    out["bytes_sharded_vs_replicated_2proc"] = (out["bytes_received_per_step_2proc"]
                                                / out["bytes_received_per_step_2proc_replicated"])
    return out


def run_json(cmd: list[str], env: dict, timeout: float) -> dict:
    """Runs a worker; its last stdout line that parses as JSON. On timeout the whole session is killed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        out, _ = proc.communicate()
        raise RuntimeError(f"{' '.join(cmd)} did not finish within {timeout} s:\n{out[-3000:]}") from None
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode} and no result:\n{out[-3000:]}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"tiny settings: {QUICK}")
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per worker (killed on expiry)")
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--worker", choices=("single", "mp"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    harness.fill_unset(args, QUICK if args.quick else DEFAULTS)
    if args.prompts % 4:
        parser.error("--prompts must divide by 4 (shares over 1, 2 and 4 devices, and the shard_map comparison)")
    return args


def measure(args) -> dict:
    """The settings, the one-process and two-process workers' figures, and the whole steps' (--full-steps)."""
    settings = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in DEFAULTS]
    result = {"settings": {k: getattr(args, k) for k in DEFAULTS}}
    result.update(run_json(harness.module_command("rl_sampling", "--worker", "single", *settings),
                           harness.child_env(JAX_PLATFORMS="cpu"), args.timeout))
    mp = mpirun_command(2, sys.executable, "-m", "mpi4py", "-m", "bench.rl_sampling", "--worker", "mp", *settings)
    result.update(run_json(mp, harness.child_env(mpi_env()), args.timeout))
    if args.full_steps:
        result.update(full_steps(args))
    return result


def print_table(result: dict, full_steps: bool) -> None:
    print(f"{'layout':<28}{'rollout s':>12}{'tokens/s':>12}")
    for name, seconds, rate in [(f"1 process, {d} device(s)", result[f"rollout_seconds_{d}dev"],
                                 result[f"tokens_per_s_{d}dev"]) for d in (1, 2, 4)] + [
            (f"2 processes, {mode}", result[f"rollout_seconds_2proc_{mode}"], result[f"tokens_per_s_2proc_{mode}"])
            for mode in ("sharded", "replicated")]:
        print(f"{name:<28}{seconds:>12.4f}{rate:>12.1f}")
    for d in (2, 4):
        print(f"{d} devices, generate only: per-device dispatch {result[f'dispatch_seconds_{d}dev']:.4f} s, "
              f"shard_map {result[f'shard_map_seconds_{d}dev']:.4f} s")
    print(f"sharded / replicated (2 processes): {result['rollout_sharded_vs_replicated_2proc']:.3f}; reward calls "
          f"per response {result['reward_calls_per_response']:.2f} (replicated "
          f"{result['reward_calls_per_response_replicated']:.2f})")
    if full_steps:
        print_full_steps(result)


def print_full_steps(result: dict) -> None:
    for name, label in (("1proc_2dev", "1 process x 2 devices"), ("2proc", "2 processes x 1 device, sharded"),
                        ("2proc_replicated", "2 processes x 1 device, replicated")):
        received = (f", process 0 received {result[f'bytes_received_per_step_{name}'] / 1e3:.1f} kB/step"
                    if name != "1proc_2dev" else "")
        print(f"whole RL step, {label}: {result[f'step_seconds_{name}']:.3f} s (rollout "
              f"{result[f'step_rollout_seconds_{name}']:.3f} s, parameters gathered "
              f"{result[f'step_params_seconds_{name}']:.4f} s = {result[f'params_vs_rollout_{name}']:.3f} of "
              f"the rollout), {result[f'step_samples_per_s_{name}']:.1f} samples/s{received}")
    print(f"whole step, sharded / replicated assembly (2 processes): samples/s x"
          f"{result['step_sharded_vs_replicated_2proc']:.3f}, bytes received x"
          f"{result['bytes_sharded_vs_replicated_2proc']:.3f}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        result = single_worker(args) if args.worker == "single" else mp_worker(args)
        if result is not None:
            print(json.dumps(result), flush=True)
        return
    result = measure(args)
    harness.report(result, harness.output(args, "rl_sampling.json"), lambda: print_table(result, args.full_steps),
                   sort_keys=True)

if __name__ == "__main__":
    main()
