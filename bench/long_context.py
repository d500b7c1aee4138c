"""Long sequences by data-aware context parallelism (CP): memory, measured steps, the simulator calibrated from them.

A LongAlign-like minibatch (the body of `longalign_sft` scaled to the CPU token cap, plus 1-2% of sequences drawn
log-uniformly from 4-8x the cap) trained three ways on `--devices` simulated CPU devices:

- ``data_aware``: `lb_mini_cp` plans under the ODC engine: each long sequence on a group of ``ceil(L / cap)`` (or
  more) lightly loaded devices chosen per minibatch, the short sequences balanced around the groups, the groups
  meeting only among themselves;
- ``lockstep_cp``: `lockstep_cp` plans under the collective engine (lock-step dynamic CP, its best group scale per
  minibatch);
- ``fixed_cp``: `fixed_cp` plans under the collective engine (every sequence split over all devices, rows packed
  with several split sequences, as a fixed CP mesh axis does).

What it measures, in one run:

(a) **Memory**: XLA's memory analysis of the compiled ODC step (one device's program: arguments + outputs - donated
    + temporaries) for one sequence of ``devices x cap`` tokens (8x the cap by default) split over all devices,
    with the engine's default K/V exchange (streamed, one member's K/V at a time; ``cp_memory_vs_cap``, target
    <= 1) and all-gathered (``cp_all_gather_memory_vs_cap``), against the same step for plain rows of ``cap``
    tokens (the cap's budget) and against the same engine running that sequence unsplit on one device (what it
    would need without CP).
(b) **Agreement**: each layout's first step against the reference engine on the same sequences unsplit (loss, grad
    norm, parameter updates: max relative difference).
(c) **Time, measured**: paired rounds (every layout's pass over the same minibatches back to back, the order
    rotated per round; ratios are medians over rounds) and one recorded per-device timeline per layout (the CP rows
    labelled with their group: `jodc.fsdp.timeline_analysis.label_cp_groups`). This machine's devices share its
    cores (8 devices on 2 here), so a device waiting for its peers lends its core to another and the measured
    walls count total work more than idling: the measured ratios understate what separate devices would see.
(c') **Across processes**: the same measured comparison under ``mpirun -np --processes`` (2 by default), each
    process holding its share of the devices (ODC's group ops over the MPI transport, the collective engine over
    gloo), process 0's calibrated cost model planning for all, each step's wall the slowest process's
    (``mp_measured_*`` keys; 0 skips it).
(d) **The simulator, calibrated**: per-token and per-pair compute from single microbatches timed alone (CPU
    seconds, as bench/e2e.py), ODC's fixed cost per microbatch (`bench.e2e.microbatch_overhead`), and the cost of
    one K/V exchange from a 2-device ODC step whose only microbatch is one CP group of 2 (2 devices on 2 cores: no
    sharing), less its calibrated compute. `jodc.sim.context_parallel` then predicts the three layouts' steps on
    ``--devices`` separate devices of this kind, and its predicted work per step is checked against the measured
    CPU seconds per step.
(e) **Cluster scale**: `cp_layouts_what_if` at ``--cluster-devices`` (1.5B model, A100s, 8 per node, a 64K cap,
    `longalign_long_tail`), and once with the calibrated CPU rates at the first scale. The headline keys
    (``cp_vs_fixed_cp`` <= 0.80, ``cp_vs_lockstep_cp`` <= 0.90, ``cp_idle_fraction`` < 0.15) are the A100 figures
    at the first (smallest) scale; every scale is in the JSON line.

Prints tables, then one JSON line (also written to bench/results/long_context.json unless --no-save, with the
data-aware layout's timeline events; --plot records every layout's and draws them to
bench/results/long_context_timeline_<layout>.png).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from bench import harness
from tools.mpirun import mpi_env, mpirun_command, stream_session


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--token-cap", type=int, default=256)
    p.add_argument("--seqs-per-device", type=int, default=8)
    p.add_argument("--long-fraction", type=float, default=0.015,
                   help="share of a minibatch's sequences drawn from the long tail (at least one per minibatch)")
    p.add_argument("--long-min", type=float, default=4.0, help="the long tail's shortest, in token caps")
    p.add_argument("--long-max", type=float, default=8.0, help="the long tail's longest, in token caps (at most "
                   "--devices: the world's capacity)")
    p.add_argument("--minibatches", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cluster-devices", default="64,128,256,512")
    p.add_argument("--cluster-minibatches", type=int, default=4)
    p.add_argument("--plot", action="store_true", help="draw the recorded timelines (matplotlib)")
    p.add_argument("--processes", type=int, default=2,
                   help="also measure the layouts with the devices split over this many processes (mpirun; 0: skip)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds before the mpirun job is killed")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one process of the mpirun job
    return harness.add_run_flags(p, "4 devices, 1 minibatch, 1 layer, 1 round, one cluster scale").parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    _devices = 4 if ARGS.quick else ARGS.devices
    _devices = _devices // ARGS.processes if ARGS.worker else _devices  # a worker holds its share
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={max(_devices, 2)}"
                               " --xla_cpu_multi_thread_eigen=false").strip()
    os.environ.setdefault("NPROC", "1")  # as bench/e2e.py: the fewest intra-op threads XLA keeps

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from bench.e2e import (  # noqa: E402
    BusyCalibrator, Contender, LocalSync, make_sequences, microbatch_overhead, paired_rounds, paired_speedup)
from bench.step_memory import capture_compiled  # noqa: E402
from jodc.balance import get_planner  # noqa: E402
from jodc.balance.cp_cost import ContextParallelCost, causal_pairs  # noqa: E402
from jodc.balance.cp_plan import CPPlan  # noqa: E402
from jodc.balance.cp_planners import CP_PLANNERS  # noqa: E402
from jodc.fsdp import CollectiveEngine, ODCEngine, OptimizerConfig, ReferenceEngine  # noqa: E402
from jodc.fsdp.batch import minibatch_from_plan  # noqa: E402
from jodc.fsdp.timeline_analysis import label_cp_groups, plot_timeline  # noqa: E402
from jodc.models.config import DecoderConfig  # noqa: E402
from jodc.sim.context_parallel import (  # noqa: E402
    cp_layouts_what_if, simulate_cp_lockstep, simulate_cp_odc)
from jodc.sim.lengths import get_length_distribution  # noqa: E402
from jodc.train.core.staged_decoder import decoder_staged_model  # noqa: E402

# layout -> (planner, engine)
LAYOUTS = {"data_aware": ("lb_mini_cp", ODCEngine), "lockstep_cp": ("lockstep_cp", CollectiveEngine),
           "fixed_cp": ("fixed_cp", CollectiveEngine)}
# eps far above sqrt(v): an update proportional to the gradient, so the agreement check compares gradients (Adam's
# normalisation would turn a near-zero gradient element's rounding difference into a full step; as the engine tests)
OPTIMIZER = OptimizerConfig(learning_rate=1e-1, max_grad_norm=1.0, eps=1.0)
VOCAB = 512
#: the body's lengths are LongAlign's at a 64K cap: scaled by token_cap / LONGALIGN_CAP
LONGALIGN_CAP = 65536
SHORTEST = 8
#: K/V exchanges a CP microbatch makes beyond the per-layer ones: the group keys' exchange and the closing barrier
EXTRA_EXCHANGES = 2
#: the mpirun worker's result line
RESULT_PREFIX = "LONGCTX "


def local_mesh(count: int) -> Mesh:
    """A mesh of this process's first `count` CPU devices (calibration runs in one process)."""
    return Mesh(np.array(jax.local_devices(backend="cpu")[:count]), ("d",))


def world_mesh(count: int) -> Mesh:
    return Mesh(np.array(jax.devices("cpu")[:count]), ("d",))


# ---- the data -----------------------------------------------------------------------------------------------------

def minibatch_lengths(args, index: int) -> np.ndarray:
    """One minibatch's lengths: `devices x seqs_per_device` sequences, max(1, round(long_fraction x n)) of them
    log-uniform in [long_min, long_max] x cap (at most the world's capacity), the rest LongAlign's body scaled to the
    cap; shuffled (seeded)."""
    n = args.devices * args.seqs_per_device
    n_long = max(1, round(args.long_fraction * n))
    rng = np.random.default_rng(args.seed * 1000 + index)
    body = get_length_distribution("longalign_sft").sample(n - n_long, seed=args.seed * 1000 + index)
    body = np.clip(np.ceil(body * args.token_cap / LONGALIGN_CAP), SHORTEST, args.token_cap).astype(np.int64)
    low, high = args.long_min * args.token_cap, min(args.long_max, args.devices) * args.token_cap
    long = np.exp(rng.uniform(np.log(low), np.log(high), n_long)).astype(np.int64)
    lengths = np.concatenate([body, np.clip(long, args.token_cap + 1, args.devices * args.token_cap)])
    return lengths[rng.permutation(n)]


@dataclasses.dataclass
class Minibatch:
    lengths: np.ndarray
    sequences: tuple  # inputs, targets, loss masks


def minibatches(args) -> list[Minibatch]:
    rng = np.random.default_rng(args.seed)
    out = []
    for i in range(args.minibatches):
        lengths = minibatch_lengths(args, i)
        out.append(Minibatch(lengths, make_sequences(lengths, rng, VOCAB)))
    return out


# ---- calibration: the cost model the planners balance and the simulator predicts with -------------------------------

def compute_rates(calibrator: BusyCalibrator, token_cap: int) -> tuple[float, float, float]:
    """(seconds per token, per causal pair, per call) of forward + backward on one device, CPU seconds: a least
    squares fit to one sequence of cap/8 .. cap tokens timed alone at its own length (negative terms dropped)."""
    lengths = np.array(sorted({max(SHORTEST, token_cap * f // 8) for f in (1, 2, 4, 6, 8)}))
    seconds = []
    for s in lengths:
        row = np.arange(token_cap)
        mb = {"tokens": np.zeros(token_cap, np.int32), "targets": np.zeros(token_cap, np.int32),
              "loss_mask": (row < s).astype(np.float32), "positions": np.where(row < s, row, 0).astype(np.int32),
              "segment_ids": (row < s).astype(np.int32)}
        seconds.append(calibrator.seconds(mb, int(s)))
    columns = {"token": lengths.astype(np.float64), "pair": causal_pairs(lengths), "call": np.ones(lengths.size)}
    names = list(columns)
    while True:
        coef = np.linalg.lstsq(np.stack([columns[n] for n in names], 1), np.asarray(seconds), rcond=None)[0]
        if (coef >= 0).all() or len(names) == 1:
            break
        names.pop(int(np.argmin(coef)))
    fitted = dict(zip(names, np.maximum(coef, 0.0)))
    if fitted.get("token", 0.0) == 0.0 and fitted.get("pair", 0.0) == 0.0:
        # no length dependence found (timer noise at tiny sizes, a loaded machine): take the time as per-token work,
        # the cost model needs some (ContextParallelCost refuses none)
        return float(np.median(np.asarray(seconds) / lengths)), 0.0, 0.0
    return fitted.get("token", 0.0), fitted.get("pair", 0.0), fitted.get("call", 0.0)


def prior_cost(model_config: DecoderConfig, per_token: float, per_pair: float, per_microbatch: float,
               exchange_seconds: float = 0.0) -> ContextParallelCost:
    """The CPU cost model: the fitted rates, fp32 K/V bytes per token and layer (gather, re-gather, reduce-scatter),
    an in-process copy link (its bandwidth is no limit next to the synchronisation) and `exchange_seconds` per
    exchange for the members to meet."""
    kv = 2 * model_config.num_kv_heads * model_config.head_dim * 4
    return ContextParallelCost(num_layers=model_config.num_layers, seconds_per_token=per_token,
                               seconds_per_pair=per_pair, exchange_bytes_per_token=float(3 * kv),
                               link_bandwidth=float("inf"), link_latency=0.0, layer_sync_seconds=exchange_seconds,
                               microbatch_seconds=per_microbatch)


def exchange_seconds(model, groups, cost: ContextParallelCost, token_cap: int, repeats: int = 5) -> float:
    """Seconds one K/V exchange adds to a CP microbatch: a 2-device ODC step whose only microbatch is one group of 2
    (a sequence of 2 x cap - 2 tokens), less its calibrated compute and fixed cost, over its exchanges."""
    mesh = local_mesh(2)
    length = 2 * token_cap - 2
    plan = CP_PLANNERS["fixed_cp"]([length], 2, token_cap, cost_model=cost)
    batch = minibatch_from_plan(plan, *make_sequences([length], np.random.default_rng(7), VOCAB))
    engine = ODCEngine(model, groups, mesh, optimizer=OPTIMIZER)
    try:
        engine.step(batch)
        wall = float(np.median([engine.step(batch).seconds for _ in range(repeats)]))
    finally:
        engine.close()
    compute = cost.microbatch_seconds + float(cost.member_compute([length], 2).max())
    exchanges = cost.num_layers * cost.exchanges_per_layer + EXTRA_EXCHANGES
    return max(0.0, (wall - compute) / exchanges)


def calibrate(args, model, groups, model_config: DecoderConfig) -> tuple[ContextParallelCost, dict]:
    calibrator = BusyCalibrator(model, groups)
    per_token, per_pair, per_call = compute_rates(calibrator, args.token_cap)
    mesh = local_mesh(2)
    # (the probe's engine runs its tiny microbatches at half the cap: one length bucket)
    overhead = microbatch_overhead(model, groups, mesh, OPTIMIZER, (args.token_cap // 2,), calibrator,
                                   args.token_cap, VOCAB)
    cost = prior_cost(model_config, per_token, per_pair, per_call + overhead)
    sync = exchange_seconds(model, groups, cost, args.token_cap)
    cost = dataclasses.replace(cost, layer_sync_seconds=sync)
    facts = {"seconds_per_token": per_token, "seconds_per_pair": per_pair, "seconds_per_call": per_call,
             "microbatch_overhead_s": overhead, "exchange_s": sync}
    return cost, facts


# ---- (a) memory ---------------------------------------------------------------------------------------------------

def compiled_bytes(engine, batch) -> dict:
    """XLA's memory analysis of `engine`'s compiled step for `batch` (one device's program), bytes."""
    captured = capture_compiled(engine)
    engine.step(batch)
    stats = captured["fn"].lower(*captured["args"]).compile().memory_analysis()
    xla = {k: int(getattr(stats, k + "_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
    xla["peak"] = xla["argument"] + xla["output"] - xla["alias"] + xla["temp"]
    return xla


def memory(args, model, groups, cost) -> dict:
    """The ODC step's memory for one sequence of devices x cap - 2 tokens split over all devices (its K/V streamed
    one member at a time, the engine's default, `cp`, or all-gathered, `cp_all_gather`), for plain rows of cap
    tokens, and for that sequence unsplit on one device (the same engine on a mesh of one)."""
    devices = jax.devices("cpu")
    rng = np.random.default_rng(11)
    long = [args.devices * args.token_cap - 2]
    plain = [args.token_cap] * args.devices
    split = CP_PLANNERS["fixed_cp"](long, args.devices, args.token_cap, cost_model=cost)
    cases = {"cp": (args.devices, long, split, "stream"), "cp_all_gather": (args.devices, long, split, "all_gather"),
             "cap": (args.devices, plain, get_planner("lb_micro")(plain, args.devices, args.token_cap), "all_gather"),
             "unsplit": (1, long, get_planner("lb_micro")(long, 1, long[0]), "all_gather")}
    rows = {}
    for name, (count, lengths, plan, kv_exchange) in cases.items():
        engine = ODCEngine(model, groups, Mesh(np.array(devices[:count]), ("d",)), optimizer=OPTIMIZER,
                           cp_kv_exchange=kv_exchange)
        try:
            rows[name] = compiled_bytes(engine, minibatch_from_plan(plan, *make_sequences(lengths, rng, VOCAB)))
        finally:
            engine.close()
    return {"sequence_tokens": long[0], "cap": args.token_cap, "bytes": rows,
            "cp_memory_vs_cap": rows["cp"]["peak"] / rows["cap"]["peak"],
            "cp_temp_vs_cap": rows["cp"]["temp"] / rows["cap"]["temp"],
            "cp_all_gather_memory_vs_cap": rows["cp_all_gather"]["peak"] / rows["cap"]["peak"],
            "unsplit_memory_vs_cap": rows["unsplit"]["peak"] / rows["cap"]["peak"]}


# ---- (b) agreement and (c) measured steps ---------------------------------------------------------------------------

def relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


class Layout(Contender):
    """One layout's engine and planned minibatches (`bench.e2e.Contender`: every minibatch stepped before timing, here
    twice, then timed pass by pass, a pass's wall the slowest process's), its first step checked against `reference`
    (when given)."""

    def __init__(self, name, args, model, groups, mesh, data: list[Minibatch], cost, reference=None, sync=None):
        planner, engine_cls = LAYOUTS[name]
        self.name, self.reference, self.start = name, reference, model.flatten_groups(groups) if reference else None
        self.plans = [CP_PLANNERS[planner](mb.lengths, args.devices, args.token_cap, cost_model=cost) for mb in data]
        self.agreement = {}
        super().__init__(engine_cls, model, groups, mesh, [minibatch_from_plan(p, *mb.sequences)
                                                           for p, mb in zip(self.plans, data)], OPTIMIZER, None, sync)

    def warm_up(self) -> None:
        first = self.engine.step(self.batches[0])
        if self.reference:
            params = self.engine.flat_params()
            ref_result, ref_params = self.reference
            self.agreement = {"loss": relative(first.loss, ref_result.loss),
                              "grad_norm": relative(first.grad_norm, ref_result.grad_norm),
                              "params": max(relative(params[g] - self.start[g], ref_params[g] - self.start[g])
                                            for g in ref_params)}
        for b in self.batches[1:]:
            self.engine.step(b)
        # and once more untimed: the first run after compiling costs about twice the CPU of later ones (ODC on 8
        # devices, measured by hand: 2.05 s against 1.0-1.1 s for the same three minibatches, no recompilation),
        # which biased round 0
        for b in self.batches:
            self.engine.step(b)

    def pass_walls(self) -> list[float]:
        return [float(w.sum()) for w in self.walls]

    def timeline(self) -> list[dict]:
        """The first minibatch's per-device events, CP rows labelled with their group."""
        result = self.engine.step(self.batches[0], record_timeline=True)
        return label_cp_groups(result.timeline, self.plans[0])

    def facts(self) -> dict:
        plan_stats = [{"groups": [list(g.members) for g in p.groups],
                       "microbatches": [len(items) for items in p.devices]} for p in self.plans]
        return {"plans": plan_stats, "agreement": self.agreement, "pass_walls_s": self.pass_walls()}


def reference_first_step(model, groups, data: list[Minibatch]):
    lengths = data[0].lengths
    plan = get_planner("lb_mini")(lengths, 1, int(lengths.max()))
    ref = ReferenceEngine(model, groups, optimizer=OPTIMIZER)
    result = ref.step(minibatch_from_plan(plan, *data[0].sequences))
    return result, ref.flat_params()


def measured(args, model, groups, data, cost, *, sync=None, check=True) -> tuple[dict, dict]:
    """(per layout: walls, CPU seconds, agreement, plans; the recorded timelines). Devices spanning processes:
    every process calls this, with `sync` (no agreement check or timelines there: `check=False`)."""
    mesh = world_mesh(args.devices)
    reference = reference_first_step(model, groups, data) if check else None
    layouts = {}
    try:
        for name in LAYOUTS:
            layouts[name] = Layout(name, args, model, groups, mesh, data, cost, reference, sync)
        passes = paired_rounds(layouts, args.rounds)
        # the data-aware layout's always (the bench's check that its CP rows carry their groups), the others' to plot
        timelines = {name: layout.timeline() for name, layout in layouts.items()
                     if check and (name == "data_aware" or args.plot)}
    finally:
        for layout in layouts.values():
            layout.close()
    steps = args.rounds * len(data)
    rows = {name: {**layout.facts(), "step_s": float(np.median(layout.pass_walls())) / len(data),
                   "cpu_s_per_step": layout.own["cpu_s"] / steps} for name, layout in layouts.items()}
    rows["data_aware"]["vs_fixed_cp"] = 1.0 / paired_speedup(passes, "data_aware", "fixed_cp")
    rows["data_aware"]["vs_lockstep_cp"] = 1.0 / paired_speedup(passes, "data_aware", "lockstep_cp")
    return rows, timelines


# ---- (c') the same across processes (mpirun) ------------------------------------------------------------------------

class MPISync(LocalSync):
    """Process 0's cost model for every process; a step's wall is the slowest process's."""

    def __init__(self, comm):
        self.comm = comm

    def agree(self, value):
        return self.comm.bcast(value, root=0)

    def slowest(self, seconds):
        from mpi4py import MPI

        local = np.asarray(seconds, np.float64)
        out = np.empty_like(local)
        self.comm.Allreduce(local, out, op=MPI.MAX)
        return out


def worker(args) -> None:
    """One process of the mpirun job: the layouts measured over every process's devices (process 0 calibrates on
    its own devices, every process plans with its cost model), process 0 prints the rows."""
    import json

    from mpi4py import MPI

    jax.distributed.initialize(cluster_detection_method="mpi4py")
    comm = MPI.COMM_WORLD
    sync = MPISync(comm)
    model, groups, config = build_model(args)
    cost = sync.agree(calibrate(args, model, groups, config)[0] if comm.Get_rank() == 0 else None)
    rows, _ = measured(args, model, groups, minibatches(args), cost, sync=sync, check=False)
    if comm.Get_rank() == 0:
        print(RESULT_PREFIX + json.dumps(rows), flush=True)


def across_processes(args) -> dict:
    """The measured section under `mpirun -np processes`, each process with devices / processes CPU devices."""
    import json

    cmd = mpirun_command(args.processes, sys.executable, "-m", "mpi4py", "-m", "bench.long_context", "--worker",
                         *worker_flags(args))
    code, lines, timed_out = stream_session(cmd, harness.child_env(mpi_env()), args.timeout)
    for line in lines:
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    why = f"did not finish within --timeout {args.timeout:g} s" if timed_out else f"failed (exit {code})"
    raise RuntimeError(f"mpirun -np {args.processes} {why}:\n" + "\n".join(lines)[-4000:])


def worker_flags(args) -> list[str]:
    """The flags that make a worker measure what this run measures."""
    flags = []
    for name in ("devices", "token_cap", "seqs_per_device", "long_fraction", "long_min", "long_max", "minibatches",
                 "rounds", "layers", "hidden", "seed", "processes"):
        flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return flags


# ---- (d) the simulator on this machine's devices and (e) at cluster scale ---------------------------------------------

def simulated(rows: dict, plans: dict[str, list[CPPlan]], cost: ContextParallelCost) -> dict:
    """Each layout's plans through the simulator with the calibrated rates: mean predicted step, idle fraction,
    total work per step (sum of busy seconds over devices: what 2 shared cores spend) beside the measured CPU."""
    out = {}
    for name, layout_plans in plans.items():
        sim = simulate_cp_odc if name == "data_aware" else simulate_cp_lockstep
        results = [sim(p, cost) for p in layout_plans]
        work = float(np.mean([sum(r.device_busy) for r in results]))
        out[name] = {"step_s": float(np.mean([r.step_time for r in results])),
                     "idle_fraction": float(np.mean([r.idle_fraction for r in results])),
                     "work_s": work, "work_vs_measured_cpu": work / rows[name]["cpu_s_per_step"]}
    out["cp_vs_fixed_cp"] = out["data_aware"]["step_s"] / out["fixed_cp"]["step_s"]
    out["cp_vs_lockstep_cp"] = out["data_aware"]["step_s"] / out["lockstep_cp"]["step_s"]
    return out


class ScaledLengths:
    """A minibatch generator for `cp_layouts_what_if` on this bench's CPU scale: `minibatch_lengths`'s mixture."""

    def __init__(self, args):
        self.args = args

    def sample(self, n: int, seed: int = 0) -> np.ndarray:
        args = argparse.Namespace(**{**vars(self.args), "seqs_per_device": 1, "devices": n, "seed": seed})
        args.long_max = min(self.args.long_max, self.args.devices)  # within one group of the bench's size
        return minibatch_lengths(args, 0)


def cluster(args, cost: ContextParallelCost) -> dict:
    scales = [int(x) for x in args.cluster_devices.split(",")]
    rows = {}
    for n in scales:
        w = cp_layouts_what_if(n, minibatches=args.cluster_minibatches, seed=args.seed)
        rows[str(n)] = {"cp_vs_fixed_cp": w.cp_vs_fixed_cp, "cp_vs_lockstep_cp": w.cp_vs_lockstep_cp,
                        "cp_idle_fraction": w.cp_idle_fraction, "cp_sequences": w.cp_sequences}
    w = cp_layouts_what_if(scales[0], seqs_per_device=args.seqs_per_device, token_cap=args.token_cap,
                           lengths=ScaledLengths(args), cost=cost, minibatches=args.cluster_minibatches,
                           seed=args.seed)
    calibrated = {"devices": scales[0], "cp_vs_fixed_cp": w.cp_vs_fixed_cp,
                  "cp_vs_lockstep_cp": w.cp_vs_lockstep_cp, "cp_idle_fraction": w.cp_idle_fraction}
    return {"a100": rows, "calibrated_cpu": calibrated, "headline_devices": scales[0]}


# ---- the run ------------------------------------------------------------------------------------------------------

def build_model(args):
    """(staged model, initial groups, config): the bench's decoder, the same in every process."""
    config = DecoderConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                           num_layers=args.layers, num_heads=4, num_kv_heads=2, attention_block_size=64,
                           max_position_embeddings=args.devices * args.token_cap)
    model, groups = decoder_staged_model(config, seed=args.seed)
    return model, groups, config


def run(args) -> dict:
    if args.quick:
        args.devices, args.minibatches, args.layers, args.rounds = 4, 1, 1, 1
        args.cluster_devices, args.cluster_minibatches = args.cluster_devices.split(",")[0], 1
    args.long_max = min(args.long_max, args.devices)
    if args.processes > 1 and args.devices % args.processes:
        raise ValueError(f"--devices {args.devices} does not split evenly over --processes {args.processes}")
    model, groups, config = build_model(args)
    cost, calibration = calibrate(args, model, groups, config)
    data = minibatches(args)
    rows, timelines = measured(args, model, groups, data, cost)
    plans = {name: [CP_PLANNERS[LAYOUTS[name][0]](mb.lengths, args.devices, args.token_cap, cost_model=cost)
                    for mb in data] for name in LAYOUTS}
    result = {"config": {k: getattr(args, k) for k in ("devices", "token_cap", "seqs_per_device", "long_fraction",
                                                       "long_min", "long_max", "minibatches", "rounds", "layers",
                                                       "hidden", "seed", "processes")},
              "lengths": [mb.lengths.tolist() for mb in data], "calibration": calibration,
              "memory": memory(args, model, groups, cost), "measured": rows,
              "simulated": simulated(rows, plans, cost), "cluster": cluster(args, cost), "timelines": timelines}
    if args.processes > 1:
        result["across_processes"] = across_processes(args)
    return result


def print_tables(r: dict) -> None:
    c, m = r["config"], r["memory"]
    print(f"Long-context CP, {c['devices']} CPU devices (sharing {os.cpu_count()} cores), decoder {c['layers']} "
          f"layers x {c['hidden']}, cap {c['token_cap']}, {c['seqs_per_device']} sequences/device, "
          f"{c['minibatches']} minibatches, {c['rounds']} paired rounds")
    long = [int(x) for mb in r["lengths"] for x in mb if x > c["token_cap"]]
    print(f"long sequences (tokens): {long}")
    b = m["bytes"]
    print(f"(a) memory, XLA per device (MiB: peak / temp): CP {m['sequence_tokens']} tokens over {c['devices']} "
          f"{b['cp']['peak'] / 2**20:.2f} / {b['cp']['temp'] / 2**20:.2f}; plain rows of the cap "
          f"{b['cap']['peak'] / 2**20:.2f} / {b['cap']['temp'] / 2**20:.2f}; unsplit on one device "
          f"{b['unsplit']['peak'] / 2**20:.2f} / {b['unsplit']['temp'] / 2**20:.2f}  -> CP / cap "
          f"{m['cp_memory_vs_cap']:.2f} (K/V all-gathered instead: {m['cp_all_gather_memory_vs_cap']:.2f}), "
          f"unsplit / cap {m['unsplit_memory_vs_cap']:.2f}")
    print(f"{'layout':<14}{'step s':>9}{'cpu s':>9}{'sim step':>10}{'sim idle':>9}{'sim work/cpu':>13}"
          f"{'loss err':>10}{'param err':>11}  groups (first minibatch)")
    for name, row in r["measured"].items():
        s = r["simulated"][name]
        print(f"{name:<14}{row['step_s']:>9.3f}{row['cpu_s_per_step']:>9.3f}{s['step_s']:>10.3f}"
              f"{s['idle_fraction']:>9.3f}{s['work_vs_measured_cpu']:>13.2f}{row['agreement']['loss']:>10.1e}"
              f"{row['agreement']['params']:>11.1e}  {row['plans'][0]['groups']}")
    d = r["measured"]["data_aware"]
    print(f"measured (paired rounds): data_aware / fixed_cp {d['vs_fixed_cp']:.3f}, / lockstep_cp "
          f"{d['vs_lockstep_cp']:.3f}; simulated on {c['devices']} separate devices: "
          f"{r['simulated']['cp_vs_fixed_cp']:.3f}, {r['simulated']['cp_vs_lockstep_cp']:.3f}")
    if "across_processes" in r:
        mp = r["across_processes"]
        print(f"{c['processes']} processes x {c['devices'] // c['processes']} devices (mpirun; walls the slowest "
              f"process's): step s " + ", ".join(f"{n} {row['step_s']:.3f}" for n, row in mp.items())
              + f"; data_aware / fixed_cp {mp['data_aware']['vs_fixed_cp']:.3f}, / lockstep_cp "
              f"{mp['data_aware']['vs_lockstep_cp']:.3f}")
    print("cluster (simulator; A100 x 8 per node, 1.5B, 64K cap, longalign_long_tail):")
    for n, row in r["cluster"]["a100"].items():
        print(f"  {n:>5} devices: vs fixed CP {row['cp_vs_fixed_cp']:.3f}, vs lock-step CP "
              f"{row['cp_vs_lockstep_cp']:.3f}, idle {row['cp_idle_fraction']:.3f}")
    cal = r["cluster"]["calibrated_cpu"]
    print(f"  {cal['devices']:>5} of this bench's CPU devices (calibrated): vs fixed CP {cal['cp_vs_fixed_cp']:.3f}, "
          f"vs lock-step CP {cal['cp_vs_lockstep_cp']:.3f}, idle {cal['cp_idle_fraction']:.3f}")


def summary_line(r: dict) -> dict:
    head = r["cluster"]["a100"][str(r["cluster"]["headline_devices"])]
    line = {"cp_vs_fixed_cp": round(head["cp_vs_fixed_cp"], 4), "cp_vs_lockstep_cp": round(head["cp_vs_lockstep_cp"], 4),
            "cp_idle_fraction": round(head["cp_idle_fraction"], 4),
            "targets_met": bool(head["cp_vs_fixed_cp"] <= 0.80 and head["cp_vs_lockstep_cp"] <= 0.90
                                and head["cp_idle_fraction"] < 0.15 and r["memory"]["cp_memory_vs_cap"] <= 1.0),
            "cp_memory_vs_cap": round(r["memory"]["cp_memory_vs_cap"], 4),
            "cp_all_gather_memory_vs_cap": round(r["memory"]["cp_all_gather_memory_vs_cap"], 4),
            "unsplit_memory_vs_cap": round(r["memory"]["unsplit_memory_vs_cap"], 4),
            "measured_cp_vs_fixed_cp": round(r["measured"]["data_aware"]["vs_fixed_cp"], 4),
            "measured_cp_vs_lockstep_cp": round(r["measured"]["data_aware"]["vs_lockstep_cp"], 4),
            "simulated_cp_vs_fixed_cp": round(r["simulated"]["cp_vs_fixed_cp"], 4),
            "simulated_cp_vs_lockstep_cp": round(r["simulated"]["cp_vs_lockstep_cp"], 4),
            "max_relative_error": float(f"{max(max(row['agreement'].values()) for row in r['measured'].values()):.3g}")}
    for n, row in r["cluster"]["a100"].items():
        for key in ("cp_vs_fixed_cp", "cp_vs_lockstep_cp", "cp_idle_fraction"):
            line[f"{key}_{n}"] = round(row[key], 4)
    if "across_processes" in r:
        line["mp_measured_cp_vs_fixed_cp"] = round(r["across_processes"]["data_aware"]["vs_fixed_cp"], 4)
        line["mp_measured_cp_vs_lockstep_cp"] = round(r["across_processes"]["data_aware"]["vs_lockstep_cp"], 4)
    return line


def main(args) -> dict:
    r = run(args)
    line = summary_line(r)
    out = harness.output(args, "long_context.json")
    if args.plot:
        for name, events in r["timelines"].items():
            plot_timeline(events, harness.results_path(f"long_context_timeline_{name}.png"),
                          num_devices=args.devices, title=f"{name}, first minibatch")
    harness.report(line, out, lambda: print_tables(r), saved={"summary": line, "details": r})
    return r


if __name__ == "__main__":
    if ARGS.worker:
        worker(ARGS)
    else:
        main(ARGS)
    sys.exit(0)
