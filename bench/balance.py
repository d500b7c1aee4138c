"""Balancing benchmark: imbalance and simulated ODC / collective-FSDP speed-up on LongAlign-like minibatches.

For 8 devices and 1, 2, 4, 8, 16 sequences per device, draws minibatches from the LongAlign-like length
distribution (8K-64K tokens, mean 16.5K; jodc.sim.lengths), plans each with local_sort, lb_micro and lb_mini
(FLOP cost model of the 1.5B golden model, T = 64K), and simulates both schedules on A100-class numbers
(jodc.sim.hardware). Per row it reports, averaged over the minibatches:

* imbalance -- max / mean of per-device FLOPs (1.0 = perfect);
* speed-up, same plan -- collective step time / ODC step time when both run that planner's plan;
* ODC+lb_mini over collective+lb_micro, and over the best collective planner -- what switching both the
  engine and the planner buys (the paper's comparison).

Per row it also reports LB-Mini against the lower bound ``max(largest sequence cost, total / devices)`` (no plan is
below it), LB-Micro against the equal-count bound (a lock-step plan with sequence counts within one: the part holding
the costliest sequence also holds at least ``floor(n / devices) - 1`` others), and every planner's planning time.
On a subset of golden minibatches (``--exact``) the proven optimum (bin completion run to the end, and with
``--milp`` also HiGHS through scipy, node-limited) gives LB-Mini's gap to the optimum. Planning time is also
measured at 32 devices x 512 sequences and at 1024 devices x 16 sequences each, and LB-Mini alone is timed over the
golden minibatches ``--golden-repeats`` times (``plan_ms_golden``: the median run; ``plan_ms_golden_runs``: all).

Speed-ups are ratios of summed step times over the minibatches (i.e. of throughput over a run). Prints a table,
then one JSON line for the golden setting (4 sequences per device) with the per-row results attached; saves the
JSON to bench/results/balance.json, the table to bench/results/balance_table.md, and two plots to docs/.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import time

import numpy as np

from bench import harness
from jodc.balance import (
    DEEPSEEK_R1_DISTILL_QWEN_1_5B,
    FlopsCost,
    equal_count_bound,
    get_planner,
    lower_bound,
    plan_metrics,
    sequence_costs,
)
from jodc.sim import A100_SXM_80GB, LONGALIGN_SFT, compare_schedules, simulate_collective, simulate_odc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLANNERS = ("local_sort", "lb_micro", "lb_mini")
SEQS_PER_DEVICE = (1, 2, 4, 8, 16)
GOLDEN_SEQS_PER_DEVICE = 4


def heaviest(plan) -> float:
    return max(sum(mb.cost for mb in device) for device in plan.devices)


def plan_ms(devices: int, sequences: int, minibatches: int, seed: int, token_cap: int) -> tuple[float, float]:
    """Mean wall time and mean process CPU time, in ms, of one LB-Mini plan of ``sequences`` LongAlign-like sequences
    over ``devices`` (on a loaded machine the wall time counts the time other processes hold the cores; the CPU
    time does not)."""
    cost_model = FlopsCost(DEEPSEEK_R1_DISTILL_QWEN_1_5B)
    planner = get_planner("lb_mini")
    wall = cpu = 0.0
    for r in range(minibatches):
        lengths = LONGALIGN_SFT.sample(sequences, seed=seed + 7919 * devices + r)
        start, start_cpu = time.perf_counter(), time.process_time()
        planner(lengths, devices, token_cap, cost_model=cost_model)
        wall += time.perf_counter() - start
        cpu += time.process_time() - start_cpu
    return 1e3 * wall / minibatches, 1e3 * cpu / minibatches


def golden_plan_ms(per_device: int, devices: int, token_cap: int, minibatches: int, seed: int,
                   repeats: int) -> list[float]:
    """Process CPU time, in ms, per LB-Mini plan of the golden row's minibatches (the same ones as :func:`run_row`),
    each of ``repeats`` runs planning all of them back to back: the spread shows how much a loaded machine moves it."""
    cost_model = FlopsCost(DEEPSEEK_R1_DISTILL_QWEN_1_5B)
    planner = get_planner("lb_mini")
    batches = [LONGALIGN_SFT.sample(per_device * devices, seed=seed + 1000 * per_device + r) for r in range(minibatches)]
    runs = []
    for _ in range(repeats):
        start_cpu = time.process_time()
        for lengths in batches:
            planner(lengths, devices, token_cap, cost_model=cost_model)
        runs.append(1e3 * (time.process_time() - start_cpu) / minibatches)
    return runs


def exact_gaps(per_device: int, devices: int, token_cap: int, count: int, seed: int, milp: bool,
               node_budget: int, milp_nodes: int) -> dict:
    """LB-Mini's heaviest device over the best partition known on the first ``count`` minibatches of a row."""
    from jodc.balance.completion import optimal_partition

    cost_model = FlopsCost(DEEPSEEK_R1_DISTILL_QWEN_1_5B)
    gaps, proven, reference_gaps = [], 0, []
    for r in range(count):
        lengths = LONGALIGN_SFT.sample(per_device * devices, seed=seed + 1000 * per_device + r)
        costs = sequence_costs(cost_model, lengths)
        plan = get_planner("lb_mini")(lengths, devices, token_cap, cost_model=cost_model)
        shares = [[i for mb in device for i in mb.seq_indices] for device in plan.devices]
        best, done = optimal_partition(costs, devices, shares, node_budget=node_budget)
        best_max = max(float(costs[p].sum()) for p in best)
        if milp:
            from jodc.balance.exact import exact_partition

            result = exact_partition(costs, devices, node_limit=milp_nodes, incumbent=best)
            best_max = min(best_max, result.makespan)
            done = done or result.optimal
        proven += bool(done)
        gaps.append(heaviest(plan) / best_max)
        reference_gaps.append(best_max / lower_bound(costs, devices))
    return {"exact_minibatches": count, "exact_proven": proven, "exact_milp": milp, "lb_mini_worst_gap_to_optimum": max(gaps),
            "lb_mini_mean_gap_to_optimum": float(np.mean(gaps)), "optimum_mean_gap_to_bound": float(np.mean(reference_gaps))}


def run_row(per_device: int, devices: int, token_cap: int, minibatches: int, seed: int) -> dict:
    """Plan and simulate ``minibatches`` minibatches of ``per_device * devices`` sequences."""
    model = DEEPSEEK_R1_DISTILL_QWEN_1_5B
    cost_model = FlopsCost(model)
    imbalance = {p: [] for p in PLANNERS}
    collective = {p: 0.0 for p in PLANNERS}
    odc = {p: 0.0 for p in PLANNERS}
    bubbles = {f"{s}_{p}": [] for s in ("collective", "odc") for p in PLANNERS}
    best_collective = 0.0
    sequences = 0
    gap_to_bound, micro_gap_to_equal_bound = [], []
    bounds, equal_bounds = [], []
    seconds = {p: 0.0 for p in PLANNERS}
    cpu_seconds = {p: 0.0 for p in PLANNERS}
    for r in range(minibatches):
        lengths = LONGALIGN_SFT.sample(per_device * devices, seed=seed + 1000 * per_device + r)
        sequences += lengths.size
        step_collective = []
        costs = sequence_costs(cost_model, lengths)
        for name in PLANNERS:
            start, start_cpu = time.perf_counter(), time.process_time()
            plan = get_planner(name)(lengths, devices, token_cap, cost_model=cost_model)
            seconds[name] += time.perf_counter() - start
            cpu_seconds[name] += time.process_time() - start_cpu
            if name == "lb_mini":
                bounds.append(lower_bound(costs, devices))
                gap_to_bound.append(heaviest(plan) / bounds[-1])
            if name == "lb_micro":
                equal_bounds.append(equal_count_bound(costs, devices))
                micro_gap_to_equal_bound.append(heaviest(plan) / equal_bounds[-1])
            imbalance[name].append(plan_metrics(plan).imbalance)
            comparison = compare_schedules(plan, model, A100_SXM_80GB)
            collective[name] += comparison.collective.step_time
            odc[name] += comparison.odc.step_time
            bubbles[f"collective_{name}"].append(comparison.collective.bubble_rate)
            bubbles[f"odc_{name}"].append(comparison.odc.bubble_rate)
            step_collective.append(comparison.collective.step_time)
        best_collective += min(step_collective)
    row = {"seqs_per_device": per_device, "minibatches": minibatches}
    for name in PLANNERS:
        row[f"{name}_imbalance"] = float(np.mean(imbalance[name]))
        row[f"odc_speedup_{name}"] = collective[name] / odc[name]
        row[f"collective_{name}_samples_per_s"] = sequences / collective[name]
        row[f"odc_{name}_samples_per_s"] = sequences / odc[name]
    for key, values in bubbles.items():
        row[f"{key}_bubble_rate"] = float(np.mean(values))
    row["lower_bound_mean"] = float(np.mean(bounds))
    row["equal_count_bound_mean"] = float(np.mean(equal_bounds))
    row["lb_mini_gap_to_bound"] = float(np.mean(gap_to_bound))
    row["lb_mini_worst_gap_to_bound"] = float(np.max(gap_to_bound))
    row["lb_micro_gap_to_equal_count_bound"] = float(np.mean(micro_gap_to_equal_bound))
    for name in PLANNERS:
        row[f"plan_ms_{name}"] = 1e3 * seconds[name] / minibatches
        row[f"plan_cpu_ms_{name}"] = 1e3 * cpu_seconds[name] / minibatches
    row["odc_lb_mini_over_collective_lb_micro"] = collective["lb_micro"] / odc["lb_mini"]
    row["odc_lb_mini_over_best_collective"] = best_collective / odc["lb_mini"]
    return row


def table(rows: list[dict]) -> str:
    header = (
        "| seqs/device | imbalance local_sort | lb_micro | lb_mini | ODC/coll. same plan: local_sort | lb_micro | "
        "lb_mini | ODC+lb_mini / coll.+lb_micro | ODC+lb_mini / best coll. |"
    )
    lines = [header, "|" + "---:|" * 9]
    for row in rows:
        cells = [str(row["seqs_per_device"])]
        cells += [f"{row[f'{p}_imbalance']:.3f}" for p in PLANNERS]
        cells += [f"{row[f'odc_speedup_{p}']:.3f}" for p in PLANNERS]
        cells += [f"{row['odc_lb_mini_over_collective_lb_micro']:.3f}", f"{row['odc_lb_mini_over_best_collective']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_speedups(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [row["seqs_per_device"] for row in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, style in zip(PLANNERS, ("o--", "s--", "^--")):
        ax.plot(x, [row[f"odc_speedup_{name}"] for row in rows], style, label=f"ODC / collective, both on {name}")
    ax.plot(x, [row["odc_lb_mini_over_collective_lb_micro"] for row in rows], "D-", lw=2.2,
            label="ODC + lb_mini / collective + lb_micro")
    ax.plot(x, [row["odc_lb_mini_over_best_collective"] for row in rows], "v:", lw=1.8,
            label="ODC + lb_mini / best collective planner")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_xlabel("sequences per device in the minibatch")
    ax.set_ylabel("simulated speed-up (step time ratio)")
    ax.set_title("LongAlign-like SFT, 1.5B model, 8 x A100, T = 64K (simulated)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_timelines(devices: int, token_cap: int, seed: int, path: pathlib.Path) -> None:
    """Per-device timelines of one golden minibatch: collective + lb_micro above, ODC + lb_mini below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model = DEEPSEEK_R1_DISTILL_QWEN_1_5B
    cost_model = FlopsCost(model)
    lengths = LONGALIGN_SFT.sample(GOLDEN_SEQS_PER_DEVICE * devices, seed=seed + 1000 * GOLDEN_SEQS_PER_DEVICE)
    runs = [
        ("collective FSDP + lb_micro", simulate_collective(
            get_planner("lb_micro")(lengths, devices, token_cap, cost_model=cost_model), model, A100_SXM_80GB,
            with_timeline=True)),
        ("ODC + lb_mini", simulate_odc(
            get_planner("lb_mini")(lengths, devices, token_cap, cost_model=cost_model), model, A100_SXM_80GB,
            with_timeline=True)),
    ]
    colors = {"compute": "#4C72B0", "comm": "#DD8452", "sync": "#C44E52"}
    horizon = max(result.step_time for _, result in runs)
    fig, axes = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    for ax, (title, result) in zip(axes, runs):
        for kind, color in colors.items():
            for d in range(devices):
                spans = [(s.start, s.end - s.start) for s in result.timeline if s.device == d and s.kind == kind]
                if spans:
                    ax.broken_barh(spans, (d - 0.4, 0.8), color=color, linewidth=0)
        ax.axvline(result.step_time, color="black", lw=1)
        ax.set_yticks(range(devices), [f"dev {d}" for d in range(devices)])
        ax.set_title(f"{title}: step {result.step_time:.2f} s, bubble rate {result.bubble_rate:.0%}", fontsize=10)
        ax.set_xlim(0, horizon * 1.02)
        ax.invert_yaxis()
    axes[-1].set_xlabel("seconds (blue: compute, orange: communication, white: waiting)")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--token-cap", type=int, default=65536)
    parser.add_argument("--minibatches", type=int, default=20, help="minibatches averaged per row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-save", action="store_true", help="print only: write no JSON, table or plots")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--exact", type=int, default=20, help="golden minibatches solved exactly (0: none)")
    parser.add_argument("--exact-nodes", type=int, default=20_000_000, help="bin-completion node budget per minibatch")
    parser.add_argument("--milp", action="store_true", help="also solve the exact subset by MILP (HiGHS, scipy)")
    parser.add_argument("--milp-nodes", type=int, default=2_000, help="MILP node limit per minibatch")
    parser.add_argument("--scale-minibatches", type=int, default=3, help="minibatches timed at 32x512 and 1024x16 (0: skip)")
    parser.add_argument("--skip-1024", action="store_true", help="skip the 1024-device timing")
    parser.add_argument("--golden-repeats", type=int, default=9,
                        help="runs over the golden minibatches timing LB-Mini alone; plan_ms_golden is their median")
    return parser.parse_args(argv)


def planning_times(args, golden: dict) -> dict:
    """The planner's own cost: the golden row's, LB-Mini alone repeated (its median), and at 32x512 / 1024x16."""
    # The plan_ms_* keys are process CPU time (the planner's own cost; on a shared machine the wall time also
    # counts the time other processes hold the cores); plan_wall_ms_* are the wall times of the same plans.
    planning = {
        "plan_time_basis": ("plan_ms_golden/_32x512/_1024x16: process CPU time per LB-Mini plan; "
                            "plan_wall_ms_*: wall time of the same plans; per planner (rows and the golden keys): "
                            "plan_cpu_ms_<planner> CPU, plan_ms_<planner> wall"),
        "plan_ms_golden": golden["plan_cpu_ms_lb_mini"],
        "plan_wall_ms_golden": golden["plan_ms_lb_mini"],
    }
    if args.golden_repeats:  # LB-Mini alone, repeated: the median is the key, the runs show the spread
        runs = golden_plan_ms(GOLDEN_SEQS_PER_DEVICE, args.devices, args.token_cap, args.minibatches, args.seed,
                              args.golden_repeats)
        planning["plan_time_basis"] += ("; plan_ms_golden: median over plan_ms_golden_runs (each the mean CPU ms "
                                        "per plan of the golden minibatches, LB-Mini alone, back to back)")
        planning["plan_ms_golden"] = float(np.median(runs))
        planning["plan_ms_golden_runs"] = runs
    if args.scale_minibatches:
        planning["plan_wall_ms_32x512"], planning["plan_ms_32x512"] = plan_ms(32, 512, args.scale_minibatches,
                                                                              args.seed, args.token_cap)
    if args.scale_minibatches and not args.skip_1024:
        planning["plan_wall_ms_1024x16"], planning["plan_ms_1024x16"] = plan_ms(
            1024, 1024 * 16, args.scale_minibatches, args.seed, args.token_cap)
    return planning


def print_summary(rows: list[dict], planning: dict, exact: dict) -> None:
    """The per-row gaps and planning times as a Markdown table, then the planning and exact-subset lines."""
    print("| seqs/device | lower bound (FLOPs, mean) | equal-count bound (FLOPs) | lb_mini / bound (mean) | worst "
          "| lb_micro / equal-count bound | plan ms CPU (wall) local_sort | lb_micro | lb_mini |")
    print("|" + "---:|" * 9)
    for row in rows:
        print(f"| {row['seqs_per_device']} | {row['lower_bound_mean']:.4g} | {row['equal_count_bound_mean']:.4g} "
              f"| {row['lb_mini_gap_to_bound']:.5f} | {row['lb_mini_worst_gap_to_bound']:.5f} "
              f"| {row['lb_micro_gap_to_equal_count_bound']:.5f} | "
              + " | ".join(f"{row[f'plan_cpu_ms_{p}']:.2f} ({row[f'plan_ms_{p}']:.2f})" for p in PLANNERS) + " |")
    print("planning time (ms; plan_ms_* CPU, plan_wall_ms_* wall): "
          + ", ".join(f"{k} {v:.1f}" for k, v in planning.items() if k not in ("plan_time_basis", "plan_ms_golden_runs")))
    if "plan_ms_golden_runs" in planning:
        runs = planning["plan_ms_golden_runs"]
        print(f"golden LB-Mini plan, CPU ms per plan over {len(runs)} runs: median {np.median(runs):.2f}, "
              f"min {min(runs):.2f}, max {max(runs):.2f}")
    if exact:
        print(f"exact subset: {exact['exact_proven']}/{exact['exact_minibatches']} proven optimal; LB-Mini / optimum "
              f"worst {exact['lb_mini_worst_gap_to_optimum']:.5f}, mean {exact['lb_mini_mean_gap_to_optimum']:.5f}; "
              f"optimum / bound mean {exact['optimum_mean_gap_to_bound']:.5f}")


def result_of(args, rows: list[dict], golden: dict, planning: dict, exact: dict, start: float, load_before) -> dict:
    result = {
        "benchmark": "balance",
        "setting": {
            "model": DEEPSEEK_R1_DISTILL_QWEN_1_5B.name,
            "devices": args.devices,
            "seqs_per_device": GOLDEN_SEQS_PER_DEVICE,
            "token_cap": args.token_cap,
            "hardware": A100_SXM_80GB.name,
            "peak_flops": A100_SXM_80GB.peak_flops,
            "achieved_fraction": A100_SXM_80GB.achieved_fraction,
            "link_bandwidth": A100_SXM_80GB.link_bandwidth,
            "lengths": LONGALIGN_SFT.name,
            "cost_model": "flops",
            "minibatches": args.minibatches,
            "seed": args.seed,
        },
        **{k: v for k, v in golden.items() if k not in ("seqs_per_device", "minibatches")},
        **planning,
        **exact,
        "rows": rows,
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "seconds": round(time.perf_counter() - start, 1),
    }
    return result


def save_extras(args, text: str, rows: list[dict]) -> None:
    """bench/results/balance_table.md (the rows' table), and the docs' plots unless --no-plots."""
    with open(harness.results_path("balance_table.md"), "w") as f:
        f.write(text + "\n")
    if not args.no_plots:
        plot_speedups(rows, ROOT / "docs" / "balance_speedup.png")
        plot_timelines(args.devices, args.token_cap, args.seed, ROOT / "docs" / "balance_timeline.png")


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    load_before = os.getloadavg()
    rows = [run_row(k, args.devices, args.token_cap, args.minibatches, args.seed) for k in SEQS_PER_DEVICE]
    text = table(rows)
    print(f"LongAlign-like lengths ({LONGALIGN_SFT.min_len}-{LONGALIGN_SFT.max_len} tokens, mean "
          f"{LONGALIGN_SFT.mean:.0f}), {DEEPSEEK_R1_DISTILL_QWEN_1_5B.name}, {args.devices} x {A100_SXM_80GB.name}, "
          f"T = {args.token_cap}, FLOP cost model, {args.minibatches} minibatches per row (simulated)")
    print(text)  # now: the planning times and the exact subset take a while
    golden = next(row for row in rows if row["seqs_per_device"] == GOLDEN_SEQS_PER_DEVICE)
    planning = planning_times(args, golden)
    exact = {}
    if args.exact:
        exact = exact_gaps(GOLDEN_SEQS_PER_DEVICE, args.devices, args.token_cap, min(args.exact, args.minibatches),
                           args.seed, args.milp, args.exact_nodes, args.milp_nodes)
    result = result_of(args, rows, golden, planning, exact, start, load_before)
    out = harness.output(args, "balance.json")
    harness.report(result, out, lambda: print_summary(rows, planning, exact))
    if out:
        save_extras(args, text, rows)

if __name__ == "__main__":
    main()
