"""Multi-node layouts predicted by the simulator (jodc.sim.hsdp): flat ODC, HSDP-ODC, HSDP-collective and flat
collective at 64, 256 and 1024 GPUs (8 per node on NVSwitch, one 400 Gb/s port per GPU across nodes), for the golden
SFT setting (LongAlign-like lengths, 64K token cap) and an RL setting (RL-response lengths, 16K cap), 1.5B model.

Prints, per setting: step time and bubble rate of every layout per device count and the winner; the cross-node
bandwidth at which flat ODC would catch up with HSDP-ODC; the minibatch size (sequences per device) from which
HSDP-ODC beats the best collective layout; one JSON line (saved to bench/results/hsdp_sim.json). A model, not a
measurement: see docs/balance.md ("Multi-node layouts") for its assumptions.
"""
from __future__ import annotations

import argparse
import dataclasses

from bench import harness
from jodc.balance import FlopsCost, get_planner
from jodc.balance.model_shape import DEEPSEEK_R1_DISTILL_QWEN_1_5B
from jodc.sim import (
    A100_NODES_400G,
    FLAT_COLLECTIVE,
    FLAT_ODC,
    HSDP_COLLECTIVE,
    HSDP_ODC,
    LONGALIGN_SFT,
    RL_RESPONSES,
    hsdp_what_if,
    inter_bandwidth_crossover,
)

SETTINGS = {"sft": (LONGALIGN_SFT, 65536), "rl": (RL_RESPONSES, 16384)}
SHAPE = DEEPSEEK_R1_DISTILL_QWEN_1_5B


def layout_rows(setting: str, devices: list[int], seqs_per_device: int, minibatches: int, seed: int) -> list[dict]:
    lengths, cap = SETTINGS[setting]
    rows = []
    for n in devices:
        result = hsdp_what_if(n, seqs_per_device=seqs_per_device, minibatches=minibatches, token_cap=cap,
                              lengths=lengths, seed=seed)
        best_collective = min(result.row(HSDP_COLLECTIVE).step_time, result.row(FLAT_COLLECTIVE).step_time)
        hsdp_odc = result.row(HSDP_ODC).step_time
        rows.append({"setting": setting, "devices": n, "winner": result.winner,
                     "hsdp_odc_vs_flat_odc": result.row(FLAT_ODC).step_time / hsdp_odc,
                     "hsdp_odc_vs_hsdp_collective": result.row(HSDP_COLLECTIVE).step_time / hsdp_odc,
                     "hsdp_odc_vs_best_collective": best_collective / hsdp_odc,
                     "layouts": [dataclasses.asdict(r) for r in result.rows]})
    return rows


def crossover(setting: str, devices: int, seqs_per_device: int, seed: int) -> dict:
    """The cross-node bandwidth per GPU at which flat ODC matches HSDP-ODC (effective = bandwidth x p2p
    efficiency)."""
    lengths, cap = SETTINGS[setting]
    plan = get_planner("lb_mini")(lengths.sample(devices * seqs_per_device, seed=seed), devices, cap,
                                  cost_model=FlopsCost(SHAPE))
    bandwidth = inter_bandwidth_crossover(plan, SHAPE, A100_NODES_400G, FLAT_ODC, HSDP_ODC)
    effective = None if bandwidth is None else bandwidth * A100_NODES_400G.inter_p2p_efficiency
    return {"setting": setting, "devices": devices, "flat_odc_matches_hsdp_odc_at_GBps": bandwidth and bandwidth / 1e9,
            "effective_p2p_GBps": effective and effective / 1e9,
            "times_a_400Gbps_port": effective and effective / A100_NODES_400G.inter_bandwidth}


def minibatch_sweep(setting: str, devices: int, sizes: list[int], minibatches: int, seed: int) -> dict:
    """HSDP-ODC vs the best collective layout per sequences-per-device; the smallest size where HSDP-ODC wins."""
    lengths, cap = SETTINGS[setting]
    gains = {}
    for s in sizes:
        result = hsdp_what_if(devices, seqs_per_device=s, minibatches=minibatches, token_cap=cap, lengths=lengths,
                              seed=seed)
        best_collective = min(result.row(HSDP_COLLECTIVE).step_time, result.row(FLAT_COLLECTIVE).step_time)
        gains[str(s)] = best_collective / result.row(HSDP_ODC).step_time
    wins = [s for s in sizes if gains[str(s)] > 1.0]
    return {"setting": setting, "devices": devices, "hsdp_odc_vs_best_collective_by_seqs_per_device": gains,
            "hsdp_odc_wins_from_seqs_per_device": min(wins) if wins else None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--seqs-per-device", type=int, default=16)
    parser.add_argument("--minibatches", type=int, default=3)
    parser.add_argument("--sweep-devices", type=int, default=64)
    parser.add_argument("--sweep-sizes", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16, 32])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-save", action="store_true")
    return parser.parse_args(argv)


def measure_setting(setting: str, args) -> tuple[list[dict], list[dict], dict]:
    """One setting's layout rows, crossovers and minibatch sweep, each printed as soon as it is done."""
    print(f"\n{setting}: step seconds (bubble) per layout, {args.seqs_per_device} sequences per device, "
          f"{args.minibatches} minibatches")
    print("| devices | flat ODC | HSDP-ODC (8) | HSDP-collective (8) | flat collective | winner | "
          "HSDP-ODC vs best collective |")
    print("|---:|---:|---:|---:|---:|---|---:|")
    rows, crossovers = [], []
    for row in layout_rows(setting, args.devices, args.seqs_per_device, args.minibatches, args.seed):
        rows.append(row)
        cells = " | ".join(f"{r['step_time']:.2f} ({r['bubble_rate']:.0%})" for r in row["layouts"])
        print(f"| {row['devices']} | {cells} | {row['winner']} | {row['hsdp_odc_vs_best_collective']:.3f} |",
              flush=True)
    for n in args.devices:
        c = crossover(setting, n, args.seqs_per_device, args.seed)
        crossovers.append(c)
        if c["effective_p2p_GBps"] is None:
            print(f"  {n} GPUs: flat ODC never catches HSDP-ODC below 10 TB/s per GPU")
        else:
            print(f"  {n} GPUs: flat ODC matches HSDP-ODC at {c['flat_odc_matches_hsdp_odc_at_GBps']:.0f} GB/s per "
                  f"GPU across nodes ({c['effective_p2p_GBps']:.0f} GB/s effective point to point, "
                  f"{c['times_a_400Gbps_port']:.1f}x a 400 Gb/s port)")
    sweep = minibatch_sweep(setting, args.sweep_devices, args.sweep_sizes, args.minibatches, args.seed)
    gains = ", ".join(f"{s}: {g:.3f}" for s, g in sweep["hsdp_odc_vs_best_collective_by_seqs_per_device"].items())
    print(f"  {args.sweep_devices} GPUs, HSDP-ODC vs best collective by sequences per device: {gains}; "
          f"HSDP-ODC wins from {sweep['hsdp_odc_wins_from_seqs_per_device']}")
    return rows, crossovers, sweep


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    rows, crossovers, sweeps = [], [], []
    for setting in SETTINGS:
        setting_rows, setting_crossovers, sweep = measure_setting(setting, args)
        rows += setting_rows
        crossovers += setting_crossovers
        sweeps.append(sweep)
    summary = {f"sim_{r['setting']}_{r['devices']}_{k}": r[k] for r in rows
               for k in ("winner", "hsdp_odc_vs_flat_odc", "hsdp_odc_vs_best_collective")}
    record = {"benchmark": "hsdp_sim", "topology": A100_NODES_400G.name, "model": SHAPE.name, **summary,
              "rows": rows, "crossovers": crossovers, "sweeps": sweeps}
    return harness.report(record, harness.output(args, "hsdp_sim.json"))

if __name__ == "__main__":
    main()
