"""End-to-end minibatch throughput: ODC + LB-Mini against collective FSDP and XLA-SPMD with LB-Micro.

The same decoder, data and optimizer under each engine on 2 simulated CPU devices with the fewest intra-op
threads XLA keeps (`NPROC=1`; 2 on jax 0.10.2, which the devices share), on (a) imbalanced minibatches drawn from
a LongAlign-like long-tailed length distribution scaled to CPU size and (b) perfectly balanced minibatches (all
sequences the same length).

Every engine runs a microbatch at the smallest of T/4, T/2, T that holds it: ODC per device and microbatch (its
devices never meet inside the step), the lock-step engines per round (the longest any device needs). Busy time is
calibrated, not guessed: every microbatch a plan contains is timed alone in CPU seconds (forward + backward on one
device, no communication). A plan's ideal step time is its total busy time / devices; an engine's efficiency is
ideal / measured, and its bubble rate 1 - busy / (devices x wall). The same calibration gives each schedule's
compute-only wall for its plans (lock-step: sum over rounds of the slowest device's microbatch at the round's
bucket; ODC: the busiest device's sum), and their ratio, the speed-up that balancing and decoupling alone can buy
on these minibatches ("balance bound"), next to the measured one. ODC's LB-Mini plans for the buckets, with a
per-microbatch overhead measured first (ODC steps of 1 and 3 tiny microbatches per device, less their compute); the
"odc_seq" row runs ODC on LB-Mini plans that balance sequence costs only, and the "odc_det" row the "odc" plans with a
deterministic heap (bit-for-bit reproducible accumulation; its step time over the default's is printed as the
deterministic cost). Every engine is built and runs all minibatches once to compile; then `--rounds` paired rounds
each time every engine's pass over the minibatches back to back (the order rotated per round). Rows report
samples/s and bubble rates over all rounds; the ratios (ODC's speed-up, the deterministic cost, the HSDP ratios) are
medians over rounds of the ratio of two passes of the same round, robust to a shared machine's load drifting.

Prints a table, then one JSON line (also written to bench/results/e2e.json unless --no-save).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

from bench import harness


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--replicas", type=int, default=2, help="replica groups of the hsdp_* rows (HSDP_CONTENDERS)")
    p.add_argument("--minibatches", type=int, default=6)
    p.add_argument("--seqs-per-device", type=int, default=4)
    p.add_argument("--token-cap", type=int, default=1024)
    p.add_argument("--length-scale", type=int, default=64, help="LongAlign lengths divided by this")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3, help="paired rounds: every row's timed pass back to back, per round")
    return harness.add_run_flags(p, "2 minibatches, 2 layers, 2 rounds (a smoke run)").parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={ARGS.devices}"
                               " --xla_cpu_multi_thread_eigen=false").strip()
    # XLA's CPU client sizes the intra-op pool that its thunk executor spreads independent work over from NPROC
    # (default: all cores): a device that waits lends its core to the other one, which hides the idling this
    # benchmark is about. NPROC=1 asks for one thread, but jax 0.10.2 keeps 2 (the `tf_XLAEigen` entries of
    # /proc/<pid>/task, both busy while one device computes), so there the devices still share both cores.
    os.environ.setdefault("NPROC", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from jodc.balance import LinearCost, QuadraticCost, get_planner  # noqa: E402
from jodc.fsdp import CollectiveEngine, ODCEngine, OptimizerConfig, XlaSpmdEngine, sharding  # noqa: E402
from jodc.fsdp.batch import minibatch_from_plan  # noqa: E402
from jodc.train.core.staged_decoder import decoder_staged_model  # noqa: E402
from jodc.models.config import DecoderConfig  # noqa: E402
from jodc.sim.lengths import get_length_distribution  # noqa: E402

# (row, planner, engine); "odc_seq" is ODC with LB-Mini balancing sequence costs only, blind to the buckets;
# "odc_det" is the "odc" row (same plans) with a deterministic heap: the price of bit-for-bit reproducibility
CONTENDERS = (("odc", "lb_mini", ODCEngine), ("odc_det", "lb_mini", ODCEngine), ("odc_seq", "lb_mini", ODCEngine),
              ("collective", "lb_micro", CollectiveEngine), ("xla_spmd", "lb_micro", XlaSpmdEngine))
# HSDP rows (bench/multiprocess.py --hsdp): the same engines on the (replica, shard) mesh of `args.replicas` groups
HSDP_CONTENDERS = (("hsdp_odc", "lb_mini", ODCEngine), ("hsdp_collective", "lb_micro", CollectiveEngine))
ENGINE_OPTIONS = {"odc_det": {"deterministic": True}}
BUCKET_PLANNED = ("odc", "odc_det", "hsdp_odc")  # rows whose LB-Mini plans for the length buckets


def make_sequences(lengths, rng, vocab):
    seqs = [rng.integers(0, vocab, int(s) + 1) for s in lengths]
    return [s[:-1] for s in seqs], [s[1:] for s in seqs], [np.ones(int(s), np.float32) for s in lengths]


def scenario_lengths(kind: str, args, rng) -> list[np.ndarray]:
    n = args.devices * args.seqs_per_device
    if kind == "balanced":
        return [np.full(n, args.token_cap // 2, np.int64) for _ in range(args.minibatches)]
    dist = get_length_distribution("longalign_sft")
    out = []
    for i in range(args.minibatches):
        lengths = np.ceil(dist.sample(n, seed=args.seed * 1000 + i) / args.length_scale).astype(np.int64)
        out.append(np.clip(lengths, 1, args.token_cap))
    return out


class BusyCalibrator:
    """Times forward + backward of single microbatches on one device (memoised by layout), in CPU seconds.

    Busy time is the CPU time of the calling process while one microbatch runs (see NPROC above), not its wall time:
    on a shared machine the load changes between the moments each layout is timed and the moments the engines run,
    and wall-time calibrations taken under heavier load than the steps overstated compute (measured across 2
    processes: calibrated busy time 1.8x the ODC step's wall, bubble rates of -0.81; the cost model fitted 6x the
    single-process one). CPU time is what the computation costs wherever it runs; the steps' walls then also count
    time a device spent descheduled as bubble, which is what it is to the step.
    """

    clock = staticmethod(time.process_time)

    def __init__(self, model, groups):
        flats = model.flatten_groups(groups)
        self.params = {g: model.layouts[g].unflatten(jnp.asarray(v)) for g, v in flats.items()}
        # the engines rematerialise every stage in the backward pass; so does the calibration
        self.grad = jax.jit(jax.value_and_grad(functools.partial(model.loss, remat=True)))
        self.cache: dict[bytes, float] = {}

    def seconds(self, microbatch: dict, length: int | None = None) -> float:
        """Forward + backward of one microbatch on its first `length` tokens (default: all)."""
        length = length or microbatch["tokens"].shape[-1]
        # compute time depends on the layout (segments, run length), not on the token ids: one timing per layout,
        # so identical microbatches of two plans get identical busy times
        key = microbatch["segment_ids"].tobytes() + bytes(str(length), "ascii")
        if key not in self.cache:
            mb = {k: jnp.asarray(v[None, :length]) for k, v in microbatch.items()}
            mb["normalizer"] = jnp.float32(1.0)
            jax.block_until_ready(self.grad(self.params, mb))
            times = []
            for _ in range(5):
                t0 = self.clock()
                jax.block_until_ready(self.grad(self.params, mb))
                times.append(self.clock() - t0)
            self.cache[key] = float(np.median(times))
        return self.cache[key]

    def lockstep_seconds(self, batch, lengths) -> float:
        """Compute-only wall of a lock-step schedule: every round runs at the longest bucket any device needs in it,
        and lasts as long as its slowest device."""
        arrays = batch.as_dict()
        used = (np.asarray(batch.segment_ids) > 0).sum(-1)
        total = 0.0
        for m in range(int(batch.counts.max()) if batch.counts.size else 0):
            rows = [d for d in range(batch.num_devices) if m < batch.counts[d] and used[d, m]]
            if not rows:
                continue
            length = int(max(lengths[np.searchsorted(lengths, used[d, m])] for d in rows))
            total += max(self.seconds({k: v[d, m] for k, v in arrays.items()}, length) for d in rows)
        return total

    def busy(self, batch, lengths) -> np.ndarray:
        """Busy seconds per device: its non-empty microbatches, each timed alone at its own (smallest) bucket."""
        arrays = batch.as_dict()
        used = (np.asarray(batch.segment_ids) > 0).sum(-1)
        out = np.zeros(batch.num_devices)
        for d in range(batch.num_devices):
            for m in range(int(batch.counts[d])):
                if used[d, m]:
                    length = int(lengths[np.searchsorted(lengths, used[d, m])])
                    out[d] += self.seconds({k: v[d, m] for k, v in arrays.items()}, length)
        return out


class LocalSync:
    """What `run` needs to agree on when its devices span processes (bench/multiprocess.py passes an MPI version):
    here, one process, nothing to do."""

    def agree(self, value):
        """The value every process uses (the plans depend on it, so they must be equal everywhere)."""
        return value

    def slowest(self, seconds):
        """Per-step wall times, the slowest process's."""
        return np.asarray(seconds)

    def per_process(self, value):
        """`value` of every process, in process order."""
        return [value]


class Contender:
    """One row's engine and minibatches: built and compiled once (every shape stepped once), then timed pass by pass,
    so that `paired_rounds` can time every row's pass of a round back to back."""

    def __init__(self, engine_cls, model, groups, mesh, batches, optimizer, length_buckets, sync=None, **options):
        self.batches, self.sync = batches, sync or LocalSync()
        self.engine = engine_cls(model, groups, mesh, optimizer=optimizer, length_buckets=length_buckets, **options)
        self.walls: list[np.ndarray] = []  # per timed pass: the per-step walls of the slowest process
        self.own = {"wall_s": 0.0, "cpu_s": 0.0}  # this process's own wall and CPU seconds over the timed passes
        try:
            self.warm_up()
        except BaseException:
            self.engine.close()
            raise

    def warm_up(self) -> None:
        """Steps every minibatch once (compiles every shape); a subclass may check the first step here."""
        for b in self.batches:
            self.engine.step(b)

    def timed_pass(self) -> float:
        """Steps every minibatch once; the pass's wall (the slowest process's steps, summed)."""
        cpu0 = time.process_time()
        walls = [self.engine.step(b).seconds for b in self.batches]
        self.own["cpu_s"] += time.process_time() - cpu0
        self.own["wall_s"] += float(np.sum(walls))
        self.walls.append(np.asarray(self.sync.slowest(walls), np.float64))
        return float(self.walls[-1].sum())

    def close(self) -> None:
        self.engine.close()


def paired_rounds(contenders: dict, rounds: int) -> dict[str, list[float]]:
    """Times `rounds` rounds; in each, every contender's pass back to back (the order rotated round by round, the
    same in every process), so a ratio of two passes of one round sees the same machine load. Returns each
    contender's pass walls in round order."""
    names = list(contenders)
    passes = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            passes[name].append(contenders[name].timed_pass())
    return passes


def paired_speedup(passes: dict[str, list[float]], faster: str, slower: str) -> float:
    """`faster`'s samples/s over `slower`'s (the same minibatches): the median over rounds of the ratio of their
    pass walls in that round."""
    return float(np.median(np.asarray(passes[slower]) / np.asarray(passes[faster])))


def microbatch_overhead(model, groups, mesh, optimizer, length_buckets, calibrator, token_cap, vocab,
                        sync=None) -> float:
    """Seconds one more microbatch adds to an ODC step beyond its own compute (per-layer gathers and pushes, the
    loop): steps with 1 and 3 one-sequence microbatches of 16 tokens per device, less the calibrated compute of the
    extra two."""
    devices = int(mesh.shape["d"])
    lengths = np.asarray(tuple(length_buckets) + (token_cap,))
    rng = np.random.default_rng(12345)
    engine = ODCEngine(model, groups, mesh, optimizer=optimizer, length_buckets=length_buckets)
    walls, busy = {}, {}
    try:
        for k in (1, 3):
            seq_lengths = np.full(k * devices, 16)
            plan = get_planner("local_sort")(seq_lengths, devices, token_cap)  # one sequence per microbatch
            batch = minibatch_from_plan(plan, *make_sequences(seq_lengths, rng, vocab))
            engine.step(batch)
            walls[k] = float(np.median((sync or LocalSync()).slowest([engine.step(batch).seconds for _ in range(7)])))
            busy[k] = float(calibrator.busy(batch, lengths).max())
    finally:
        engine.close()
    return max(0.0, (walls[3] - walls[1] - (busy[3] - busy[1])) / 2)


def hsdp_ratios(passes: dict[str, list[float]]) -> dict:
    """HSDP-ODC's samples/s over each other row present of hsdp_collective, odc and collective, from paired rounds
    (`paired_speedup`): {"hsdp_odc_vs_<row>": ratio}; empty without an hsdp_odc row."""
    if "hsdp_odc" not in passes:
        return {}
    return {f"hsdp_odc_vs_{other}": paired_speedup(passes, "hsdp_odc", other)
            for other in ("hsdp_collective", "odc", "collective") if other in passes}


def fitted_cost(args, calibrator, sync):
    """The cost model the plans balance: a quadratic fitted to this model's time at a few lengths alone, each run at
    exactly its length (LB-Mini, told the buckets, adds the padding a packed microbatch runs with at the fit's
    linear rate); linear when the fit fails. Every process agrees on one."""
    probe_lengths = np.array([128, 256, 512, 1024])
    probe_costs = []
    for s in probe_lengths:
        mb = {"tokens": np.zeros(args.token_cap, np.int32), "targets": np.zeros(args.token_cap, np.int32),
              "loss_mask": np.zeros(args.token_cap, np.float32), "positions": np.zeros(args.token_cap, np.int32),
              "segment_ids": (np.arange(args.token_cap) < s).astype(np.int32)}
        mb["positions"][:s] = np.arange(s)
        probe_costs.append(calibrator.seconds(mb, int(s)))
    try:
        cost_model = QuadraticCost.fit(probe_lengths, np.asarray(probe_costs))
    except ValueError:
        cost_model = LinearCost()
    return sync.agree(cost_model)


def engine_row(args, name, prepared, contender, passes, calibrator, lengths, local, sync) -> tuple[dict, float]:
    """One engine's row of a scenario (throughput, bubbles, balance, per-process time), and the total of its
    compute-only step times (the balance bound's side)."""
    planner, engine_cls, batches, busy = prepared
    walls = np.concatenate(contender.walls)  # every timed pass's per-step walls
    own = dict(contender.own)
    own["busy_s"] = args.rounds * float(sum(b[local].sum() for b in busy))  # this process's devices' compute
    busy_total = args.rounds * np.array([b.sum() for b in busy])
    if engine_cls is ODCEngine:
        ideal = np.array([b.max() for b in busy])
    else:
        ideal = np.array([calibrator.lockstep_seconds(b, lengths) for b in batches])
    tokens = args.rounds * np.array([b.num_tokens for b in batches])
    return {
        "planner": planner + ("+buckets" if name in BUCKET_PLANNED else ""),
        "wall_s": float(np.median(walls)),
        "samples_per_s": float(args.rounds * np.sum([b.num_sequences for b in batches]) / walls.sum()),
        "tokens_per_s": float(tokens.sum() / walls.sum()),
        "bubble_rate": float(1 - busy_total.sum() / (args.devices * walls.sum())),
        "efficiency": float((busy_total.sum() / args.devices) / walls.sum()),
        "imbalance": float(np.mean([b.max() / max(b.mean(), 1e-12) for b in busy])),
        "microbatches_per_device": [int(c) for c in batches[0].counts],
        "compute_only_wall_s": float(np.median(ideal)),
        "schedule_efficiency": float(args.rounds * ideal.sum() / walls.sum()),
        "pass_walls_s": passes[name],
        # where each process's time went over the timed passes: its devices' calibrated compute (busy_s), the
        # CPU it spent beyond that (cpu_s - busy_s: communication, dispatch, host work) and the wall it did
        # not run at all (wall_s - cpu_s: waiting for peers, or descheduled on a loaded machine)
        "per_process": sync.per_process(own),
    }, float(ideal.sum())


def run_scenario(scenario, args, setup, contenders, rng) -> dict:
    """Every contender on one scenario's minibatches (planned by its planner), timed in paired rounds."""
    model, groups, meshes, calibrator, cost_model, overhead, length_buckets, lengths, local, sync, vocab = setup
    lengths_per_mb = scenario_lengths(scenario, args, rng)
    data = [make_sequences(mb_lengths, rng, vocab) for mb_lengths in lengths_per_mb]
    prepared, built = {}, {}
    try:
        for name, planner, engine_cls in contenders:
            plan_fn = get_planner(planner)
            if name in BUCKET_PLANNED:  # ODC plans for the buckets it runs at (jodc.balance.buckets)
                plan_fn = functools.partial(plan_fn, length_buckets=length_buckets, microbatch_overhead=overhead)
            batches = [minibatch_from_plan(plan_fn(mb_lengths, args.devices, args.token_cap, cost_model=cost_model),
                                           *seqs) for mb_lengths, seqs in zip(lengths_per_mb, data)]
            prepared[name] = (planner, engine_cls, batches, [calibrator.busy(b, lengths) for b in batches])
            built[name] = Contender(engine_cls, model, groups, meshes[name], batches, OPTIMIZER, length_buckets,
                                    sync, **ENGINE_OPTIONS.get(name, {}))
        passes = paired_rounds(built, args.rounds)
    finally:
        for contender in built.values():
            contender.close()
    rows, ideal_totals = {}, {}
    for name in prepared:
        rows[name], ideal_totals[name] = engine_row(args, name, prepared[name], built[name], passes, calibrator,
                                                    lengths, local, sync)
    baselines = [n for n in ("collective", "xla_spmd") if n in rows]
    best_name = max(baselines, key=lambda n: rows[n]["samples_per_s"])
    out = {"engines": rows, "odc_speedup": paired_speedup(passes, "odc", best_name),
           "balance_bound": ideal_totals[best_name] / ideal_totals["odc"], "best_baseline": best_name}
    out.update(hsdp_ratios(passes))
    if "odc_det" in rows:  # step time of deterministic ODC relative to the default (same plans): 1.05 = 5% slower
        out["deterministic_cost"] = paired_speedup(passes, "odc", "odc_det")
    return out


OPTIMIZER = OptimizerConfig(learning_rate=1e-4)


def run(args, sync=None, contenders=CONTENDERS) -> dict:
    """The whole comparison on `args.devices` devices. `sync`: see LocalSync (devices spanning processes: every
    process calls this, with the same arguments). `contenders`: a subset of CONTENDERS ("odc" and at least one of
    "collective" / "xla_spmd" are needed)."""
    sync = sync or LocalSync()
    if args.quick:
        args.minibatches, args.layers, args.rounds = 2, 2, min(args.rounds, 2)
    devices = jax.devices("cpu")[: args.devices]
    mesh = Mesh(np.array(devices), ("d",))
    meshes = {name: sharding.hsdp_mesh(devices, args.replicas) if name.startswith("hsdp_") else mesh
              for name, _, _ in contenders}
    local = np.array([d.process_index == jax.process_index() for d in devices])  # this process's devices
    config = DecoderConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                           num_layers=args.layers, num_heads=4, num_kv_heads=2, attention_block_size=128,
                           max_position_embeddings=args.token_cap)
    model, groups = decoder_staged_model(config, seed=args.seed)
    calibrator = BusyCalibrator(model, groups)
    # every engine runs a microbatch at the smallest of these lengths that holds it (per device under ODC, per
    # lock-step round under the others), so a microbatch costs about what it holds
    length_buckets = tuple(args.token_cap // f for f in (4, 2))
    lengths = np.asarray(length_buckets + (args.token_cap,))
    cost_model = fitted_cost(args, calibrator, sync)
    # what one more microbatch costs ODC beyond its tokens, in the cost model's units (seconds): LB-Mini weighs it
    # against the padding a split into shorter buckets saves
    overhead = sync.agree(microbatch_overhead(model, groups, mesh, OPTIMIZER, length_buckets, calibrator,
                                              args.token_cap, config.vocab_size, sync))
    rng = np.random.default_rng(args.seed)
    results = {"config": {"devices": args.devices, "layers": args.layers, "hidden": args.hidden,
                          "token_cap": args.token_cap, "seqs_per_device": args.seqs_per_device,
                          "minibatches": args.minibatches, "cost_model": repr(cost_model),
                          "microbatch_overhead_s": overhead,
                          "length_buckets": [int(x) for x in lengths]}}
    setup = (model, groups, meshes, calibrator, cost_model, overhead, length_buckets, lengths, local, sync,
             config.vocab_size)
    for scenario in ("imbalanced", "balanced"):
        results[scenario] = run_scenario(scenario, args, setup, contenders, rng)
    for key in ("odc_speedup", "balance_bound") + (("deterministic_cost",) if "deterministic_cost" in
                                                   results["balanced"] else ()):
        results[f"{key}_imbalanced"] = results["imbalanced"][key]
        results[f"{key}_balanced"] = results["balanced"][key]
    return results


def print_table(r: dict) -> None:
    c = r["config"]
    print(f"End-to-end SFT step, {c['devices']} CPU devices x 1 thread, decoder {c['layers']} layers x {c['hidden']}, "
          f"T={c['token_cap']}, {c['seqs_per_device']} sequences/device, {c['minibatches']} minibatches, "
          f"ODC microbatch overhead {1e3 * c['microbatch_overhead_s']:.1f} ms")
    print(f"{'scenario':<12}{'engine':<16}{'planner':<16}{'samples/s':>10}{'tokens/s':>10}{'bubble':>8}"
          f"{'effic.':>8}{'sched.':>8}{'imbal.':>8}  microbatches/device")
    for scenario in ("imbalanced", "balanced"):
        for name, row in r[scenario]["engines"].items():
            print(f"{scenario:<12}{name:<16}{row['planner']:<16}{row['samples_per_s']:>10.2f}{row['tokens_per_s']:>10.0f}"
                  f"{row['bubble_rate']:>8.2f}{row['efficiency']:>8.2f}{row['schedule_efficiency']:>8.2f}"
                  f"{row['imbalance']:>8.2f}  "
                  f"{row['microbatches_per_device']}")
    print("Per process, timed passes (s): wall = calibrated compute of its devices + other CPU (communication, "
          "dispatch, host) + not running (waiting for peers, or descheduled)")
    for scenario in ("imbalanced", "balanced"):
        for name, row in r[scenario]["engines"].items():
            parts = [f"p{p}: {q['wall_s']:.2f} = {q['busy_s']:.2f} + {q['cpu_s'] - q['busy_s']:.2f} + "
                     f"{q['wall_s'] - q['cpu_s']:.2f}" for p, q in enumerate(row.get("per_process", []))]
            print(f"  {scenario:<12}{name:<16}" + "   ".join(parts))
    print(f"ODC speed-up over the faster baseline: imbalanced {r['odc_speedup_imbalanced']:.2f}, "
          f"balanced {r['odc_speedup_balanced']:.2f}")
    print(f"Balance bound (compute-only walls from the calibration, lock-step / ODC schedule): imbalanced "
          f"{r['balance_bound_imbalanced']:.2f}, balanced {r['balance_bound_balanced']:.2f}")
    if "deterministic_cost_balanced" in r:
        print(f"Deterministic ODC (odc_det, same plans) step time / default ODC: imbalanced "
              f"{r['deterministic_cost_imbalanced']:.3f}, balanced {r['deterministic_cost_balanced']:.3f}")
    print("effic. = ideal (busy / devices) / wall; sched. = the schedule's compute-only wall / measured wall")


def summary_line(r: dict) -> dict:
    """The JSON line: the headline ratios, and per scenario and engine samples/s and the bubble rate."""
    line = {"odc_speedup_imbalanced": round(r["odc_speedup_imbalanced"], 4),
            "odc_speedup_balanced": round(r["odc_speedup_balanced"], 4),
            "balance_bound_imbalanced": round(r["balance_bound_imbalanced"], 4),
            "balance_bound_balanced": round(r["balance_bound_balanced"], 4),
            "deterministic_cost_imbalanced": round(r["deterministic_cost_imbalanced"], 4),
            "deterministic_cost_balanced": round(r["deterministic_cost_balanced"], 4)}
    for scenario in ("imbalanced", "balanced"):
        for name, row in r[scenario]["engines"].items():
            line[f"{scenario}_{name}_samples_per_s"] = round(row["samples_per_s"], 3)
            line[f"{scenario}_{name}_bubble_rate"] = round(row["bubble_rate"], 4)
    return line


def main(args) -> dict:
    r = run(args)
    line = summary_line(r)
    harness.report(line, harness.output(args, "e2e.json"), lambda: print_table(r),
                   saved={"summary": line, "details": r})
    return r

if __name__ == "__main__":
    main(ARGS)
    sys.exit(0)
