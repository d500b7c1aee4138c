"""Shared checks of the context-parallel exchange over ODC with groups chosen at run time (OdcGroupExchange), run in
one process by tests/test_context_parallel_group.py and across processes by tests/multiprocess/cp_group_cases.py.

Every device of the heap runs one compiled program: a `lax.switch` on its role picks the branch of its group's size
(a CP microbatch of two decoder layers whose attention is split over the group, loss and gradients taken on the
device) or an idle branch. The groups are a per-device run-time input, so the same program serves any grouping.
Each group's loss and gradients must equal the one-device computation of the sequences its rows hold.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jodc import ops
from jodc.models import DecoderConfig
from jodc.ops.token import as_varying
from jodc.models.context_parallel import context_parallel_layer_apply, group_keys
from jodc.models.layerwise import init_group_params, layer_apply
from jodc.ops.group.exchange import ExchangeSlots, OdcGroupExchange
from test_context_parallel import (gather_from_members, group_case, reference_layer_inputs, relative_error,
                                   scatter_to_members)

TOKEN_CAP = 20
CONFIG = DecoderConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                       num_kv_heads=2, attention_impl="blockwise", attention_block_size=4)
LAYERS = 2  # the layer applied twice by default: two K/V exchanges per direction (the slots alternate)
#: short sequences packed beside each member's piece, by group size
SHORTS = {1: [[3, 2]], 2: [[3, 2], [5]], 4: [[4], [2, 3], [], [6]]}


@dataclasses.dataclass
class SizeCase:
    """A group size's rows (member-major, one row per member) and its one-device reference loss and gradients."""

    case: object  # test_context_parallel.GroupCase
    h: np.ndarray  # [k, T, hidden] member rows
    ct: np.ndarray
    want_loss: float
    want_dparams: dict
    want_dh: np.ndarray  # reference layout [1, Tref, hidden]


def params():
    return init_group_params(CONFIG, "layer_0", jax.random.key(3), init_std=0.2)


def size_case(group_size: int, layer_params, layers: int = LAYERS) -> SizeCase:
    case = group_case(6 * group_size + 1, group_size, TOKEN_CAP, SHORTS[group_size])
    ref_seg, ref_pos, h_ref, ct_ref = reference_layer_inputs(case, CONFIG.hidden_size, seed=group_size)

    def reference_loss(p, h):
        for _ in range(layers):
            h = layer_apply(CONFIG, p, h, ref_pos, ref_seg)
        return jnp.sum(h * ct_ref)

    loss, (dparams, dh) = jax.jit(jax.value_and_grad(reference_loss, argnums=(0, 1)))(layer_params, h_ref)
    h_m = scatter_to_members(case, h_ref, np.zeros((group_size, TOKEN_CAP, CONFIG.hidden_size), np.float32))
    ct_m = scatter_to_members(case, ct_ref, np.zeros_like(h_m))
    return SizeCase(case, h_m, ct_m, float(loss), jax.tree.map(np.asarray, dparams), np.asarray(dh))


def member_step(slots: ExchangeSlots, group_size: int, layers: int = LAYERS, stream_kv: bool = False):
    """(params, h, ct, seg, pos, split, members) -> (loss, dparams, dh, token) on one member of a group of
    `group_size` (members[:group_size] is the list); `stream_kv`: the attention pulls one member's K/V at a time."""

    def step(p, h, ct, seg, pos, split, members):
        members = members[:group_size]

        def loss(p, h):
            exchange = OdcGroupExchange(slots, members, stream_kv=stream_kv)
            keys = group_keys(seg[None], pos[None], split[None], exchange)
            out = h[None]
            for _ in range(layers):
                out = context_parallel_layer_apply(CONFIG, p, out, pos[None], keys, exchange)
            return jnp.sum(out[0] * ct), exchange.token

        (value, token), (dparams, dh) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(p, h)
        # the group's last barrier, once the backward pass (its pushes and reads) is done here
        token = OdcGroupExchange(slots, members, ops.after(token, dparams, dh)).close()
        return value, dparams, dh, token

    return step


def idle_step(p, h, ct, seg, pos, split, members):
    """A device in no group this time: nothing exchanged."""
    return jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, p), jnp.zeros_like(h), ops.new_token("d")


def group_program(slots: ExchangeSlots, sizes: tuple[int, ...], layers: int = LAYERS, stream_kv: bool = False):
    """The per-device program for shard_map over the heap's axis (every input and output with a leading device axis
    of 1 there): branch i runs a member of a group of sizes[i], the last branch idles."""
    axis = slots.heap.axis_name

    def per_device(step):  # every branch's outputs typed as varying over the axis, as switch requires
        return lambda *a: jax.tree.map(lambda o: as_varying(o, {axis}), step(*a))

    branches = [per_device(member_step(slots, k, layers, stream_kv)) for k in sizes] + [per_device(idle_step)]

    def program(*inputs):
        role, *rest = (jax.tree.map(lambda x: x[0], a) for a in inputs)
        out = lax.switch(role, branches, *rest)
        return jax.tree.map(lambda o: o[None], out)

    return program


def device_inputs(world: int, groups: list[list[int]], cases: dict[int, SizeCase], sizes, layer_params):
    """Per-device inputs (leading axis: device) for `groups` (lists of heap positions; the rest idle)."""
    width = max(sizes)
    role = np.full(world, len(sizes), np.int32)
    members = np.zeros((world, width), np.int32)
    h = np.zeros((world, TOKEN_CAP, CONFIG.hidden_size), np.float32)
    ct = np.zeros_like(h)
    seg = np.zeros((world, TOKEN_CAP), np.int32)
    pos, split = np.zeros_like(seg), np.zeros(world, np.int32)
    for group in groups:
        c = cases[len(group)]
        for i, d in enumerate(group):
            role[d] = sizes.index(len(group))
            members[d, :len(group)] = group
            h[d], ct[d] = c.h[i], c.ct[i]
            seg[d], pos[d], split[d] = c.case.segment_ids[i], c.case.positions[i], c.case.split_segments[i]
    stacked = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (world,) + x.shape).copy(), layer_params)
    return role, stacked, h, ct, seg, pos, split, members


def group_errors(groups, cases, loss, dparams, dh) -> dict[str, float]:
    """Relative errors of every group's loss (summed over members), parameter gradients (summed) and input gradient
    (gathered from members) against its one-device reference. Args: per-device values, indexable by device."""
    errors = {}
    for group in groups:
        c = cases[len(group)]
        tag = "g" + "-".join(map(str, group))
        errors[f"{tag}.loss"] = relative_error(sum(float(loss[d]) for d in group), c.want_loss)
        got_dh = np.stack([np.asarray(dh[d]) for d in group])
        errors[f"{tag}.dh"] = relative_error(gather_from_members(c.case, got_dh, c.case.reference_segment_ids.shape),
                                             c.want_dh)
        for name, want in c.want_dparams.items():
            errors[f"{tag}.d{name}"] = relative_error(sum(np.asarray(dparams[name][d]) for d in group), want)
    return errors
