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
from jodc.fsdp.stages import StagedModel, split_loss


class XlaSpmdEngine(Engine):
    """Flat fp32 parameter vectors per group, padded as the heap pads them (`sharding.shard_numels`) and sharded
    over 'd'. No timelines: one program for all devices has no per-device place to stamp (`supports_timeline`).

    On an HSDP mesh ('r', 'd') the parameters are sharded over 'd' and replicated over 'r', and the batch rows are
    split over both (XLA places the cross-replica reduction)."""

    name = "xla_spmd"
    lockstep = True  # one program for all devices
    supports_timeline = False
    default_planner = "lb_micro"
    supports_deterministic = False  # XLA places (and orders) the reductions
    options = ("remat",)

    def __init__(self, model: StagedModel, groups: dict[str, Any], mesh: Mesh, *, optimizer: OptimizerConfig,
                 compute_dtype=jnp.float32, remat: bool = True, length_buckets=None):
        super().__init__(model, groups, optimizer=optimizer, compute_dtype=compute_dtype,
                         length_buckets=length_buckets)
        self.layout = sharding.MeshLayout.of(mesh, "SPMD")
        self.mesh = mesh
        self.remat = remat  # per-stage rematerialisation, like the other engines (MaxText's remat_policy=full)
        self.numels = {g: model.layouts[g].numel for g in model.group_names}
        shards = self.layout.shards
        self.padded = {g: n * shards for g, n in sharding.shard_numels(self.numels, shards).items()}
        self.param_sharding = NamedSharding(mesh, P("d"))
        # split over 'd' (replicated over HSDP replica groups): the canonical layout itself (jodc.fsdp.state)
        flats = state.place_groups(state.as_source(groups, model.layouts), self.padded, self.param_sharding)
        self._place_state(flats, self.param_sharding, self._opt_shardings(jax.eval_shape(self.tx.init, flats)))
        self.batch_sharding = NamedSharding(mesh, P(None, self.layout.axes, None))  # [M, D, T]: one row per device

    def _opt_shardings(self, opt_state):
        """Optimizer state leaves of a parameter group are sharded as the parameters, the others replicated."""
        replicated = NamedSharding(self.mesh, P())

        def pick(path, _):
            return self.param_sharding if any(getattr(k, "key", None) in self.numels for k in path) else replicated

        return jax.tree_util.tree_map_with_path(pick, opt_state)

    @property
    def num_devices(self) -> int:
        return self.layout.devices

    def _loss(self, flats, microbatch):
        # FSDP's partitioning, stated: stage by stage, the stage's groups are gathered whole right before it runs
        # (each flat vector constrained to be replicated: XLA's partitioner places the all-gather), every device runs
        # its own rows of the stage, and the gathered parameters are dropped after it; the backward gathers them
        # again (remat), and their gradient flows back as a reduction into the shards. One stage's parameters are
        # whole at a time, as in FSDP. Constraining every group to be replicated at once, as this engine first did,
        # kept the whole model gathered for the whole step (bench/step_memory.py).
        #
        # Why per device at all: left to itself the partitioner sliced the sharded flat vectors in place (a
        # collective-permute wherever a tensor straddles two shards), and blockwise attention's loop over (row,
        # block) pairs, which indexes rows dynamically, made it all-gather the rows' activations at every block:
        # 400 collectives per step of bench/e2e.py --quick and every row's attention computed on every device.
        # Within a process those are copies; across processes each is a gloo round trip (35 s per step). Hence each
        # stage runs per device under shard_map on the replicated parameters; the activations between stages stay
        # sharded by rows (a leading device axis on every leaf), and the last stage's loss and metrics, sums over
        # rows, are psummed into the whole microbatch's.
        specs = {k: P(self.layout.axes) if jnp.ndim(v) else P() for k, v in microbatch.items()}
        h = None
        last = len(self.model.stages) - 1
        for index, st in enumerate(self.model.stages):
            stage = functools.partial(self._stage, st, specs, index == last)
            if self.remat:
                h = self._fsdp_remat(stage, index == last)(tuple(flats[g] for g in st.groups), h, microbatch)
            else:  # the gathered parameters are kept for the backward: every stage's, the whole model
                full = self._gather(tuple(flats[g] for g in st.groups),
                                    h if h is not None else microbatch["tokens"], P(self.layout.axes))
                h = stage(full, h, microbatch)
        return h

    def _gather(self, flats, after, after_spec):
        """The whole (replicated) flat vectors of `flats`, gathered once `after` (a pytree with `after_spec`) is
        computed: a constraint to be replicated, from which XLA's partitioner makes the all-gather."""
        replicated = NamedSharding(self.mesh, P())
        flats = _tie(self.mesh, flats, P("d"), after, after_spec)
        return tuple(lax.with_sharding_constraint(v, replicated) for v in flats)

    def _stage(self, st, specs, last, full, h, microbatch):
        """One stage on its gathered groups (`full`: whole flat vectors), per device on the device's rows (`h`: every
        leaf with a leading device axis, sharded over the devices)."""

        def per_device(full, h, microbatch):
            # varying from here on: the gradient of each whole flat vector is reduced over the devices at once,
            # after its tensors' gradients are put together, rather than tensor by tensor, each padded to the
            # vector's size first (XLA kept those padded copies alive together: a dozen layers' worth of memory)
            full = lax.pcast(full, self.layout.axes, to="varying")
            params = tuple(self.model.layouts[g].unflatten(v[: self.numels[g]].astype(self.compute_dtype))
                           for g, v in zip(st.groups, full))
            out = st.fn(params, jax.tree.map(lambda x: x[0], h), microbatch)
            if last:
                loss, metrics = split_loss(out, self.model.metric_names)
                return lax.psum((loss.astype(jnp.float32), metrics), self.layout.axes)
            return jax.tree.map(lambda x: x[None], out)

        return jax.shard_map(per_device, mesh=self.mesh, in_specs=(P(), P(self.layout.axes), specs),
                             out_specs=P() if last else P(self.layout.axes))(full, h, microbatch)

    def _fsdp_remat(self, stage, last):
        """`stage(full, h, microbatch)` on the gathered parameters, rematerialised as FSDP does it: a function of the
        shards, `(flats, h, microbatch) -> output`, whose forward gathers the stage's groups once `h` is there and
        keeps only its inputs (the shards, `h`, the microbatch); whose backward gathers them again once the
        cotangent is there, recomputes the stage and reduces the parameter gradient into the shards; and whose
        cotangent for `h` (the previous stage's backward) waits for that reduction.

        Those waits are data dependencies (`_tie`), not `jax.checkpoint`: the gathers do not depend on the
        microbatch, and XLA placed them all at the start of the step (hoisted out of the microbatch loop, or
        scheduled first; optimization barriers are gone by then on CPU), every stage's parameters whole twice over
        for the whole step, and it delayed every stage's gradient all-reduce to the end of the backward (combined
        into one), every stage's whole gradient at once. That is what the collective engine's all_gathers get."""
        rows = P(self.layout.axes)

        @jax.custom_vjp
        def run(flats, h, microbatch):
            return stage(self._gather(flats, h if h is not None else microbatch["tokens"], rows), h, microbatch)

        def forward(flats, h, microbatch):
            return run(flats, h, microbatch), (flats, h, microbatch)

        def backward(saved, cotangent):
            flats, h, microbatch = saved
            full = self._gather(flats, cotangent, P() if last else rows)
            _, vjp = jax.vjp(lambda full, h: stage(full, h, microbatch), full, h)
            d_full, d_h = vjp(cotangent)
            d_flats = tuple(lax.with_sharding_constraint(g, self.param_sharding) for g in d_full)
            if d_h is not None:
                d_h = _tie(self.mesh, d_h, rows, d_flats, P("d"))
            return d_flats, d_h, jax.tree.map(_zero_cotangent, microbatch)

        run.defvjp(forward, backward)
        return run

    def _full_step(self, flats, opt_state, arrays, round_bucket, normalizer, lengths=()):
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)

        def microbatch_grads(mb, i):  # every microbatch's gradient reduced into the shards, summed there
            aux, grads = grad_fn(flats, mb)
            return aux, jax.tree.map(lambda g: lax.with_sharding_constraint(g, self.param_sharding), grads)

        # one program for all devices: round i runs every device's row at the longest bucket any of them needs
        loss, metric_sums, grads = microbatch_loop(
            accumulate(microbatch_grads), arrays, next(iter(arrays.values())).shape[0],
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


def _tie(mesh, tree, spec, after, after_spec):
    """`tree` (sharded by `spec`), made to depend on `after` (sharded by `after_spec`) on every device, so that XLA
    computes nothing from it before `after` exists. The dependency is a select on a condition no value meets (the
    first local element of `after` above +inf; false for NaN too), so `tree` passes unchanged, but XLA cannot see
    that and cannot drop it; each device reads only its own data (no collective)."""

    def local(tree, after):
        probe = next(x for x in jax.tree.leaves(after) if x.size).ravel()[0].astype(jnp.float32)
        never = probe > jnp.inf
        return jax.tree.map(lambda v: jnp.where(never, jnp.zeros_like(v), v), tree)

    return jax.shard_map(local, mesh=mesh, in_specs=(spec, after_spec), out_specs=spec, check_vma=False)(tree, after)


def _zero_cotangent(x):
    """The (unused) cotangent of a microbatch field: zeros, float0 for integer fields."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)
