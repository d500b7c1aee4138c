"""The collective FSDP engine: every stage all-gathers its parameters and the backward pass reduce-scatters the
gradients (the transpose of all_gather), devices in lock-step over the same number of microbatches.

On an HSDP mesh ('r', 'd') the all-gathers and reduce-scatters stay inside a replica group ('d') and every
microbatch's gradient shard is all-reduced across the replicas ('r'), as torch's HSDP does."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jodc.fsdp import sharding, timeline
from jodc.fsdp.batch import MinibatchArrays
from jodc.fsdp.engine import Engine, accumulate, microbatch_loop, replica_sum, update_step
from jodc.fsdp.optim import OptimizerConfig
from jodc.fsdp.stages import CP_SPLIT_SEGMENTS, StagedModel, split_loss
from jodc.fsdp.state import ShardedStateMixin


@dataclasses.dataclass(frozen=True)
class MemberAxisExchange:
    """A group named at run time among the devices of a shard_map mesh axis, for lock-step engines: every device of
    the axis calls `all_gather` together (one `jax.lax.all_gather` over the whole axis, backward `psum_scatter`), and
    each keeps the slices of its own group. `members`: int32 [W] (W, static, at most the axis size), the group's
    axis positions in member order, then -1; a -1 slot stacks zeros (padding: segment 0 in the group keys, so it is
    never attended to). Devices outside any group pass ``[self, -1, ...]``: their rows attend within themselves."""

    axis_name: str
    members: jax.Array
    streams_kv = False  # all-gathers K/V over the axis

    def member_index(self) -> jax.Array:
        me = jax.lax.axis_index(self.axis_name)
        return jnp.argmax(self.members == me).astype(jnp.int32)

    def all_gather(self, x: jax.Array) -> jax.Array:
        gathered = jax.lax.all_gather(x, self.axis_name)
        valid = self.members >= 0
        picked = gathered[jnp.where(valid, self.members, 0)]
        mask = valid.reshape((-1,) + (1,) * x.ndim)
        return jnp.where(mask, picked, jnp.zeros_like(picked))


class CollectiveEngine(ShardedStateMixin, Engine):
    """all_gather / psum_scatter inside shard_map. All devices run max(counts) microbatches (plans from
    `lb_micro` give equal counts; extra ones are empty and cost compute)."""

    name = "collective"
    lockstep = True  # every device runs max(counts) microbatches: its collectives meet in every one
    supports_timeline = True
    default_planner = "lb_micro"
    supports_deterministic = False  # psum_scatter adds in the collective's own order
    # lock-step CP plans (`lockstep_cp`, `fixed_cp`): in a round where any device runs a CP row, every device runs the
    # CP form of the stages, its K/V all-gathered over the whole mesh axis and its own group's slices kept
    # (`MemberAxisExchange`); a device beside the groups is a group of itself
    supports_context_parallel = True

    def __init__(self, model: StagedModel, groups: dict[str, Any], mesh: Mesh, *, optimizer: OptimizerConfig,
                 compute_dtype=jnp.float32, length_buckets=None):
        super().__init__(model, groups, optimizer=optimizer, compute_dtype=compute_dtype,
                         length_buckets=length_buckets)
        self.layout = sharding.MeshLayout.of(mesh, self.name)
        self.mesh = mesh
        self.numels = {g: model.layouts[g].numel for g in model.group_names}
        self.shard_numels = sharding.shard_numels(self.numels, self.layout.shards)
        self._init_sharded_state(groups)

    @property
    def num_devices(self) -> int:
        return self.layout.devices

    def _microbatch_loss(self, shards, microbatch, i=None, recorder=None, members=None, split_segments=None):
        h = None
        exchange = None
        if members is not None:  # a round with context-parallel rows: every device runs the CP stages
            exchange = MemberAxisExchange("d", members)
            # the row's split sequences (segments 1..split_segments; 0 on a device beside the groups)
            rows = {**microbatch, CP_SPLIT_SEGMENTS: split_segments[None]}
            microbatch = {**microbatch, "cp_keys": self.model.context_parallel.keys(rows, exchange)}
        for index, st in enumerate(self.model.stages):
            def stage(local_shards, h, st=st):
                params = []
                for g, s in zip(st.groups, local_shards):
                    full = lax.all_gather(s, "d", tiled=True)[: self.numels[g]].astype(self.compute_dtype)
                    params.append(self.model.layouts[g].unflatten(full))
                if exchange is not None and st.context_parallel is not None:
                    return st.context_parallel(tuple(params), h, microbatch, exchange)
                return st.fn(tuple(params), h, microbatch)

            # remat: the gathered parameters are dropped after forward and re-gathered in backward (FSDP memory)
            h = jax.checkpoint(stage)(tuple(shards[g] for g in st.groups), h)
            if recorder is not None:
                last = index == len(self.model.stages) - 1  # the loss: its cotangent is a constant
                h = recorder.mark(h, i, timeline.STAGE_FORWARD, index) if last else recorder.probe(h, i, index)
        loss, metrics = split_loss(h, self.model.metric_names)
        return loss.astype(jnp.float32), metrics

    def _device_step(self, shards, opt_state, arrays, round_bucket, normalizer, round_cp=None, cp_members=None,
                     cp_split=None, recorder=None, lengths=()):
        groups = self.model.group_names
        shards, opt_state = sharding.local_state(shards, groups), sharding.local_state(opt_state, groups)
        arrays = sharding.local(arrays)
        grad_fn = jax.value_and_grad(functools.partial(self._microbatch_loss, recorder=recorder), has_aux=True)
        if cp_members is not None:
            cp_members, cp_split = cp_members[0], cp_split[0]  # this device's [M, D], [M]

        def plain_grads(mb, i):
            aux, grads = grad_fn(shards, mb, i)
            if self.layout.hsdp:  # all-reduce every microbatch's gradient over the replicas
                grads = replica_sum(grads, sharding.REPLICA_AXIS)
            return aux, grads

        def cp_grads(mb, i):
            return grad_fn(shards, mb, i, members=cp_members[i], split_segments=cp_split[i])

        def microbatch_grads(mb, i):
            if cp_members is None or mb["tokens"].shape[1] != lengths[-1]:  # CP rounds run at the full length
                return plain_grads(mb, i)
            # the predicate is the same on every device (replicated), so their collectives meet
            return lax.cond(round_cp[i], cp_grads, plain_grads, mb, i)

        arrays = jax.tree.map(lambda v: v[:, None], arrays)  # [M, 1, T]: this device's one row per microbatch
        # lock-step: every device runs round i at the longest bucket any device needs in that round
        loss_sum, metric_sums, grads = microbatch_loop(
            accumulate(microbatch_grads), arrays, next(iter(arrays.values())).shape[0],
            jax.tree.map(jnp.zeros_like, shards), normalizer=normalizer, lengths=lengths, bucket=round_bucket,
            metric_names=self.model.metric_names, axis=self.layout.axes, recorder=recorder)
        shards, opt_state, loss, norm, metrics, applied = update_step(
            self.tx, self.optimizer, grads, shards, opt_state, loss_sum, metric_sums, layout=self.layout)
        return (shards, sharding.stacked_state(opt_state, groups), loss[None], norm[None],
                sharding.stacked(metrics), applied[None])

    def _build(self, arrays, recorder, lengths, cp=False):
        axes = self.layout.axes
        specs = (sharding.device_spec(self.shards, axes), sharding.opt_state_specs(self.tx, self.shards, axes),
                 sharding.device_spec(arrays, axes), P(), P())
        if cp:
            specs += (P(), P(axes), P(axes))
        device_step = functools.partial(self._device_step, recorder=recorder, lengths=lengths)
        return jax.jit(jax.shard_map(device_step, mesh=self.mesh, in_specs=specs,
                                     out_specs=(specs[0], specs[1], *[P(axes)] * 4)),
                       donate_argnums=(0, 1))

    def _run(self, batch: MinibatchArrays, recorder=None):
        arrays = {k: np.asarray(v) for k, v in batch.as_dict().items()}
        m = int(batch.counts.max()) if batch.counts.size else 0
        arrays = {k: v[:, : max(m, 1)] for k, v in arrays.items()}  # lock-step over the largest count
        lengths = self.bucket_lengths(batch.token_cap)
        round_bucket = self.bucket_indices(batch)[:, : max(m, 1)].max(axis=0)
        cp = batch.has_context_parallel
        cp_inputs = ()
        if cp:
            cp_size, members = batch.cp_size[:, : max(m, 1)], batch.cp_members[:, : max(m, 1)]
            round_cp = (cp_size > 0).any(axis=0)
            round_bucket = np.where(round_cp, len(lengths) - 1, round_bucket)
            # -1 past each group's size; a plain row in a CP round is a group of its own device
            padded = np.where(np.arange(members.shape[2]) < cp_size[..., None], members, -1).astype(np.int32)
            alone = cp_size == 0
            padded[alone] = -1
            padded[..., 0] = np.where(alone, np.arange(padded.shape[0])[:, None], padded[..., 0])
            split = batch.cp_split_segments[:, : max(m, 1)]
            cp_inputs = (sharding.put_replicated(self.mesh, round_cp), sharding.put_per_device(self.mesh, padded),
                         sharding.put_per_device(self.mesh, split))
        key = (tuple(sorted((k, v.shape) for k, v in arrays.items())), recorder is not None, lengths, cp)
        fn = self._cached(key, lambda: self._build(arrays, recorder, lengths, cp))
        self.shards, self.opt_state, loss, norm, metrics, applied = fn(
            self.shards, self.opt_state, sharding.put_per_device(self.mesh, arrays),
            sharding.put_replicated(self.mesh, round_bucket),
            sharding.put_replicated(self.mesh, np.float32(batch.normalizer)), *cp_inputs)
        return loss, norm, metrics, applied

    def _check_context_parallel(self, batch: MinibatchArrays) -> None:
        if not batch.has_context_parallel:
            return
        if self.layout.hsdp:
            raise ValueError("the collective engine runs context-parallel microbatches on a flat ('d',) mesh only")
        if self.model.context_parallel is None:
            raise ValueError("the minibatch has context-parallel microbatches but the model has no context_parallel "
                             "stages (StagedModel.context_parallel)")
        # lock-step: every member of a group must run its row in the same round
        for d, row in enumerate(batch.cp_size):
            for j in np.flatnonzero(row > 0):
                for member in batch.cp_members[d, j, : row[j]]:
                    if batch.cp_size[member, j] != row[j] or (batch.cp_members[member, j] != batch.cp_members[d, j]).any():
                        raise ValueError(f"device {d}'s microbatch {j} is a row of a context-parallel group whose "
                                         f"member {int(member)} runs it at another step; the collective engine runs "
                                         "lock-step plans only (lockstep_cp, fixed_cp)")
                    if batch.cp_split_segments[member, j] != batch.cp_split_segments[d, j]:
                        raise ValueError(f"device {d}'s microbatch {j} holds {batch.cp_split_segments[d, j]} split "
                                         f"sequences, its group's member {int(member)} "
                                         f"{batch.cp_split_segments[member, j]}; every member's row holds pieces of "
                                         "the same ones")
