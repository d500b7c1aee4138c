"""The context-parallel exchange over ODC: a group of devices chosen at run time swaps K/V through heap slots.

Under ODC a context-parallel group is whichever devices the planner picked for one long sequence in this minibatch,
while the others run their own microbatches, so the exchange cannot be a collective over a mesh axis.
`OdcGroupExchange` implements the exchange the attention takes (`jodc.models.context_parallel.GroupExchange`:
`member_index`, `all_gather`) with jodc's group ops, the member list an int32 [k] run-time value (one compiled
program serves every grouping). It lives beside the ops, below the models and the engines: the ODC engine builds one
per context-parallel stage and hands it to the model's attention.

- forward: each member `publish`es its array into its own slot (its shard of a heap bucket), meets the members at a
  `group_barrier`, then `group_gather`s the members' slots, stacked in list order;
- backward: `group_scatter_accumulate` pushes the cotangent of slot i into member i's fp32 accumulator, a
  `group_barrier`, then each member reads its accumulator (the sum of every member's cotangent of its slot: the
  reduce-scatter of dK/dV, point to point) and zeroes it.

A `custom_vjp` carries the backward half, with an ordering token threaded through every op of the forward (DESIGN
section 3: side-effecting FFI calls cannot sit inside `jax.checkpoint`). Integer arrays (segment ids, orders: no
gradient) travel as float32, exact below 2^24.

With ``stream_kv=True`` the exchange also hands out a `SlotStream` (`kv_stream`): the attention then holds one
member's K/V at a time instead of the whole group's (models/streamed_context_parallel.py): each member publishes its
K/V once, meets the group, and pulls the members' slots one after another; in the backward pass it publishes them
again (into the other float bucket), pulls them one by one again, pushes each member's dK/dV into that member's
accumulator as soon as it is computed, meets the group and reads its own sum.

Slots (`ExchangeSlots`) are registered once for a CP microbatch's largest exchange (`for_microbatch`: the stacked
K/V, 2 * B * T * KV * D). Floating exchanges alternate between two buckets, integer ones between two more, so a
member republishes a slot (or peers push into its accumulator again) only after a later exchange's barrier, by which
time every member has finished reading it: one barrier per exchange and direction. Backward exchanges are ordered by
their data (each one's cotangent depends on the previous one's result, as along a decoder's layers). Call `close()`
at the end of the group's work (a last group barrier) before its members join other groups that reuse the slots.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jodc.ops.accumulator import read_accumulator, zero_accumulator
from jodc.ops.group.barrier import group_barrier
from jodc.ops.group.gather import group_gather
from jodc.ops.group.members import check_streaming
from jodc.ops.group.scatter_accumulate import group_scatter_accumulate
from jodc.ops.heap import Bucket, SymmetricHeap
from jodc.ops.publish import publish
from jodc.ops.token import after, depend_on, new_token

#: Integers exchanged as float32 are exact up to this magnitude.
EXACT_FLOAT32_INTEGER = 2 ** 24


class ExchangeSlots:
    """The heap buckets of the exchange: one fp32 slot of `slot_numel` elements per device, in two buckets for
    floating arrays and two for integer ones (alternated: see the module docstring). Register once, before tracing,
    collectively (every process of a multi-process heap, in the same order)."""

    def __init__(self, heap: SymmetricHeap, slot_numel: int, *, name: str = "cp_exchange"):
        if not isinstance(slot_numel, int) or slot_numel < 1:
            raise ValueError(f"slot_numel must be a positive int, got {slot_numel!r}")
        self.heap, self.slot_numel = heap, slot_numel
        self.float_buckets = tuple(heap.register(heap.world * slot_numel, jnp.float32, name=f"{name}_float{i}")
                                   for i in range(2))
        self.int_buckets = tuple(heap.register(heap.world * slot_numel, jnp.float32, name=f"{name}_int{i}")
                                 for i in range(2))

    @classmethod
    def for_microbatch(cls, heap: SymmetricHeap, batch: int, tokens: int, kv_heads: int, head_dim: int, *,
                       name: str = "cp_exchange") -> "ExchangeSlots":
        """Slots for a CP microbatch of [batch, tokens] rows: the stacked K/V (2 * B * T * KV * D) and the group
        keys (3 * B * T)."""
        return cls(heap, max(2 * batch * tokens * kv_heads * head_dim, 3 * batch * tokens), name=name)


class OdcGroupExchange:
    """`all_gather` among the devices of `members` (int32 [k]: heap positions, this device among them; every member
    passes the same list) through `slots`. Create one per traced CP microbatch, inside ``shard_map`` over the heap's
    axis; `token` orders its ops after earlier ones (default: a fresh token). `token` holds the latest token.

    Under ``jax.grad`` (taken inside shard_map, each device its own loss), create the exchange inside the loss
    function, return its `token` as auxiliary output, then close the group once the gradients exist::

        def loss(p, h):
            exchange = OdcGroupExchange(slots, members)
            ...
            return value, exchange.token
        (value, token), grads = jax.value_and_grad(loss, has_aux=True)(p, h)
        token = OdcGroupExchange(slots, members, ops.after(token, grads)).close()
    """

    def __init__(self, slots: ExchangeSlots, members, token=None, *, first_float: int = 0, stream_kv: bool = False):
        self.slots, self.heap = slots, slots.heap
        self.streams_kv = bool(stream_kv)  # the attention pulls one member's K/V at a time (`kv_stream`)
        self.members = jnp.asarray(members)
        if self.members.dtype != jnp.int32 or self.members.ndim != 1:
            raise ValueError(f"members must be an int32 [k] array, got {self.members.dtype}"
                             f"{list(self.members.shape)}")
        self.token = new_token(self.heap.axis_name) if token is None else token
        # `first_float`: which float bucket the first floating exchange uses (its parity): a caller that makes one
        # exchange per object (the ODC engine, one per layer call) alternates the buckets itself
        self._exchanges = {"float": int(first_float), "int": 0}

    @property
    def group_size(self) -> int:
        return int(self.members.shape[0])

    def member_index(self) -> jax.Array:
        """This device's index in the member list (int32 scalar)."""
        me = lax.axis_index(self.heap.axis_name)
        return jnp.argmax(self.members == me).astype(jnp.int32)

    def _next_bucket(self, kind: str) -> Bucket:
        buckets = self.slots.float_buckets if kind == "float" else self.slots.int_buckets
        bucket = buckets[self._exchanges[kind] % 2]
        self._exchanges[kind] += 1
        return bucket

    def all_gather(self, x: jax.Array) -> jax.Array:
        """[k, *x.shape]: every member's `x`, in list order. Differentiable for floating `x`: the cotangent of
        slice i returns, summed over the members, to member i."""
        x = jnp.asarray(x)
        numel = math.prod(x.shape)
        if numel > self.slots.slot_numel:
            raise ValueError(f"OdcGroupExchange: an array of {numel} elements {tuple(x.shape)} does not fit the "
                             f"slots of {self.slots.slot_numel} (register ExchangeSlots for the largest exchange)")
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        bucket = self._next_bucket("float" if floating else "int")
        heap, k, shard = self.heap, self.group_size, bucket.shard_numel

        def pull(flat, members, token):
            slot = jnp.zeros((shard,), jnp.float32).at[:numel].set(flat)
            token = publish(bucket, slot, token)
            token = group_barrier(heap, members, token)
            slots, token = group_gather(bucket, members, token)
            return slots[:, :numel], token

        flat = x.reshape(-1).astype(jnp.float32)
        if not floating:  # segment ids / orders: no gradient
            slots, self.token = pull(lax.stop_gradient(flat), self.members, self.token)
            return jnp.round(slots).astype(x.dtype).reshape((k,) + x.shape)

        @jax.custom_vjp
        def exchange(flat, members, token):
            return pull(flat, members, token)

        def forward(flat, members, token):
            slots, token = pull(flat, members, token)
            return (slots, token), (members, token)

        def backward(residuals, cotangents):
            members, token = residuals
            slots_ct, _ = cotangents
            pushed = jnp.zeros((k, shard), jnp.float32).at[:, :numel].set(slots_ct.astype(jnp.float32))
            token = group_scatter_accumulate(bucket, members, pushed, token)
            token = group_barrier(heap, members, token)
            mine, token = read_accumulator(bucket, token)
            mine = depend_on(mine, zero_accumulator(bucket, token))
            return mine[:numel], None, None

        exchange.defvjp(forward, backward)
        slots, self.token = exchange(flat, self.members, self.token)
        return slots.astype(x.dtype).reshape((k,) + x.shape)

    def kv_stream(self) -> "SlotStream":
        """The slots of one streamed exchange: the next float bucket for its forward half, the other one for its
        backward half (so the backward's publish never overwrites a slot a member may still be reading for the
        exchange just before it). Counts as one floating exchange."""
        check_streaming("OdcGroupExchange.kv_stream")
        forward = self._next_bucket("float")
        backward = self.slots.float_buckets[1 - self.slots.float_buckets.index(forward)]
        return SlotStream(self.heap, forward, backward)

    def close(self) -> jax.Array:
        """A last group barrier (returns and keeps the token): every member has finished reading the slots, so they
        may join other groups that reuse them."""
        self.token = group_barrier(self.heap, self.members, self.token)
        return self.token


class SlotStream:
    """One member's array at a time among a group (`members`, int32 [k] holding this device; the same list on every
    member), through two buckets' slots: `forward` for the forward half, `backward` for the backward half. Every
    method takes and returns the ordering token; arrays travel flat, as fp32.

    The sequence on every member, forward: `publish`, then `fetch` offsets 1 .. k-1 (any order); backward:
    `publish(backward=True)`, `fetch(backward=True)` and `push` for offsets 1 .. k-1, then `collect`. Offset r names
    member ``(i + r) % k`` for the caller at index i: over the offsets each member is pulled by every other once.
    """

    def __init__(self, heap: SymmetricHeap, forward: Bucket, backward: Bucket):
        self.heap, self.forward, self.backward = heap, forward, backward

    def _bucket(self, backward: bool) -> Bucket:
        return self.backward if backward else self.forward

    def _check(self, numel: int) -> None:
        if numel > self.forward.shard_numel:
            raise ValueError(f"SlotStream: an array of {numel} elements does not fit the slots of "
                             f"{self.forward.shard_numel} (register ExchangeSlots for the largest exchange)")

    def _pair(self, members, offset):
        """[this device, member (i + offset) % k]: the list of a pull or push from one member."""
        k = members.shape[0]
        me = lax.axis_index(self.heap.axis_name)
        index = jnp.argmax(members == me).astype(jnp.int32)
        return jnp.stack([me.astype(jnp.int32), members[(index + offset) % k]])

    def publish(self, flat, members, token, *, backward: bool = False, wait_for=()):
        """Writes `flat` into this device's slot, then meets the group (every member's slot is then readable).
        `wait_for`: values that must exist first. The backward half passes its cotangent: its token comes from the
        forward half, so without it the publish could run before the exchanges that follow in the forward pass
        (and precede in the backward pass) are done with the slots."""
        token = after(token, *wait_for) if wait_for else token
        bucket = self._bucket(backward)
        numel = flat.shape[0]
        self._check(numel)
        slot = jnp.zeros((bucket.shard_numel,), jnp.float32).at[:numel].set(flat.astype(jnp.float32))
        token = publish(bucket, slot, token)
        return group_barrier(self.heap, members, token)

    def fetch(self, members, offset, token, numel: int, *, backward: bool = False):
        """(fp32 [numel]: the slot of member (i + offset) % k, token). `offset`: int32 scalar in 1 .. k-1."""
        self._check(numel)
        slots, token = group_gather(self._bucket(backward), self._pair(members, offset), token)
        return slots[1, :numel], token

    def push(self, members, offset, flat, token):
        """Adds `flat` (fp32 [numel]) into the backward bucket's accumulator of member (i + offset) % k."""
        bucket, numel = self.backward, flat.shape[0]
        self._check(numel)
        slices = jnp.zeros((2, bucket.shard_numel), jnp.float32).at[1, :numel].set(flat.astype(jnp.float32))
        return group_scatter_accumulate(bucket, self._pair(members, offset), slices, token)

    def collect(self, members, token, numel: int):
        """(fp32 [numel]: the sum of what the group pushed to this device, token): meets the group (every push has
        landed), reads this device's accumulator and zeroes it."""
        self._check(numel)
        token = group_barrier(self.heap, members, token)
        mine, token = read_accumulator(self.backward, token)
        token = zero_accumulator(self.backward, token)
        return depend_on(mine, token)[:numel], token
