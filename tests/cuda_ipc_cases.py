"""One process of a CUDA IPC heap (tests/test_ops_cuda.py starts two: one per GPU, jax.distributed on localhost).

Usage: python tests/cuda_ipc_cases.py PROCESS_ID NUM_PROCESSES COORDINATOR_PORT [DETERMINISTIC [TRANSPORT]]

The heap over the global mesh must choose transport 'cuda_ipc' (or use TRANSPORT when given: 'nvshmem'); gather, scatter_accumulate, barrier,
read_accumulator, zero_accumulator and publish are checked against numpy across the processes, over several rounds.
Prints "IPC CASES PASSED <transport> <landing slots>" at the end.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def main():
    pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    deterministic = len(sys.argv) > 4 and sys.argv[4] == "1"
    transport = sys.argv[5] if len(sys.argv) > 5 else "auto"
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid, local_device_ids=[pid])
    from jodc import ops

    devices = jax.devices()
    assert len(devices) == nproc and len(jax.local_devices()) == 1
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    numel, rounds = 10_007, 5
    rng = np.random.default_rng(0)
    values = rng.standard_normal(numel).astype(np.float32)
    grads = rng.standard_normal((nproc, numel)).astype(np.float32)
    with ops.SymmetricHeap(mesh, deterministic=deterministic, barrier_timeout_s=60.0, transport=transport) as heap:
        assert heap.transport == ("cuda_ipc" if transport == "auto" else transport), heap.transport
        b = heap.register(numel)
        me = heap.positions[jax.local_devices()[0]]
        padded = np.zeros(b.padded_numel, np.float32)
        padded[:numel] = values
        b.set_shard(me, padded[me * b.shard_numel:(me + 1) * b.shard_numel])

        def body(g):
            def step(r, carry):
                tok, total = carry
                tok = ops.barrier(heap, tok)
                full, tok = ops.gather(b, tok)
                tok = ops.scatter_accumulate(b, g[0] * (r + 1).astype(jnp.float32), tok)
                tok = ops.barrier(heap, tok)
                acc, tok = ops.read_accumulator(b, tok)
                tok = ops.zero_accumulator(b, tok)
                own = lax.dynamic_slice_in_dim(jnp.pad(full, (0, b.padded_numel - numel)),
                                               lax.axis_index("d") * b.shard_numel, b.shard_numel)
                tok = ops.publish(b, own + 1.0, tok)
                return tok, total + acc + jnp.sum(full) * 0.0

            _, total = lax.fori_loop(0, rounds, step, (ops.new_token(), jnp.zeros((b.shard_numel,), jnp.float32)))
            return total[None]

        sharding = NamedSharding(mesh, P("d"))
        g = jax.make_array_from_process_local_data(sharding, grads[me][None])
        sm = jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
        out = jax.block_until_ready(jax.jit(sm)(g))
        mine = np.asarray(out.addressable_shards[0].data)[0]
        expected = sum(grads.sum(0) * (r + 1) for r in range(rounds))
        lo, hi = b.owner_range(me)
        np.testing.assert_allclose(mine[:hi - lo], expected[lo:hi], rtol=1e-4, atol=1e-3)
        # every round published full[own slice] + 1 on each position: rounds added everywhere (own shard checked:
        # with NVSHMEM the host reaches only its own position)
        np.testing.assert_allclose(b.shard(me)[:hi - lo], values[lo:hi] + rounds, rtol=1e-6)
        if heap.transport == "cuda_ipc":
            np.testing.assert_allclose(b.full(), values + rounds, rtol=1e-6)
        assert heap.generations() == [2 * rounds] * nproc
        print("IPC CASES PASSED", heap.transport, heap.landing_slots, flush=True)


if __name__ == "__main__":
    main()
