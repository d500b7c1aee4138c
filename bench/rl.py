"""DPPO against PPO clipping and GRPO under stale rollouts, on the shipped arithmetic task, on CPU.

One warm start (SFT on the task's solutions, shared by every run), then for each loss and seed one RL run with
the same prompts, sampling seeds, model, optimizer and budget: the demo's setting (`configs/rl_demo.yaml`): 100
steps of 128 prompts x 8 responses, 2 minibatch updates per rollout (`--updates-per-step`: every update after the
first is off-policy) at 3e-4 after a 50-update warm-up, a k3 KL penalty of 0.5 to the warm start (`--kl-coef`;
GRPO keeps its published 0.04). Training prompts are fresh problems every step (`--pool-size 0`), never the fixed
evaluation set's, so the held-out numbers measure what RL generalises, and the warm start (300 SFT steps) leaves
room to improve: greedy accuracy about 0.5. At this setting every loss raises held-out greedy accuracy and sampled
reward (docs/rl.md, "Benchmark"); the earlier defaults (4 updates of 64 responses at 1e-4 without a KL penalty,
from a 300- or 600-step warm start) lost greedy accuracy for every loss: many small noisy updates spread the
correct answer's probability, and greedy decoding is a threshold on it (docs/rl.md, "Why RL lowered held-out greedy
accuracy"); before those, a pool of 256 problems at 8 updates x 3e-4 overfitted the pool. Per loss and regime the table gives means over seeds with their standard errors (`--seeds`, default 5), and
the headline comparisons (each loss's held-out change from the warm start, each loss against DPPO seed by seed) say
when a difference is inside the noise (less than 2 standard errors). Variants:

* `dppo` (binary TV, delta 0.15), `dppo_kl` (binary KL, delta 0.05), `dppo_topk` (Top-K TV, K 20): the trust
  region on the divergence between the behaviour policy and the current one (Qi et al., arXiv 2602.04879);
* `ppo`: PPO's clipped ratio (0.2, dual clip 3), token-mean;
* `grpo`: GRPO as published: the same clipped ratio, sequence-mean aggregation and a k3 KL penalty (beta 0.04)
  to the initial policy.

All take the rollout's behaviour log-probs as their anchor (synchronous rollouts: the "old" policy of PPO/GRPO is
the behaviour policy). Reported per variant (means over seeds, +- standard errors): final greedy accuracy on a fixed evaluation set,
mean sampled reward over the last steps, the number of steps whose policy change blew up (the largest per-update
KL(behaviour || policy) of the step above `--unstable-kl`), the fraction of tokens the trust region masked or
clipped, and the wall time split between rollout and training (steps 2.., after compilation).

Regimes (`--regimes`), each run for every loss: `sync` (synchronous fp32 rollouts, as above), `stale2` /
`stale4` (asynchronous rollouts sampled from weights 2 / 4 versions old, `rollout.max_staleness`, by a child
process: `--sampler`), `mismatch` (a bf16 sampler against the fp32 trainer: `rollout.dtype: bfloat16`) and
`both` (stale2 and bf16). Losses that read old / proximal log-probs (PPO, GRPO, decoupled PPO, TIS) get them
recomputed by the trainer off-policy; DPPO's trust region is around the behaviour policy itself.

Prints a table and one JSON line (also written to bench/results/rl.json unless --no-save) with at least
`dppo_final_accuracy`, `ppo_final_accuracy`, `dppo_unstable_steps` and `ppo_unstable_steps` (the sync regime),
`initial_sampled_reward` (the shared warm start's held-out sampled reward), `<loss>_<regime>_final_sampled_reward`
for every loss and regime run, and `async_speedup`: the step time of the sync regime over the stale2 regime for
the same rollouts and updates, for the default loss (DPPO; if it did not run, the mean over the losses), from the
steps 2.. during which the process compiled nothing (`warm_step_seconds`: which regime runs first compiles the
padded shapes it meets, which made the summed times depend on the order), as the mean over seeds of the ratio of
the two runs of a seed (a loss's regimes run back to back, their order reversed every other seed, so that the
machine's drift cancels); per loss in `async_speedup_by_loss`,
their mean in `async_speedup_mean_over_losses`, and the summed-time ratio in `async_speedup_all_steps`. `--sampler
process` computes the asynchronous regimes' rollouts in a child process at `--sampler-nice` (the default:
`rollout.sampler: process`, as configs/rl_async.yaml). Per run also the
CPU use (process CPU seconds per wall second) of the rollout calls, the engine updates and whole steps
(`rollout_cpu_utilisation`, `train_cpu_utilisation`, `step_cpu_utilisation`; the split is meaningful for the
sync regime, where the phases do not overlap). One engine per objective is compiled once and reused by every run
(`EnginePool`), so a run costs its steps, not recompilations.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

DEVICES = 2
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")

from bench import harness  # noqa: E402  (imports no JAX)
from jodc.train.core.callbacks import Callback  # noqa: E402  (imports no JAX: the flags above still apply)

#: CPU seconds per wall second of the rollout (sampler) calls, the engine updates and whole steps (steps 2..);
#: the rollout / train split is meaningful for the synchronous regime only (see `PhaseClock`)
PHASE_KEYS = ("rollout_cpu_utilisation", "train_cpu_utilisation", "step_cpu_utilisation")
KL_THRESHOLDS = (0.05, 0.1, 0.2, 0.5)  # also counted: steps whose largest per-update KL exceeds each

VARIANTS = {
    "dppo": ["--loss.name", "dppo"],
    "dppo_kl": ["--loss.name", "dppo_kl"],
    "dppo_topk": ["--loss.name", "dppo_topk"],
    "ppo": ["--loss.name", "ppo"],
    "grpo": ["--loss.name", "grpo", "--aggregation", "seq-mean-token-mean", "--kl_coef", "0.04"],
    "decoupled_ppo": ["--loss.name", "decoupled_ppo"],
    "tis": ["--loss.name", "tis"],
    # critic PPO: GAE over token rewards with the shared-trunk value head (synchronous rollouts only: the stale
    # regimes refuse it, and the table says so)
    "critic_ppo": ["--loss.name", "ppo", "--loss.advantage", "gae"],
}
DEFAULT_VARIANTS = ("dppo", "dppo_topk", "ppo", "grpo", "decoupled_ppo", "tis", "critic_ppo")
REGIMES = {
    "sync": [],
    "stale2": ["--max_staleness", "2"],
    "stale4": ["--max_staleness", "4"],
    "mismatch": ["--rollout.dtype", "bfloat16"],
    "both": ["--max_staleness", "2", "--rollout.dtype", "bfloat16"],
}


class EnginePool:
    """One engine per objective, reused by every run of the benchmark (seeds and regimes), reset to the shared warm
    start before each run.

    Why: an engine's compiled step cannot be shared between engines (the ODC step's custom calls name the engine's
    own heap, so even JAX's persistent cache misses), and compiling it costs 2-3 compilations per run (one per
    padded microbatch count), 10-40 s each on the loaded 2-core machine: more than a 12-step run's training. A
    reused engine computes exactly what a fresh one does: `load_state_dict` puts back the warm start's parameters,
    the fresh optimizer state and the step count (the learning-rate schedule's position), and the objective (the
    compiled head loss) is part of the key. Step 1 of a run (excluded from every timing) no longer compiles.
    """

    def __init__(self):
        self.engines: dict[tuple, tuple[object, dict]] = {}
        self.key: tuple = ()

    def __call__(self, settings, model, groups):
        """The run's engine factory (train/core/callbacks.py): a pooled engine, reset to the warm start."""
        import copy

        from jodc.train.core.model import make_engine

        key = (self.key, repr(settings.optimizer), repr(settings.engine))
        if key not in self.engines:
            engine = make_engine(settings, model, groups)
            self.engines[key] = (engine, copy.deepcopy(engine.state_dict()))
        engine, initial = self.engines[key]
        engine.load_state_dict(initial)
        return engine

    def release(self, engine) -> None:
        """A run ends: its engine stays open for the next run (closed by `__exit__`)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for engine, _ in self.engines.values():
            engine.close()
        self.engines.clear()


class PhaseClock(Callback):
    """Process CPU time and wall time of the rollout and training phases (steps 2..), from which the CPU
    utilisation (CPU seconds per wall second: 2.0 = both cores busy) of each phase; a run's callback
    (train/core/callbacks.py). Process-wide CPU time: in the synchronous regime the phases do not overlap, so each
    phase's CPU time is its own; asynchronous runs report the whole step's utilisation only."""

    def __init__(self):
        self.totals: dict[str, list[float]] = {}
        self.started: dict[str, tuple[float, float]] = {}
        self.step = 0
        self.compiled_steps: set[int] = set()  # 0-based steps during which this process compiled something
        self.compiles_before = 0

    def _start(self, phase: str) -> None:
        self.started[phase] = (time.perf_counter(), time.process_time())

    def _stop(self, phase: str) -> None:
        wall, cpu = self.started.pop(phase)
        if self.step >= 1:  # 0-based: step 1 compiles
            t = self.totals.setdefault(phase, [0.0, 0.0])
            t[0] += time.perf_counter() - wall
            t[1] += time.process_time() - cpu

    def on_step_start(self, trainer, step):
        self.step, self.compiles_before = step, COMPILES[0]
        self._start("step")

    def on_step_end(self, trainer, step, record):
        self._stop("step")
        if COMPILES[0] != self.compiles_before:
            self.compiled_steps.add(step)

    def on_rollout_start(self, trainer, step):
        self._start("rollout")

    def on_rollout_end(self, trainer, step, rollout):
        self._stop("rollout")

    def on_update_start(self, trainer):
        self._start("train")

    def on_update_end(self, trainer, result):
        self._stop("train")

    def utilisation(self) -> dict[str, float]:
        return {f"{phase}_cpu_utilisation": cpu / wall if wall > 0 else 0.0
                for phase, (wall, cpu) in self.totals.items()}


ENGINES = EnginePool()
COMPILES = [0]  # XLA compilations in this process so far (any thread: the sampler thread's too)
COUNTING: list = []  # the registered listener (registered once)


def count_compiles() -> None:
    """Counts XLA backend compilations (jax.monitoring), so that steps which compiled are left out of the warm
    step time: the first run of a regime order compiles the padded microbatch counts it meets, in steps 2.. too,
    which made `async_speedup` depend on which regime ran first (docs/rl.md: 1.84 sync first, 0.51 stale2 first)."""
    import jax

    def listen(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            COMPILES[0] += 1

    if not COUNTING:
        jax.monitoring.register_event_duration_secs_listener(listen)
        COUNTING.append(listen)


def common_overrides(args, out_dir: str) -> list[str]:
    """The settings every run shares (model, task, rollout, optimizer, budget)."""
    return ["--preset", "small", "--max_digits", "1", "--max_terms", "3", "--pool_size", str(args.pool_size),
            "--devices", str(DEVICES), "--token_cap", "128", "--prompt_bucket", "16", "--max_new_tokens", "4",
            "--prompts_per_step", str(args.prompts), "--group_size", "8", "--updates_per_step",
            str(args.updates_per_step),
            "--learning_rate", str(args.learning_rate), "--warmup_steps", str(args.warmup_steps),
            "--kl_coef", str(args.kl_coef), "--steps", str(args.steps),
            "--eval_every", str(args.steps), "--eval_problems", "256", "--unstable_kl", str(args.unstable_kl),
            "--sft_examples", "8192", "--sft_steps", str(args.sft_steps), "--no-progress", "--no-export_hf",
            "--save_every", "0", "--out_dir", out_dir]


def run_variant(name: str, seed: int, args, work: str, warm_hf: str, regime: str = "sync") -> dict:
    """One RL run from the shared warm start; returns its summary numbers."""
    from jodc.train.core.metrics import read_metrics
    from jodc.train.rl.loop import run_rl
    from jodc.train.rl.config import load_rl_config
    from jodc.train.rl.loss import build_objective

    out_dir = os.path.join(work, f"{name}_{regime}_seed{seed}")
    # every run starts from the same warm-started model (its HF export), whatever its seed
    sampler = (["--rollout.sampler", args.sampler, "--rollout.sampler_nice", str(args.sampler_nice)]
               if "--max_staleness" in REGIMES[regime] else [])
    config = load_rl_config(None, common_overrides(args, out_dir) + VARIANTS[name] + REGIMES[regime] + sampler +
                            ["--seed", str(seed), "--hf_path", warm_hf, "--sft_steps", "0"])
    # the compiled objective: the loss, and whether it reads recomputed old / proximal log-probs
    ENGINES.key = (name, build_objective(config.loss, config.rollout).recompute)
    started = time.perf_counter()
    clock = PhaseClock()
    summary = run_rl(config, log=lambda _: None, engine_factory=ENGINES, callbacks=[clock])
    wall = time.perf_counter() - started
    utilisation = clock.utilisation()
    records = read_metrics(summary["metrics"])
    tail = records[-args.tail:]
    warm = [r["step_seconds"] for r in records[1:] if r["step"] - 1 not in clock.compiled_steps]
    return {
        "final_accuracy": summary["final_eval_accuracy"],
        "initial_accuracy": records[0]["eval_accuracy"],
        "final_eval_sampled_reward": summary["final_eval_sampled_reward"],
        "initial_eval_sampled_reward": records[0]["eval_sampled_reward"],
        "final_reward": statistics.fmean(r["reward_mean"] for r in tail),
        "initial_reward": statistics.fmean(r["reward_mean"] for r in records[:args.tail]),
        "unstable_steps": sum(1 for r in records if r["unstable"]),
        **{f"steps_kl_over_{t}": sum(1 for r in records if r["policy_kl_max"] > t) for t in KL_THRESHOLDS},
        "policy_kl_max": max(r["policy_kl_max"] for r in records),
        "masked_fraction": statistics.fmean(r.get("trust_region_fraction", 0.0) for r in records),
        # step 1 includes compilation (the first run also compiles the sampler): timed from step 2 on
        "rollout_seconds": sum(r["rollout_seconds"] for r in records[1:]),
        "train_seconds": sum(r["train_seconds"] for r in records[1:]),
        "step_seconds": sum(r["step_seconds"] for r in records[1:]),
        # steps 2.. that compiled nothing in this process: the steady state asynchrony is meant to speed up
        "warm_step_seconds": statistics.fmean(warm) if warm else float("nan"),
        "compiled_steps": len(records) - 1 - len(warm),
        "trainer_idle_fraction": statistics.fmean(r["trainer_idle_fraction"] for r in records[1:]),
        "sampler_idle_fraction": statistics.fmean(r["sampler_idle_fraction"] for r in records[1:]),
        # measured only where the sampler differs from the trainer (async or bf16); sync fp32: 0 by construction
        "logprob_mismatch": statistics.fmean(r.get("logprob_mismatch", 0.0) for r in records),
        "logprob_mismatch_max": max(r.get("logprob_mismatch_max", 0.0) for r in records),
        "mismatch_kl": statistics.fmean(r.get("mismatch_kl", 0.0) for r in records),
        "wall_seconds": wall,
        **{k: utilisation.get(k, 0.0) for k in PHASE_KEYS},
    }


#: A difference counts as a finding only when it is at least this many standard errors from zero
NOISE_SES = 2.0


def mean_se(values) -> tuple[float, float]:
    """(mean, standard error of the mean) of per-seed values: the sample standard deviation (n - 1) over sqrt(n);
    the error of a single value is nan (unknown, never "no noise")."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("mean_se: no values")
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return mean, se


def compare(label: str, values, baseline) -> dict:
    """The headline comparison of per-seed `values` with `baseline` (a number, or per-seed values of the same seeds:
    then the per-seed differences, which share prompts and sampling keys, are what is averaged): the mean
    difference, its standard error, and `within_noise` when it is less than `NOISE_SES` standard errors from zero
    (or its error is unknown; no change at all is no finding either)."""
    values = [float(v) for v in values]
    base = [float(baseline)] * len(values) if isinstance(baseline, (int, float)) else [float(b) for b in baseline]
    if len(base) != len(values):
        raise ValueError(f"compare {label}: {len(values)} values against {len(base)} baseline values")
    diff, se = mean_se([v - b for v, b in zip(values, base)])
    within = not (se == se and abs(diff) > NOISE_SES * se)  # se != se: nan, one seed; 0 +- 0: no change
    return {"comparison": label, "difference": round(diff, 4), "se": round(se, 4) if se == se else None,
            "seeds": len(values), "within_noise": within}


def headline_comparisons(runs: dict[str, dict[str, list[dict]]]) -> list[dict]:
    """Every loss's held-out change from the warm start (greedy accuracy and sampled reward), per regime, each run
    against the warm start's evaluation on the same seed's evaluation set (the set is drawn from the seed), and each
    loss against DPPO (the default) in every regime, seed by seed."""
    out = []
    for regime, by_loss in runs.items():
        for name, done in by_loss.items():
            for key, start in (("final_accuracy", "initial_accuracy"),
                               ("final_eval_sampled_reward", "initial_eval_sampled_reward")):
                out.append(compare(f"{regime} {name} {key} - warm start", [r[key] for r in done],
                                   [r[start] for r in done]))
        if "dppo" in by_loss:
            for name, done in by_loss.items():
                if name != "dppo":
                    out.append(compare(f"{regime} {name} - dppo final_eval_sampled_reward",
                                       [r["final_eval_sampled_reward"] for r in done],
                                       [r["final_eval_sampled_reward"] for r in by_loss["dppo"]]))
    return out


def se_text(se: float | None) -> str:
    """A standard error as the table prints it ("" when unknown: one seed)."""
    return f"+-{se:.3f}" if se is not None else ""


def comparison_line(c: dict) -> str:
    """One headline comparison as text: difference +- standard error, and whether it is inside the noise."""
    se = f" +- {c['se']:.3f}" if c["se"] is not None else " (one seed: no error estimate)"
    return (f"{c['comparison']}: {c['difference']:+.3f}{se} over {c['seeds']} seeds"
            + (" -- inside the noise" if c["within_noise"] else ""))


def warm_start(args, work: str) -> str:
    """Runs the shared warm start once; returns its HF export."""
    from jodc.train.rl.config import load_rl_config
    from jodc.train.rl.tasks import make_task
    from jodc.train.rl.warmstart import run_warmstart

    config = load_rl_config(None, common_overrides(args, os.path.join(work, "warm")))
    return run_warmstart(config, make_task("arithmetic", **config.task.task_options()), log=lambda _: None)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="RL steps per run (the demo's)")
    parser.add_argument("--seeds", type=int, default=5,
                        help="runs per variant (seeds 0..n-1); the headline standard errors need >= 2, 5 by default")
    parser.add_argument("--updates-per-step", type=int, default=2,
                        help="minibatch updates per rollout (the demo's 2: the second is off-policy)")
    parser.add_argument("--learning-rate", type=float, default=3e-4, help="peak learning rate (the demo's)")
    parser.add_argument("--warmup-steps", type=int, default=50,
                        help="optimizer updates of linear warm-up (the demo's 50: Adam's first steps on noise)")
    parser.add_argument("--kl-coef", type=float, default=0.5,
                        help="k3 KL penalty to the warm start for every loss but GRPO (its own 0.04); the demo's")
    parser.add_argument("--prompts", type=int, default=128, help="prompts per step (x 8 responses; the demo's)")
    parser.add_argument("--pool-size", type=int, default=0,
                        help="training problems drawn from a fixed pool of this many (0: fresh problems every step)")
    parser.add_argument("--sft-steps", type=int, default=300,
                        help="warm-start SFT steps (300, the demo's: greedy accuracy about 0.5, room to improve)")
    parser.add_argument("--unstable-kl", type=float, default=0.1, help="KL(behaviour || policy) of a blow-up")
    parser.add_argument("--tail", type=int, default=5, help="steps averaged for the final sampled reward")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated losses among {', '.join(VARIANTS)}")
    parser.add_argument("--regimes", default=",".join(REGIMES), help="comma-separated subset of the regimes")
    parser.add_argument("--sampler", choices=("thread", "process"), default="process",
                        help="where the asynchronous regimes' sampler computes (rollout.sampler)")
    parser.add_argument("--sampler-nice", type=int, default=10, help="rollout.sampler_nice of --sampler process")
    parser.add_argument("--quick", action="store_true", help="a short smoke run (10 steps, one seed)")
    parser.add_argument("--no-save", action="store_true", help="do not write the results file")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "rl.json"),
                        help="the results file (a run of other regimes or seeds can keep its own)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.sft_steps, args.tail, args.warmup_steps = 10, 1, 300, 3, 4
    args.names = [v for v in args.variants.split(",") if v]
    args.regime_list = [v for v in args.regimes.split(",") if v]
    unknown = [v for v in args.names if v not in VARIANTS] + [v for v in args.regime_list if v not in REGIMES]
    if unknown:
        parser.error(f"unknown variants/regimes {unknown}; choose from {', '.join(VARIANTS)} / {', '.join(REGIMES)}")
    return args


def run_all(args, work: str, warm_hf: str) -> tuple[dict, dict]:
    """Every (loss, seed, regime) run: ({regime: {loss: [run, ...]}} of the runs done, {"regime loss": why the
    config refused it}). A loss's regimes run back to back, in reversed order every other seed, so that the machine's
    drift over the half hour (whole-run speed varies by 1.5x on this VM) cancels in the regimes' ratios."""
    from jodc.train.core.config import ConfigError

    names, regimes = args.names, args.regime_list
    runs: dict[str, dict[str, list[dict]]] = {regime: {name: [] for name in names} for regime in regimes}
    refused: dict[str, str] = {}
    for name in names:
        for seed in range(args.seeds):
            for regime in (regimes if seed % 2 == 0 else regimes[::-1]):
                if f"{regime} {name}" in refused:
                    continue
                try:
                    run = run_variant(name, seed, args, work, warm_hf, regime)
                except ConfigError as e:
                    refused[f"{regime} {name}"] = str(e)
                    print(f"  {regime} {name}: refused by the config: {e}", file=sys.stderr, flush=True)
                    continue
                runs[regime][name].append(run)
                print(f"  {regime} {name} seed {seed}: {run['wall_seconds']:.0f} s, warm step "
                      f"{1000 * run['warm_step_seconds']:.0f} ms; CPU use rollout "
                      f"{run['rollout_cpu_utilisation']:.2f}, train {run['train_cpu_utilisation']:.2f}, step "
                      f"{run['step_cpu_utilisation']:.2f} of 2 cores", file=sys.stderr, flush=True)
                print(json.dumps({"partial": [regime, name, seed], **run}), file=sys.stderr, flush=True)
    runs = {regime: {name: done for name, done in by_loss.items() if done} for regime, by_loss in runs.items()}
    return runs, refused


def seed_summary(done: list[dict]) -> dict:
    """One loss under one regime over its seeds: the means, the per-seed lists and the standard errors."""
    r = {key: round(statistics.fmean(run[key] for run in done), 4) for key in done[0]}
    r["unstable_steps_per_seed"] = [run["unstable_steps"] for run in done]
    r["final_accuracy_per_seed"] = [run["final_accuracy"] for run in done]
    r["final_sampled_reward_per_seed"] = [run["final_eval_sampled_reward"] for run in done]
    for key in ("final_accuracy", "final_eval_sampled_reward"):
        se = mean_se([run[key] for run in done])[1]
        r[f"{key}_se"] = round(se, 4) if se == se else None
    r["warm_step_seconds_per_seed"] = [round(run["warm_step_seconds"], 4) for run in done]
    return r


def print_results(results: dict) -> None:
    """The table: per regime and loss, accuracy and rewards from the warm start to the end, stability, time."""
    header = (f"{'regime':<8} {'loss':<13} {'greedy acc (+-se)':>20} {'held-out reward (+-se)':>22} {'train reward':>13} "
              f"{'KL>0.1':>6} {'max KL':>7} {'masked':>7} {'mismatch':>8} {'rollout s':>9} {'train s':>8} "
              f"{'step s':>7} {'warm ms':>7} {'idle T/S':>9} {'CPU R/T/step':>14}")
    print(header)
    print("-" * len(header))
    for regime, by_loss in results.items():
        for name, r in by_loss.items():
            print(f"{regime:<8} {name:<13} {r['initial_accuracy']:>6.3f}>{r['final_accuracy']:.3f}"
                  f"{se_text(r['final_accuracy_se']):<7} "
                  f"{r['initial_eval_sampled_reward']:>7.3f}>{r['final_eval_sampled_reward']:.3f}"
                  f"{se_text(r['final_eval_sampled_reward_se']):<7} "
                  f"{r['initial_reward']:>6.3f}>{r['final_reward']:<6.3f} {r['steps_kl_over_0.1']:>6.1f} "
                  f"{r['policy_kl_max']:>7.3f} {r['masked_fraction']:>7.4f} {r['logprob_mismatch']:>8.4f} "
                  f"{r['rollout_seconds']:>9.1f} {r['train_seconds']:>8.1f} {r['step_seconds']:>7.1f} "
                  f"{1000 * r['warm_step_seconds']:>7.0f} "
                  f"{r['trainer_idle_fraction']:>4.2f}/{r['sampler_idle_fraction']:<4.2f} "
                  f"{r['rollout_cpu_utilisation']:>4.2f}/{r['train_cpu_utilisation']:.2f}/{r['step_cpu_utilisation']:.2f}")


def async_speedup(results: dict, sampler: str) -> dict:
    """The sync / stale2 step-time ratios (when both regimes ran), printed and as the result's fields."""
    if "sync" not in results or "stale2" not in results:
        return {}
    common = [n for n in results["sync"] if n in results["stale2"]]
    by_loss = {n: round(statistics.fmean(a / b for a, b in zip(results["sync"][n]["warm_step_seconds_per_seed"],
                                                               results["stale2"][n]["warm_step_seconds_per_seed"])),
                        3) for n in common}  # per seed (runs back to back), then the mean
    # the default loss's (DPPO's) when it ran: the others that read old / proximal log-probs pay one extra
    # forward pass per stale rollout in the trainer, which the synchronous loop does not (docs/rl.md)
    out = {"async_speedup": by_loss.get("dppo", round(statistics.fmean(by_loss.values()), 3)),
           "async_speedup_by_loss": by_loss,
           "async_speedup_mean_over_losses": round(statistics.fmean(by_loss.values()), 3),
           "async_speedup_all_steps": round(statistics.fmean(results["sync"][n]["step_seconds"] /
                                                             results["stale2"][n]["step_seconds"]
                                                             for n in common), 3)}
    print(f"async speedup (sync / stale2 step time, steps 2.. that compiled nothing; sampler {sampler}): "
          + ", ".join(f"{n} {v:.2f}" for n, v in by_loss.items())
          + f"; async_speedup {out['async_speedup']:.2f}, mean over losses "
            f"{out['async_speedup_mean_over_losses']:.2f} (all steps 2..: {out['async_speedup_all_steps']:.2f})")
    return out


def result_line(args, results: dict, headline: list, warm_seconds: float) -> dict:
    """The JSON line's settings and headline fields, per loss and regime (the rest is added by `main`)."""
    line = {"bench": "rl", "steps": args.steps, "seeds": args.seeds, "updates_per_step": args.updates_per_step,
            "learning_rate": args.learning_rate, "warmup_steps": args.warmup_steps, "kl_coef": args.kl_coef,
            "prompts_per_step": args.prompts, "group_size": 8,
            "unstable_kl": args.unstable_kl, "warm_start_seconds": round(warm_seconds, 1),
            "regimes": args.regime_list, "losses": args.names}
    first = next(iter(next(iter(results.values())).values()))
    line["initial_sampled_reward"] = first["initial_eval_sampled_reward"]
    line["initial_accuracy"] = first["initial_accuracy"]
    line["headline"] = headline
    for name, r in results.get("sync", {}).items():
        line[f"{name}_final_accuracy"] = r["final_accuracy"]
        line[f"{name}_unstable_steps"] = r["unstable_steps"]
    for regime, by_loss in results.items():
        for name, r in by_loss.items():
            line[f"{name}_{regime}_final_sampled_reward"] = r["final_eval_sampled_reward"]
            line[f"{name}_{regime}_final_accuracy"] = r["final_accuracy"]
    return line


def kept_records(path: str | None) -> dict:
    """The previous default settings' runs that the results file holds (docs/rl.md quotes them): a rerun keeps them."""
    if path is None:
        return {}
    return {k: v for k, v in harness.previous(path).items() if k == "previous_setting_runs"}


def main(argv=None) -> int:
    args = parse_args(argv)
    count_compiles()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="jodc_bench_rl_") as work, ENGINES:
        warm_hf = warm_start(args, work)
        warm_seconds = time.perf_counter() - started
        runs, refused = run_all(args, work, warm_hf)
    results = {regime: {name: seed_summary(done) for name, done in runs[regime].items()} for regime in args.regime_list}
    print_results(results)
    headline = headline_comparisons(runs)
    print(f"headline comparisons (mean over seeds of the difference +- its standard error; inside the noise: less "
          f"than {NOISE_SES:g} standard errors from zero):")
    for c in headline:
        print("  " + comparison_line(c))
    line = result_line(args, results, headline, warm_seconds)
    line.update(async_speedup(results, args.sampler))
    line.update(sampler=args.sampler, sampler_nice=args.sampler_nice, refused=refused)
    for combination, why in refused.items():
        print(f"not run: {combination} ({why})")
    line["by_regime"] = results
    line["by_loss"] = results.get("sync", {})
    environment = harness.environment()
    line.update(total_seconds=round(time.perf_counter() - started, 1), jax=environment["jax"],
                platform=environment["platform"], cpu_count=environment["cpu_count"])
    out = harness.output(args, "rl.json")
    harness.report(line, out, saved={**line, **kept_records(out)})
    return 0

if __name__ == "__main__":
    sys.exit(main())
