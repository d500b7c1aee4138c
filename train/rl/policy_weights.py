"""The policy's weights where an RL step uses them, made on the devices from the engine's sharded fp32 state: no
host copy of the model per step (DESIGN.md section 10).

- `sampler_weights_on_devices`: the whole policy in the sampler's dtype (`rollout.dtype`) on each sampling device,
  by one jitted reshard per parameter set: the shards are cast on the devices that hold them, then gathered in that
  dtype (an all-gather of bf16 for a bf16 sampler: no fp32 full copy on any device), then cut into the groups'
  pytrees (bf16 moved as 32-bit words: XLA's CPU backend would widen it). Each sampling device keeps its own copy (`DeviceWeights.on`), which `generate` uses where it lies.
- `policy_on_device`: the fp32 group pytrees on one device, for the trainer's fp32 forward passes (recomputed
  log-probs, values, the sampler's mismatch pass, the KL reference): the same values, the same compiled forward as
  with host parameters, so the same bits.
- `PolicyWeights`: one policy version as the step uses it (the sampler's copies and the trainer's fp32 copy); the
  asynchronous sampler keeps these as its versions.

Across processes (jax.distributed) a gather over the engine's mesh is a collective: every process must make each
version in the same order, which the trainer does at the start of every step (never the sampler thread). A value
on a device outside the source's devices (the reference engine's one device, sampled on several) is copied device
to device from the process's first copy.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

FLOAT32 = "float32"


def sharded_params(engine) -> dict[str, jax.Array]:
    """The engine's current fp32 parameters per group (`Engine.sharded_params`: 1-D over its devices, no copy)."""
    return engine.sharded_params()


def _source(engine_or_params, layouts=None):
    """(flat arrays per group, layouts per group) of an engine or of a mapping of flat arrays."""
    if isinstance(engine_or_params, Mapping):
        if layouts is None:
            raise ValueError("policy_weights: flat parameters need their group layouts")
        return dict(engine_or_params), layouts
    return sharded_params(engine_or_params), layouts if layouts is not None else engine_or_params.model.layouts


def _numel(layout) -> int:
    return sum(math.prod(s) for s in layout.shapes)


def _replicated(sharding) -> jax.sharding.Sharding:
    """Every device of `sharding` holding the whole value."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, P())
    return sharding  # one device


_PROGRAMS: dict[Any, Any] = {}


def _gather_program(groups: tuple, layouts: tuple, dtype: str, in_shardings: tuple, shapes: tuple):
    """The jitted reshard of flat group vectors (any shape whose row-major order is the group's padded vector)
    into group pytrees in `dtype` replicated over the source's devices, built once per signature. The cast runs
    on the shards (the sharding constraint keeps it there), the gather moves the cast values (`_gathered_bits`)."""
    key = (groups, layouts, dtype, in_shardings, shapes)
    program = _PROGRAMS.get(key)
    if program is None:
        out = _replicated(in_shardings[0])

        def reshard(flats):
            trees = []
            for flat, layout, sharding in zip(flats, layouts, in_shardings):
                whole = flat.astype(dtype)
                if isinstance(sharding, NamedSharding):  # cast where the shards are, then gather the cast values
                    whole = _gathered_bits(jax.lax.with_sharding_constraint(whole, sharding), sharding, out)
                trees.append(layout.unflatten(whole.reshape(-1)[:_numel(layout)]))
            return tuple(trees)

        program = _PROGRAMS[key] = jax.jit(reshard, out_shardings=out)
    return program


def _gathered_bits(x, sharding, out):
    """Inside the reshard: `x` (sharded by `sharding`) resharded to `out`, moved as 32-bit words where its dtype is
    narrower and each shard's last axis packs into whole words (XLA's CPU backend widens 8- and 16-bit collectives
    to fp32, which would gather a bf16 model at fp32's size); bit for bit the same values."""
    k = 4 // x.dtype.itemsize
    if k <= 1 or sharding.shard_shape(x.shape)[-1] % k:
        return jax.lax.with_sharding_constraint(x, out)
    words = jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // k, k), jnp.uint32)
    words = jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(words, sharding), out)
    return jax.lax.bitcast_convert_type(words, x.dtype).reshape(x.shape)


def _gathered(flats: dict, layouts, dtype: str) -> dict[str, Any]:
    """{group: pytree} in `dtype`, every leaf replicated over the devices of the flat arrays (one program)."""
    groups = tuple(flats)
    program = _gather_program(groups, tuple(layouts[g] for g in groups), dtype,
                              tuple(flats[g].sharding for g in groups), tuple(flats[g].shape for g in groups))
    return dict(zip(groups, program(tuple(flats[g] for g in groups))))


def _copy_on(leaf: jax.Array, device) -> jax.Array | None:
    """The single-device array of a replicated `leaf` on `device` (no copy), None if it has none there."""
    for shard in leaf.addressable_shards:
        if shard.device == device:
            return shard.data
    return None


@dataclasses.dataclass(frozen=True)
class DeviceWeights:
    """The whole policy in `dtype` on each of its devices: `on(device)` is the group pytrees held there (committed
    to that device, so `generate` runs with them without a transfer)."""

    dtype: str
    copies: dict  # jax.Device -> {group: pytree}

    @property
    def devices(self) -> list:
        return list(self.copies)

    def on(self, device) -> dict[str, Any]:
        try:
            return self.copies[device]
        except KeyError:
            raise ValueError(f"no copy of the policy on {device} (copies on {self.devices})") from None


def sampler_weights_on_devices(engine_or_params, layouts=None, numels=None, devices: Sequence = (),
                               dtype: str = FLOAT32) -> DeviceWeights:
    """The policy on each of `devices` in `dtype` (see the module docstring): one jitted reshard of the engine's
    sharded fp32 state (or of `engine_or_params`, a mapping of flat group vectors, with `layouts`); `numels` is
    implied by the layouts (checked when given). Across processes, `devices` are this process's."""
    flats, layouts = _source(engine_or_params, layouts)
    if numels is not None:
        wrong = {g: (numels[g], _numel(layouts[g])) for g in flats if numels[g] != _numel(layouts[g])}
        if wrong:
            raise ValueError(f"sampler_weights_on_devices: numels disagree with the layouts: {wrong}")
    if not devices:
        raise ValueError("sampler_weights_on_devices: no devices")
    dtype = jnp.dtype(dtype).name
    trees = _gathered(flats, layouts, dtype)
    leaves, treedef = jax.tree.flatten(trees)
    copies, first = {}, None
    for device in devices:
        held = [_copy_on(leaf, device) for leaf in leaves]
        if any(x is None for x in held):  # outside the source's devices: copied from this process's first copy
            if first is None:
                first = [_copy_on(leaf, next(iter(leaf.sharding.addressable_devices))) for leaf in leaves]
            held = jax.device_put(first, device)
        copies[device] = jax.tree.unflatten(treedef, held)
    return DeviceWeights(dtype=dtype, copies=copies)


def policy_on_device(engine_or_params, device, layouts=None) -> dict[str, Any]:
    """The fp32 group pytrees on `device` (the trainer's forward passes). Where every shard is in this process, the
    distinct shards are copied device to device onto `device` and joined there (the whole model is built on that
    device only); across processes a replicated gather (a collective, as `sampler_weights_on_devices`) of which
    only `device`'s copy is kept."""
    flats, layouts = _source(engine_or_params, layouts)
    if not all(flat.is_fully_addressable for flat in flats.values()):
        return sampler_weights_on_devices(flats, layouts, None, [device], FLOAT32).on(device)
    groups = tuple(flats)
    parts = tuple(tuple(jax.device_put(_distinct_shards(flats[g]), device)) for g in groups)
    key = ("join", groups, tuple(layouts[g] for g in groups))
    program = _PROGRAMS.get(key)
    if program is None:
        group_layouts = key[2]

        def join(parts):
            return tuple(layout.unflatten(jnp.concatenate([p.reshape(-1) for p in pieces])[:_numel(layout)]
                                          .astype(jnp.float32)) for pieces, layout in zip(parts, group_layouts))

        program = _PROGRAMS[key] = jax.jit(join)
    return dict(zip(groups, program(parts)))


def _distinct_shards(flat: jax.Array) -> list[jax.Array]:
    """The single-device arrays of `flat`'s distinct shards in index order (replicas skipped): joined row-major
    they are the whole array."""
    seen = {}
    for shard in flat.addressable_shards:
        key = tuple((s.start or 0) for s in shard.index)
        seen.setdefault(key, shard.data)
    return [seen[k] for k in sorted(seen)]


@dataclasses.dataclass(frozen=True)
class PolicyWeights:
    """One policy version as an RL step uses it: `sampler`, the whole policy in the sampler's dtype on every
    sampling device of this process; `trainer`, the fp32 group pytrees on the device of the trainer's forward
    passes (the sampler's own copy there when the sampler is fp32)."""

    sampler: DeviceWeights
    trainer: dict[str, Any]


def policy_weights(engine, devices: Sequence, dtype: str, trainer_device) -> PolicyWeights:
    """The current policy version of `engine` for `devices` sampling in `dtype` and the trainer's passes on
    `trainer_device` (across processes every process calls this at the same point: see the module docstring)."""
    sampler = sampler_weights_on_devices(engine, None, None, devices, dtype)
    if sampler.dtype == FLOAT32 and trainer_device in sampler.copies:
        trainer = sampler.on(trainer_device)
    else:
        trainer = policy_on_device(engine, trainer_device)
    return PolicyWeights(sampler=sampler, trainer=trainer)


def trainer_params(params):
    """The fp32 parameters of the trainer's forward passes: a `PolicyWeights`' trainer copy, or host pytrees as
    they are (the sampler process path)."""
    return params.trainer if isinstance(params, PolicyWeights) else params


def held_copy(engine, groups: Sequence[str] | None = None) -> dict[str, jax.Array]:
    """A copy of the engine's sharded fp32 state (of `groups`, default all) as it is now (the KL reference: the run's
    initial policy), held sharded as the engine holds it (1 / devices of the model per device), unaffected by later
    steps (the engine's step donates its own buffers)."""
    flats = sharded_params(engine)
    return {g: jnp.copy(flats[g]) for g in (groups if groups is not None else flats)}
