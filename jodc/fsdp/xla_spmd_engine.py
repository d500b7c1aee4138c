"""The XLA-SPMD engine: what JAX users do today. Parameters are sharded with `NamedSharding` and one plain
`jax.jit` program runs the minibatch; XLA's SPMD partitioner inserts the all-gathers and reduce-scatters. Devices
run in lock-step over the same number of microbatches, one row per device (feed it lock-step plans, `lb_micro`)."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jodc.fsdp import sharding, state
from jodc.fsdp.batch import MinibatchArrays
from jodc.fsdp.engine import Engine, accumulate, microbatch_loop, update_step
from jodc.fsdp.optim import OptimizerConfig
from jodc.fsdp.stages import StagedModel


class XlaSpmdEngine(Engine):
    """Flat fp32 parameter vectors per group, padded as the heap pads them (`sharding.shard_numels`) and sharded
    over 'd'. No timelines: one program for all devices has no per-device place to stamp (`supports_timeline`).

    On an HSDP mesh ('r', 'd') the parameters are sharded over 'd' and replicated over 'r', and the batch rows are
    split over both (XLA places the cross-replica reduction)."""

    name = "xla_spmd"
    options = ("remat",)

    def __init__(self, model: StagedModel, groups: dict[str, Any], mesh: Mesh, *, optimizer: OptimizerConfig,
                 compute_dtype=jnp.float32, remat: bool = True, length_buckets=None):
        super().__init__(model, groups, optimizer=optimizer, compute_dtype=compute_dtype,
                         length_buckets=length_buckets)
        self.mesh = sharding.check_mesh(mesh, "SPMD")
        self.axes = sharding.device_axes(mesh)
        self.remat = remat  # per-stage rematerialisation, like the other engines (MaxText's remat_policy=full)
        self.numels = {g: model.layouts[g].numel for g in model.group_names}
        shards = sharding.shards(mesh)
        self.padded = {g: n * shards for g, n in sharding.shard_numels(self.numels, shards).items()}
        self.param_sharding = NamedSharding(mesh, P("d"))
        # split over 'd' (replicated over HSDP replica groups): the canonical layout itself (jodc.fsdp.state)
        flats = state.place_groups(state.as_source(groups, model.layouts), self.padded, self.param_sharding)
        self._place_state(flats, self.param_sharding, self._opt_shardings(jax.eval_shape(self.tx.init, flats)))
        self.batch_sharding = NamedSharding(mesh, P(None, self.axes, None))  # [M, D, T]: one row per device

    def _opt_shardings(self, opt_state):
        """Optimizer state leaves of a parameter group are sharded as the parameters, the others replicated."""
        replicated = NamedSharding(self.mesh, P())

        def pick(path, _):
            return self.param_sharding if any(getattr(k, "key", None) in self.numels for k in path) else replicated

        return jax.tree_util.tree_map_with_path(pick, opt_state)

    @property
    def num_devices(self) -> int:
        return int(self.mesh.devices.size)  # replicas x shards

    def _loss(self, flats, microbatch):
        # FSDP's partitioning, stated: each group is gathered whole (one all-gather of its flat vector per
        # microbatch, whose gradient flows back as a reduction into the shards) and every device runs its own
        # rows. Left to itself the partitioner sliced the sharded flat vectors in place (a collective-permute
        # wherever a tensor straddles two shards), and blockwise attention's loop over (row, block) pairs, which
        # indexes rows dynamically, made it all-gather the rows' activations at every block: 400 collectives per
        # step of bench/e2e.py --quick and every row's attention computed on every device. Within a process those
        # are copies; across processes each is a gloo round trip (35 s per step). Hence the parameters are
        # constrained to be replicated and the model runs per device under shard_map (its loss and metrics are
        # sums over rows, so the psum is the whole microbatch's).
        replicated = NamedSharding(self.mesh, P())
        flats = {g: lax.with_sharding_constraint(v, replicated) for g, v in flats.items()}
        specs = {k: P(self.axes) if jnp.ndim(v) else P() for k, v in microbatch.items()}

        def per_device(flats, microbatch):
            groups = {g: self.model.layouts[g].unflatten(v[: self.numels[g]].astype(self.compute_dtype))
                      for g, v in flats.items()}
            loss, metrics = self.model.loss_and_metrics(groups, microbatch, remat=self.remat)
            return lax.psum((loss.astype(jnp.float32), metrics), self.axes)

        return jax.shard_map(per_device, mesh=self.mesh, in_specs=(P(), specs), out_specs=P())(flats, microbatch)

    def _full_step(self, flats, opt_state, arrays, round_bucket, normalizer, lengths=()):
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)
        # one program for all devices: round i runs every device's row at the longest bucket any of them needs
        loss, metric_sums, grads = microbatch_loop(
            accumulate(lambda mb, i: grad_fn(flats, mb)), arrays, next(iter(arrays.values())).shape[0],
            jax.tree.map(jnp.zeros_like, flats), normalizer=normalizer, lengths=lengths, bucket=round_bucket,
            metric_names=self.model.metric_names)
        flats, opt_state, loss, norm, metrics, applied = update_step(self.tx, self.optimizer, grads, flats,
                                                                     opt_state, loss, metric_sums)
        flats = jax.tree.map(lambda p: lax.with_sharding_constraint(p, self.param_sharding), flats)
        return flats, opt_state, loss, norm, metrics, applied

    def _run(self, batch: MinibatchArrays, recorder=None):
        m = max(1, int(batch.counts.max()))
        arrays = {k: np.ascontiguousarray(np.swapaxes(np.asarray(v)[:, :m], 0, 1))  # [M, D, T]
                  for k, v in batch.as_dict().items()}
        arrays = {k: sharding.put_sharded(v, self.batch_sharding) for k, v in arrays.items()}
        lengths = self.bucket_lengths(batch.token_cap)
        round_bucket = self.bucket_indices(batch)[:, :m].max(axis=0)
        step = self._cached(lengths, lambda: self._jit_step(functools.partial(self._full_step, lengths=lengths),
                                                            NamedSharding(self.mesh, P())))
        self.flats, self.opt_state, loss, norm, metrics, applied = step(
            self.flats, self.opt_state, arrays, sharding.put_replicated(self.mesh, round_bucket),
            sharding.put_replicated(self.mesh, np.float32(batch.normalizer)))
        return loss, norm, metrics, applied

    def _canonical(self) -> dict[str, Any]:
        return {"params": self.flats, "opt_state": self.opt_state}  # canonical as it is: split over 'd'

    def _targets(self) -> dict[str, Any]:
        return state.targets_of(self._canonical())

    def _load_canonical(self, loaded: dict[str, Any]) -> None:
        self.flats, self.opt_state = loaded["params"], loaded["opt_state"]
