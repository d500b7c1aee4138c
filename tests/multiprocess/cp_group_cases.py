"""The context-parallel exchange over ODC across processes (MPI transport), mirroring
tests/test_context_parallel_group.py. Usage, under mpirun:

    python cp_group_cases.py LOCAL_DEVICES [case ...]     (no case: all of them)

Every group spans both processes; the groups change between calls of one compiled program.
"""
import sys

import _mp  # noqa: E402

SPEC = sys.argv[1]
jax, comm = _mp.init(SPEC)
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import cp_group_checks as checks  # noqa: E402
from jodc import ops  # noqa: E402
from jodc.ops.group.exchange import ExchangeSlots  # noqa: E402

mesh = _mp.global_mesh(jax)
WORLD = mesh.shape["d"]
RANK = comm.Get_rank()


LAYERS = 1  # one decoder layer: CI time (the in-process test runs two)


def groupings():
    """Groups of 2 (one branch: CI time), each holding devices of both processes (devices are process-major), in two
    groupings: with 2 devices per process, two groups at once."""
    if WORLD == 2:
        return (2,), [[[0, 1]], [[1, 0]]]
    return (2,), [[[0, 3], [2, 1]], [[1, 2], [3, 0]]]


def global_array(values):
    sharding = NamedSharding(mesh, P("d"))
    return jax.make_array_from_callback(np.shape(values), sharding, lambda idx: np.asarray(values)[idx])


def everyones(array) -> dict:
    """{global device: numpy value} over all processes (the groups span them)."""
    local = {s.index[0].start: np.asarray(s.data)[0] for s in array.addressable_shards}
    merged = {}
    for part in comm.allgather(local):
        merged.update(part)
    return merged


def case_transport_is_mpi():
    with ops.SymmetricHeap(mesh) as heap:
        assert heap.transport == "mpi", heap.transport


def case_exchange_gives_the_one_device_loss_and_gradients():
    exchange_gives_the_one_device_loss_and_gradients(stream_kv=False)


def case_streamed_exchange_gives_the_one_device_loss_and_gradients():
    """The attention pulling one member's K/V at a time (the ODC engine's default) across the processes."""
    exchange_gives_the_one_device_loss_and_gradients(stream_kv=True)


def exchange_gives_the_one_device_loss_and_gradients(stream_kv: bool):
    sizes, all_groups = groupings()
    layer_params = checks.params()
    cases = {k: checks.size_case(k, layer_params, LAYERS) for k in sizes}
    with ops.SymmetricHeap(mesh, barrier_timeout_s=60) as heap:
        slots = ExchangeSlots.for_microbatch(heap, 1, checks.TOKEN_CAP, checks.CONFIG.num_kv_heads,
                                             checks.CONFIG.head_dim)
        program = jax.jit(jax.shard_map(checks.group_program(slots, sizes, LAYERS, stream_kv), mesh=mesh,
                                        in_specs=(P("d"),) * 8, out_specs=P("d")))
        worst = 0.0
        for groups in all_groups:
            inputs = checks.device_inputs(WORLD, groups, cases, sizes, layer_params)
            loss, dparams, dh, _ = ops.block_until_ready(program(*jax.tree.map(global_array, inputs)), heap)
            dparams = {name: everyones(v) for name, v in dparams.items()}
            errors = checks.group_errors(groups, cases, everyones(loss), dparams, everyones(dh))
            worst = max(worst, max(errors.values()))
            assert max(errors.values()) <= 1e-5, {k: v for k, v in errors.items() if v > 1e-5}
        assert program._cache_size() == 1
        if RANK == 0:
            print(f"cp_group {WORLD} devices (K/V {'streamed' if stream_kv else 'all-gathered'}): max relative error "
                  f"{worst:.2e}", flush=True)


def case_group_barrier_timeout_names_missing_member():
    """Device 0 waits in a group barrier for the last device (of the other process), which never comes."""
    import time

    import jax.numpy as jnp
    from jax import lax

    heap = ops.SymmetricHeap(mesh, barrier_timeout_s=1.0)
    last = WORLD - 1
    members = jnp.array([0, last], jnp.int32)

    def fn(dev):
        wait = dev.astype(jnp.int32) == 0
        return lax.cond(wait, lambda t: ops.group_barrier(heap, members, t), lambda t: t, ops.new_token())

    devs = np.arange(WORLD, dtype=np.float32)
    if RANK == 0:
        t0 = time.monotonic()
        try:
            _mp.spmd(jax, mesh, fn, devs)
            raise AssertionError("the group barrier did not fail")
        except Exception as e:  # noqa: BLE001
            text = str(e)
        for fragment in ("group_barrier timed out after 1 s", f"member(s) [{last}] of group [0, {last}]",
                         "held by process(es) [1]"):
            assert fragment in text, text
        assert time.monotonic() - t0 < 11, time.monotonic() - t0
    else:
        _mp.spmd(jax, mesh, fn, devs)  # no barrier here: returns at once
    comm.Barrier()
    try:  # the failure reached the other process too: its heap is poisoned with the waiter's message
        heap.check_alive()
        raise AssertionError("the heap is still healthy")
    except RuntimeError as e:
        assert "never arrived" in str(e), e
    heap.free()


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    names = sys.argv[2:] or list(CASES)
    _mp.run_cases(CASES, names, comm)
