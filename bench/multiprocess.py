"""ODC across processes: the MPI transport's ops against XLA's collectives over the same processes (gloo).

`python -m bench.multiprocess` is the whole command: it starts its own `mpirun -np 2` (and `-np 4` unless
--nprocs says otherwise), one CPU device per process, and prints the combined table and one JSON line at the end
(also written to bench/results/multiprocess.json unless --no-save).

Per op and bucket size (fp32, default 4 and 16 MiB), one jitted program per contender issues `--ops` ops back to
back on one bucket:
- gather: `--ops` x jodc.ops.gather (MPI_Get of every remote shard) vs `--ops` x lax.all_gather of the shards;
- scatter: `--ops` x jodc.ops.scatter_accumulate (MPI_Accumulate into every owner) followed by one barrier, so all
  pushes have landed when the program ends, vs `--ops` x lax.psum_scatter of the full gradient.
Each round times every contender once, back to back, each call started after an MPI barrier and timed as the
slowest process's wall time; a ratio is XLA's time over ODC's in the same round, and the reported figure is the
median of the rounds' ratios (robust to a shared machine's load drifts).

Allocator: the workers run with glibc's malloc tunables MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ raised, so
XLA's per-execution buffers of many MiB are reused instead of being mmapped and page-faulted anew on every call
(on this VM a fresh 8 MiB buffer costs ~17 ms of page faults, more than the transfer). Both contenders run in the
same processes with the same setting; --default-malloc measures without it.

End to end (`mpirun -np 2`, 2 processes x 1 CPU device, `NPROC=1` as in bench/e2e.py): bench/e2e.py's
`run` itself (same decoder, LongAlign-like imbalanced and perfectly balanced SFT minibatches, length buckets,
calibration, planners: ODC + LB-Mini for the buckets vs the collective engine and XLA-SPMD with LB-Micro) on a mesh
whose devices live in different processes: ODC over the MPI transport, the lock-step engines over gloo. The
processes agree on what the plans depend on (the fitted cost model and ODC's measured per-microbatch overhead,
process 0's), and a step's wall is the slowest process's. `mp_odc_speedup_*` is ODC's samples/s over the faster
lock-step engine's. --quick: 2 minibatches of a 2-layer model (bench/e2e.py --quick); --skip-ops / --skip-e2e run
one half only.

HSDP (--hsdp; `mpirun -np 2`, 2 processes x --hsdp-local-devices CPU devices, 1 thread each): the same end-to-end
comparison on 4 devices with four rows: flat ODC over the MPI transport (`odc`), HSDP-ODC with a replica group per
process (`hsdp_odc`: in-process heaps, the cross-replica reduce over gloo once per minibatch), flat collective FSDP
over gloo (`collective`) and HSDP-collective (`hsdp_collective`: gathers inside a process, an all-reduce across
them per microbatch). `mp_hsdp_odc_vs_hsdp_collective_*` and `mp_hsdp_odc_vs_flat_odc_*` are samples/s ratios from
paired rounds (bench/e2e.py: every row's pass over the same minibatches back to back per round, median of the rounds'
ratios).

Progress (each op's ratio; each end-to-end phase with wall and process 0's CPU time) goes to stderr as the workers
report it. Every mpirun is bounded by --timeout; on expiry it and all its workers are killed (the whole session).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench import harness  # noqa: E402
from tools.mpirun import mpi_env, mpirun_command, stream_session  # noqa: E402
RESULT_PREFIX = "MPBENCH "
PROGRESS_PREFIX = "# progress: "
E2E_TABLE_HEADING = "# end to end across "


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nprocs", type=int, nargs="+", default=[2, 4], help="process counts to run (1 device each)")
    p.add_argument("--mib", type=float, nargs="+", default=[4.0, 16.0], help="bucket sizes in MiB (fp32)")
    p.add_argument("--ops", type=int, default=4, help="ops per jitted program")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--timeout", type=float, default=3600,
                   help="seconds per mpirun; on expiry mpirun and all its workers are killed")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--default-malloc", action="store_true", help="leave glibc's malloc thresholds at their defaults")
    p.add_argument("--quick", action="store_true", help="end to end: bench/e2e.py --quick (2 minibatches, 2 layers)")
    p.add_argument("--skip-ops", action="store_true", help="only the end-to-end comparison")
    p.add_argument("--skip-e2e", action="store_true", help="only the op-level comparison")
    p.add_argument("--e2e-nprocs", type=int, default=2, help="processes (1 device each) for the end-to-end part")
    p.add_argument("--e2e-rounds", type=int, default=None,
                   help="paired rounds of the end-to-end and HSDP parts (bench/e2e.py --rounds; its default if unset)")
    p.add_argument("--hsdp", action="store_true", help="also the HSDP comparison (2 processes x --hsdp-local-devices)")
    p.add_argument("--hsdp-local-devices", type=int, default=2, help="CPU devices per process of the HSDP comparison")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-e2e", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-hsdp", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------- worker side
def op_bodies(heap, b, k: int, numel: int) -> dict:
    """{op: (ODC body, XLA body)}: `k` gathers of bucket `b` against `k` all_gathers, `k` scatter-accumulates (and a
    barrier) against `k` psum_scatters, each a shard_map body over one device's slice."""
    from jax import lax

    from jodc import ops

    def odc_gather(x):
        tok = ops.new_token()
        acc = x[0, :1]
        for _ in range(k):
            # each gather waits for the previous one's consumer, as each all_gather below waits for its
            # input: one output buffer is live at a time in both programs (without this XLA may keep all k
            # outputs live, allocate k x the bucket afresh per call and page-fault through it)
            tok = ops.after(tok, acc)
            full, tok = ops.gather(b, tok)
            acc = acc + full[:1]
        return acc[None]

    def xla_gather(x):
        s = x[0]
        acc = s[:1]
        for _ in range(k):
            full = lax.all_gather(s + acc[0] * 0, "d", tiled=True)
            acc = acc + full[:1]
        return acc[None]

    def odc_scatter(g):
        tok = ops.new_token()
        for _ in range(k):
            tok = ops.scatter_accumulate(b, g[0][:numel], tok)
        tok = ops.barrier(heap, tok)
        return ops.depend_on(g[0, :1], tok)[None]

    def xla_scatter(g):
        full = g[0]
        acc = full[:1]
        for _ in range(k):
            part = lax.psum_scatter(full + acc[0] * 0, "d", scatter_dimension=0, tiled=True)
            acc = acc + part[:1]
        return acc[None]

    return {"gather": (odc_gather, xla_gather), "scatter": (odc_scatter, xla_scatter)}


def paired_times(timed, odc_fn, xla_fn, arg, rounds: int) -> tuple[list, list, list]:
    """(ODC seconds, XLA seconds, XLA / ODC) per round, the two alternating; three untimed rounds first (compile,
    warm up)."""
    for _ in range(3):
        timed(odc_fn, arg)
        timed(xla_fn, arg)
    t_odc, t_xla, ratios = [], [], []
    for _ in range(rounds):
        a, c = timed(odc_fn, arg), timed(xla_fn, arg)
        t_odc.append(a)
        t_xla.append(c)
        ratios.append(c / a)
    return t_odc, t_xla, ratios


def worker(args) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    from mpi4py import MPI

    import jax

    jax.distributed.initialize(cluster_detection_method="mpi4py")
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jodc import ops

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    world = mesh.shape["d"]
    sharding = NamedSharding(mesh, P("d"))
    k = args.ops

    def per_device(shape, value):
        return jax.make_array_from_callback((world, *shape), sharding,
                                            lambda idx: np.full((1, *shape), value, np.float32))

    def timed(fn, arg) -> float:
        comm.Barrier()
        t0 = time.perf_counter()
        jax.block_until_ready(fn(arg))
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    def smap(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"),), out_specs=P("d")))

    rows, t_start = [], time.monotonic()
    for mib in args.mib:
        numel = int(mib * 2**20) // 4
        with ops.SymmetricHeap(mesh) as heap:
            assert heap.transport == "mpi"
            b = heap.register(numel, name="bench")
            inputs = {"gather": per_device((b.shard_numel,), 1.0),
                      "scatter": per_device((b.shard_numel * world,), 1.0)}
            for op, (odc_body, xla_body) in op_bodies(heap, b, k, numel).items():
                t_odc, t_xla, ratios = paired_times(timed, smap(odc_body), smap(xla_body), inputs[op], args.rounds)
                b.zero_accumulators()
                rows.append({"nprocs": world, "op": op, "mib": mib, "odc_ms": float(np.median(t_odc)) * 1e3 / k,
                             "xla_ms": float(np.median(t_xla)) * 1e3 / k, "ratio": float(np.median(ratios))})
                if rank == 0:
                    print(f"{PROGRESS_PREFIX}{op} {mib:g} MiB: XLA / ODC {rows[-1]['ratio']:.2f} "
                          f"({time.monotonic() - t_start:.0f} s)", flush=True)
    if rank == 0:
        print(RESULT_PREFIX + json.dumps(rows), flush=True)


def e2e_worker(args, hsdp: bool = False) -> None:
    """bench/e2e.py's comparison across the processes: 1 device each, or with `hsdp` --hsdp-local-devices each and
    the flat and HSDP rows of ODC and collective FSDP (a replica group per process)."""
    local_devices = args.hsdp_local_devices if hsdp else 1
    # as bench/e2e.py: NPROC=1 (the fewest intra-op threads XLA keeps: 2 on jax 0.10.2)
    os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={local_devices} "
                               "--xla_cpu_multi_thread_eigen=false")
    os.environ.setdefault("NPROC", "1")
    from mpi4py import MPI

    import jax

    jax.distributed.initialize(cluster_detection_method="mpi4py")
    import numpy as np

    from bench import e2e

    comm = MPI.COMM_WORLD

    t_start, cpu_start = time.monotonic(), time.process_time()

    def progress(what: str) -> None:
        """One progress line (process 0) that the driver echoes live: wall and this process's CPU time so far."""
        if comm.Get_rank() == 0:
            print(f"{PROGRESS_PREFIX}{what}: {time.monotonic() - t_start:.0f} s wall, "
                  f"{time.process_time() - cpu_start:.0f} s CPU (process 0)", flush=True)

    class MPISync(e2e.LocalSync):
        def __init__(self):
            self.agreed = 0

        def agree(self, value):
            self.agreed += 1
            progress(("calibrated the cost model", "measured ODC's microbatch overhead")[min(self.agreed, 2) - 1])
            return comm.bcast(value, root=0)

        def slowest(self, seconds):
            local = np.asarray(seconds, np.float64)
            out = np.empty_like(local)
            comm.Allreduce(local, out, op=MPI.MAX)
            if len(out) > 1:  # a contender's timed pass (the overhead probe's 7 repeats count too)
                progress(f"timed {len(out)} steps ({1e3 * float(np.median(out)):.0f} ms median)")
            return out

        def per_process(self, value):
            return comm.allgather(value)

    e2e_args = e2e.parse_args(["--devices", str(jax.device_count()), "--replicas", str(jax.process_count())]
                              + (["--quick"] if args.quick else [])
                              + (["--rounds", str(args.e2e_rounds)] if args.e2e_rounds else []))
    if hsdp:
        contenders = [c for c in e2e.CONTENDERS if c[0] in ("odc", "collective")] + list(e2e.HSDP_CONTENDERS)
    else:
        contenders = [c for c in e2e.CONTENDERS if c[0] in ("odc", "collective", "xla_spmd")]
    r = e2e.run(e2e_args, MPISync(), contenders)
    if comm.Get_rank() == 0:
        print(f"{E2E_TABLE_HEADING}{jax.process_count()} processes x {jax.local_device_count()} device(s)", flush=True)
        e2e.print_table(r)
        print(RESULT_PREFIX + json.dumps(r), flush=True)


# --------------------------------------------------------------------------------------------------- driver side
def run_nprocs(nprocs: int, args, e2e: bool = False, hsdp: bool = False):
    env = harness.child_env(mpi_env())
    if not args.default_malloc:
        env.update(MALLOC_MMAP_THRESHOLD_=str(1 << 30), MALLOC_TRIM_THRESHOLD_=str(1 << 33))
    cmd = mpirun_command(nprocs, sys.executable, "-m", "mpi4py", "-m", "bench.multiprocess")
    if e2e or hsdp:
        cmd += ["--worker-hsdp" if hsdp else "--worker-e2e"] + (["--quick"] if args.quick else [])
        cmd += ["--hsdp-local-devices", str(args.hsdp_local_devices)]
        cmd += ["--e2e-rounds", str(args.e2e_rounds)] if args.e2e_rounds else []
    else:
        cmd += ["--worker", "--ops", str(args.ops), "--rounds", str(args.rounds), "--mib", *[str(m) for m in args.mib]]
    # Output is read as it comes: progress lines are echoed at once; on timeout the whole process group (mpirun and
    # its workers, started in a session of their own) is killed and the error shows the output so far.
    def echo(line: str) -> None:
        if line.startswith(PROGRESS_PREFIX):
            what = " (HSDP)" if hsdp else " (end to end)" if e2e else ""
            print(f"# mpirun -np {nprocs}{what}: {line[len(PROGRESS_PREFIX):]}", file=sys.stderr, flush=True)

    returncode, lines, timed_out = stream_session(cmd, env, args.timeout, echo)
    for line in lines:
        if line.startswith(RESULT_PREFIX):
            if e2e or hsdp:  # the worker's own table (from its heading on: MPI's and gloo's chatter before it is dropped)
                table = [i for i, x in enumerate(lines) if x.startswith(E2E_TABLE_HEADING)]
                sys.stderr.write("".join(x + "\n" for x in lines[table[0] if table else 0:]
                                         if not x.startswith((RESULT_PREFIX, PROGRESS_PREFIX))))
            return json.loads(line[len(RESULT_PREFIX):])
    why = f"did not finish within --timeout {args.timeout:g} s" if timed_out else f"failed (exit {returncode})"
    tail = "\n".join(lines)[-4000:]
    raise RuntimeError(f"mpirun -np {nprocs} {why}:\n{tail}")


def measure(args) -> tuple[list[dict], dict | None, dict | None]:
    """The op rows of every --nprocs, the end-to-end run and the HSDP run (None where skipped)."""
    rows, e2e, hsdp = [], None, None
    for n in [] if args.skip_ops else args.nprocs:
        t0 = time.monotonic()
        rows += run_nprocs(n, args)
        print(f"# mpirun -np {n}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    if not args.skip_e2e:
        t0 = time.monotonic()
        e2e = run_nprocs(args.e2e_nprocs, args, e2e=True)
        print(f"# mpirun -np {args.e2e_nprocs} (end to end): {time.monotonic() - t0:.0f} s", file=sys.stderr)
    if args.hsdp:
        t0 = time.monotonic()
        hsdp = run_nprocs(2, args, hsdp=True)
        print(f"# mpirun -np 2 (HSDP): {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return rows, e2e, hsdp


def main(args) -> dict:
    rows, e2e, hsdp = measure(args)
    summary = {"nprocs": min(args.nprocs), "malloc_tuned": not args.default_malloc}
    # each table prints itself and gives its JSON keys
    if rows:
        summary.update(op_table(rows, args))
    if e2e is not None:
        summary.update(e2e_table(e2e, args))
    if hsdp is not None:
        summary.update(hsdp_table(hsdp, args))
    only_hsdp = args.hsdp and args.skip_ops and args.skip_e2e  # a run of its own: keep the full run's file
    name = f"multiprocess{'_hsdp' if only_hsdp else ''}{'_quick' if args.quick else ''}.json"
    return harness.report(summary, harness.output(args, name),
                          saved={"summary": summary, "rows": rows, "e2e": e2e, "hsdp": hsdp})


def e2e_table(r: dict, args) -> dict:
    c = r["config"]
    print(f"End to end across {args.e2e_nprocs} processes x 1 CPU device (1 thread), decoder {c['layers']} layers x "
          f"{c['hidden']}, T={c['token_cap']}, {c['minibatches']} minibatches; samples/s (bubble rate)")
    print(f"{'scenario':<12}" + "".join(f"{n:>20}" for n in r["imbalanced"]["engines"]) + f"{'ODC speed-up':>14}"
          f"{'bound':>7}")
    out = {"e2e_nprocs": args.e2e_nprocs, "e2e_quick": bool(args.quick)}
    for scenario in ("imbalanced", "balanced"):
        rows = r[scenario]["engines"]
        print(f"{scenario:<12}" + "".join(f"{row['samples_per_s']:>13.2f} ({row['bubble_rate']:.2f})"
                                         for row in rows.values())
              + f"{r[scenario]['odc_speedup']:>14.2f}{r[scenario]['balance_bound']:>7.2f}")
        out[f"mp_odc_speedup_{scenario}"] = round(r[scenario]["odc_speedup"], 4)
        out[f"mp_balance_bound_{scenario}"] = round(r[scenario]["balance_bound"], 4)
        for name, row in rows.items():
            out[f"mp_{scenario}_{name}_samples_per_s"] = round(row["samples_per_s"], 3)
            out[f"mp_{scenario}_{name}_bubble_rate"] = round(row["bubble_rate"], 4)
    return out


def hsdp_table(r: dict, args) -> dict:
    """The HSDP comparison's table (samples/s and bubble rate per row) and its JSON keys."""
    c = r["config"]
    print(f"HSDP across 2 processes x {args.hsdp_local_devices} CPU devices (a replica group per process), decoder "
          f"{c['layers']} layers x {c['hidden']}, T={c['token_cap']}, {c['minibatches']} minibatches; samples/s "
          f"(bubble rate)")
    names = list(r["imbalanced"]["engines"])
    print(f"{'scenario':<12}" + "".join(f"{n:>20}" for n in names) + f"{'HSDP-ODC/HSDP-coll':>20}"
          f"{'HSDP-ODC/flat ODC':>19}")
    out = {"hsdp_local_devices": args.hsdp_local_devices, "hsdp_quick": bool(args.quick),
           "hsdp_rounds": len(r["imbalanced"]["engines"]["odc"]["pass_walls_s"])}
    for scenario in ("imbalanced", "balanced"):
        rows, s = r[scenario]["engines"], r[scenario]
        print(f"{scenario:<12}" + "".join(f"{rows[n]['samples_per_s']:>13.2f} ({rows[n]['bubble_rate']:.2f})"
                                         for n in names)
              + f"{s['hsdp_odc_vs_hsdp_collective']:>20.2f}{s['hsdp_odc_vs_odc']:>19.2f}")
        out[f"mp_hsdp_odc_vs_hsdp_collective_{scenario}"] = round(s["hsdp_odc_vs_hsdp_collective"], 4)
        out[f"mp_hsdp_odc_vs_flat_odc_{scenario}"] = round(s["hsdp_odc_vs_odc"], 4)
        walls = {n: rows[n]["pass_walls_s"] for n in ("odc", "hsdp_odc")}  # the spread behind the median
        out[f"mp_hsdp_odc_vs_flat_odc_{scenario}_per_round"] = [round(a / b, 4) for a, b in
                                                                 zip(walls["odc"], walls["hsdp_odc"])]
        for name, row in rows.items():
            out[f"mp_hsdp_{scenario}_{name}_samples_per_s"] = round(row["samples_per_s"], 3)
            out[f"mp_hsdp_{scenario}_{name}_bubble_rate"] = round(row["bubble_rate"], 4)
    return out


def op_table(rows: list[dict], args) -> dict:
    print(f"{'procs':>5} {'op':>8} {'MiB':>5} {'ODC ms/op':>10} {'XLA ms/op':>10} {'XLA/ODC':>8}  (XLA: all_gather / "
          f"psum_scatter over gloo; median of paired rounds)")
    for r in rows:
        print(f"{r['nprocs']:>5} {r['op']:>8} {r['mib']:>5g} {r['odc_ms']:>10.3f} {r['xla_ms']:>10.3f} "
              f"{r['ratio']:>8.2f}")
    two = [r for r in rows if r["nprocs"] == min(args.nprocs)]
    summary = {
        # the headline: the smaller ratio over the bucket sizes (the conservative figure)
        "mp_gather_vs_all_gather": min(r["ratio"] for r in two if r["op"] == "gather"),
        "mp_scatter_vs_psum_scatter": min(r["ratio"] for r in two if r["op"] == "scatter"),
    }
    for r in rows:
        summary[f"np{r['nprocs']}_{r['op']}_{r['mib']:g}mib_ratio"] = round(r["ratio"], 3)
    return summary


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.worker:
        worker(ARGS)
    elif ARGS.worker_e2e or ARGS.worker_hsdp:
        e2e_worker(ARGS, hsdp=ARGS.worker_hsdp)
    else:
        main(ARGS)
