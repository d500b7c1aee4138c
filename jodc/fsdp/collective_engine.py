"""The collective FSDP engine: every stage all-gathers its parameters and the backward pass reduce-scatters the
gradients (the transpose of all_gather), devices in lock-step over the same number of microbatches."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jodc.fsdp import sharding, timeline
from jodc.fsdp.batch import MinibatchArrays
from jodc.fsdp.engine import Engine
from jodc.fsdp.odc_engine import P_tree
from jodc.fsdp.optim import OptimizerConfig, guarded_update, make_optimizer, squared_norm
from jodc.fsdp.stages import StagedModel, split_loss
from jodc.fsdp.state import ShardedStateMixin, shard_tree
from jodc.ops import _native


class CollectiveEngine(ShardedStateMixin, Engine):
    """all_gather / psum_scatter inside shard_map. All devices run max(counts) microbatches (plans from
    `lb_micro` give equal counts; extra ones are empty and cost compute)."""

    name = "collective"

    def __init__(self, model: StagedModel, groups: dict[str, Any], mesh: Mesh, *, optimizer: OptimizerConfig,
                 compute_dtype=jnp.float32, length_buckets=None):
        super().__init__(model, groups, optimizer=optimizer, compute_dtype=compute_dtype,
                         length_buckets=length_buckets)
        if "d" not in mesh.shape or len(mesh.shape) != 1:
            raise ValueError(f"the collective engine needs a 1-D mesh with axis 'd', got axes {dict(mesh.shape)}")
        self.mesh = mesh
        devices = int(mesh.shape["d"])
        lib = _native.cpu_library()
        self.numels = {g: model.layouts[g].numel for g in model.group_names}
        self.shard_numels = {g: int(lib.shard_numel(n, devices, 4)) for g, n in self.numels.items()}
        self.tx = make_optimizer(optimizer)
        flats = model.flatten_groups(groups)
        self.shards = sharding.put_per_device(mesh, shard_tree(flats, self.numels, self.shard_numels, devices))
        init = jax.shard_map(lambda s: sharding.stacked(self.tx.init(sharding.local(s))), mesh=mesh,
                             in_specs=(sharding.device_spec(self.shards),), out_specs=P_tree(self.tx, self.shards))
        self.opt_state = jax.jit(init)(self.shards)
        self._step_fns: dict[Any, Any] = {}

    @property
    def num_devices(self) -> int:
        return int(self.mesh.shape["d"])

    def _microbatch_loss(self, shards, microbatch, i=None, recorder=None):
        h = None
        for index, st in enumerate(self.model.stages):
            def stage(local_shards, h, st=st):
                params = []
                for g, s in zip(st.groups, local_shards):
                    full = lax.all_gather(s, "d", tiled=True)[: self.numels[g]].astype(self.compute_dtype)
                    params.append(self.model.layouts[g].unflatten(full))
                return st.fn(tuple(params), h, microbatch)

            # remat: the gathered parameters are dropped after forward and re-gathered in backward (FSDP memory)
            h = jax.checkpoint(stage)(tuple(shards[g] for g in st.groups), h)
            if recorder is not None:
                last = index == len(self.model.stages) - 1  # the loss: its cotangent is a constant
                h = recorder.mark(h, i, timeline.STAGE_FORWARD, index) if last else recorder.probe(h, i, index)
        loss, metrics = split_loss(h, self.model.metric_names)
        return loss.astype(jnp.float32), metrics

    def _device_step(self, shards, opt_state, arrays, round_bucket, normalizer, recorder=None, lengths=()):
        shards, opt_state, arrays = sharding.local(shards), sharding.local(opt_state), sharding.local(arrays)
        num_micro = next(iter(arrays.values())).shape[0]
        grad_fn = jax.value_and_grad(functools.partial(self._microbatch_loss, recorder=recorder), has_aux=True)

        def run_microbatch(length, full, i):
            microbatch = {k: v[:, :length] for k, v in full.items()}
            microbatch["normalizer"] = normalizer
            return grad_fn(shards, microbatch, i)

        def body(i, carry):
            grads, loss_sum, metric_sums = carry
            if recorder is not None:
                loss_sum = recorder.mark(loss_sum, i, timeline.MICROBATCH_START)
            full = {k: lax.dynamic_index_in_dim(v, i, keepdims=True)[0][None] for k, v in arrays.items()}
            if len(lengths) == 1:
                (loss, metrics), g = run_microbatch(lengths[0], full, i)
            else:  # lock-step: every device runs round i at the longest bucket any device needs in that round
                branches = [functools.partial(run_microbatch, length) for length in lengths]
                (loss, metrics), g = lax.switch(round_bucket[i], branches, full, i)
            if recorder is not None:
                g = recorder.mark(g, i, timeline.MICROBATCH_END)
            metric_sums = {k: metric_sums[k] + metrics[k] for k in metric_sums}
            return jax.tree.map(jnp.add, grads, g), loss_sum + loss, metric_sums

        zeros = jax.tree.map(jnp.zeros_like, shards)
        def varying_zero():
            return lax.pcast(jnp.zeros((), jnp.float32), "d", to="varying")

        init = (zeros, varying_zero(), {m: varying_zero() for m in self.model.metric_names})
        grads, loss_sum, metric_sums = lax.fori_loop(0, num_micro, body, init)
        global_sq, loss = lax.psum((squared_norm(grads), loss_sum), "d")
        shards, opt_state, norm, applied = guarded_update(self.tx, self.optimizer, grads, shards, opt_state,
                                                          global_sq_norm=global_sq, loss=loss,
                                                          all_reduce=lambda x: lax.psum(x, "d"))
        metric_sums = {k: lax.psum(v, "d")[None] for k, v in metric_sums.items()}
        return (sharding.stacked(shards), sharding.stacked(opt_state), loss[None], norm[None], metric_sums,
                applied[None])

    def _run(self, batch: MinibatchArrays, recorder=None):
        arrays = {k: np.asarray(v) for k, v in batch.as_dict().items()}
        m = int(batch.counts.max()) if batch.counts.size else 0
        arrays = {k: v[:, : max(m, 1)] for k, v in arrays.items()}  # lock-step over the largest count
        lengths = self.bucket_lengths(batch.token_cap)
        round_bucket = self.bucket_indices(batch)[:, : max(m, 1)].max(axis=0)
        key = (tuple(sorted((k, v.shape) for k, v in arrays.items())), recorder is not None, lengths)
        fn = self._step_fns.get(key)
        if fn is None:
            specs = (sharding.device_spec(self.shards), P_tree(self.tx, self.shards), sharding.device_spec(arrays),
                     P(), P())
            device_step = functools.partial(self._device_step, recorder=recorder, lengths=lengths)
            fn = jax.jit(jax.shard_map(device_step, mesh=self.mesh, in_specs=specs,
                                       out_specs=(specs[0], specs[1], P("d"), P("d"), P("d"), P("d"))),
                         donate_argnums=(0, 1))
            self._step_fns[key] = fn
        self.shards, self.opt_state, loss, norm, metrics, applied = fn(
            self.shards, self.opt_state, sharding.put_per_device(self.mesh, arrays),
            sharding.put_replicated(self.mesh, round_bucket),
            sharding.put_replicated(self.mesh, np.float32(batch.normalizer)))
        return loss, norm, metrics, applied
