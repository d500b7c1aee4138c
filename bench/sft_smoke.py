"""The SFT smoke run: `jodc-train sft` with configs/sft_gpu_smoke.yaml (ODC engine, one device, bf16 compute, 30 steps),
then a check of its metrics file that the loss fell.

    python -m bench.sft_smoke --platform gpu --out-dir DIR    # train into DIR (fresh), then check
    python -m bench.sft_smoke --check DIR/metrics.jsonl       # only check a finished run

The run is `python -m jodc.train sft --config configs/sft_gpu_smoke.yaml --run.out_dir DIR --engine.platform P`, plus,
on the CPU (the test of this path, and `make bench` without a GPU), a smaller model and fewer steps (`CPU_OVERRIDES`);
arguments after `--` go to the trainer as further overrides. The check reads the trainer's `metrics.jsonl` (one record
per step, `jodc.train.core.metrics`): the steps must run 1..N without a gap, every loss must be finite, and the mean
loss of the last `--window` steps must be at least `--min-drop` nats below that of the first `--window` steps.
Prints a table and one JSON line (`sft_loss_fell`, the losses, tokens/s after the first step, which compiles),
writes it to bench/results/sft_smoke[_cpu].json unless --no-save, and exits 1 unless the loss fell.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time

from bench import harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "sft_gpu_smoke.yaml")
CPU_OVERRIDES = ["--model.preset", "tiny", "--run.steps", "8"]  # 2 CPU cores: the path, not the scale


def check_losses(records: list[dict], *, window: int, min_drop: float) -> dict:
    """What the metrics say about the run (see the module docstring); `fell` is the verdict, `problems` why not."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    steps = [int(r["step"]) for r in records]
    losses = [float(r["loss"]) for r in records]
    problems = []
    if len(records) < 2 * window:
        problems.append(f"{len(records)} logged steps, need at least {2 * window} (two windows of {window})")
    if steps != list(range(1, len(steps) + 1)):
        problems.append(f"the steps are not 1..{len(steps)} without a gap: {steps}")
    bad = [s for s, loss in zip(steps, losses) if not math.isfinite(loss)]
    if bad:
        problems.append(f"non-finite loss at steps {bad}")
    out = {"steps": len(records), "window": window, "min_drop": min_drop}
    if records:
        first, last = losses[:window], losses[-window:]
        drop = statistics.fmean(first) - statistics.fmean(last)
        out.update(loss_first=losses[0], loss_last=losses[-1], loss_first_window=statistics.fmean(first),
                   loss_last_window=statistics.fmean(last), loss_drop=drop)
        if not drop >= min_drop:
            problems.append(f"the loss fell by {drop:.4f} nats (mean of the first {window} steps minus the last "
                            f"{window}), less than {min_drop}")
        after_first = records[1:] or records
        out.update(tokens_per_s=statistics.median(r["tokens_per_s"] for r in after_first),
                   step_seconds=statistics.median(r["step_seconds"] for r in after_first),
                   first_step_seconds=float(records[0]["step_seconds"]))
    out["fell"] = not problems
    out["problems"] = problems
    return out


def detect_platform() -> str:
    """'gpu' when JAX sees a GPU, else 'cpu', asked in a child process so that this one never holds GPU memory that
    the trainer needs."""
    probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], capture_output=True,
                           text=True, timeout=300)
    return "gpu" if probe.returncode == 0 and probe.stdout.strip().endswith(("gpu", "cuda")) else "cpu"


def train(platform: str, out_dir: str, extra: list[str]) -> float:
    """Runs the trainer into `out_dir` (which must be new or empty); returns its wall seconds."""
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise SystemExit(f"{out_dir} is not empty: the smoke run needs a fresh directory (its config does not resume)")
    command = [sys.executable, "-m", "jodc.train", "sft", "--config", CONFIG, "--run.out_dir", out_dir,
               "--engine.platform", platform, *(CPU_OVERRIDES if platform == "cpu" else []), *extra]
    print("$ " + " ".join(command), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"the SFT run failed (exit {proc.returncode})")
    return time.perf_counter() - t0


def print_table(r: dict) -> None:
    rows = [("steps", f"{r['steps']}")]
    if "loss_first" in r:
        rows += [("loss, first -> last step", f"{r['loss_first']:.4f} -> {r['loss_last']:.4f}"),
                 (f"loss, mean of first / last {r['window']} steps",
                  f"{r['loss_first_window']:.4f} / {r['loss_last_window']:.4f}"),
                 (f"drop (needed >= {r['min_drop']})", f"{r['loss_drop']:.4f}"),
                 ("tokens/s (median after step 1)", f"{r['tokens_per_s']:,.0f}"),
                 ("step seconds: first (compiles) / median", f"{r['first_step_seconds']:.2f} / {r['step_seconds']:.3f}")]
    if r.get("run_seconds") is not None:
        rows.append(("trainer wall seconds", f"{r['run_seconds']:.1f}"))
    rows.append(("loss fell", "yes" if r["sft_loss_fell"] else "NO: " + "; ".join(r["problems"])))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--platform", choices=("auto", "gpu", "cpu"), default="auto")
    p.add_argument("--out-dir", default=None, help="the run's directory (default: runs/sft_smoke_<platform>_<time>)")
    p.add_argument("--check", metavar="METRICS", help="only check this metrics.jsonl (no training)")
    p.add_argument("--window", type=int, default=3, help="steps averaged at each end")
    p.add_argument("--min-drop", type=float, default=0.25, help="nats the loss must fall by")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/sft_smoke[_cpu].json)")
    args = p.parse_args(argv)
    from jodc.train.core.metrics import METRICS_FILE, read_metrics

    run_seconds, platform = None, None
    if args.check:
        metrics = args.check
    else:
        platform = detect_platform() if args.platform == "auto" else args.platform
        out_dir = args.out_dir or os.path.join(REPO, "runs", f"sft_smoke_{platform}_{time.strftime('%Y%m%d_%H%M%S')}")
        run_seconds = train(platform, os.path.abspath(out_dir), extra)
        metrics = os.path.join(out_dir, METRICS_FILE)
    if not os.path.exists(metrics):
        raise SystemExit(f"{metrics}: no such metrics file")
    verdict = check_losses(read_metrics(metrics), window=args.window, min_drop=args.min_drop)
    r = {"bench": "sft_smoke", "sft_loss_fell": verdict.pop("fell"), "platform": platform,
         "metrics": os.path.abspath(metrics), "run_seconds": run_seconds, **verdict}
    harness.report(r, harness.output(args, "sft_smoke_cpu.json" if platform == "cpu" else "sft_smoke.json"),
                   lambda: print_table(r))
    if not r["sft_loss_fell"]:
        raise SystemExit(1)
    return r


if __name__ == "__main__":
    main()
