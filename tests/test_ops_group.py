"""The group ops (group_gather, group_scatter_accumulate, group_barrier) on 8 CPU devices against numpy: groups named
at run time (a per-device int32 operand), two groups at once with the others idle, the groups changing between calls
of one compiled program; a member that never arrives fails the barrier within its timeout; bad member lists and
operands fail with clear errors, before dispatch where they can be seen, else from the native op."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from conftest import cpu_mesh
from jodc import ops
from jodc.ops.token import as_varying
from test_ops_faults import bounded, free_after_failure

WORLD, WIDTH = 8, 4
SLOT = 37  # elements published per device (the shard is padded to a multiple of 16)


# jaxlib 0.11 compiles these programs with Shardy off only (docs/context_parallel.md, "Known issues")
pytestmark = pytest.mark.usefixtures("shardy_off_on_jaxlib_0_11")


def group_round_trip(heap, bucket, sizes):
    """Per device: publish its slot, group_barrier, group_gather (forward); group_scatter_accumulate its slices,
    group_barrier, read and zero its accumulator (backward). Branch i: a member of a group of sizes[i] (its list is
    members[:sizes[i]]); the last branch idles. Returns jit(shard_map(...))."""
    shard = bucket.shard_numel

    def member(k):
        def run(slot, slices, members):
            members = members[:k]
            token = ops.publish(bucket, slot, ops.new_token("d"))
            token = ops.group_barrier(heap, members, token)
            got, token = ops.group_gather(bucket, members, token)
            token = ops.group_scatter_accumulate(bucket, members, slices[:k], token)
            token = ops.group_barrier(heap, members, token)
            acc, token = ops.read_accumulator(bucket, token)
            token = ops.zero_accumulator(bucket, token)
            return jnp.zeros((WIDTH, shard), jnp.float32).at[:k].set(got), acc, token
        return run

    def idle(slot, slices, members):
        return jnp.zeros((WIDTH, shard), jnp.float32), jnp.zeros((shard,), jnp.float32), jnp.zeros((), jnp.int32)

    def varying(fn):
        return lambda *a: jax.tree.map(lambda o: as_varying(o, {"d"}), fn(*a))

    branches = [varying(member(k)) for k in sizes] + [varying(idle)]

    def body(role, slot, slices, members):
        out = lax.switch(role[0], branches, slot[0], slices[0], members[0])
        return jax.tree.map(lambda o: o[None], out)

    return jax.jit(jax.shard_map(body, mesh=heap.mesh, in_specs=(P("d"),) * 4, out_specs=P("d")))


def expected(groups, slot, slices, shard):
    """numpy: what each device gathers ([WIDTH, shard], rows past k zero) and accumulates ([shard])."""
    gathered = np.zeros((WORLD, WIDTH, shard), np.float32)
    acc = np.zeros((WORLD, shard), np.float32)
    for group in groups:
        for d in group:
            gathered[d, :len(group)] = slot[group]
            for i, m in enumerate(group):
                acc[m] += slices[d, i]
    return gathered, acc


@pytest.mark.parametrize("deterministic", [False, True])
def test_two_groups_at_once_then_other_groups_in_the_same_program(deterministic):
    sizes = (4, 2)
    rng = np.random.default_rng(0)
    with ops.SymmetricHeap(cpu_mesh(WORLD), deterministic=deterministic, barrier_timeout_s=60) as heap:
        bucket = heap.register(WORLD * SLOT, name="slots")
        shard = bucket.shard_numel
        program = group_round_trip(heap, bucket, sizes)
        for groups in ([[0, 3, 5, 6], [1, 2]], [[6, 1, 7, 2], [4, 0]], [[5, 4], [3, 7]], [[0, 3, 5, 6], [1, 2]]):
            role = np.full(WORLD, len(sizes), np.int32)
            members = np.zeros((WORLD, WIDTH), np.int32)
            for g in groups:
                for d in g:
                    role[d], members[d, :len(g)] = sizes.index(len(g)), g
            slot = rng.standard_normal((WORLD, shard)).astype(np.float32)
            slices = rng.standard_normal((WORLD, WIDTH, shard)).astype(np.float32)
            got, acc, token = ops.block_until_ready(program(role, slot, slices, members), heap)
            want_got, want_acc = expected(groups, slot, slices, shard)
            np.testing.assert_array_equal(np.asarray(got), want_got)  # copies: exact
            np.testing.assert_allclose(np.asarray(acc), want_acc, rtol=1e-6, atol=1e-6)
            active = role < len(sizes)
            np.testing.assert_array_equal(np.asarray(token)[active], 7)  # each of the 7 ops advanced it once
        assert program._cache_size() == 1
        assert not np.any(bucket.accumulated())  # every member zeroed its accumulator


def test_group_gather_converts_and_scatter_takes_bf16():
    mesh = cpu_mesh(2)
    with ops.SymmetricHeap(mesh, barrier_timeout_s=60) as heap:
        bucket = heap.register((2, 16))
        values = np.arange(32, dtype=np.float32).reshape(2, 16) / 4
        bucket.set_full(values)

        def body(_):
            members = jnp.array([1, 0], jnp.int32)
            got, token = ops.group_gather(bucket, members, ops.new_token("d"), dtype=jnp.bfloat16)
            token = ops.group_scatter_accumulate(bucket, members, jnp.ones((2, 16), jnp.bfloat16), token)
            token = ops.group_barrier(heap, members, token)
            acc, token = ops.read_accumulator(bucket, token)
            return got[None], acc[None]

        got, acc = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(jnp.zeros(2))
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.stack([values[::-1]] * 2))
        np.testing.assert_array_equal(np.asarray(acc), np.full((2, 16), 2.0))


def test_a_member_that_never_arrives_fails_the_group_barrier_within_the_timeout():
    """Device 0 waits for group [0, 1]; device 1 never comes (it idles), the others run a group of their own."""
    mesh = cpu_mesh(4)
    heap = ops.SymmetricHeap(mesh, barrier_timeout_s=1.0)

    def body(members):
        members = members[0]
        me = lax.axis_index("d")
        token = lax.cond(me == 1, lambda m: ops.new_token("d"),
                         lambda m: as_varying(ops.group_barrier(heap, m, ops.new_token("d")), {"d"}), members)
        return token[None]

    lists = np.array([[0, 1], [0, 1], [2, 3], [3, 2]], np.int32)
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    error, seconds = bounded(lambda: ops.block_until_ready(run(lists), heap), heap, seconds=30)
    assert isinstance(error, Exception), error
    assert "group_barrier timed out after 1 s" in str(error) and "member(s) [1] of group [0, 1]" in str(error), error
    assert seconds < 15, seconds
    free_after_failure(heap.free)


def test_bad_member_lists_and_operands_fail_before_dispatch():
    mesh = cpu_mesh(4)
    with ops.SymmetricHeap(mesh, barrier_timeout_s=60) as heap:
        bucket = heap.register(64)
        token = ops.new_token()

        def trace(op):  # traces op() inside shard_map over the heap's axis (nothing runs)
            body = lambda _: jax.tree.leaves(op())[-1][None]  # noqa: E731
            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))).trace(jnp.zeros(4))

        for members, message in (
                (jnp.array([0.0, 1.0]), "member list must be int32, got float32"),
                (jnp.zeros((2, 2), jnp.int32), "must be one-dimensional"),
                (jnp.arange(5, dtype=jnp.int32), "has 5 entries, expected 1 to 4"),
                (jnp.zeros((0,), jnp.int32), "has 0 entries"),
                (jnp.array([0, 4], jnp.int32), "entries [4] outside [0, 4)"),
                (jnp.array([2, 1, 2], jnp.int32), "names device(s) [2] more than once")):
            for op in (lambda: ops.group_barrier(heap, members, token),
                       lambda: ops.group_gather(bucket, members, token)):
                with pytest.raises(ValueError, match=re.escape(message)):
                    trace(op)
        with pytest.raises(ValueError, match=re.escape("slices of shape (2, 15) do not match 2 members' slots")):
            trace(lambda: ops.group_scatter_accumulate(bucket, jnp.array([0, 1], jnp.int32), jnp.zeros((2, 15)),
                                                       token))
        with pytest.raises(ValueError, match="must be called inside jax.shard_map"):
            ops.group_barrier(heap, jnp.array([0], jnp.int32), token)


@pytest.mark.parametrize("lists,message", [
    ([[0, 1], [0, 1], [0, 1], [2, 3]], "does not hold the calling device 2"),
    ([[0, 0], [1, 0], [2, 3], [3, 2]], "names device 0 twice"),
    ([[0, 9], [1, 0], [2, 3], [3, 2]], "entry 1 is 9, outside [0, 4)"),
])
def test_bad_member_lists_seen_only_at_run_time_fail_in_the_native_op(lists, message):
    mesh = cpu_mesh(4)
    heap = ops.SymmetricHeap(mesh, barrier_timeout_s=30)
    bucket = heap.register(64)

    def body(members):
        got, token = ops.group_gather(bucket, members[0], ops.new_token("d"))
        return token[None]

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    error, _ = bounded(lambda: ops.block_until_ready(run(np.array(lists, np.int32)), heap), heap, seconds=30)
    assert isinstance(error, Exception) and message in str(error), error
    free_after_failure(heap.free)


@pytest.mark.skipif(jax.__version_info__[:2] != (0, 11), reason="jaxlib 0.11 only (its Shardy crash)")
def test_jaxlib_0_11_with_shardy_on_is_refused_before_it_compiles():
    with ops.SymmetricHeap(cpu_mesh(WORLD), barrier_timeout_s=60) as heap:
        jax.config.update("jax_use_shardy_partitioner", True)  # the module's fixture puts the original back
        try:
            barrier = jax.jit(jax.shard_map(
                lambda: ops.group_barrier(heap, jnp.arange(2, dtype=jnp.int32), ops.new_token("d"))[None],
                mesh=heap.mesh, in_specs=(), out_specs=P("d")))
            with pytest.raises(RuntimeError, match="crashes compiling programs with the group ops"):
                barrier()  # refused while tracing: nothing compiles
        finally:
            jax.config.update("jax_use_shardy_partitioner", False)
