"""The ODC engine: parameters live in a symmetric heap; each device runs its own number of microbatches,
gathering layers on demand and pushing gradients to their owners, and meets the others once per minibatch.

On an HSDP mesh ('r', 'd') every replica group is its own ODC world (`jodc.ops.ReplicatedHeap`): gathers and pushes
stay inside the group; once every device of every group has arrived (`jodc.ops.replica_barrier`), each device's
accumulated shard is summed over the replicas once per minibatch (`replica_sum`), then updated and published into
its own group's heap as on a flat mesh."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jodc import ops
from jodc.fsdp import sharding, timeline
from jodc.fsdp.batch import FIELDS, MinibatchArrays
from jodc.fsdp.engine import Engine, microbatch_loop, replica_sum, update_step
from jodc.fsdp.optim import OptimizerConfig
from jodc.fsdp.stages import CP_SPLIT_SEGMENTS, StagedModel, split_loss
from jodc.fsdp.state import ShardedStateMixin
from jodc.ops.group.exchange import ExchangeSlots, OdcGroupExchange
from jodc.ops.group.members import check_streaming, streaming_compiles
from jodc.ops.token import as_varying


def _stage_layer_fn(stage):
    def fn(params, x):
        h, microbatch = x
        return stage.fn(params, h, microbatch)

    return fn


class ODCEngine(ShardedStateMixin, Engine):
    """On-Demand Communication. Use with per-device microbatch counts (e.g. `lb_mini` plans).

    `deterministic=True` makes gradient accumulation bit-for-bit reproducible (per-source landing slots; on an
    HSDP mesh the cross-replica sum is added in replica order too). `barrier_timeout_s` bounds the wait for a device
    that never arrives (``inf``: forever; None: the heap's default, ``jodc.ops.heap.default_barrier_timeout_s``); a
    device that fails aborts the step at once (`jodc.ops.DeviceFailed`), whatever the timeout.

    `cp_kv_exchange` (context-parallel microbatches): "stream" (the default; on jaxlib 0.11, which aborts compiling
    it, "all_gather" is and "stream" is refused) pulls one member's K/V at a time
    (`jodc.models.streamed_context_parallel`): a member's memory does not grow with its group (bench/long_context.py:
    a sequence 8x the cap over 8 devices needs 0.89x the step of plain rows at the cap, against 1.17x all-gathered),
    for one more group barrier and k-1 more pulls per layer backward (docs/context_parallel.md, "Streaming");
    "all_gather" gives each member the whole group's K/V of a layer at once.

    `mesh`: ('d',) for flat ODC over every device, or ('r', 'd') for HSDP (`sharding.hsdp_mesh`): replica groups
    along 'r', each sharding the parameters over its 'd' devices. Minibatches are planned for all replicas x shards
    devices (device (r, d) runs row r * shards + d); replicas may run different microbatch counts.
    """

    name = "odc"
    lockstep = False  # each device runs its own microbatch count
    supports_timeline = True
    # runs `jodc.balance.CPPlan`s (`lb_mini_cp`): a CP microbatch's members exchange K/V among themselves at every
    # attention layer over the heap's group ops (`jodc.ops.group.exchange`), inside the layer's custom_vjp
    supports_context_parallel = True
    default_planner = "lb_mini"
    supports_deterministic = True  # per-source landing slots (`deterministic=True`)
    options = ("deterministic", "barrier_timeout_s", "cp_kv_exchange")
    #: how a CP group's members see each other's K/V: "stream" (one member's at a time:
    #: `jodc.models.streamed_context_parallel`, the default) or "all_gather" (the group's K/V of a layer at once)
    CP_KV_EXCHANGES = ("stream", "all_gather")

    def __init__(self, model: StagedModel, groups: dict[str, Any], mesh: Mesh, *, optimizer: OptimizerConfig,
                 compute_dtype=jnp.float32, deterministic: bool = False, barrier_timeout_s: float | None = None,
                 length_buckets=None, cp_kv_exchange: str | None = None):
        if cp_kv_exchange is None:  # stream where the compiler can (not jaxlib 0.11: it aborts on it)
            cp_kv_exchange = "stream" if streaming_compiles() else "all_gather"
        if cp_kv_exchange not in self.CP_KV_EXCHANGES:
            raise ValueError(f"cp_kv_exchange must be one of {self.CP_KV_EXCHANGES}, got {cp_kv_exchange!r}")
        if cp_kv_exchange == "stream":
            check_streaming("ODCEngine(cp_kv_exchange='stream')")
        super().__init__(model, groups, optimizer=optimizer, compute_dtype=compute_dtype,
                         length_buckets=length_buckets)
        self.layout = sharding.MeshLayout.of(mesh, "ODC")
        self.mesh = mesh
        if self.layout.hsdp:  # one heap per replica group
            self.heap = ops.ReplicatedHeap(mesh, sharding.SHARD_AXIS, sharding.REPLICA_AXIS,
                                           deterministic=deterministic, barrier_timeout_s=barrier_timeout_s)
        else:
            self.heap = ops.SymmetricHeap(mesh, "d", deterministic=deterministic, barrier_timeout_s=barrier_timeout_s)
        self.deterministic = bool(deterministic)
        self.buckets = {g: self.heap.register(model.layouts[g].numel, jnp.float32, name=g) for g in model.group_names}
        self.numels = {g: b.numel for g, b in self.buckets.items()}
        self.shard_numels = sharding.shard_numels(self.numels, self.layout.shards)
        native = {g: b.shard_numel for g, b in self.buckets.items()}
        if native != self.shard_numels:  # one layout for every engine and checkpoint; never expected to differ
            raise RuntimeError(f"the heap's shard sizes {native} differ from jodc.ops.layout's {self.shard_numels}")
        self._init_sharded_state(groups)
        self._cp_slots = None  # the context-parallel exchange's slots, registered by the first CP minibatch
        self.cp_kv_exchange = cp_kv_exchange
        self._cp_sizes_seen: set[int] = set()  # group sizes the compiled step has a branch for

    @property
    def num_devices(self) -> int:
        return self.layout.devices

    # -- compiled pieces ---------------------------------------------------------------------------------------
    def _layers(self):
        layers = []
        for st in self.model.stages:
            layers.append(ops.odc_layer(
                _stage_layer_fn(st), tuple(self.buckets[g] for g in st.groups), dtype=self.compute_dtype,
                unflatten=tuple(self.model.layouts[g].unflatten for g in st.groups)))
        return layers

    def _cp_layers(self, slots):
        """The stages on a context-parallel row: a stage with a `context_parallel` fn runs it over an
        `OdcGroupExchange` among the row's group (``microbatch["cp_members"]``) inside the same per-layer custom_vjp
        (gather, recompute in the backward pass, push), the exchange's ops threaded on the layer's token; the
        others run as on a plain row. The n-th CP stage's forward exchange uses float slot bucket n % 2 and its
        recomputation in the backward pass (n + 1) % 2, so consecutive exchanges of a member always alternate
        buckets (forward 0, 1, ..., n-1, then backward n-1, ..., 0 recomputed): a member republishes a bucket only
        after a later exchange's barrier, when every member has read it. A streamed exchange's backward half
        (``cp_kv_exchange="stream"``) republishes into the bucket its recomputation did not use, after a barrier
        that follows every read of the recomputation."""
        layers, ordinal = [], 0
        for st in self.model.stages:
            buckets = tuple(self.buckets[g] for g in st.groups)
            unflatten = tuple(self.model.layouts[g].unflatten for g in st.groups)
            if st.context_parallel is None:
                layers.append(ops.odc_layer(_stage_layer_fn(st), buckets, dtype=self.compute_dtype,
                                            unflatten=unflatten))
                continue

            def fn(params, x, token, recompute, st=st, n=ordinal):
                h, microbatch = x
                exchange = OdcGroupExchange(slots, microbatch["cp_members"], token, first_float=(n + recompute) % 2,
                                            stream_kv=self.cp_kv_exchange == "stream")
                h = st.context_parallel(params, h, microbatch, exchange)
                return h, exchange.token

            layers.append(ops.odc_layer(fn, buckets, dtype=self.compute_dtype, unflatten=unflatten, with_token=True))
            ordinal += 1
        return layers

    def _device_step(self, shards, opt_state, arrays, counts, bucket_index, normalizer, cp_branch=None,
                     cp_members=None, cp_split=None, recorder=None, lengths=(), cp_sizes=()):
        groups, axes = self.model.group_names, self.layout.axes
        shards, opt_state = sharding.local_state(shards, groups), sharding.local_state(opt_state, groups)
        arrays = sharding.local(arrays)
        layers = self._layers()
        if cp_sizes:
            cp_branch, cp_members, cp_split = cp_branch[0], cp_members[0], cp_split[0]  # this device's [M], [M, D], [M]
            cp_layers = self._cp_layers(self._cp_slots)

        def microbatch_loss(anchor, token, microbatch, i, layers):
            h = anchor  # a float input whose cotangent is released only after the first stage's push
            if recorder is not None:
                h = recorder.probe(h, i, -1)  # forward: input ready; backward: the first stage's push is done
            for s, layer in enumerate(layers):
                h, token = layer((h, microbatch), token)
                if recorder is not None:
                    last = s == len(layers) - 1  # the loss: its cotangent is a constant, no backward mark
                    h = recorder.mark(h, i, timeline.STAGE_FORWARD, s) if last else recorder.probe(h, i, s)
            loss, metrics = split_loss(h, self.model.metric_names)
            return loss, (token, metrics)

        def forward_backward(microbatch, i, token, layers):
            anchor = lax.pcast(jnp.zeros(()), axes, to="varying")
            loss, vjp_fn, (token, metrics) = jax.vjp(lambda a, t: microbatch_loss(a, t, microbatch, i, layers),
                                                     anchor, token, has_aux=True)
            d_anchor, _ = vjp_fn(jnp.ones_like(loss))
            token = ops.after(token, d_anchor)  # every push of this microbatch precedes what follows
            return loss, metrics, token

        def plain_microbatch(microbatch, i, token):
            return forward_backward(microbatch, i, token, layers)

        def cp_microbatch(group_size, microbatch, i, token):
            """This device's row of a CP group of `group_size`: the group's keys (one integer exchange), then the
            stages with the attention over the group, then a last group barrier (every member is done with the
            slots before any of them joins another group that reuses them). The keys learn from `cp_split` how many
            split sequences the row holds."""
            members = cp_members[i][:group_size]
            exchange = OdcGroupExchange(self._cp_slots, members, token)
            keys = self.model.context_parallel.keys({**microbatch, CP_SPLIT_SEGMENTS: cp_split[i][None]}, exchange)
            microbatch = {**microbatch, "cp_keys": keys, "cp_members": members}
            loss, metrics, token = forward_backward(microbatch, i, exchange.token, cp_layers)
            token = OdcGroupExchange(self._cp_slots, members, token).close()
            return loss, metrics, token

        def run_microbatch(microbatch, i, token):
            """Forward + backward of one microbatch; its gradients are pushed to their owners, not carried."""
            if not cp_sizes or microbatch["tokens"].shape[1] != lengths[-1]:  # CP rows run at the full length
                return plain_microbatch(microbatch, i, token)
            branches = [plain_microbatch] + [functools.partial(cp_microbatch, k) for k in cp_sizes]
            branches = [_varying_outputs(b, axes) for b in branches]
            return lax.switch(cp_branch[i], branches, microbatch, i, token)

        # each device runs its own count and picks its own length per microbatch: no collective inside the loop
        arrays = jax.tree.map(lambda v: v[:, None], arrays)  # [M, 1, T]: this device's one row per microbatch
        per_device_normalizer = lax.pcast(normalizer, axes, to="varying")  # no collective in the backward
        loss_sum, metric_sums, token = microbatch_loop(
            run_microbatch, arrays, counts[0], ops.new_token(axes), normalizer=per_device_normalizer,
            lengths=lengths, bucket=bucket_index[0], metric_names=self.model.metric_names, axis=axes)
        # every device's pushes have landed. HSDP: every device of every group meets here (`replica_barrier`), so
        # that a failure anywhere ends every device's step in an abortable barrier, never in a collective below
        token = self._barrier(token, recorder, every_group=self.layout.hsdp)
        # the reductions below are collectives: keep them after the barrier (XLA would otherwise hoist them, and
        # the devices would meet there instead, invisibly)
        loss_sum, metric_sums = ops.depend_on((loss_sum, metric_sums), token)
        grads = {}
        for g in self.model.group_names:
            grads[g], token = ops.read_accumulator(self.buckets[g], token)
            token = ops.zero_accumulator(self.buckets[g], token)
        if self.layout.hsdp:  # each group holds its own devices' gradients; sum them, once
            grads = replica_sum(grads, sharding.REPLICA_AXIS, ordered=self.deterministic)
        # a non-finite step keeps (and republishes) the previous shards: a NaN on one device reaches no parameter
        shards, opt_state, loss, norm, metrics, applied = update_step(
            self.tx, self.optimizer, grads, shards, opt_state, loss_sum, metric_sums, layout=self.layout)
        for g in self.model.group_names:
            token = ops.publish(self.buckets[g], shards[g], token)
        token = self._barrier(token, recorder)  # nobody gathers the next minibatch before everyone published
        shards = jax.tree.map(lambda s: ops.depend_on(s, token), shards)  # results wait for the last barrier
        return (shards, sharding.stacked_state(opt_state, groups), loss[None], norm[None],
                sharding.stacked(metrics), applied[None])

    def _barrier(self, token, recorder, every_group: bool = False):
        if recorder is not None:
            token = recorder.mark(token, -1, timeline.BARRIER_ENTER)
        token = ops.replica_barrier(self.heap, token) if every_group else ops.barrier(self.heap, token)
        if recorder is not None:
            token = recorder.mark(token, -1, timeline.BARRIER_EXIT)
        return token

    def _step_fn(self, arrays_template, recorder, cp_sizes=()):
        lengths = self.bucket_lengths(next(iter(arrays_template.values())).shape[2])
        key = jax.tree.map(lambda x: x.shape, arrays_template)
        key = (tuple(sorted((k, v) for k, v in key.items())), recorder is not None, lengths, cp_sizes)

        def build():
            axes = self.layout.axes
            specs = (sharding.device_spec(self.shards, axes), sharding.opt_state_specs(self.tx, self.shards, axes),
                     sharding.device_spec(arrays_template, axes), P(axes), P(axes), P())
            if cp_sizes:
                specs += (P(axes), P(axes), P(axes))
            device_step = functools.partial(self._device_step, recorder=recorder, lengths=lengths, cp_sizes=cp_sizes)
            return jax.jit(jax.shard_map(device_step, mesh=self.mesh, in_specs=specs,
                                         out_specs=(specs[0], specs[1], *[P(axes)] * 4)),
                           donate_argnums=(0, 1))

        return self._cached(key, build)

    def _run(self, batch: MinibatchArrays, recorder=None):
        self.heap.check_alive()  # an aborted or timed-out heap fails here, before anything is dispatched
        arrays = {k: np.asarray(v) for k, v in batch.as_dict().items()}
        arrays = _pad_microbatches(arrays)
        bucket_index = self.bucket_indices(batch)
        cp_sizes, cp_inputs = (), ()
        if batch.has_context_parallel:
            self._ensure_cp_slots(batch.token_cap)
            # one compiled branch per group size; which devices form the groups is a run-time operand (the member
            # lists), so any grouping of these sizes reuses the program. The program keeps the branches of every
            # size seen so far: at most one compilation per new size (devices - 1 at most), never one per grouping
            self._cp_sizes_seen |= {int(k) for k in batch.cp_size[batch.cp_size > 0]}
            cp_sizes = tuple(sorted(self._cp_sizes_seen))
            branch = np.zeros(batch.cp_size.shape, np.int32)
            for j, k in enumerate(cp_sizes):
                branch[batch.cp_size == k] = j + 1
            bucket_index = np.where(batch.cp_size > 0, len(self.bucket_lengths(batch.token_cap)) - 1, bucket_index)
            m = arrays["tokens"].shape[1]
            pad = ((0, 0), (0, m - branch.shape[1]))
            cp_inputs = (sharding.put_per_device(self.mesh, np.pad(branch, pad)),
                         sharding.put_per_device(self.mesh, np.pad(batch.cp_members, pad + ((0, 0),))),
                         sharding.put_per_device(self.mesh, np.pad(batch.cp_split_segments, pad)))
        fn = self._step_fn(arrays, recorder, cp_sizes)
        bucket_index = np.pad(bucket_index, ((0, 0), (0, arrays["tokens"].shape[1] - bucket_index.shape[1])))
        self.shards, self.opt_state, loss, norm, metrics, applied = fn(
            self.shards, self.opt_state, sharding.put_per_device(self.mesh, arrays),
            sharding.put_per_device(self.mesh, batch.counts), sharding.put_per_device(self.mesh, bucket_index),
            jnp.float32(batch.normalizer), *cp_inputs)
        return loss, norm, metrics, applied

    def _ensure_cp_slots(self, token_cap: int) -> None:
        """Registers the context-parallel exchange's slots once, for the first CP minibatch's token cap (sized by
        the model: `ContextParallel.slot_numel`); a later CP minibatch with a larger cap is refused."""
        numel = self.model.context_parallel.slot_numel(int(token_cap))
        if self._cp_slots is None:
            self._cp_slots = ExchangeSlots(self.heap, numel)
        elif numel > self._cp_slots.slot_numel:
            raise ValueError(f"this minibatch's token cap {token_cap} needs context-parallel exchange slots of "
                             f"{numel} elements; the engine registered {self._cp_slots.slot_numel} for its first CP "
                             "minibatch (keep engine.token_cap fixed)")

    def _check_batch(self, batch: MinibatchArrays) -> None:
        super()._check_batch(batch)
        if batch.has_context_parallel:
            if self.layout.hsdp:
                raise ValueError("the ODC engine runs context-parallel microbatches on a flat ('d',) mesh only, not "
                                 "on an HSDP mesh")
            if self.model.context_parallel is None:
                raise ValueError("the minibatch has context-parallel microbatches but the model has no "
                                 "context_parallel stages (StagedModel.context_parallel)")

    def _wait(self, outputs):
        """Waits device by device: the first device whose step fails aborts the heap, so the others leave the
        barrier at once and the step raises `jodc.ops.DeviceFailed` with that device's error (not a timeout)."""
        if self.heap.freed:  # closed: nothing to wait for that uses the heap
            return jax.block_until_ready(outputs)
        return self.heap.block_until_ready(outputs)

    # -- state ---------------------------------------------------------------------------------------------------
    def _params_loaded(self) -> None:
        """Publishes the engine's shards into the heap, each device its own (on device: no host copy, no process
        writes another's shard), then meets the others, so no gather reads a shard before it is published."""
        self.heap.check_alive()
        axes, groups = self.layout.axes, self.model.group_names

        def publish_all(shards):
            token = ops.new_token(axes)
            for g in groups:
                token = ops.publish(self.buckets[g], shards[g], token)
            return self._barrier(token, None)[None]

        fn = self._cached("publish", lambda: jax.jit(jax.shard_map(
            publish_all, mesh=self.mesh, in_specs=(sharding.device_spec(self.shards, axes),), out_specs=P(axes))))
        self._wait(fn(self.shards))

    def close(self) -> None:
        self.heap.free()


def _varying_outputs(fn, axes):
    """`fn` with every output typed as varying over `axes` (lax.switch needs its branches' types equal)."""
    return lambda *args: jax.tree.map(lambda o: as_varying(o, set(axes)), fn(*args))


def _pad_microbatches(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Pads the microbatch axis to a power of two so that varying counts reuse a few compiled steps."""
    m = next(iter(arrays.values())).shape[1]
    target = 1 << max(0, (m - 1).bit_length())
    if target == m:
        return arrays
    return {k: np.concatenate([v, np.zeros(v.shape[:1] + (target - m,) + v.shape[2:], v.dtype)], axis=1)
            for k, v in arrays.items()}


__all__ = ["ODCEngine", "FIELDS"]
