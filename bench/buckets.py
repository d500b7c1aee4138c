"""Planning for length buckets, modelled: how much faster than LB-Micro's lock-step rounds the busiest device of an
LB-Mini plan is, with LB-Mini balancing sequence costs only and with it planning for the buckets.

bench/e2e.py's setting without running a model: LongAlign-like lengths / 64, T = 1024, buckets 256 / 512, an
illustrative quadratic cost (a = 0.05, b = 0.1, x = s / 1024), every microbatch priced at its padded length
(`jodc.balance.PaddedMicrobatchCost`). Lock-step: each round runs at the longest bucket any device needs and lasts
as long as its costliest device. Means over `--minibatches` seeds per row.

Prints a table, then one JSON line (also written to bench/results/buckets.json unless --no-save).
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np

from bench import harness
from jodc.balance import PaddedMicrobatchCost, QuadraticCost, lb_micro, lb_mini
from jodc.sim.lengths import get_length_distribution

TOKEN_CAP, BUCKETS, SCALE = 1024, (256, 512), 64
COST = QuadraticCost(a=0.05, b=0.1, scale=1024)
SETTINGS = ((2, 2), (2, 4), (2, 8), (8, 4), (8, 16))  # (devices, sequences per device)


def busiest_device(plan, price) -> float:
    return max(math.fsum(price(mb.seq_lengths) for mb in device) for device in plan.devices)


def lockstep(plan, price) -> float:
    total = 0.0
    for m in range(max(len(device) for device in plan.devices)):
        round_ = [device[m].seq_lengths for device in plan.devices if m < len(device) and sum(device[m].seq_lengths)]
        if round_:
            run = max(price.run_length(sum(s)) for s in round_)
            total += max(price(s) + price.rate * (run - price.run_length(sum(s))) for s in round_)
    return total


def run(minibatches: int) -> list[dict]:
    price = PaddedMicrobatchCost.for_buckets(COST, BUCKETS, TOKEN_CAP)
    dist = get_length_distribution("longalign_sft")
    rows = []
    for devices, per_device in SETTINGS:
        plain, aware, seconds = [], [], []
        for seed in range(minibatches):
            lengths = np.clip(np.ceil(dist.sample(devices * per_device, seed=seed) / SCALE).astype(np.int64),
                              1, TOKEN_CAP)
            rounds = lockstep(lb_micro(lengths, devices, TOKEN_CAP, cost_model=COST), price)
            plain.append(rounds / busiest_device(lb_mini(lengths, devices, TOKEN_CAP, cost_model=COST), price))
            t0 = time.perf_counter()
            plan = lb_mini(lengths, devices, TOKEN_CAP, cost_model=COST, length_buckets=BUCKETS)
            seconds.append(time.perf_counter() - t0)
            aware.append(rounds / busiest_device(plan, price))
        rows.append({"devices": devices, "seqs_per_device": per_device, "bound_sequence_costs": float(np.mean(plain)),
                     "bound_bucket_aware": float(np.mean(aware)), "plan_seconds_max": float(np.max(seconds))})
    return rows


def print_table(rows: list[dict]) -> None:
    print("LB-Micro lock-step rounds / LB-Mini busiest device, padded microbatch costs (modelled)")
    print(f"{'devices':>8}{'seqs/dev':>10}{'sequence costs':>16}{'bucket-aware':>14}{'plan s (max)':>14}")
    for r in rows:
        print(f"{r['devices']:>8}{r['seqs_per_device']:>10}{r['bound_sequence_costs']:>16.3f}"
              f"{r['bound_bucket_aware']:>14.3f}{r['plan_seconds_max']:>14.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minibatches", type=int, default=10)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    rows = run(args.minibatches)
    harness.report({"benchmark": "buckets", "minibatches": args.minibatches, "rows": rows},
                   harness.output(args, "buckets.json"), lambda: print_table(rows))

if __name__ == "__main__":
    main()
