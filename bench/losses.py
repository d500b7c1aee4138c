"""Cost of DPPO relative to PPO, and of chunked relative to unchunked log-probs, forward + backward on CPU.

For each vocabulary size V (32768 and 151936 by default) and B x T = 4 x 1024 tokens it measures, for the
gradient of the loss with respect to the logits (what the LM head's backward pass consumes):

* time: ``jax.jit(jax.value_and_grad(loss))`` per call, on two clocks: this process's CPU time (summed over
  XLA's threads) and wall time. Functions are timed round-robin (shuffled order), ``--repeats`` rounds; every
  ratio is the median over rounds of the ratio within a round. The ``*_time`` ratios use CPU time, which other
  jobs on a shared machine barely move; the ``*_wall_time`` ratios are reported next to them.
* peak memory: XLA's compiled memory analysis, ``temp_size_in_bytes``: the scratch memory the computation
  allocates on top of its input (the logits) and its output (their gradient), which every variant needs alike.
  ``total`` = arguments + outputs + temps - aliased is reported alongside.

Policy losses all use the chunked log-softmax (``--chunk-size``, default 128) and fp32 logits. The log-prob
comparison runs ``token_logprobs`` with ``chunk_size=None`` (naive) and chunked, for fp32 and bf16 logits.

On a GPU (JAX's default device), the process's CPU time measures the host thread that dispatches and waits, not
the work: only wall time is taken (each call timed up to its results on the device, `jax.block_until_ready`), the
``*_time`` ratios are wall-time ratios (``time_clock`` says which clock they use) and the JSON goes to
bench/results/losses_gpu.json.

Prints a table, then one JSON line (also written to bench/results/losses.json unless --no-save) with at least
``dppo_topk_vs_ppo_time`` and ``chunked_vs_naive_peak_memory`` (both at the largest V; the memory ratio is the
larger of the fp32 and bf16 ones). Targets: DPPO Top-K <= 1.15x PPO; chunked <= 0.5x naive memory.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from bench import harness
from jodc.losses import DEFAULT_TOPK, dppo_loss, ppo_loss, token_logprobs, topk_logprobs

MiB = 2**20


def make_batch(batch: int, seq: int, vocab: int, k: int, seed: int = 0):
    """Random logits [B, T, V] (fp32), sampled tokens, behaviour log-probs near the current policy, advantages,
    a mask with some padding, and the behaviour policy's top-k (sampled token forced in)."""
    key_logits, key_tokens, key_noise, key_adv, key_mu = jax.random.split(jax.random.PRNGKey(seed), 5)
    logits = 2.0 * jax.random.normal(key_logits, (batch, seq, vocab), jnp.float32)
    tokens = jax.random.randint(key_tokens, (batch, seq), 0, vocab)
    behaviour_logits = logits + 0.3 * jax.random.normal(key_mu, logits.shape, jnp.float32)
    topk_ids, topk_lps = jax.jit(topk_logprobs, static_argnums=2)(behaviour_logits, tokens, k)
    del behaviour_logits
    current = jax.jit(token_logprobs)(logits, tokens)
    behaviour = current + 0.2 * jax.random.normal(key_noise, current.shape)
    advantages = jax.random.normal(key_adv, current.shape)
    mask = (jnp.arange(seq)[None, :] < seq - 64 * jnp.arange(batch)[:, None]).astype(jnp.float32)
    return dict(logits=logits, tokens=tokens, behaviour=behaviour, advantages=advantages, mask=mask,
                topk_ids=topk_ids, topk_logprobs=topk_lps)


def loss_functions(data, chunk_size: int):
    """name -> (function of the logits returning (value, grad), description)."""
    tok, mu, adv, mask = data["tokens"], data["behaviour"], data["advantages"], data["mask"]

    return {
        "ppo": lambda x: jax.value_and_grad(
            lambda y: ppo_loss(y, tok, mu, adv, mask, chunk_size=chunk_size)[0])(x),
        "dppo_binary": lambda x: jax.value_and_grad(
            lambda y: dppo_loss(y, tok, mu, adv, mask, chunk_size=chunk_size)[0])(x),
        "dppo_topk": lambda x: jax.value_and_grad(
            lambda y: dppo_loss(y, tok, mu, adv, mask, approximation="topk", topk_ids=data["topk_ids"],
                                topk_logprobs=data["topk_logprobs"], chunk_size=chunk_size)[0])(x),
        "logprobs_naive": lambda x: jax.value_and_grad(
            lambda y: jnp.sum(adv * token_logprobs(y, tok)))(x),
        "logprobs_chunked": lambda x: jax.value_and_grad(
            lambda y: jnp.sum(adv * token_logprobs(y, tok, chunk_size=chunk_size)))(x),
    }


def memory_of(compiled) -> dict[str, float]:
    """Temp and total bytes (MiB) from XLA's compiled memory analysis."""
    stats = compiled.memory_analysis()
    temp = stats.temp_size_in_bytes
    total = stats.argument_size_in_bytes + stats.output_size_in_bytes + temp - stats.alias_size_in_bytes
    return {"temp_mib": temp / MiB, "total_mib": total / MiB}


def clocks_for(platform: str) -> tuple[str, ...]:
    """The clocks that mean something for a device: ``cpu`` (this process's CPU time, all XLA threads: on the CPU
    backend that is the work, and other jobs barely move it) and ``wall``; on an accelerator only ``wall`` (the
    host thread only dispatches and waits). The first is the headline clock of the ``*_time`` ratios."""
    return ("cpu", "wall") if platform == "cpu" else ("wall",)


def time_round_robin(compiled: dict, logits, repeats: int, seed: int = 0,
                     clocks: tuple[str, ...] = ("cpu", "wall")) -> dict[str, dict[str, list[float]]]:
    """{clock: {name: seconds per call}} for every compiled function, one call each per round, ``repeats``
    rounds. Clocks: ``cpu`` = this process's CPU time (all XLA threads), ``wall`` = elapsed time up to the results
    (``jax.block_until_ready``: on a GPU, a device synchronisation). The order within a round is shuffled (seeded):
    with a fixed order the ratios were biased by up to ~7% by position alone."""
    times = {clock: {name: [] for name in compiled} for clock in clocks}
    order = list(compiled)
    rng = random.Random(seed)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            wall, cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(compiled[name](logits))
            elapsed = {"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall}
            for clock in clocks:
                times[clock][name].append(elapsed[clock])
    return times


def median_ratio(times: dict[str, list[float]], num: str, den: str) -> float:
    """Median over rounds of the within-round ratio num / den."""
    return statistics.median(a / b for a, b in zip(times[num], times[den]))


TIME_RATIOS = {  # result key -> (numerator, denominator)
    "dppo_binary_vs_ppo": ("dppo_binary", "ppo"),
    "dppo_topk_vs_ppo": ("dppo_topk", "ppo"),
    "chunked_vs_naive": ("logprobs_chunked", "logprobs_naive"),
}


def bench_vocab(vocab: int, batch: int, seq: int, k: int, chunk_size: int, repeats: int) -> dict:
    data = make_batch(batch, seq, vocab, k)
    logits = data["logits"]
    fns = loss_functions(data, chunk_size)
    compiled, memory = {}, {}
    for name, fn in fns.items():
        compiled[name] = jax.jit(fn).lower(logits).compile()
        memory[name] = memory_of(compiled[name])
    # bf16 logits: memory only (the CPU's bf16 arithmetic is not what a GPU run would time)
    logits_bf16 = jax.ShapeDtypeStruct(logits.shape, jnp.bfloat16)
    for name in ("logprobs_naive", "logprobs_chunked"):
        memory[name + "_bf16"] = memory_of(jax.jit(fns[name]).lower(logits_bf16).compile())

    for fn in compiled.values():  # warm-up
        jax.block_until_ready(fn(logits))
    clocks = clocks_for(logits.devices().pop().platform)
    times = time_round_robin(compiled, logits, repeats, clocks=clocks)
    del data, logits
    result = {
        "vocab": vocab,
        "time_clock": clocks[0],
        "time_s": {clock: {name: statistics.median(t) for name, t in times[clock].items()} for clock in clocks},
        "memory": memory,
    }
    for key, (num, den) in TIME_RATIOS.items():
        result[f"{key}_time"] = median_ratio(times[clocks[0]], num, den)
        result[f"{key}_wall_time"] = median_ratio(times["wall"], num, den)
    temp = {name: m["temp_mib"] for name, m in memory.items()}
    total = {name: m["total_mib"] for name, m in memory.items()}
    result.update({
        "dppo_binary_vs_ppo_peak_memory": temp["dppo_binary"] / temp["ppo"],
        "dppo_topk_vs_ppo_peak_memory": temp["dppo_topk"] / temp["ppo"],
        "chunked_vs_naive_peak_memory_fp32": temp["logprobs_chunked"] / temp["logprobs_naive"],
        "chunked_vs_naive_peak_memory_bf16": temp["logprobs_chunked_bf16"] / temp["logprobs_naive_bf16"],
        "chunked_vs_naive_total_memory_fp32": total["logprobs_chunked"] / total["logprobs_naive"],
        "chunked_vs_naive_total_memory_bf16": total["logprobs_chunked_bf16"] / total["logprobs_naive_bf16"],
    })
    return result


def print_table(results: list[dict], batch: int, seq: int, chunk_size: int) -> None:
    print(f"losses fwd+bwd wrt logits, B x T = {batch} x {seq}, chunk_size = {chunk_size}, "
          f"{jax.devices()[0].platform} ({os.cpu_count()} cores)")
    header = (f"{'V':>7} {'function':<22} {'cpu ms':>8} {'vs ref':>7} {'wall ms':>8} {'vs ref':>7} "
              f"{'temp MiB':>9} {'vs ref':>7} {'total MiB':>9}")
    print(header)
    print("-" * len(header))
    ratio_key = {num: key for key, (num, _) in TIME_RATIOS.items()}
    rows = [  # (name, memory reference)
        ("ppo", "ppo"), ("dppo_binary", "ppo"), ("dppo_topk", "ppo"),
        ("logprobs_naive", "logprobs_naive"), ("logprobs_chunked", "logprobs_naive"),
        ("logprobs_naive_bf16", "logprobs_naive_bf16"), ("logprobs_chunked_bf16", "logprobs_naive_bf16"),
    ]
    for res in results:
        mem = res["memory"]
        for name, mem_ref in rows:
            cells = []
            for clock, suffix in (("cpu", "_time"), ("wall", "_wall_time")):
                if name not in res["time_s"].get(clock, {}):
                    cells.append(f"{'-':>8} {'':>7}")
                    continue
                vs = res[ratio_key[name] + suffix] if name in ratio_key else 1.0
                cells.append(f"{res['time_s'][clock][name] * 1e3:8.1f} {vs:7.3f}")
            mem_vs = mem[name]["temp_mib"] / mem[mem_ref]["temp_mib"]
            print(f"{res['vocab']:>7} {name:<22} {' '.join(cells)} {mem[name]['temp_mib']:9.1f} {mem_vs:7.3f} "
                  f"{mem[name]['total_mib']:9.1f}")
    print("vs ref: ppo for the losses, logprobs_naive(_bf16) for log-probs; time ratios are medians over rounds "
          "of within-round ratios;\ncpu = process CPU time (robust to other load; not taken on accelerators), "
          "wall = elapsed up to the results; temp = XLA temp buffers beyond the logits and their gradient; bf16 "
          "rows: memory only")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--topk", type=int, default=DEFAULT_TOPK)
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of --repeats")
    parser.add_argument("--no-save", action="store_true", help="do not write the JSON file")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/losses.json, or "
                                                        "losses_gpu.json when JAX's default device is not the CPU)")
    args = parser.parse_args(argv)
    if args.out is None:
        on_cpu = jax.devices()[0].platform == "cpu"
        args.out = harness.results_path("losses.json" if on_cpu else "losses_gpu.json")
    if args.quick:
        args.repeats = 2
    return args


def summary_of(args, results: list[dict]) -> dict:
    """The JSON line: the settings, the largest vocabulary's ratios (the headline), every vocabulary's numbers."""
    largest = max(results, key=lambda r: r["vocab"])
    summary = {
        "bench": "losses",
        "batch": args.batch,
        "seq": args.seq,
        "topk": args.topk,
        "chunk_size": args.chunk_size,
        "repeats": args.repeats,
        "vocab": largest["vocab"],
        "time_clock": largest["time_clock"],
        "dppo_topk_vs_ppo_time": round(largest["dppo_topk_vs_ppo_time"], 4),
        "dppo_topk_vs_ppo_wall_time": round(largest["dppo_topk_vs_ppo_wall_time"], 4),
        "dppo_binary_vs_ppo_time": round(largest["dppo_binary_vs_ppo_time"], 4),
        "dppo_binary_vs_ppo_wall_time": round(largest["dppo_binary_vs_ppo_wall_time"], 4),
        "dppo_topk_vs_ppo_peak_memory": round(largest["dppo_topk_vs_ppo_peak_memory"], 4),
        "chunked_vs_naive_peak_memory": round(max(largest["chunked_vs_naive_peak_memory_fp32"],
                                                  largest["chunked_vs_naive_peak_memory_bf16"]), 4),
        "chunked_vs_naive_time": round(largest["chunked_vs_naive_time"], 4),
        "chunked_vs_naive_wall_time": round(largest["chunked_vs_naive_wall_time"], 4),
        "targets_met": bool(largest["dppo_topk_vs_ppo_time"] <= 1.15 and max(
            largest["chunked_vs_naive_peak_memory_fp32"], largest["chunked_vs_naive_peak_memory_bf16"]) <= 0.5),
        "by_vocab": {
            str(r["vocab"]): {key: (round(val, 4) if isinstance(val, float) else val) for key, val in r.items()
                              if key not in ("vocab", "time_s", "memory")}
            for r in results
        },
        "cpu_ms": {str(r["vocab"]): {k: round(v * 1e3, 1) for k, v in r["time_s"]["cpu"].items()}
                   for r in results if "cpu" in r["time_s"]},
        "wall_ms": {str(r["vocab"]): {k: round(v * 1e3, 1) for k, v in r["time_s"]["wall"].items()}
                    for r in results},
        "temp_mib": {str(r["vocab"]): {k: round(v["temp_mib"], 1) for k, v in r["memory"].items()}
                     for r in results},
        "device": jax.devices()[0].device_kind,
        **harness.environment(),
    }
    return summary


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = [bench_vocab(v, args.batch, args.seq, args.topk, args.chunk_size, args.repeats) for v in args.vocab]
    return harness.report(summary_of(args, results), None if args.no_save else args.out,
                          lambda: print_table(results, args.batch, args.seq, args.chunk_size), indent=None)

if __name__ == "__main__":
    main(sys.argv[1:])
