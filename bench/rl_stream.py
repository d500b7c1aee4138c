"""Rollouts on a long-tailed task: continuous batching over a paged KV cache vs the static batch, at equal cache
memory.

`python -m bench.rl_stream` (or `--quick`) warm-starts the RL demo's model ("small" preset) on the `expand` task
(run-length expansion: median response about 8 tokens, about 2% 16x that or longer; `--model DIR` samples from an
HF checkpoint instead), then samples one response per prompt for `--prompts` held-out prompts, temperature 1, the
same per-prompt keys in both samplers:

* static (`generate`, today's sampler): batches of `--batch` prompts, left-padded, each batch running until its
  longest response ends; its KV cache is `batch x (prompt width + max_new_tokens)` tokens.
* stream (`ContinuousSampler`): `--slots` slots over a page pool of the same number of cache tokens (pages of
  `--page-size`), `--chunk` decode steps per compiled call.

Each sampler runs once to compile, then `--repeats` times alternately; the figures are medians. Prints a table and
one JSON line (also written to bench/results/rl_stream.json unless --no-save): `static_tokens_per_s`,
`stream_tokens_per_s`, `stream_vs_static_tokens_per_s` (target >= 2.0), `static_rollout_seconds`,
`stream_rollout_seconds`, `responses_equal` (the fraction of responses token-for-token equal in the two samplers:
the stream samples what the static sampler samples), `max_logprob_difference`, the cache sizes, the slot
utilisation of each (tokens generated / slot-steps decoded) and the stream's preemptions and waits.

Then (`--rl-steps N`, 0 to skip) whole asynchronous RL steps from the same warm start (`rollout.max_staleness` 1,
continuous batching with `--slots` slots, `--rl-prompts` x `--rl-group` responses per step, 2 updates per step
at 3e-4, a KL penalty of 0.1 to the warm start),
without and with `rollout.partial_rollouts`, one run each in its own interpreter (so that each pays its own
compilations): `step_seconds_static_phases` / `_partial` (the median step after the first),
`partial_rollout_step_speedup` (their ratio: above 1 is faster), `trainer_idle_fraction_*`
and `sampler_idle_fraction_*`, and the held-out evaluation after the N steps (`eval_sampled_reward_*`,
`eval_accuracy_*`), so that speed is not bought with learning.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench import harness  # noqa: E402

DEFAULTS = dict(prompts=256, batch=32, slots=64, page_size=16, chunk=8, max_new_tokens=208, repeats=3,
                warmstart_steps=400, rl_steps=20, rl_prompts=16, rl_group=4)
QUICK = dict(prompts=96, batch=16, slots=32, repeats=1, warmstart_steps=100, rl_steps=0)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, value in DEFAULTS.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=None)
    p.add_argument("--model", default=None, help="an HF checkpoint directory (default: warm-start one)")
    p.add_argument("--work", default=os.path.join("runs", "bench_rl_stream"), help="where the warm start goes")
    p.add_argument("--quick", action="store_true", help="a small run (CI-sized)")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    return harness.fill_unset(args, QUICK if args.quick else {}, DEFAULTS)


def warm_started_model(args):
    """(decoder, tokenizer, task, config) of the expand task's warm start (made once in `args.work`)."""
    from jodc.models import load_pretrained, load_tokenizer
    from jodc.train.rl.config import load_rl_config
    from jodc.train.rl.tasks import make_task
    from jodc.train.rl.warmstart import run_warmstart

    config = load_rl_config(None, ["--task.name", "expand", "--warmstart.sft_steps", str(args.warmstart_steps),
                                   "--warmstart.sft_examples", "8192", "--engine.token_cap", "512",
                                   "--out_dir", args.work, "--no-progress"])
    task = make_task("expand", **config.task.task_options())
    path = args.model or run_warmstart(config, task, log=lambda line: print(line, file=sys.stderr))
    return load_pretrained(path), load_tokenizer(path), task, config


def held_out_prompts(tokenizer, task, count: int) -> list[np.ndarray]:
    from jodc.train.rl.rollout import encode_prompts
    from jodc.train.rl.tasks import eval_problems

    return encode_prompts(tokenizer, [p.prompt for p in eval_problems(task, 7, count)])


def rl_args(args, out_dir: str, partial: bool) -> list[str]:
    """The RL run of the comparison: the warm start's settings (so it is reused), async k = 1, continuous."""
    return ["--task.name", "expand", "--warmstart.sft_steps", str(args.warmstart_steps), "--warmstart.sft_examples",
            "8192", "--engine.token_cap", "512", "--out_dir", out_dir, "--no-progress", "--run.steps",
            str(args.rl_steps), "--rollout.prompts_per_step", str(args.rl_prompts), "--rollout.group_size",
            str(args.rl_group), "--rollout.max_new_tokens", str(args.max_new_tokens), "--run.updates_per_step", "2",
            "--rollout.max_staleness", "1", "--rollout.batching", "continuous", "--rollout.slots", str(args.slots),
            "--rollout.page_size", str(args.page_size), "--rollout.decode_chunk", str(args.chunk),
            "--rollout.partial_rollouts", str(partial).lower(), "--run.eval_every", str(args.rl_steps),
            "--task.eval_problems", "64", "--checkpoint.save_every", "0", "--no-export_hf",
            "--optimizer.learning_rate", "3e-4", "--loss.kl_coef", "0.1"]


#: One RL run in a fresh interpreter (each mode pays its own compilations): the summary and records as JSON.
_RL_RUN = """
import json, sys
from jodc.train.core.metrics import read_metrics
from jodc.train.rl.config import load_rl_config
from jodc.train.rl.loop import run_rl
summary = run_rl(load_rl_config(None, json.loads(sys.argv[1])), log=lambda line: None)
print(json.dumps({"summary": {k: v for k, v in summary.items() if isinstance(v, (int, float, str, type(None)))},
                  "records": read_metrics(summary["metrics"])}))
"""


def measure_rl(args) -> dict:
    """Whole async RL steps without and with partial rollouts, each run in its own interpreter (see the module
    docstring)."""
    import shutil
    import subprocess

    out: dict = {"rl_steps": args.rl_steps, "rl_responses_per_step": args.rl_prompts * args.rl_group}
    for name, partial in (("static_phases", False), ("partial", True)):
        run_dir = os.path.join(args.work, f"rl_{name}")
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.copytree(os.path.join(args.work, "warmstart"), os.path.join(run_dir, "warmstart"))
        proc = subprocess.run([sys.executable, "-c", _RL_RUN, json.dumps(rl_args(args, run_dir, partial))],
                              capture_output=True, text=True, env=os.environ.copy())
        if proc.returncode:
            raise RuntimeError(f"the {name} RL run failed:\n{proc.stderr[-3000:]}")
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        records = run["records"][1:]  # after the first step, which compiles most
        out[f"step_seconds_{name}"] = statistics.median(r["step_seconds"] for r in records)
        for key in ("trainer_idle_fraction", "sampler_idle_fraction"):
            out[f"{key}_{name}"] = float(np.mean([r[key] for r in records]))
        out[f"eval_sampled_reward_{name}"] = run["summary"]["final_eval_sampled_reward"]
        out[f"eval_accuracy_{name}"] = run["summary"]["final_eval_accuracy"]
    out["partial_rollout_step_speedup"] = out["step_seconds_static_phases"] / out["step_seconds_partial"]
    return out


def run_static(model, prompts, keys, sampling, batch: int):
    """Today's sampler in batches of `batch`: (responses, wall seconds, slot-steps decoded)."""
    from jodc.models import generate

    start, responses, slot_steps = time.perf_counter(), [], 0
    for first in range(0, len(prompts), batch):
        out = jax.device_get(generate(model, prompts[first:first + batch], key=keys[first:first + batch],
                                      sampling=sampling, prompt_width=max(map(len, prompts))))
        rows = len(out.lengths)
        slot_steps += rows * int(out.lengths.max())
        responses += [(out.tokens[r, :out.lengths[r]], out.logprobs[r, :out.lengths[r]]) for r in range(rows)]
    return responses, time.perf_counter() - start, slot_steps


def run_stream(model, prompts, keys, sampling, shape):
    """The continuous sampler over all prompts: (responses, wall seconds, stats)."""
    from jodc.models.stream import ContinuousSampler

    start = time.perf_counter()
    sampler = ContinuousSampler(model, sampling, shape, max_prompt_tokens=max(map(len, prompts)))
    ids = sampler.submit(prompts, keys)
    done = sampler.run()
    wall = time.perf_counter() - start
    return [(done[i].tokens, done[i].logprobs) for i in ids], wall, sampler.stats


def measure(args) -> dict:
    """Both samplers, compiled once, then timed `repeats` times alternately; the figures of the comparison."""
    from jodc.models.paged_cache import pages_for
    from jodc.models.stream import StreamShape
    from jodc.train.rl.rollout import sampling_params

    model, tokenizer, task, _ = warm_started_model(args)
    prompts = held_out_prompts(tokenizer, task, args.prompts)
    sampling = sampling_params(tokenizer, model.config, max_new_tokens=args.max_new_tokens, temperature=1.0)
    width = -(-max(map(len, prompts)) // sampling.prompt_bucket) * sampling.prompt_bucket
    static_cache = args.batch * (width + args.max_new_tokens)
    shape = StreamShape(slots=args.slots, page_size=args.page_size, pages=static_cache // args.page_size,
                        chunk=args.chunk, prefill_rows=min(8, args.slots))
    keys = jax.random.split(jax.random.key(0), len(prompts))
    static, stream = run_static(model, prompts, keys, sampling, args.batch), run_stream(model, prompts, keys,
                                                                                       sampling, shape)
    static_walls, stream_walls = [], []
    for _ in range(args.repeats):
        static_walls.append(run_static(model, prompts, keys, sampling, args.batch)[1])
        stream_walls.append(run_stream(model, prompts, keys, sampling, shape)[1])
    return summarise(args, static, stream, static_walls, stream_walls, static_cache,
                     shape.pages * args.page_size, pages_for(width + args.max_new_tokens, args.page_size))


def summarise(args, static, stream, static_walls, stream_walls, static_cache, stream_cache, row_pages) -> dict:
    tokens = sum(len(t) for t, _ in static[0])
    equal = [len(a) == len(b) and (a == b).all() for (a, _), (b, _) in zip(static[0], stream[0])]
    diff = max(float(np.abs(la - lb).max()) for (a, la), (b, lb), same in zip(static[0], stream[0], equal) if same)
    stats = stream[2]
    static_s, stream_s = statistics.median(static_walls), statistics.median(stream_walls)
    lengths = np.array([len(t) for t, _ in static[0]])
    return {
        "prompts": args.prompts, "batch": args.batch, "slots": args.slots, "page_size": args.page_size,
        "chunk": args.chunk, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "response_length_median": float(np.median(lengths)), "response_length_max": int(lengths.max()),
        "tokens": tokens, "static_rollout_seconds": static_s, "stream_rollout_seconds": stream_s,
        "static_tokens_per_s": tokens / static_s, "stream_tokens_per_s": tokens / stream_s,
        "stream_vs_static_tokens_per_s": static_s / stream_s,
        "responses_equal": float(np.mean(equal)), "max_logprob_difference": diff,
        "static_cache_tokens": static_cache, "stream_cache_tokens": stream_cache, "stream_row_pages": row_pages,
        "static_slot_utilisation": tokens / static[2], "stream_slot_utilisation": stats.tokens / stats.slot_steps,
        "stream_preempted": stats.preempted, "stream_held": stats.held, "stream_peak_pages": stats.peak_pages,
        "stream_decode_calls": stats.decode_calls,
    }


def print_table(r: dict) -> None:
    print(f"{r['prompts']} expand prompts, responses median {r['response_length_median']:.0f} / max "
          f"{r['response_length_max']} tokens, {r['tokens']} tokens; cache: static {r['static_cache_tokens']} "
          f"tokens, stream {r['stream_cache_tokens']}")
    print(f"{'sampler':<28}{'rollout s':>10}{'tokens/s':>10}{'slot use':>10}")
    print(f"{'static, batch ' + str(r['batch']):<28}{r['static_rollout_seconds']:>10.2f}"
          f"{r['static_tokens_per_s']:>10.0f}{r['static_slot_utilisation']:>10.2f}")
    print(f"{'stream, ' + str(r['slots']) + ' slots':<28}{r['stream_rollout_seconds']:>10.2f}"
          f"{r['stream_tokens_per_s']:>10.0f}{r['stream_slot_utilisation']:>10.2f}")
    print(f"stream vs static tokens/s: {r['stream_vs_static_tokens_per_s']:.2f}x; responses equal "
          f"{r['responses_equal']:.3f}, max log-prob difference {r['max_logprob_difference']:.1e}; "
          f"preempted {r['stream_preempted']}, held {r['stream_held']}")


def print_rl_table(r: dict) -> None:
    print(f"async RL, {r['rl_steps']} steps of {r['rl_responses_per_step']} responses (max_staleness 1, continuous):")
    print(f"{'':<22}{'step s':>8}{'trainer idle':>14}{'sampler idle':>14}{'eval reward':>13}{'eval acc':>10}")
    for name in ("static_phases", "partial"):
        print(f"{name:<22}{r['step_seconds_' + name]:>8.2f}{r['trainer_idle_fraction_' + name]:>14.2f}"
              f"{r['sampler_idle_fraction_' + name]:>14.2f}{r['eval_sampled_reward_' + name]:>13.3f}"
              f"{r['eval_accuracy_' + name]:>10.3f}")
    print(f"partial rollouts: {r['partial_rollout_step_speedup']:.2f}x the steps per second")


def main(argv=None) -> int:
    args = parse_args(argv)
    result = measure(args)
    print_table(result)
    if args.rl_steps and not args.model:
        result.update(measure_rl(args))
        print_rl_table(result)
    harness.report(result, harness.output(args, "rl_stream.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
