"""The ODC ops on one GPU against the GPU's own ceilings, all measured in the same run.

Ceilings (bench/device_timing.py): a device-to-device copy (GB/s, bytes read + written) and a bf16 matrix product
(TFLOP/s, 8192^3 by default). Then, for buckets of each size (`--sizes`, fp32 bytes: 64 KiB, 256 MiB, 1 GiB), the
ops as GB/s and as a fraction of the copy ceiling, every byte an op reads or writes counted as for the copy:

  op                     bytes per op (n = bucket elements, m = shard elements incl. padding, s = landing slots)
  copy                   8 n                    read + write
  gather fp32 -> fp32    8 n                    every owner's shard read, the full bucket written
  gather fp32 -> bf16    6 n
  scatter_accumulate     12 n                   gradient read; accumulator (atomic) or own landing slot
                                                (deterministic) read and written
  read_accumulator       4 m (2 + s)            accumulator and slots read, the shard written
  zero_accumulator       4 m (1 + s)            accumulator and slots written
  publish                8 m                    new shard read, master shard written

and the barrier's round trip (microseconds: the kernel, its arrival and poll, the stream synchronisation of the
handler and the report back to the host).

Two worlds:
- world 1, through `jodc.ops` on the one-device mesh (what a single-GPU run executes): gather is a copy of the own
  shard, scatter_accumulate adds into the own accumulator (atomic mode: vector `red.add` reductions; deterministic
  mode: the landing slot), the barrier meets nobody but itself.
- a simulated world (`--sim-world`, 4): the heap's positions all live on this GPU (the handlers are called directly
  with position 0, as tests/test_ops_cuda.py's raw-handler tests do), so gather really pulls `--sim-world` owners'
  shards and scatter_accumulate really pushes into that many accumulators, through the multi-owner kernel paths
  (one grid row per owner). The owners' memory is local, not a peer's over NVLink: these figures say what the kernels
  cost, not what a link delivers. read / zero / publish touch only the caller's shard and the barrier needs every
  position's device to arrive, so the simulated world measures gather and scatter_accumulate only. (With several
  visible GPUs, position p goes on GPU p % count and the owners become peers: run it with one visible GPU;
  `visible_devices` in the JSON says how many there were.)

Method: each timed program issues `k` ops on `k` different buckets (`k` = `--budget` / bucket size, 2..32: the
program's dispatch is spread over them, and small buckets rotate instead of one staying in cache); ops within a
heap are timed round-robin; medians over `--repeats` programs after warm-up; wall time up to the device's results
(`jax.block_until_ready`). Masters and gradients are random, never zeros; after timing, a gather of each heap must
return exactly what was published (so every owner's bytes were moved). 64 KiB buckets are launch-bound and live in
L2: their GB/s say what one op costs, not what memory delivers.

Targets (benchmarks, not tests): gather and scatter_accumulate >= 0.8 of the copy ceiling at 256 MiB, barrier < 20 us.

`--platform cpu` runs the same code on the host's CPU device (tiny sizes: the test of every code path; the figures
are memcpy's, not a GPU's). Prints a table and one JSON line (keys `gpu_gather_vs_copy`, `gpu_scatter_vs_copy` at
256 MiB, or the size nearest to it, `gpu_barrier_us`, and the full table under `rows`); writes it to
bench/results/gpu_ops.json (gpu_ops_cpu.json for --platform cpu) unless --no-save.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
HEADLINE_BYTES = 256 * MiB
DEFAULTS = {  # per platform: sizes, matmul n, memory per heap's buckets (k = budget / size)
    "gpu": {"sizes": "64KiB,256MiB,1GiB", "matmul": 8192, "budget": "2GiB"},
    "cpu": {"sizes": "64KiB,16MiB", "matmul": 1024, "budget": "64MiB"},
}


def parse_size(text: str) -> int:
    """'64KiB' / '256MiB' / '1GiB' / '4096' (bytes) -> bytes; a positive multiple of 4 (fp32 buckets)."""
    match = re.fullmatch(r"\s*(\d+)\s*(B|KiB|MiB|GiB)?\s*", str(text))
    if not match:
        raise ValueError(f"bad size {text!r}: write it like 64KiB, 256MiB, 1GiB or a byte count")
    size = int(match.group(1)) * {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB}[match.group(2) or "B"]
    if size <= 0 or size % 4:
        raise ValueError(f"size {text!r} must be a positive multiple of 4 bytes (fp32 elements)")
    return size


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--platform", choices=("auto", "gpu", "cpu"), default="auto",
                   help="auto: the GPU if JAX has one, else the CPU; cpu: the smoke test of every code path")
    p.add_argument("--sizes", default=None, help="bucket sizes, comma-separated (gpu: 64KiB,256MiB,1GiB)")
    p.add_argument("--repeats", type=int, default=30, help="timed programs per contender (median)")
    p.add_argument("--quick", action="store_true", help="10 repeats, 2 matmuls per program: for make gpu-check")
    p.add_argument("--sim-world", type=int, default=4, help="positions of the simulated world (0: skip it)")
    p.add_argument("--matmul", type=int, default=None, help="n of the bf16 n^3 ceiling (gpu: 8192)")
    p.add_argument("--budget", default=None, help="bytes of buckets per heap (k = budget / size, 2..32)")
    p.add_argument("--barriers", type=int, default=32, help="barriers per timed program")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/gpu_ops[_cpu].json)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.barriers < 1 or args.sim_world < 0 or args.sim_world == 1:
        p.error("need --repeats >= 1, --barriers >= 1 and --sim-world 0 or >= 2")
    if args.quick:
        args.repeats = min(args.repeats, 10)
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.platform != "cpu":
    # XLA's pool takes 75% of the GPU by default; the heap's shards, accumulators and landing slots are allocated
    # by jodc outside it (cudaMalloc), so leave them room
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from jodc import ops  # noqa: E402
from jodc.ops.transports import registration, target_names  # noqa: E402
from bench import harness  # noqa: E402
from bench.device_timing import copy_contender, interleaved_times, matmul_tflops, random_array  # noqa: E402

TOKEN = jax.ShapeDtypeStruct((), jnp.int32)


def moved_bytes(op: str, *, numel: int, shard_numel: int, world: int, landing_slots: bool,
                out_itemsize: int = 4) -> int:
    """Bytes `op` reads plus writes in device memory for a bucket of `numel` fp32 elements (shards of `shard_numel`,
    including padding) in a heap of `world` positions (see the module docstring's table)."""
    slots = world if landing_slots else 0
    if op == "copy":
        return 8 * numel
    if op == "gather":
        return numel * (4 + out_itemsize)
    if op == "scatter_accumulate":
        return 12 * numel
    if op == "read_accumulator":
        return 4 * shard_numel * (2 + slots)
    if op == "zero_accumulator":
        return 4 * shard_numel * (1 + slots)
    if op == "publish":
        return 8 * shard_numel
    raise ValueError(f"no byte count for op {op!r}")


def buckets_per_heap(size: int, budget: int) -> int:
    """How many buckets (ops per timed program) a heap gets: budget / size, at least 2, at most 32."""
    return int(min(32, max(2, budget // size)))


# ---------------------------------------------------------------------------------------------------------------
# Two ways to call the ops: the public API on a one-device mesh, and the handlers of a simulated world


class MeshCaller:
    """World 1: `jodc.ops` inside `shard_map` over a one-device mesh, exactly what a single-GPU run executes."""

    label = "world 1 (jodc.ops)"

    def __init__(self, device):
        self.mesh = Mesh(np.array([device]), ("d",))
        self.device = device
        self.world = 1

    def open_heap(self, deterministic: bool):
        heap = ops.SymmetricHeap(self.mesh, "d", deterministic=deterministic)
        return heap, heap.landing_slots

    def register(self, heap, numel: int):
        bucket = heap.register(numel)
        return bucket, bucket.shard_numel

    @staticmethod
    def close_heap(heap) -> None:
        heap.free()

    def program(self, body):
        """`body(*arrays) -> tuple of 1-D arrays`, run per device (inputs and outputs split along the mesh axis)."""
        return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=P("d"), out_specs=P("d")))

    def put(self, x):
        return jax.device_put(x, jax.sharding.NamedSharding(self.mesh, P("d")))

    @staticmethod
    def token():
        return ops.new_token()

    @staticmethod
    def gather(bucket, token, dtype, device=0):
        return ops.gather(bucket, token, dtype=dtype)

    @staticmethod
    def scatter_accumulate(bucket, grad, token, device=0):
        return ops.scatter_accumulate(bucket, grad, token)

    @staticmethod
    def read_accumulator(bucket, token, device=0):
        return ops.read_accumulator(bucket, token)

    @staticmethod
    def zero_accumulator(bucket, token, device=0):
        return ops.zero_accumulator(bucket, token)

    @staticmethod
    def publish(bucket, shard, token, device=0):
        return ops.publish(bucket, shard, token)

    @staticmethod
    def barrier(heap, token):
        return ops.barrier(heap, token)


@dataclasses.dataclass
class RawBucket:
    heap_id: int
    id: int
    numel: int
    shard_numel: int


class SimulatedCaller:
    """A world of `world` positions whose memory all lives on one device: the handlers called directly with an
    explicit position (heap created without a placement, so position p goes on visible GPU p % count = this one)."""

    def __init__(self, device, world: int):
        self.device = device
        self.world = world
        self.label = self.label_for(world)
        platform = "cpu" if device.platform == "cpu" else "cuda"
        registration.ensure_registered(platform)
        self.lib = registration.cpu_library() if platform == "cpu" else _cuda_library()

    @staticmethod
    def label_for(world: int) -> str:
        return f"simulated world {world} (handlers, position 0)"

    def open_heap(self, deterministic: bool):
        heap_id = int(self.lib.heap_create(self.world, deterministic, 300.0))
        probe = getattr(self.lib, "heap_landing_slots", None)  # the CPU backend has no atomic mode
        return heap_id, bool(deterministic or (probe is not None and probe(heap_id)))

    def register(self, heap_id: int, numel: int):
        bucket_id = int(self.lib.bucket_register(heap_id, numel, "float32"))
        shard_numel = int(self.lib.bucket_shard_numel(heap_id, bucket_id))
        return RawBucket(heap_id, bucket_id, numel, shard_numel), shard_numel

    def close_heap(self, heap_id: int) -> None:
        jax.effects_barrier()
        self.lib.heap_free(heap_id)

    @staticmethod
    def program(body):
        return jax.jit(body)

    def put(self, x):
        return jax.device_put(x, self.device)

    @staticmethod
    def token():
        return jnp.zeros((), jnp.int32)

    @staticmethod
    def _call(op, bucket, results, device, *operands):
        return jax.ffi.ffi_call(target_names.target_name(op, "local"), results, has_side_effect=True)(
            jnp.asarray(device, jnp.int32), *operands, heap=np.int64(bucket.heap_id), bucket=np.int64(bucket.id))

    def gather(self, bucket, token, dtype, device=0):
        return self._call("gather", bucket, (jax.ShapeDtypeStruct((bucket.numel,), dtype), TOKEN), device, token)

    def scatter_accumulate(self, bucket, grad, token, device=0):
        return self._call("scatter_accumulate", bucket, (TOKEN,), device, grad, token)[0]

    def publish(self, bucket, shard, token, device=0):
        return self._call("publish", bucket, (TOKEN,), device, shard, token)[0]


def _cuda_library():
    from jodc.ops.transports import cuda_library

    return cuda_library.library()


# ---------------------------------------------------------------------------------------------------------------
# Programs: k ops on k buckets, tokens chained, every result returned (nothing for the compiler to drop)


def gather_program(caller, buckets, dtype):
    def body(dummy):
        token, outs = caller.token(), []
        for b in buckets:
            full, token = caller.gather(b, token, dtype)
            outs.append(full.reshape(-1))
        return (*outs, token[None])
    return body


def scatter_program(caller, buckets):
    def body(dummy, *grads):
        token = caller.token()
        for b, g in zip(buckets, grads):
            token = caller.scatter_accumulate(b, g, token)
        return (token[None],)
    return body


def read_program(caller, buckets):
    def body(dummy):
        token, outs = caller.token(), []
        for b in buckets:
            acc, token = caller.read_accumulator(b, token)
            outs.append(acc)
        return (*outs, token[None])
    return body


def zero_program(caller, buckets):
    def body(dummy):
        token = caller.token()
        for b in buckets:
            token = caller.zero_accumulator(b, token)
        return (token[None],)
    return body


def publish_program(caller, buckets):
    def body(device, *shards):
        token = caller.token()
        for b, s in zip(buckets, shards):
            token = caller.publish(b, s, token, device=device[0])
        return (token[None],)
    return body


def barrier_program(caller, heap, count: int):
    def body(dummy):
        token = caller.token()
        for _ in range(count):
            token = caller.barrier(heap, token)
        return (token[None],)
    return body


# ---------------------------------------------------------------------------------------------------------------
# Measurements


@dataclasses.dataclass
class Row:
    """One measured op: median seconds per op and the bytes it moves."""

    op: str
    variant: str
    world: str
    size: int
    bytes_per_op: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes_per_op / self.seconds / 1e9


def measure_heap(caller, deterministic: bool, size: int, k: int, repeats: int, key) -> tuple[list[Row], bool]:
    """Registers k buckets of `size` bytes, publishes random masters, times the heap's ops round-robin; returns the
    rows and whether a gather returned exactly what was published (every owner's shard of bucket 0)."""
    numel = size // 4
    world, mode = caller.world, "deterministic" if deterministic else "atomic"
    heap, landing = caller.open_heap(deterministic)
    try:
        buckets, shard_numel = [], 0
        for _ in range(k):
            bucket, shard_numel = caller.register(heap, numel)
            buckets.append(bucket)
        key_master, key_grad = jax.random.split(key)
        masters = [random_array(kk, (world, shard_numel), jnp.float32, caller.device)
                   for kk in jax.random.split(key_master, k)]
        publish = caller.program(publish_program(caller, buckets))
        for position in range(world):  # each position publishes its own shard
            jax.block_until_ready(publish(caller.put(jnp.full((1,), position, jnp.int32)),
                                          *[caller.put(m[position]) for m in masters]))
        dummy = caller.put(jnp.zeros((1,), jnp.int32))
        grads = [caller.put(random_array(kk, (numel,), jnp.float32, caller.device))
                 for kk in jax.random.split(key_grad, k)]
        sizes = dict(numel=numel, shard_numel=shard_numel, world=world, landing_slots=landing)
        contenders = {}  # (op, variant) -> (call, bytes per op)
        if not deterministic:  # gather and publish do not depend on the accumulation mode
            for dtype, name in ((jnp.float32, "fp32->fp32"), (jnp.bfloat16, "fp32->bf16")):
                fn = caller.program(gather_program(caller, buckets, dtype))
                contenders[("gather", name)] = ((lambda fn=fn: fn(dummy)),
                                                moved_bytes("gather", out_itemsize=jnp.dtype(dtype).itemsize, **sizes))
        scatter = caller.program(scatter_program(caller, buckets))
        contenders[("scatter_accumulate", mode)] = (lambda: scatter(dummy, *grads),
                                                    moved_bytes("scatter_accumulate", **sizes))
        if isinstance(caller, MeshCaller):  # the caller's own shard only: world 1 says it all
            read = caller.program(read_program(caller, buckets))
            zero = caller.program(zero_program(caller, buckets))
            contenders[("read_accumulator", mode)] = (lambda: read(dummy), moved_bytes("read_accumulator", **sizes))
            contenders[("zero_accumulator", mode)] = (lambda: zero(dummy), moved_bytes("zero_accumulator", **sizes))
            if not deterministic:
                own = caller.put(jnp.zeros((1,), jnp.int32))
                sources = [caller.put(m[0]) for m in masters]
                contenders[("publish", "fp32")] = (lambda: publish(own, *sources), moved_bytes("publish", **sizes))
        times = interleaved_times({name: call for name, (call, _) in contenders.items()}, repeats)
        rows = [Row(op, variant, caller.label, size, nbytes, float(np.median(times[(op, variant)])) / k)
                for (op, variant), (_, nbytes) in contenders.items()]
        gathered = caller.program(gather_program(caller, buckets[:1], jnp.float32))(dummy)[0]
        exact = bool(jnp.array_equal(gathered, masters[0].reshape(-1)[:numel]))
        return rows, exact
    finally:
        caller.close_heap(heap)


def measure_barrier(caller: MeshCaller, count: int, repeats: int) -> float:
    """Seconds per barrier round trip at world 1, `count` chained barriers per program."""
    heap, _ = caller.open_heap(False)
    try:
        fn = caller.program(barrier_program(caller, heap, count))
        dummy = caller.put(jnp.zeros((1,), jnp.int32))
        return float(np.median(interleaved_times({"barrier": lambda: fn(dummy)}, repeats)["barrier"])) / count
    finally:
        caller.close_heap(heap)


def measure_copy(device, size: int, k: int, repeats: int) -> Row:
    call, nbytes = copy_contender(size // 4, k, device)
    seconds = float(np.median(interleaved_times({"copy": call}, repeats)["copy"])) / k
    return Row("copy", "fp32", "device", size, nbytes, seconds)


def run(platform: str, sizes: list[int], repeats: int, sim_world: int, matmul_n: int, matmuls: int, budget: int,
        barriers: int) -> dict:
    device = jax.devices(platform)[0]
    mesh_caller = MeshCaller(device)
    callers = [mesh_caller] + ([SimulatedCaller(device, sim_world)] if sim_world else [])
    matmul = matmul_tflops(matmul_n, matmuls, repeats, device)
    rows, checks = [], {}
    key = jax.random.PRNGKey(0)
    for size in sizes:
        k = buckets_per_heap(size, budget)
        rows.append(measure_copy(device, size, k, repeats))
        for caller in callers:
            for deterministic in (False, True):
                key, sub = jax.random.split(key)
                heap_rows, exact = measure_heap(caller, deterministic, size, k, repeats, sub)
                rows += heap_rows
                checks[f"{caller.label}, {'deterministic' if deterministic else 'atomic'}, {size} B"] = exact
    barrier_s = measure_barrier(mesh_caller, barriers, repeats)
    return summarize(rows, matmul, barrier_s, checks, device, sizes, repeats, sim_world, budget, barriers)


def summarize(rows: list[Row], matmul: dict, barrier_s: float, checks: dict, device, sizes, repeats, sim_world,
              budget, barriers) -> dict:
    """The JSON result: the ceilings, every row with its fraction of the copy ceiling, and the headline ratios at
    the size nearest 256 MiB (world 1, fp32 gather, atomic scatter: what a single-GPU run does by default)."""
    copy_ceiling = max(r.gbps for r in rows if r.op == "copy")
    headline = min(sizes, key=lambda s: abs(np.log(s / HEADLINE_BYTES)))

    def find(op, variant, world=MeshCaller.label, size=headline):
        return next(r for r in rows if (r.op, r.variant, r.world, r.size) == (op, variant, world, size))

    table = [{"op": r.op, "variant": r.variant, "world": r.world, "size_bytes": r.size, "bytes_per_op": r.bytes_per_op,
              "us": round(r.seconds * 1e6, 3), "gbps": round(r.gbps, 2), "vs_copy": round(r.gbps / copy_ceiling, 4)}
             for r in rows]
    out = {
        "bench": "gpu_ops",
        "device": device.device_kind,
        "platform": device.platform,
        "gpu_gather_vs_copy": round(find("gather", "fp32->fp32").gbps / copy_ceiling, 4),
        "gpu_scatter_vs_copy": round(find("scatter_accumulate", "atomic").gbps / copy_ceiling, 4),
        "gpu_barrier_us": round(barrier_s * 1e6, 3),
        "gpu_gather_bf16_vs_copy": round(find("gather", "fp32->bf16").gbps / copy_ceiling, 4),
        "gpu_scatter_deterministic_vs_copy": round(find("scatter_accumulate", "deterministic").gbps / copy_ceiling, 4),
        "headline_size_bytes": headline,
        "copy_ceiling_gbps": round(copy_ceiling, 2),
        "matmul_bf16_tflops": float(f"{matmul['tflops']:.4g}"),
        "matmul_n": matmul["n"],
        "targets": {"gather_vs_copy": 0.8, "scatter_vs_copy": 0.8, "barrier_us": 20.0},
        "gather_exact": checks,
        "rows": table,
        "repeats": repeats,
        "sim_world": sim_world,
        "budget_bytes": budget,
        "barriers_per_program": barriers,
        "visible_devices": len(jax.devices(device.platform)),
        "jax": jax.__version__,
    }
    if sim_world:
        sim = SimulatedCaller.label_for(sim_world)
        out[f"sim{sim_world}_gather_vs_copy"] = round(find("gather", "fp32->fp32", sim).gbps / copy_ceiling, 4)
        out[f"sim{sim_world}_scatter_vs_copy"] = round(find("scatter_accumulate", "atomic", sim).gbps / copy_ceiling, 4)
    out["targets_met"] = bool(out["gpu_gather_vs_copy"] >= 0.8 and out["gpu_scatter_vs_copy"] >= 0.8
                              and out["gpu_barrier_us"] < 20.0)
    return out


def size_label(size: int) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if size % unit == 0:
            return f"{size // unit} {name}"
    return f"{size} B"


def print_table(r: dict) -> None:
    print(f"ODC ops on {r['device']} ({r['platform']}): copy ceiling {r['copy_ceiling_gbps']:.1f} GB/s (read + "
          f"written), bf16 matmul {r['matmul_n']}^3 {r['matmul_bf16_tflops']:.1f} TFLOP/s; medians of "
          f"{r['repeats']} programs")
    header = f"{'op':<20}{'variant':<15}{'world':<40}{'size':>9}{'us/op':>11}{'GB/s':>10}{'vs copy':>9}"
    print(header)
    print("-" * len(header))
    for row in r["rows"]:
        print(f"{row['op']:<20}{row['variant']:<15}{row['world']:<40}{size_label(row['size_bytes']):>9}"
              f"{row['us']:>11.2f}{row['gbps']:>10.1f}{row['vs_copy']:>9.3f}")
    at = size_label(r["headline_size_bytes"])
    print(f"gather / copy at {at}: {r['gpu_gather_vs_copy']:.3f} (target >= 0.8); scatter_accumulate / copy: "
          f"{r['gpu_scatter_vs_copy']:.3f} (target >= 0.8); barrier round trip {r['gpu_barrier_us']:.1f} us "
          f"(target < 20)")
    bad = [name for name, ok in r["gather_exact"].items() if not ok]
    print("gather returned exactly the published masters in every heap" if not bad else
          f"WRONG: gather did not return the published masters in {bad}")


def main(args) -> dict:
    platform = args.platform
    if platform == "auto":
        platform = "gpu" if any(d.platform == "gpu" for d in jax.devices()) else "cpu"
    defaults = DEFAULTS[platform]
    sizes = [parse_size(s) for s in (args.sizes or defaults["sizes"]).split(",") if s.strip()]
    budget = parse_size(args.budget or defaults["budget"])
    r = run(platform, sizes, args.repeats, args.sim_world, args.matmul or defaults["matmul"],
            2 if args.quick else 4, budget, args.barriers)
    harness.report(r, harness.output(args, "gpu_ops.json" if platform == "gpu" else "gpu_ops_cpu.json"),
                   lambda: print_table(r))
    if not all(r["gather_exact"].values()):
        raise SystemExit("gather did not return the published masters: the figures above are not trustworthy")
    return r


if __name__ == "__main__":
    main(ARGS)
    sys.exit(0)
