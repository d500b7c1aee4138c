"""What a sampler running beside the RL trainer costs the trainer on this host.

`async_speedup` (bench/rl.py) stays near 1 on 2 CPU cores although the asynchronous sampler never makes the
trainer wait (docs/rl.md). This benchmark measures the cause directly: the synchronous trainer alone, and beside a
separate process that loops the RL sampler (`RolloutSampler`: the step's prompts, `generate`, rewards) at `nice 19`
and at `nice 0`. If the trainer left spare CPU that a sampler could use for free, the low-priority background
process would not slow it.

Each trainer run is `python -m jodc.train rl --config configs/rl_async.yaml` with a synchronous fp32 sampler
(`rollout.max_staleness 0`, `rollout.dtype float32`), a 10-step warm start, no evaluation, checkpoints or export,
and `--steps` steps. The background process (`--background`) builds the same decoder (random weights: the cost does
not depend on them) and samples the config's rollouts on one simulated CPU device until it is stopped; it is
started from this process, so it shares its scheduling group (the kernel's autogroup), where `nice` applies. The
modes alternate (alone, nice 19, nice 0) `--repeats` times.

Prints a table and one JSON line (also written to bench/results/rl_contention.json unless --no-save): per mode the
mean step and update-phase (`train_seconds`) seconds over the steps after `--skip`, their ratio to `alone`
(`step_slowdown_nice19`, `step_slowdown_nice0`, ...), and the background process's CPU seconds per wall second
(`background_cpu_nice19`, `background_cpu_nice0`).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from bench import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "rl_async.yaml")
#: The trainer's settings for every run: a synchronous fp32 sampler, a short warm start, nothing but the steps
SYNC = ["--rollout.max_staleness", "0", "--rollout.dtype", "float32", "--warmstart.sft_steps", "10",
        "--run.eval_every", "0", "--checkpoint.save_every", "0", "--no-export_hf", "--no-progress"]
MODES = {"alone": None, "nice19": 19, "nice0": 0}  # mode: the background sampler's nice value (None: none)
PHASES = ("step_seconds", "train_seconds", "rollout_seconds")


def background(config_path: str, overrides: list[str]) -> None:
    """The background sampler: prints 'ready' once compiled, samples until SIGTERM, then prints one JSON line with
    its rollouts, wall and CPU seconds."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    from jodc.models.tokenizer import byte_level_tokenizer
    from jodc.train.core.init_source import decoder_host_params
    from jodc.train.core.model import build_decoder
    from jodc.train.rl.config import load_rl_config
    from jodc.train.rl.rollout import sampling_params
    from jodc.train.rl.sampler import RolloutSampler
    from jodc.train.rl.tasks import make_task

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    config = load_rl_config(config_path, overrides)
    r, tokenizer = config.rollout, byte_level_tokenizer()
    model_config, source = build_decoder(config.model, tokenizer, max_length=config.engine.token_cap,
                                         compute_dtype="float32", seed=0)
    params = decoder_host_params(model_config, source)  # the sampler's host weights
    task = make_task(config.task.name, **config.task.task_options())
    sampler = RolloutSampler(task=task, seed=0, pool=None, rollout=r, model_config=model_config, tokenizer=tokenizer,
                             sampling=sampling_params(tokenizer, model_config, max_new_tokens=r.max_new_tokens,
                                                      temperature=r.temperature, prompt_bucket=r.prompt_bucket),
                             reward_fn=task.reward)
    sampler(0, params, 0)  # compiles
    print("ready", flush=True)
    rollouts, wall, cpu = 0, time.perf_counter(), time.process_time()
    while not stop:
        sampler(rollouts, params, 0)
        rollouts += 1
    print(json.dumps({"rollouts": rollouts, "seconds": time.perf_counter() - wall,
                      "cpu_seconds": time.process_time() - cpu}), flush=True)


def start_background(nice: int, overrides: list[str]) -> subprocess.Popen:
    """The background sampler at `nice`, once it has compiled."""
    proc = subprocess.Popen(["nice", "-n", str(nice), *harness.module_command("rl_contention", "--background",
                                                                               *overrides)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT, env=harness.child_env())
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"the background sampler did not start (exit status {proc.wait()})")
    return proc


def stop_background(proc: subprocess.Popen) -> dict:
    """Stops the background sampler; its rollouts, wall and CPU seconds."""
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    return json.loads(out.strip().splitlines()[-1])


def phase_means(records: list[dict], skip: int) -> dict[str, float]:
    """Mean seconds per step of each phase over the records after the first `skip` (compilation, warm-up)."""
    steady = [r for r in records if r["step"] > skip]
    if not steady:
        raise ValueError(f"no steps after the first {skip}")
    return {key: statistics.fmean(r[key] for r in steady) for key in PHASES}


def trainer_run(out_dir: str, steps: int, skip: int, overrides: list[str]) -> dict[str, float]:
    """One synchronous trainer run; its phase means."""
    subprocess.run([sys.executable, "-m", "jodc.train", "rl", "--config", CONFIG, *SYNC, "--run.steps", str(steps),
                    "--run.out_dir", out_dir, *overrides], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return phase_means([json.loads(line) for line in f if line.strip()], skip)


def summarize(runs: dict[str, list[dict]]) -> dict[str, float]:
    """Per mode the mean of each phase over its runs, each phase's ratio to `alone` and the background CPU use."""
    out: dict[str, float] = {}
    for mode, results in runs.items():
        for key in PHASES:
            out[f"{mode}_{key}"] = round(statistics.fmean(r[key] for r in results), 4)
        if mode != "alone":
            for key in PHASES:
                out[f"{key.removesuffix('_seconds')}_slowdown_{mode}"] = round(
                    out[f"{mode}_{key}"] / out[f"alone_{key}"], 4)
            out[f"background_cpu_{mode}"] = round(
                statistics.fmean(r["background"]["cpu_seconds"] / r["background"]["seconds"] for r in results), 4)
    return out


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="trainer steps per run")
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the means (compilation)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode, alternated")
    parser.add_argument("--no-save", action="store_true")
    args, overrides = parser.parse_known_args(argv)  # overrides: jodc-train rl's, for trainer and sampler alike
    if args.skip >= args.steps:
        parser.error(f"--skip {args.skip} leaves no step of --steps {args.steps}")
    return args, overrides


def alternated_runs(args, overrides: list[str]) -> dict[str, list[dict]]:
    """--repeats trainer runs per mode, the modes alternated, each with its background sampler (if any)."""
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="jodc_rl_contention_") as work:
        for repeat in range(args.repeats):
            for mode, nice in MODES.items():
                proc = start_background(nice, overrides) if nice is not None else None
                try:
                    result = trainer_run(os.path.join(work, f"{mode}_{repeat}"), args.steps, args.skip, overrides)
                finally:
                    used = stop_background(proc) if proc is not None else None
                runs[mode].append({**result, **({"background": used} if used else {})})
                print(f"  {mode} {repeat + 1}/{args.repeats}: step {result['step_seconds']:.3f} s, update phase "
                      f"{result['train_seconds']:.3f} s", flush=True)
    return runs


def print_table(summary: dict, args) -> None:
    print(f"\nSynchronous trainer ({CONFIG}, fp32 sampler, {args.steps} steps, means over steps {args.skip + 1}..; "
          f"{args.repeats} runs per mode, alternated)")
    print(f"{'mode':<8} {'step s':>8} {'update s':>9} {'rollout s':>10} {'step x':>7} {'background CPU':>15}")
    for mode in MODES:
        ratio = summary.get(f"step_slowdown_{mode}", 1.0)
        cpu = summary.get(f"background_cpu_{mode}")
        print(f"{mode:<8} {summary[f'{mode}_step_seconds']:8.3f} {summary[f'{mode}_train_seconds']:9.3f} "
              f"{summary[f'{mode}_rollout_seconds']:10.3f} {ratio:7.2f} {'-' if cpu is None else f'{cpu:.2f}':>15}")


def main(argv=None) -> int:
    args, overrides = parse_args(argv)
    started = time.perf_counter()
    runs = alternated_runs(args, overrides)
    summary = summarize(runs)
    result = {"bench": "rl_contention", "steps": args.steps, "skip": args.skip, "repeats": args.repeats,
              "overrides": overrides, **summary, "runs": runs, "total_seconds": round(time.perf_counter() - started),
              "jax": importlib.metadata.version("jax"), "platform": platform.platform(), "cpu_count": os.cpu_count()}
    # the line leaves the runs out; the file keeps them
    harness.report({k: v for k, v in result.items() if k != "runs"}, harness.output(args, "rl_contention.json"),
                   lambda: print_table(summary, args), saved=result)
    return 0

if __name__ == "__main__":
    if sys.argv[1:2] == ["--background"]:
        background(CONFIG, sys.argv[2:])
    else:
        sys.exit(main())
