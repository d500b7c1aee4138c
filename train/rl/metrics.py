"""Per-step RL metrics: the record of one step (rollout, rewards, the updates' diagnostics, time split), what the
progress bar shows (reward instead of loss), the PNG of reward and trust-region masked fraction vs step, and the
lines printed at the end of a run (`format_summary`).

Records go to `metrics.jsonl` and TensorBoard through the trainers' `MetricsLogger` (same files, same resume
behaviour: records after the restored checkpoint are dropped).
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from ..core.trainer import summary_text

CURVES_FILE = "rl_curves.png"
#: The progress bar's fields: mean reward, accuracy and the trust-region masked fraction (`MetricsLogger`).
BAR_FIELDS = (("reward_mean", "reward", ".3f"), ("accuracy", "acc", ".2f"), ("trust_region_fraction", "masked", ".3f"))


def rollout_metrics(rewards: np.ndarray, group_size: int, response_lengths: np.ndarray, finished: np.ndarray, *,
                    success_reward: float) -> dict[str, float]:
    """What the rollout itself says: mean / std reward, accuracy (reward >= success_reward), response length,
    responses cut by the budget, and the fraction of groups whose rewards are all equal (no learning signal)."""
    groups = rewards.reshape(-1, group_size)
    return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
            "accuracy": float(np.mean(rewards >= success_reward)),
            "response_length": float(response_lengths.mean()), "response_length_max": int(response_lengths.max()),
            "unfinished_fraction": float(np.mean(~finished)),
            "zero_advantage_groups": float(np.mean(groups.max(axis=1) == groups.min(axis=1)))}


def update_metrics(per_update: Sequence[dict[str, float]], *, unstable_kl: float) -> dict[str, Any]:
    """One step's view of its updates (dicts from `rl_loss.summarize_metrics` plus loss and grad_norm): means over
    the updates, the largest policy KL to the behaviour policy (the stalest update), whether it exceeded
    `unstable_kl` (a blow-up), and the last update's KL and masked fraction (the most off-policy one)."""
    keys = sorted(set().union(*per_update))
    out: dict[str, Any] = {k: float(np.mean([u[k] for u in per_update if k in u])) for k in keys}
    kls = [u["policy_kl"] for u in per_update]
    out["policy_kl_max"] = float(max(kls))
    out["policy_kl_last"] = float(kls[-1])
    out["unstable"] = bool(max(kls) > unstable_kl)
    out["grad_norm_max"] = float(max(u["grad_norm"] for u in per_update))
    if "trust_region_fraction" in per_update[-1]:
        out["trust_region_fraction_last"] = float(per_update[-1]["trust_region_fraction"])
    return out


def step_record(scored, step: int, updates: Sequence[dict[str, float]], *, group_size: int, success_reward: float,
                unstable_kl: float, seconds: float, train_seconds: float, waited: float, sampler_busy: float,
                tokens: int, **extra) -> dict[str, Any]:
    """The record one RL step writes: what its rollout (`scored`, a `ScoredRollout` of step `step`, or across
    processes a `ShardedRollout`) says, its
    applied updates' summary (NaN loss and grad norm when every update was skipped), its throughput and time split
    (`seconds` for the step, `train_seconds` of it updating, `waited` for the rollout, `sampler_busy` of the
    sampler's), its staleness and rollout/trainer mismatch, and `extra` fields (learning rate, skipped updates,
    microbatches, the KL-in-reward controller) as given."""
    record = rollout_metrics(scored.rewards, group_size, scored.response_lengths, scored.finished,
                             success_reward=success_reward)
    record.update(update_metrics(updates, unstable_kl=unstable_kl) if updates else
                  {"loss": float("nan"), "grad_norm": float("nan")})
    oldest = int(scored.versions.min())
    newest = getattr(scored, "newest_versions", None)
    if newest is not None:  # partial rollouts: the responses a weight update reached under way, the newest token
        record["partial_response_fraction"] = float(np.mean(newest > scored.versions))
        record["newest_policy_version"] = int(newest.max())
    record.update({"tokens": tokens, "tokens_per_s": tokens / train_seconds if train_seconds > 0 else 0.0,
                   "rollout_seconds": scored.rollout_seconds, "reward_seconds": scored.reward_seconds,
                   "mismatch_seconds": scored.mismatch_seconds, "rollout_fraction": scored.rollout_seconds / seconds,
                   "train_fraction": train_seconds / seconds, "policy_version": oldest, "staleness": step - oldest,
                   "rollout_wait_seconds": waited, "trainer_idle_fraction": min(waited / seconds, 1.0),
                   "sampler_idle_fraction": max(0.0, 1.0 - sampler_busy / seconds), **scored.mismatch, **extra})
    return record


def plot_curves(records: Sequence[dict[str, Any]], path: str, *, title: str = "RL",
                final_eval: dict[str, float] | None = None, smoothing: int = 10) -> str:
    """Draws mean reward, accuracy (and the held-out evaluation where measured) and the trust-region masked
    fraction (mean over the step's updates and its last update) against step to a PNG at `path`. The reward
    also gets a trailing moving average over `smoothing` steps; `final_eval` (the evaluation after the last
    step) is drawn one step after it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not records:
        raise ValueError("plot_curves: no records")
    steps = [r["step"] for r in records]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, [r["reward_mean"] for r in records], label="mean reward", color="tab:blue")
    top.plot(steps, [r["accuracy"] for r in records], label="accuracy (samples)", color="tab:cyan", alpha=0.5)
    if smoothing > 1 and len(records) >= smoothing:
        rewards = np.array([r["reward_mean"] for r in records])
        average = np.convolve(rewards, np.ones(smoothing) / smoothing, mode="valid")
        top.plot(steps[smoothing - 1:], average, label=f"mean reward, {smoothing}-step average", color="tab:purple",
                 linewidth=2)
    for key, label, colour in (("eval_accuracy", "held-out greedy accuracy (before the step)", "tab:green"),
                               ("eval_sampled_reward", "held-out sampled reward (before the step)", "tab:olive")):
        evaluated = [(r["step"], r[key]) for r in records if key in r]
        if final_eval is not None and key in final_eval:
            evaluated.append((steps[-1] + 1, final_eval[key]))
        if evaluated:
            top.plot(*zip(*evaluated), "o-", label=label, color=colour)
    top.set_ylabel("reward")
    top.legend(fontsize="small", loc="lower right", ncol=2)
    top.grid(alpha=0.3)
    for key, label, style in (("trust_region_fraction", "masked / clipped fraction (mean over updates)", "-"),
                              ("trust_region_fraction_last", "same, last (stalest) update", "--")):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            bottom.plot(*zip(*points), style, label=label, color="tab:red")
    bottom.set_ylabel("fraction of tokens")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    if bottom.lines:
        bottom.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def overlap_summary(records: list[dict[str, Any]], rollout) -> dict[str, Any]:
    """Means over this invocation's steps after the first (which compiles) of the rollout/trainer overlap and
    mismatch: `max_staleness`, `rollout_dtype`, `trainer_idle_fraction`, `sampler_idle_fraction`,
    `logprob_mismatch` (None without such steps)."""
    steady = records[1:] or records
    out: dict[str, Any] = {"max_staleness": rollout.max_staleness, "rollout_dtype": rollout.dtype}
    for key in ("trainer_idle_fraction", "sampler_idle_fraction", "logprob_mismatch"):
        values = [r[key] for r in steady if key in r]
        out[key] = float(np.mean(values)) if values else None
    return out


def format_summary(summary: dict[str, Any]) -> str:
    """The lines printed at the end of a run: what was done and where everything is. The held-out change (greedy
    accuracy and sampled reward on the evaluation set, from the evaluation before this invocation's first step to
    the one after its last) comes first, the training reward second: a training reward that rises while the
    held-out numbers fall is overfitting, not RL working (docs/rl.md)."""
    training = (f"training reward {summary['first_reward']:.3f} -> {summary['last_reward']:.3f}, "
                f"{summary['unstable_steps']} unstable step(s)" if summary["first_reward"] is not None else None)
    start, end = summary.get("first_eval_accuracy"), summary["final_eval_accuracy"]
    if start is not None and end is not None:
        achieved = (f"held-out greedy accuracy {start:.3f} -> {end:.3f}, sampled reward "
                    f"{summary['first_eval_sampled_reward']:.3f} -> {summary['final_eval_sampled_reward']:.3f}"
                    + (f"; {training}" if training else ""))
        evaluation = []
    else:  # no evaluation before the first step (eval_every 0, or a resume between evaluations)
        achieved = training
        evaluation = ([f"held-out evaluation at the end: greedy accuracy {end:.3f}, "
                       f"sampled reward {summary['final_eval_sampled_reward']:.3f}"] if end is not None else [])
    curves = [f"curves:     {summary['curves']}"] if summary["curves"] else []
    return summary_text(summary, achieved, evaluation + overlap_lines(summary), curves, unit="RL steps")


def overlap_lines(summary: dict[str, Any]) -> list[str]:
    """The summary's line on asynchronous / mismatched rollouts (none for synchronous fp32 ones); the log-prob
    mismatch only where it was measured (a sampler with other numerics than the trainer's)."""
    if summary.get("trainer_idle_fraction") is None or not (summary.get("max_staleness")
                                                            or summary.get("rollout_dtype") != "float32"):
        return []
    mismatch = summary.get("logprob_mismatch")
    return [f"rollouts: max_staleness {summary['max_staleness']}, sampler {summary['rollout_dtype']}; trainer "
            f"idle {summary['trainer_idle_fraction']:.0%}, sampler idle {summary['sampler_idle_fraction']:.0%} of the "
            "step" + (f"; log-prob mismatch {mismatch:.2e} per token" if mismatch is not None else "")]


def run_summary_fields(records: Sequence[dict[str, Any]], start_step: int, final_eval: dict[str, float] | None,
                       config, *, curves_path: str) -> dict[str, Any]:
    """What an RL run's summary adds: rewards over the whole run (`records`; this invocation's steps, after
    `start_step`, for first / last), the evaluations before this invocation's first step and after its last, the
    curves (drawn to `curves_path` where there are records: process 0's), the rollout/trainer overlap."""
    curves = plot_curves(records, curves_path, final_eval=final_eval,
                         title=f"{config.loss.name} on {config.task.name}") if records else None
    ran = [r for r in records if r["step"] > start_step]
    return {"rewards": [(r["step"], r["reward_mean"]) for r in records],
            "first_reward": ran[0]["reward_mean"] if ran else None,
            "last_reward": ran[-1]["reward_mean"] if ran else None,
            # the evaluation before this invocation's first step, where one ran (eval_every > 0)
            "first_eval_accuracy": ran[0].get("eval_accuracy") if ran else None,
            "first_eval_sampled_reward": ran[0].get("eval_sampled_reward") if ran else None,
            "final_eval_accuracy": final_eval["eval_accuracy"] if final_eval else None,
            "final_eval_sampled_reward": final_eval["eval_sampled_reward"] if final_eval else None,
            "unstable_steps": sum(1 for r in records if r.get("unstable")), "curves": curves,
            **overlap_summary(ran, config.rollout)}
