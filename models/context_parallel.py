"""Context-parallel attention: long sequences' attention split over a group of devices, rows still packed.

A sequence too long for one device is split over a group of ``k`` devices in the zigzag layout
(`jodc.balance.zigzag`: ``2k`` chunks, member ``i`` holding chunks ``i`` and ``2k-1-i``). Each member's row
[B, T] holds its pieces of ``n_b = split_segments_b[b]`` split sequences (segment ids 1..n_b, piece after piece: the
same sequences in row ``b`` of every member, each with its *global* positions) and, packed after them, short
sequences of its own (segment ids above n_b, positions restarting at 0). One split sequence per row is the layout
of the data-aware planners; several are what the fixed layout (`fixed_cp`) packs. Every member computes the
attention output of its own queries:

- a token of split sequence ``s`` attends to the tokens of split sequence ``s`` on *all* members whose global
  position is <= its own (causal over the whole sequence);
- a token of one of the row's own sequences attends, as in `attention.dense_attention`, to its segment's tokens at
  columns <= its own on the same member only.

How: every token gets a group-wide key (`group_keys`): split sequence ``s`` keeps segment key ``s`` on every member
(1 <= s <= n_b <= T) with order = global position; a row's own sequence ``s`` on member ``m`` gets the key
``T + 1 + (s - 1) k + m`` (above every split key, distinct across members and sequences) with order = column;
padding gets 0. Then the members' keys and values are exchanged, and the keyed attention of `keyed_attention.py`
(same segment, key order <= query order) of the member's queries against the whole group's keys is exactly the
attention of the one-device computation. Block pairs are chosen per class, told apart by key range (split keys
<= T, own keys > T), so a row of short sequences still skips what `attention.blockwise_attention` skips, and the
split sequences' blocks skip by segment and position (causal).

The exchange is pluggable (`GroupExchange`): anything that gives this member's index in the group and stacks an
array from every member, differentiably (its transpose must return to each member the sum of the cotangents of its
slice). `AxisExchange` does it with `jax.lax.all_gather` over a shard_map mesh axis (its backward is the
reduce-scatter of dK/dV). `jodc.ops.group.exchange.OdcGroupExchange` does it over ODC's group ops among devices
chosen at run time (not a mesh axis); `jodc.fsdp.collective_engine.MemberAxisExchange` over a whole mesh axis for
a run-time member list (docs/context_parallel.md). By default the whole group's K/V are held at once (all-gather
context parallelism, as Llama 3's training did); an exchange with ``streams_kv`` (`OdcGroupExchange(stream_kv=True)`)
lets the blockwise attention hold one member's K/V at a time instead (`streamed_context_parallel`).

Backward: JAX autodiff through the exchange and the keyed kernel's own `custom_vjp`; exact up to fp32
reassociation. Shapes: q [B, T, H, D], k and v [B, T, KV, D] per member; must be called where the exchange works
(inside shard_map over the axis for `AxisExchange`).
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp

from .attention_inputs import check_attention_inputs
from .config import DecoderConfig
from .keyed_attention import (
    blockwise_keyed_attention,
    block_ranges,
    dense_keyed_attention,
    pad_tokens,
    ranges_may_interact,
)
from .layerwise import attention_inputs, check_group_params, layer_group_name, layer_output
from .streamed_context_parallel import streamed_context_parallel_attention

#: The implementations `context_parallel_attention` accepts.
CONTEXT_PARALLEL_IMPLS = ("blockwise", "dense")


class GroupExchange(Protocol):
    """How the members of a context-parallel group see each other's keys and values."""

    def member_index(self) -> jax.Array:
        """This member's index in the group (int32 scalar, 0 .. k-1), the order `all_gather` stacks in."""
        ...

    def all_gather(self, x: jax.Array) -> jax.Array:
        """[k, *x.shape]: every member's `x`, stacked by member index. Differentiable: the cotangent of slice i goes
        back (summed over the members that received it) to member i."""
        ...

    #: True: the attention pulls one member's K/V at a time through ``kv_stream()`` (`SlotStream`), advancing
    #: ``token`` and reading ``members`` (`streamed_context_parallel`); False: it all-gathers them.
    streams_kv: bool


@dataclasses.dataclass(frozen=True)
class AxisExchange:
    """The group is a shard_map mesh axis: `jax.lax.all_gather` over it (backward: `psum_scatter`)."""

    axis_name: str
    streams_kv = False  # all-gathers K/V

    def member_index(self) -> jax.Array:
        return jax.lax.axis_index(self.axis_name)

    def all_gather(self, x: jax.Array) -> jax.Array:
        return jax.lax.all_gather(x, self.axis_name)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupKeys:
    """The group-wide segment ids and causal orders of a member's queries and of the whole group's keys.

    Built once per microbatch by `group_keys` and reused by every layer (the rows are the same in all of them).
    Segment keys below `own_key_base` (and above 0) are split sequences', keys from it up are the rows' own
    sequences'.
    """

    query_segment_bt: jax.Array  # int32 [B, T], this member's tokens
    query_order_bt: jax.Array  # int32 [B, T]
    key_segment_gbt: jax.Array  # int32 [k, B, T], every member's tokens, stacked by member index
    key_order_gbt: jax.Array  # int32 [k, B, T]
    member: jax.Array  # int32 scalar: this member's index in the group
    # T + 1 for rows of T columns (static): the smallest key of a row's own sequence, above every split key
    own_key_base: int = dataclasses.field(metadata=dict(static=True))

    def split_tokens(self, segment):
        """bool, like `segment` (one of the key arrays): the tokens of split sequences."""
        return (segment > 0) & (segment < self.own_key_base)

    def own_tokens(self, segment):
        """bool, like `segment`: the tokens of the rows' own sequences."""
        return segment >= self.own_key_base


def _group_segment(segment_bt, split_bt, member, group_size, own_key_base):
    """Group-wide segment keys: 0 padding; split sequence s keeps s; a row's own sequence s on member m gets
    ``own_key_base + (s - 1) * k + m`` (distinct for every (s, m), above every split key)."""
    own = own_key_base + (segment_bt - 1) * group_size + member
    return jnp.where(segment_bt <= 0, 0, jnp.where(split_bt, segment_bt, own))


def group_keys(segment_ids_bt: jax.Array, positions_bt: jax.Array, split_segments_b: jax.Array,
               exchange: GroupExchange) -> GroupKeys:
    """The keys of this member's row and, through `exchange`, of the group's rows.

    segment_ids_bt: int [B, T], the row's segment ids (0 padding, positive ids for sequences, each a contiguous run
    as in packing). positions_bt: int [B, T]; over the split sequences they must be their global positions,
    distinct over the whole group for each sequence (the zigzag layout's); elsewhere they are not read.
    split_segments_b: int [B], how many split sequences each row holds: segments 1..n_b of row b are split
    sequences, the same ones (with the same n_b) on every member; 0: none (its tokens then attend within the row
    only). Counts above T are taken as T (a row of T columns holds at most T / 2 pieces).

    The keys are int32: a row's own sequence ``s`` on member ``m`` gets ``T + 1 + (s - 1) k + m <= T + s k``, so
    segment ids must be at most ``(2^31 - 1 - T) / k`` (`jodc.balance.zigzag.segment_id_limit`;
    `check_group_rows` checks it on the host). One integer exchange of [3, B, T] per call (the ODC exchange carries
    it as float32: ids and positions below 2^24).
    """
    if segment_ids_bt.ndim != 2:
        raise ValueError(f"segment_ids must be [B, T], got shape {tuple(segment_ids_bt.shape)}")
    b, t = segment_ids_bt.shape
    for name, array, shape in (("positions", positions_bt, (b, t)), ("split_segments", split_segments_b, (b,))):
        if tuple(array.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(array.shape)}, expected {shape}")
    for name, array in (("segment_ids", segment_ids_bt), ("positions", positions_bt),
                        ("split_segments", split_segments_b)):
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise ValueError(f"{name} must be integers, got {array.dtype}")
    seg = segment_ids_bt.astype(jnp.int32)
    split_count = jnp.clip(split_segments_b.astype(jnp.int32), 0, t)[:, None]
    split = (seg > 0) & (seg <= split_count)
    order = jnp.where(split, positions_bt.astype(jnp.int32), jnp.arange(t, dtype=jnp.int32)[None, :])
    # one exchange for the three: [k, 3, B, T]; the group-wide ids are made after it, from the stacking order
    gathered = exchange.all_gather(jnp.stack([seg, split.astype(jnp.int32), order]))
    group_size = gathered.shape[0]
    member = jnp.asarray(exchange.member_index(), jnp.int32)
    members = jnp.arange(group_size, dtype=jnp.int32)[:, None, None]
    base = t + 1
    return GroupKeys(query_segment_bt=_group_segment(seg, split, member, group_size, base), query_order_bt=order,
                     key_segment_gbt=_group_segment(gathered[:, 0], gathered[:, 1] > 0, members, group_size, base),
                     key_order_gbt=gathered[:, 2], member=member, own_key_base=base)


def _members_to_row(x_gbt):
    """[k, B, T, ...] -> [B, k*T, ...]: the group's tokens as one long key row, member after member."""
    g, b, t = x_gbt.shape[:3]
    return jnp.moveaxis(x_gbt, 0, 1).reshape(b, g * t, *x_gbt.shape[3:])


def context_parallel_block_pairs(keys: GroupKeys, block: int) -> jax.Array:
    """bool [B, T/blk, k*T/blk]: the (query block, key block) pairs to visit, class by class (told apart by key
    range, `GroupKeys.split_tokens` / `own_tokens`): split-sequence tokens against split-sequence tokens (by segment
    and position), own sequences against own sequences (by segment and column; other members' own sequences never).
    T must be a multiple of `block`."""
    key_segment = _members_to_row(keys.key_segment_gbt)
    key_order = _members_to_row(keys.key_order_gbt)
    query_segment, query_order = keys.query_segment_bt, keys.query_order_bt
    split_pairs = ranges_may_interact(
        block_ranges(query_segment, query_order, block, keys.split_tokens(query_segment)),
        block_ranges(key_segment, key_order, block, keys.split_tokens(key_segment)))
    own_pairs = ranges_may_interact(block_ranges(query_segment, query_order, block, keys.own_tokens(query_segment)),
                                    block_ranges(key_segment, key_order, block, keys.own_tokens(key_segment)))
    blocks_per_member = query_segment.shape[1] // block
    key_block_member = jnp.arange(key_segment.shape[1] // block) // blocks_per_member
    return split_pairs | (own_pairs & (key_block_member == keys.member)[None, None, :])


def context_parallel_attention(q_bthd: jax.Array, k_btkd: jax.Array, v_btkd: jax.Array, keys: GroupKeys,
                               exchange: GroupExchange, *, impl: str = "blockwise", block_size: int = 128) -> jax.Array:
    """This member's attention output [B, T, H, D] for its queries against the group's keys and values.

    q, k, v: this member's rows (k and v are exchanged with the group here). keys: from `group_keys` on the same
    rows. impl: "blockwise" (visits only the block pairs that may interact; blocks of min(block_size, T) tokens,
    rows padded to a multiple internally) or "dense" (the [T, k*T] mask: the reference).
    """
    check_attention_inputs(q_bthd, k_btkd, v_btkd, keys.query_segment_bt)
    if impl not in CONTEXT_PARALLEL_IMPLS:
        raise ValueError(f"unknown context-parallel attention impl {impl!r}; expected one of {CONTEXT_PARALLEL_IMPLS}")
    if keys.key_segment_gbt.shape[1:] != keys.query_segment_bt.shape:
        raise ValueError(f"keys were built for rows {tuple(keys.key_segment_gbt.shape[1:])}, the queries are "
                         f"{tuple(keys.query_segment_bt.shape)}")
    t = q_bthd.shape[1]
    if impl == "dense":
        kv_gbtkd = exchange.all_gather(jnp.stack([k_btkd, v_btkd]))  # [k, 2, B, T, KV, D]: one exchange
        return dense_keyed_attention(q_bthd, _members_to_row(kv_gbtkd[:, 0]), _members_to_row(kv_gbtkd[:, 1]),
                                     keys.query_segment_bt, keys.query_order_bt,
                                     _members_to_row(keys.key_segment_gbt), _members_to_row(keys.key_order_gbt))
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    block = min(block_size, t)
    pad = -t % block  # every member's row padded alike, so no block straddles two members
    if pad:
        q_bthd = pad_tokens(q_bthd, 1, pad)
        keys = dataclasses.replace(keys, **{name: pad_tokens(getattr(keys, name), getattr(keys, name).ndim - 1, pad)
                                            for name in ("query_segment_bt", "query_order_bt", "key_segment_gbt",
                                                         "key_order_gbt")})
    if exchange.streams_kv:  # one member's K/V at a time
        return streamed_context_parallel_attention(q_bthd, k_btkd, v_btkd, keys,
                                                   context_parallel_block_pairs(keys, block), exchange,
                                                   block=block)[:, :t]
    kv_gbtkd = exchange.all_gather(jnp.stack([k_btkd, v_btkd]))  # [k, 2, B, T, KV, D]: one exchange
    k_gbtkd, v_gbtkd = pad_tokens(kv_gbtkd[:, 0], 2, pad), pad_tokens(kv_gbtkd[:, 1], 2, pad)
    out = blockwise_keyed_attention(
        q_bthd, _members_to_row(k_gbtkd), _members_to_row(v_gbtkd), keys.query_segment_bt, keys.query_order_bt,
        _members_to_row(keys.key_segment_gbt), _members_to_row(keys.key_order_gbt), block_size=block,
        block_pairs_bij=context_parallel_block_pairs(keys, block))
    return out[:, :t]


def context_parallel_layer_apply(config: DecoderConfig, layer_params, h_btd: jax.Array, positions_bt: jax.Array,
                                 keys: GroupKeys, exchange: GroupExchange) -> jax.Array:
    """One decoder layer (`layerwise.layer_apply`) on a member's rows, its attention split over the group.

    positions_bt are the rows' RoPE positions (global ones over the split sequences). The attention is "dense" when
    the config asks for dense attention, else "blockwise" (the fused GPU kernel has no context-parallel form yet).
    """
    if h_btd.ndim != 3 or h_btd.shape[-1] != config.hidden_size:
        raise ValueError(f"hidden states must be [B, T, {config.hidden_size}], got {tuple(h_btd.shape)}")
    check_group_params(config, layer_group_name(0), layer_params)
    h_btd = h_btd.astype(config.activation_dtype)
    q, k, v = attention_inputs(config, layer_params, h_btd, positions_bt.astype(jnp.int32))
    impl = "dense" if config.attention_impl == "dense" else "blockwise"
    attn = context_parallel_attention(q, k, v, keys, exchange, impl=impl, block_size=config.attention_block_size)
    return layer_output(config, layer_params, h_btd, attn)
