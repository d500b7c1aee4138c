"""How the device benchmarks here measure (a helper module, not a benchmark): wall time of jitted calls, and the two
ceilings a device's figures are judged against, measured in the same run (never a datasheet).

Timing: compile and warm up first, then time each call up to the moment its outputs are ready on the device
(`jax.block_until_ready`: a device synchronisation, not a dispatch time), contenders in turn within each round so that
drifts of clock or load hit all of them alike. Take medians of what `interleaved_times` returns.

Ceilings (inputs random, never zeros: zeros can run faster than real data):
- memory: a device-to-device copy of an fp32 array (XLA's `copy` of a jit argument, which the compiler must keep: the
  output cannot alias an argument that is not donated), counting the bytes read plus the bytes written;
- arithmetic: an n x n x n bf16 matrix product (XLA's library GEMM, fp32 accumulation, bf16 result), 2 n^3 FLOPs.
Several independent instances run in one program so that the dispatch of the program is spread over them.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def interleaved_times(contenders: dict, repeats: int, warmup: int = 3) -> dict:
    """Seconds per call of each zero-argument callable (it returns what to wait for): `warmup` untimed calls each
    (compilation, module loading and first-touch allocations stay out), then `repeats` rounds of one timed call
    each, round-robin. Returns {name: array of `repeats` seconds}."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    for call in contenders.values():
        for _ in range(warmup):
            jax.block_until_ready(call())
    times = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, call in contenders.items():
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - t0)
    return {name: np.asarray(ts) for name, ts in times.items()}


def median_seconds(contenders: dict, repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds per call of each contender (see `interleaved_times`)."""
    return {name: float(np.median(ts)) for name, ts in interleaved_times(contenders, repeats, warmup).items()}


def random_array(key, shape, dtype, device) -> jax.Array:
    """Standard-normal values of `dtype` made on `device` (no host transfer of large inputs)."""
    return jax.device_put(jax.random.normal(key, shape, jnp.float32).astype(dtype), device)


def copy_contender(numel: int, count: int, device, seed: int = 0):
    """(call, bytes per copy): a program copying `count` random fp32 arrays of `numel` elements on `device`, and the
    bytes each copy moves (read + written). Fails if the compiler dropped the copies (then nothing would be timed)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), count)
    arrays = [random_array(k, (numel,), jnp.float32, device) for k in keys]
    program = jax.jit(lambda *xs: tuple(jnp.copy(x) for x in xs)).lower(*arrays).compile()
    kept = program.as_text().count(" copy(")
    if kept < count:
        raise RuntimeError(f"the copy program keeps {kept} of its {count} copies: nothing to time")
    return (lambda: program(*arrays)), 8 * numel


def matmul_tflops(n: int, count: int, repeats: int, device, warmup: int = 3, seed: int = 1) -> dict:
    """The bf16 matrix-product ceiling: `count` independent random n x n x n bf16 products per program (fp32
    accumulation, bf16 results), median over `repeats` programs. Returns {"n", "ms" per product, "tflops"}."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * count)
    operands = [random_array(k, (n, n), jnp.bfloat16, device) for k in keys]
    program = jax.jit(lambda *xs: tuple(a @ b for a, b in zip(xs[0::2], xs[1::2])))
    seconds = median_seconds({"matmul": lambda: program(*operands)}, repeats, warmup)["matmul"] / count
    return {"n": n, "ms": seconds * 1e3, "tflops": 2 * n**3 / seconds / 1e12}


def print_table(title: str | None, rows, value_width: int = 30) -> None:
    """A benchmark's table: `title` (if any), then one `name  value` line per (name, value) row, names aligned."""
    if title:
        print(title)
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value:>{value_width}}")
