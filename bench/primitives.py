"""Throughput of the ODC primitives against XLA's collectives and a plain C++ memcpy, in one run.

Each contender moves the same bytes: a bucket of `--mib` MiB (fp32) over `--devices` simulated CPU devices.
Bandwidth is algorithmic: devices x bucket bytes / seconds (every device receives, or sends, a full bucket per op),
so gather and all_gather (and scatter_accumulate and psum_scatter) are directly comparable. The memcpy rows copy a
bucket-sized buffer per thread. Times are medians of `--repeats` calls of one jitted op each.

Prints a table, then one JSON line (also written to bench/results/primitives.json unless --no-save).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--mib", type=float, default=16.0, help="bucket size in MiB (fp32)")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--quick", action="store_true", help="fewer repeats (for make demo)")
    p.add_argument("--no-save", action="store_true")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={ARGS.devices}").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from jodc import ops  # noqa: E402
from jodc.ops import _native  # noqa: E402


def interleaved_medians(contenders: dict, repeats: int) -> dict:
    """Median seconds per call of each zero-argument callable, timed round-robin so that drifts in machine load
    hit every contender alike."""
    for call in contenders.values():  # compile and warm up
        for _ in range(3):
            jax.block_until_ready(call())
    times = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, call in contenders.items():
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(ts)) for name, ts in times.items()}


class Accumulating:
    """psum_scatter followed by adding into a persistent (donated) gradient accumulator: what collective FSDP must
    do per microbatch to match scatter_accumulate's semantics."""

    def __init__(self, fn, grads, acc):
        self.fn, self.grads, self.acc = fn, grads, acc

    def __call__(self):
        self.acc = self.fn(self.grads, self.acc)
        return self.acc


def run(devices: int, mib: float, repeats: int) -> dict:
    cpu = jax.devices("cpu")
    if len(cpu) < devices:
        raise SystemExit(f"need {devices} CPU devices, have {len(cpu)} (set XLA_FLAGS before importing jax)")
    mesh = Mesh(np.array(cpu[:devices]), ("d",))
    numel = int(mib * (1 << 20)) // 4
    bucket_bytes = numel * 4
    moved = devices * bucket_bytes

    def shard_mapped(body, in_specs, out_specs):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))

    with ops.SymmetricHeap(mesh) as heap:
        bucket = heap.register(numel)
        bucket.set_full(np.arange(numel, dtype=np.float32))
        shard = bucket.shard_numel

        def gather_body(x):
            full, _ = ops.gather(bucket, ops.new_token())
            return full[None]

        def scatter_body(g):
            return ops.scatter_accumulate(bucket, g[0], ops.new_token())[None]

        gather_fn = shard_mapped(gather_body, P("d"), P("d"))
        scatter_fn = shard_mapped(scatter_body, P("d"), P("d"))
        grads = jax.device_put(jnp.ones((devices, numel), jnp.float32),
                               jax.sharding.NamedSharding(mesh, P("d")))
        padded = shard * devices
        shards = jax.device_put(jnp.ones((padded,), jnp.float32), jax.sharding.NamedSharding(mesh, P("d")))
        all_gather_fn = shard_mapped(lambda s: lax.all_gather(s, "d", tiled=True)[None], P("d"), P("d"))
        grads_padded = jax.device_put(jnp.ones((devices, padded), jnp.float32),
                                      jax.sharding.NamedSharding(mesh, P("d")))
        psum_scatter_fn = shard_mapped(lambda g: lax.psum_scatter(g[0], "d", tiled=True), P("d"), P("d"))
        accumulate_fn = jax.jit(
            jax.shard_map(lambda g, a: a + lax.psum_scatter(g[0], "d", tiled=True), mesh=mesh,
                          in_specs=(P("d"), P("d")), out_specs=P("d")),
            donate_argnums=1)
        zeros = jnp.zeros(devices)
        results = interleaved_medians({
            "odc_gather": lambda: gather_fn(zeros),
            "xla_all_gather": lambda: all_gather_fn(shards),
            "odc_scatter_accumulate": lambda: scatter_fn(grads),
            "xla_psum_scatter": lambda: psum_scatter_fn(grads_padded),
            "xla_psum_scatter_accumulate": Accumulating(accumulate_fn, grads_padded, jnp.zeros_like(shards)),
        }, repeats)

    lib = _native.cpu_library()
    iters = max(3, repeats // 3)
    memcpy_gbps = {t: float(np.median([lib.memcpy_bandwidth(bucket_bytes, t, iters) for _ in range(3)]))
                   for t in (1, 2)}

    gbps = {k: moved / v / 1e9 for k, v in results.items()}
    gbps["memcpy_1_thread"] = memcpy_gbps[1]
    gbps["memcpy_2_threads"] = memcpy_gbps[2]
    return {
        "devices": devices,
        "bucket_mib": mib,
        "gbps": gbps,
        "ms": {k: v * 1e3 for k, v in results.items()},
        "gather_vs_all_gather": gbps["odc_gather"] / gbps["xla_all_gather"],
        "scatter_vs_psum_scatter": gbps["odc_scatter_accumulate"] / gbps["xla_psum_scatter"],
        "scatter_vs_psum_scatter_accumulate": gbps["odc_scatter_accumulate"] / gbps["xla_psum_scatter_accumulate"],
        "gather_vs_memcpy": gbps["odc_gather"] / gbps["memcpy_2_threads"],
    }


def print_table(r: dict) -> None:
    print(f"ODC primitives, {r['devices']} CPU devices, {r['bucket_mib']:g} MiB fp32 bucket "
          f"(GB/s = devices x bucket bytes / time)")
    print(f"{'contender':<28}{'ms / op':>10}{'GB/s':>10}")
    rows = [("jodc gather", "odc_gather"), ("lax.all_gather", "xla_all_gather"),
            ("jodc scatter_accumulate", "odc_scatter_accumulate"), ("lax.psum_scatter", "xla_psum_scatter"),
            ("lax.psum_scatter + acc +=", "xla_psum_scatter_accumulate"),
            ("C++ memcpy, 1 thread", "memcpy_1_thread"), ("C++ memcpy, 2 threads", "memcpy_2_threads")]
    for label, key in rows:
        ms = r["ms"].get(key)
        print(f"{label:<28}{(f'{ms:.2f}' if ms is not None else '-'):>10}{r['gbps'][key]:>10.2f}")
    print(f"gather / all_gather = {r['gather_vs_all_gather']:.2f}   "
          f"scatter / psum_scatter = {r['scatter_vs_psum_scatter']:.2f}   "
          f"gather / memcpy(2 threads) = {r['gather_vs_memcpy']:.2f}   "
          f"scatter / (psum_scatter + acc) = {r['scatter_vs_psum_scatter_accumulate']:.2f}")


def main(args) -> dict:
    repeats = 8 if args.quick else args.repeats
    r = run(args.devices, args.mib, repeats)
    print_table(r)
    line = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k not in ("gbps", "ms")}
    line.update({f"{k}_gbps": round(v, 3) for k, v in r["gbps"].items()})
    print(json.dumps(line))
    if not args.no_save:
        out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "primitives.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(line, f, indent=1)
    return r


if __name__ == "__main__":
    main(ARGS)
    sys.exit(0)
