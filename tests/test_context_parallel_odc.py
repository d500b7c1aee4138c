"""Prototype (issue 44, next step): the context-parallel exchange over ODC's point-to-point ops, in one process.

Each member publishes what it exchanges into its own shard (slot) of a heap bucket, meets the others at a barrier and
`gather`s the slots; in the backward pass it pushes the cotangent of every slot to its owner with
`scatter_accumulate`, meets them again and reads (then zeroes) its accumulator: the reduce-scatter of dK/dV, point to
point. Here the group is the heap's whole axis and the barrier the heap's (world-wide); the library version over a
run-time member list and a group barrier is `jodc.ops.group.exchange.OdcGroupExchange`
(tests/test_context_parallel_group.py). The attention code is unchanged: the exchange only has to provide
`member_index` and `all_gather`.
"""
import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from conftest import cpu_mesh
from jodc import ops
from jodc.models import dense_attention
from jodc.models.context_parallel import context_parallel_attention, group_keys
from test_context_parallel import gather_from_members, group_case, random_qkv, relative_error, scatter_to_members

AXIS = "d"


class HeapExchange:
    """`all_gather` through heap slots: one bucket per exchanged array (registered beforehand by its size), a token
    threaded through every op so that the exchanges of one program run in the same order on every device."""

    streams_kv = False  # all-gathers K/V (the streamed form: OdcGroupExchange(stream_kv=True))

    def __init__(self, heap, buckets):
        self.heap, self.buckets, self.token = heap, buckets, ops.new_token(AXIS)

    def member_index(self):
        return jax.lax.axis_index(AXIS)

    def all_gather(self, x):
        bucket = self.buckets[x.size]
        world, numel = self.heap.world, x.size

        def pull(flat, token):
            slot = jnp.zeros((bucket.shard_numel,), jnp.float32).at[:numel].set(flat)
            token = ops.publish(bucket, slot, token)
            token = ops.barrier(self.heap, token)
            full, token = ops.gather(bucket, token)
            return full.reshape(world, bucket.shard_numel)[:, :numel], token

        if not jnp.issubdtype(x.dtype, jnp.floating):  # segment ids / orders: exact in fp32 below 2^24, no gradient
            slots, self.token = pull(x.reshape(-1).astype(jnp.float32), self.token)
            return slots.astype(x.dtype).reshape((world,) + x.shape)

        @jax.custom_vjp
        def exchange(flat, token):
            return pull(flat, token)

        def forward(flat, token):
            slots, token = pull(flat, token)
            return (slots, token), token

        def backward(token, cotangents):
            slots_ct, _ = cotangents
            grad = jnp.zeros((world, bucket.shard_numel), jnp.float32).at[:, :numel].set(slots_ct)
            token = ops.scatter_accumulate(bucket, grad.reshape(-1), token)
            token = ops.barrier(self.heap, token)
            mine, token = ops.read_accumulator(bucket, token)
            mine = ops.depend_on(mine, ops.zero_accumulator(bucket, token))
            return mine[:numel], None

        exchange.defvjp(forward, backward)
        slots, self.token = exchange(x.reshape(-1).astype(jnp.float32), self.token)
        return slots.astype(x.dtype).reshape((world,) + x.shape)


def test_odc_exchange_gives_the_one_device_attention_and_gradients():
    k_group, cap = 4, 24
    case = group_case(50, k_group, cap, [[3], [5, 2], [], [4]])
    rng = np.random.default_rng(7)
    ref_shape = case.reference_segment_ids.shape
    q_ref, k_ref, v_ref = random_qkv(rng, *ref_shape, ref_shape[1])
    dout_ref = rng.standard_normal(q_ref.shape).astype(np.float32)
    ref_seg = jnp.asarray(case.reference_segment_ids)
    want_loss, want_grads = jax.value_and_grad(
        lambda q, k, v: jnp.sum(dense_attention(q, k, v, ref_seg) * dout_ref), argnums=(0, 1, 2))(q_ref, k_ref, v_ref)
    zeros = lambda x: np.zeros((k_group, cap) + x.shape[2:], np.float32)  # noqa: E731
    q_m, k_m, v_m, dout_m = (scatter_to_members(case, x, zeros(x)) for x in (q_ref, k_ref, v_ref, dout_ref))
    mesh = cpu_mesh(k_group)
    seg, pos, split = (jnp.asarray(x) for x in (case.segment_ids, case.positions, case.split_segments))
    with ops.SymmetricHeap(mesh, AXIS) as heap:
        sizes = {3 * cap: None, 2 * cap * k_m.shape[2] * k_m.shape[3]: None}
        buckets = {n: heap.register(k_group * -(-n // 16) * 16, name=f"cp_slots_{n}") for n in sizes}

        def member_loss(q, k, v, dout, seg, pos, split):
            exchange = HeapExchange(heap, buckets)
            keys = group_keys(seg, pos, split, exchange)
            out = context_parallel_attention(q, k, v, keys, exchange, block_size=4)
            return jnp.sum(out * dout)[None]

        sharded = jax.shard_map(member_loss, mesh=mesh, in_specs=(P(AXIS),) * 7, out_specs=P(AXIS))
        loss_fn = lambda q, k, v: jnp.sum(sharded(q, k, v, dout_m, seg, pos, split))  # noqa: E731
        loss, grads = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2)))(q_m, k_m, v_m)
        ops.block_until_ready((loss, grads), heap)
    errors = {"loss": relative_error(loss, want_loss)}
    for label, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
        errors[label] = relative_error(gather_from_members(case, got, ref_shape), want)
    print(errors)
    assert max(errors.values()) <= 1e-5, errors
