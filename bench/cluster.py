"""Cluster-scale what-if (jodc.sim.cluster): 256 and 1024 devices, 16 LongAlign-like sequences each, 1.5B model.

Prints a table and one JSON line (saved to bench/results/cluster.json): per device count the modelled ODC gain
(collective / ODC on the same LB-Mini plan, and collective + local sort / ODC + LB-Mini), LB-Mini's gap to the
lower bound, its planning time (process CPU time, and wall time in brackets: the machine may be shared) and the CPU
time as a fraction of the modelled ODC step.
"""
from __future__ import annotations

import argparse
import dataclasses

from bench import harness
from jodc.sim import cluster_what_if


def measure(args) -> list[dict]:
    """One row per device count, printed as a table row as soon as it is done."""
    print("| devices | ODC / collective, same plan | ODC+lb_mini / collective+local_sort | lb_mini / bound | "
          "plan ms CPU (wall) | plan CPU / ODC step |")
    print("|" + "---:|" * 6)
    rows = []
    for devices in args.devices:
        result = cluster_what_if(devices, seqs_per_device=args.seqs_per_device, minibatches=args.minibatches,
                                 seed=args.seed)
        rows.append({**dataclasses.asdict(result), "plan_fraction_of_step": result.plan_fraction_of_step})
        print(f"| {devices} | {result.odc_gain_same_plan:.3f} | {result.odc_gain_over_local_sort:.3f} | "
              f"{result.lb_mini_gap_to_bound:.6f} | {result.plan_cpu_ms_lb_mini:.0f} ({result.plan_ms_lb_mini:.0f}) | "
              f"{result.plan_fraction_of_step:.2%} |",
              flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--seqs-per-device", type=int, default=16)
    parser.add_argument("--minibatches", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    rows = measure(args)
    # the file holds the rows alone (a list), the line names the benchmark
    harness.report({"benchmark": "cluster", "rows": rows}, harness.output(args, "cluster.json"), saved=rows)

if __name__ == "__main__":
    main()
