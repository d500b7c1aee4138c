"""Throughput of the ODC primitives against XLA's collectives and a plain C++ memcpy, in one run.

Each contender moves the same bytes: buckets of `--mib` MiB (fp32) over `--devices` simulated CPU devices, measured
two ways: one op per jitted program, and `--layers` ops on as many buckets inside one program, the way a training
step issues them (one per layer). The JSON's headline ratios are the former (prefixed copies of both follow).
Bandwidth is algorithmic: devices x bucket bytes / seconds (every device receives, or sends, a full bucket per op),
so gather and all_gather (and scatter_accumulate and psum_scatter) are directly comparable. The memcpy rows copy a
bucket-sized buffer per thread. Times are medians of `--repeats` calls of one jitted op each. The ratios against
XLA are medians of per-round ratios (each round times every contender once, back to back), which cancels the slow
drifts of a shared machine's load; the memcpy reference is the median of measurements taken before and after
the collectives.

`--platform gpu` runs the same comparison on a CUDA mesh of `--devices` GPUs (default: all of them): jodc's CUDA
kernels (peer pointers over NVLink / PCIe P2P) against XLA's collectives there, which are NCCL's all_gather and
reduce_scatter. There is no memcpy row on GPUs. Results go to bench/results/primitives_gpu.json.

Prints a table, then one JSON line (also written to bench/results/primitives.json unless --no-save).
"""
from __future__ import annotations

import argparse
import os
import sys

from bench import harness


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                   help="cpu: simulated CPU devices; gpu: a CUDA mesh, against NCCL collectives")
    p.add_argument("--devices", type=int, default=None, help="devices in the mesh (cpu: 4; gpu: every GPU)")
    p.add_argument("--mib", type=float, default=16.0, help="bucket size in MiB (fp32)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--layers", type=int, default=8, help="buckets per program in the layer-stack mode")
    return harness.add_run_flags(p, "fewer repeats (for make demo)").parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.platform == "cpu":
    ARGS.devices = ARGS.devices or 4
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={ARGS.devices}").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from jodc import ops  # noqa: E402
from jodc.ops.transports import registration  # noqa: E402
from bench.device_timing import interleaved_times  # noqa: E402


def xla_all_gather(*shards):
    """XLA's side of the gathers: one all_gather per layer's shard, each result consumed."""
    acc = jnp.zeros(())
    for s in shards:
        acc = acc + lax.all_gather(s, "d", tiled=True)[0]
    return acc[None]


def xla_psum_scatter(*grads):
    """XLA's side of the scatters: one psum_scatter per layer's gradient, each result consumed."""
    acc = jnp.zeros(())
    for g in grads:
        acc = acc + lax.psum_scatter(g[0], "d", tiled=True)[0]
    return acc[None]


def measure(mesh, devices: int, numel: int, layers: int, repeats: int) -> dict:
    """Seconds per op, one entry per round, when one jitted program issues `layers` ops on `layers` different buckets
    (as a forward pass does, one per layer); layers=1 is a single op per program."""
    sharding = jax.sharding.NamedSharding(mesh, P("d"))

    def shard_mapped(body, n_in, donate=()):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"),) * n_in, out_specs=P("d")),
                       donate_argnums=donate)

    with ops.SymmetricHeap(mesh) as heap:
        buckets = [heap.register(numel, name=f"layer{i}") for i in range(layers)]
        for b in buckets:
            b.set_full(np.arange(numel, dtype=np.float32))
        padded = buckets[0].shard_numel * devices

        def odc_gather(_):
            token, acc = ops.new_token(), jnp.zeros(())
            for b in buckets:
                full, token = ops.gather(b, token)
                acc = acc + full[0]  # consume the result, as a layer would
            return acc[None]

        def odc_scatter(*grads):
            token = ops.new_token()
            for b, g in zip(buckets, grads):
                token = ops.scatter_accumulate(b, g[0], token)
            return token[None]

        def xla_psum_scatter_accumulate(*args):
            grads, accs = args[:layers], args[layers:]
            return jnp.stack([a + lax.psum_scatter(g[0], "d", tiled=True) for g, a in zip(grads, accs)])

        grads = [jax.device_put(jnp.full((devices, numel), 1.0 + i, jnp.float32), sharding) for i in range(layers)]
        grads_padded = [jax.device_put(jnp.full((devices, padded), 1.0 + i, jnp.float32), sharding)
                        for i in range(layers)]
        shards = [jax.device_put(jnp.full((padded,), 1.0 + i, jnp.float32), sharding) for i in range(layers)]
        gather_fn = shard_mapped(odc_gather, 1)
        all_gather_fn = shard_mapped(xla_all_gather, layers)
        scatter_fn = shard_mapped(odc_scatter, layers)
        psum_scatter_fn = shard_mapped(xla_psum_scatter, layers)
        accumulate_fn = jax.jit(jax.shard_map(xla_psum_scatter_accumulate, mesh=mesh,
                                              in_specs=(P("d"),) * (2 * layers), out_specs=P(None, "d")))
        accs = [jax.device_put(jnp.zeros((padded,), jnp.float32), sharding) for _ in range(layers)]
        zeros = jnp.zeros(devices)
        seconds = interleaved_times({
            "odc_gather": lambda: gather_fn(zeros),
            "xla_all_gather": lambda: all_gather_fn(*shards),
            "odc_scatter_accumulate": lambda: scatter_fn(*grads),
            "xla_psum_scatter": lambda: psum_scatter_fn(*grads_padded),
            "xla_psum_scatter_accumulate": lambda: accumulate_fn(*grads_padded, *accs),
        }, repeats)
    return {k: v / layers for k, v in seconds.items()}


def ratios(rounds: dict, gbps: dict) -> dict:
    """Throughput ratios: against XLA the median of paired per-round ratios, against memcpy the ratio of medians."""
    def paired(ours, theirs):
        return float(np.median(rounds[theirs] / rounds[ours]))

    out = {
        "gather_vs_all_gather": paired("odc_gather", "xla_all_gather"),
        "scatter_vs_psum_scatter": paired("odc_scatter_accumulate", "xla_psum_scatter"),
        "scatter_vs_psum_scatter_accumulate": paired("odc_scatter_accumulate", "xla_psum_scatter_accumulate"),
    }
    if "memcpy_2_threads" in gbps:
        out["gather_vs_memcpy"] = gbps["odc_gather"] / gbps["memcpy_2_threads"]
    return out


def run(devices: int | None, mib: float, repeats: int, layers: int, platform: str = "cpu") -> dict:
    available = jax.devices(platform)
    devices = devices or len(available)
    if len(available) < devices:
        raise SystemExit(f"need {devices} {platform} devices, have {len(available)}"
                         + (" (set XLA_FLAGS before importing jax)" if platform == "cpu" else ""))
    mesh = Mesh(np.array(available[:devices]), ("d",))
    numel = int(mib * (1 << 20)) // 4
    bucket_bytes = numel * 4
    moved = devices * bucket_bytes
    lib = registration.cpu_library()
    iters = max(3, repeats // 3)
    memcpy_runs = {1: [], 2: []} if platform == "cpu" else {}  # a host memcpy says nothing about GPUs

    def time_memcpy():
        for t in memcpy_runs:
            memcpy_runs[t] += [lib.memcpy_bandwidth(bucket_bytes, t, iters) for _ in range(3)]

    time_memcpy()
    rounds = {mode: measure(mesh, devices, numel, n, repeats) for mode, n in (("single", 1), ("stack", layers))}
    time_memcpy()
    memcpy = {t: float(np.median(v)) for t, v in memcpy_runs.items()}
    out = {"platform": platform, "devices": devices, "bucket_mib": mib, "layers": layers, "modes": {}}
    if platform == "gpu":
        out["gpu"] = available[0].device_kind
    for mode, per_round in rounds.items():
        seconds = {k: float(np.median(v)) for k, v in per_round.items()}
        gbps = {k: moved / v / 1e9 for k, v in seconds.items()}
        if memcpy:
            gbps["memcpy_1_thread"], gbps["memcpy_2_threads"] = memcpy[1], memcpy[2]
        out["modes"][mode] = {"gbps": gbps, "ms": {k: v * 1e3 for k, v in seconds.items()},
                              **ratios(per_round, gbps)}
    # headline: one op per program, the definition; the layer-stack figures are reported beside it
    out.update({k: v for k, v in out["modes"]["single"].items() if k not in ("gbps", "ms")})
    return out


def print_table(r: dict) -> None:
    where = f"{r['devices']} x {r['gpu']} (XLA collectives = NCCL)" if r.get("platform") == "gpu" else \
        f"{r['devices']} CPU devices"
    print(f"ODC primitives, {where}, {r['bucket_mib']:g} MiB fp32 buckets "
          f"(GB/s = devices x bucket bytes / time per op)")
    stack_title = f"{r['layers']}-layer program"
    print(f"{'contender':<30}{'single op':>20}  {stack_title:>20}")
    print(f"{'':<30}{'ms':>10}{'GB/s':>10}{'ms/op':>12}{'GB/s':>12}")
    rows = [("jodc gather", "odc_gather"), ("lax.all_gather", "xla_all_gather"),
            ("jodc scatter_accumulate", "odc_scatter_accumulate"), ("lax.psum_scatter", "xla_psum_scatter"),
            ("lax.psum_scatter + acc +=", "xla_psum_scatter_accumulate"),
            ("C++ memcpy, 1 thread", "memcpy_1_thread"), ("C++ memcpy, 2 threads", "memcpy_2_threads")]
    single, stack = r["modes"]["single"], r["modes"]["stack"]
    for label, key in rows:
        if key not in single["gbps"]:
            continue
        cells = []
        for mode in (single, stack):
            ms = mode["ms"].get(key)
            cells.append(f"{(f'{ms:.2f}' if ms is not None else '-'):>10}{mode['gbps'][key]:>10.2f}")
        print(f"{label:<30}{cells[0]}  {cells[1]}")
    for name, mode in (("single op", single), (f"{r['layers']}-layer program", stack)):
        print(f"{name:>20}: gather/all_gather {mode['gather_vs_all_gather']:.2f}  "
              f"scatter/psum_scatter {mode['scatter_vs_psum_scatter']:.2f}  "
              f"scatter/(psum_scatter+acc) {mode['scatter_vs_psum_scatter_accumulate']:.2f}"
              + (f"  gather/memcpy(2 thr) {mode['gather_vs_memcpy']:.2f}" if "gather_vs_memcpy" in mode else ""))


def summary_line(r: dict) -> dict:
    """The JSON line: the headline figures, then each mode's (single op, layer stack) with the mode as prefix."""
    line = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "modes"}
    for mode, values in r["modes"].items():
        for k, v in values.items():
            if k in ("gbps", "ms"):
                line.update({f"{mode}_{name}_{k}": round(x, 3) for name, x in v.items()})
            else:
                line[f"{mode}_{k}"] = round(v, 4)
    return line


def main(args) -> dict:
    repeats = 8 if args.quick else args.repeats
    r = run(args.devices, args.mib, repeats, 2 if args.quick else args.layers, getattr(args, "platform", "cpu"))
    harness.report(summary_line(r), harness.output(args, "primitives_gpu.json" if r.get("platform") == "gpu"
                                                   else "primitives.json"), lambda: print_table(r))
    return r

if __name__ == "__main__":
    main(ARGS)
    sys.exit(0)
