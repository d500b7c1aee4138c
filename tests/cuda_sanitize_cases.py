"""Every jodc CUDA kernel on one GPU, for compute-sanitizer (tests/test_ops_cuda.py's stress test (f)).

Run as a script under ``compute-sanitizer --tool memcheck|racecheck``: a 3-position heap simulated on GPU 0 in both
accumulation modes and both master dtypes; gather (both compute dtypes), scatter_accumulate (fp32 and bf16 gradients,
a second push into the same accumulator), read / zero accumulator, publish, the barrier (a 1-position heap), and the
token ops (after, depend_on). Each result is checked against numpy; prints ALL CASES PASSED at the end.

``--configs quick`` (tools/gpu_check.py's memcheck and racecheck steps, where a sanitized process has seconds) runs
two of the four (mode, master dtype) heaps: atomic with an fp32 master and deterministic with a bf16 master, which
still launch every kernel and both accumulation paths; ``all`` (default) runs the four. Each distinct call is compiled
once (the sanitizer slows every launch, XLA's included).
"""
import argparse
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jodc import ops
from jodc.ops.transports import cuda_library, registration
from jodc.ops.heap import default_barrier_timeout_s

TOKEN = jax.ShapeDtypeStruct((), jnp.int32)


CONFIGS = {"all": [(d, m) for d in (False, True) for m in ("float32", "bfloat16")],
           "quick": [(False, "float32"), (True, "bfloat16")]}
# a barrier that never completes fails in seconds under a time-boxed check, never after minutes
TIMEOUT_S = min(60.0, default_barrier_timeout_s())


@functools.lru_cache(maxsize=None)
def _jitted(target, results, attrs):
    attrs = {k: np.int64(v) for k, v in attrs}
    return jax.jit(lambda dev, *xs: jax.ffi.ffi_call(target, results, has_side_effect=True)(dev, *xs, **attrs))


def call(target, results, device, *args, **attrs):
    fn = _jitted(target, results, tuple(sorted(attrs.items())))
    gpu = jax.devices("gpu")[0]
    return jax.block_until_ready(fn(*[jax.device_put(x, gpu) for x in (jnp.int32(device), *args)]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", choices=sorted(CONFIGS), default="all")
    configs = CONFIGS[parser.parse_args(argv).configs]
    lib = cuda_library.library()
    registration.ensure_registered("gpu")
    world, numel = 3, 5003
    for deterministic, master in configs:
        heap = lib.heap_create(world, deterministic, TIMEOUT_S)
        bucket = lib.bucket_register(heap, numel, master)
        ids = dict(heap=heap, bucket=bucket)
        shard_numel = lib.bucket_shard_numel(heap, bucket)
        np_master = np.float32 if master == "float32" else ml_dtypes.bfloat16
        values = np.random.default_rng(0).standard_normal(shard_numel * world).astype(np_master)
        for d in range(world):
            lib.bucket_set_shard(heap, bucket, d, values[d * shard_numel:(d + 1) * shard_numel])
        for out_dtype in (jnp.float32, jnp.bfloat16):
            full, _ = call("jodc_gather", (jax.ShapeDtypeStruct((numel,), out_dtype), TOKEN), 1, jnp.int32(0),
                           **ids)
            np.testing.assert_array_equal(np.asarray(full), values[:numel].astype(out_dtype))
        grads = np.random.default_rng(1).standard_normal((world, numel)).astype(np.float32)
        for d in range(world):
            g = jnp.asarray(grads[d]) if d != 1 else jnp.asarray(grads[d]).astype(jnp.bfloat16)
            call("jodc_scatter_accumulate", (TOKEN,), d, g, jnp.int32(0), **ids)
        call("jodc_scatter_accumulate", (TOKEN,), 0, jnp.asarray(grads[0]), jnp.int32(0), **ids)  # a second push
        expected = grads[0] * 2 + grads[1].astype(ml_dtypes.bfloat16).astype(np.float32) + grads[2]
        got = np.concatenate([np.asarray(call("jodc_read_accumulator",
                                              (jax.ShapeDtypeStruct((shard_numel,), jnp.float32), TOKEN), d,
                                              jnp.int32(0), **ids)[0]) for d in range(world)])[:numel]
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        for d in range(world):
            call("jodc_zero_accumulator", (TOKEN,), d, jnp.int32(0), **ids)
            assert not np.frombuffer(lib.bucket_get_accumulator(heap, bucket, d), np.float32).any()
        new_shard = np.full(shard_numel, 3.0, np_master)
        call("jodc_publish", (TOKEN,), 2, jnp.asarray(new_shard), jnp.int32(0), **ids)
        assert np.array_equal(np.frombuffer(lib.bucket_get_shard(heap, bucket, 2), np_master), new_shard)
        jax.effects_barrier()
        lib.heap_free(heap)
    heap = lib.heap_create(1, False, TIMEOUT_S)
    for g in range(1, 4):
        (tok,) = call("jodc_barrier", (TOKEN,), 0, jnp.int32(g), heap=heap)
        assert int(tok) == g + 1
    jax.effects_barrier()
    lib.heap_free(heap)
    gpu = jax.devices("gpu")[0]
    x = jax.device_put(jnp.arange(1000, dtype=jnp.float32), gpu)
    token_ops = jax.jit(lambda x, t: (ops.depend_on(x * 2.0, ops.after(t, x)), ops.after(t, x)))
    y, tok = jax.block_until_ready(token_ops(x, jax.device_put(jnp.int32(5), gpu)))
    assert np.array_equal(np.asarray(y), np.arange(1000, dtype=np.float32) * 2.0) and int(tok) == 6
    print(f"ALL CASES PASSED ({len(configs)} heap configurations)")


if __name__ == "__main__":
    main()
