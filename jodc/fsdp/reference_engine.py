"""The unsharded single-device reference: the same model, data and optimizer with no distribution at all.
Both distributed engines are tested against it."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jodc.fsdp import state
from jodc.fsdp.batch import MinibatchArrays
from jodc.fsdp.engine import Engine, accumulate, microbatch_loop, update_step
from jodc.fsdp.optim import OptimizerConfig
from jodc.fsdp.stages import StagedModel


class ReferenceEngine(Engine):
    """Runs every microbatch of every device, in order, on one device with full fp32 parameters.

    `mesh`: the devices the minibatches are planned for (any 1-D mesh; its size is `num_devices`); the reference
    runs on its first device. None: one device, the first CPU device. Length buckets are accepted (the shape every
    engine shares) and not used: each microbatch runs at the full token cap."""

    name = "reference"
    lockstep = False  # it runs each device's own microbatches, in turn
    supports_timeline = False  # one device: nothing to wait for
    default_planner = "lb_mini"
    supports_deterministic = True  # one device, one order: always

    def __init__(self, model: StagedModel, groups: dict[str, Any], mesh: Mesh | None = None, *,
                 optimizer: OptimizerConfig, compute_dtype=jnp.float32, length_buckets=None):
        super().__init__(model, groups, optimizer=optimizer, compute_dtype=compute_dtype,
                         length_buckets=length_buckets)
        self._num_devices = 1 if mesh is None else int(mesh.devices.size)
        self.device = jax.devices("cpu")[0] if mesh is None else mesh.devices.flat[0]
        on_device = jax.sharding.SingleDeviceSharding(self.device)
        flats = state.place_groups(state.as_source(groups, model.layouts), self.numels, on_device)
        self._place_state(flats, on_device, on_device)
        self._step = self._jit_step(self._full_step, on_device)

    @property
    def num_devices(self) -> int:
        return self._num_devices

    def _loss(self, flats, microbatch):
        groups = {g: self.model.layouts[g].unflatten(v.astype(self.compute_dtype)) for g, v in flats.items()}
        loss, metrics = self.model.loss_and_metrics(groups, microbatch)
        return loss.astype(jnp.float32), metrics

    def _full_step(self, flats, opt_state, arrays, normalizer):
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)
        arrays = jax.tree.map(lambda v: v[:, None], arrays)  # [N, 1, T]: one row per microbatch
        n = next(iter(arrays.values())).shape[0]
        loss, metric_sums, grads = microbatch_loop(
            accumulate(lambda mb, i: grad_fn(flats, mb)), arrays, n, jax.tree.map(jnp.zeros_like, flats),
            normalizer=normalizer, lengths=(next(iter(arrays.values())).shape[2],), bucket=None,
            metric_names=self.model.metric_names)
        return update_step(self.tx, self.optimizer, grads, flats, opt_state, loss, metric_sums)

    def _run(self, batch: MinibatchArrays, recorder=None):
        rows = [(d, m) for d in range(batch.num_devices) for m in range(int(batch.counts[d]))]
        arrays = {k: np.stack([v[d, m] for d, m in rows]) if rows else v[0, :0]
                  for k, v in batch.as_dict().items()}
        self.flats, self.opt_state, loss, norm, metrics, applied = self._step(
            self.flats, self.opt_state, jax.device_put(arrays, self.device), jnp.float32(batch.normalizer))
        return loss, norm, metrics, applied

    def _check_batch(self, batch: MinibatchArrays) -> None:
        pass  # any device count: the reference flattens the plan

    def _canonical(self) -> dict[str, Any]:
        return {"params": self.flats, "opt_state": self.opt_state}  # unpadded: canonical as it is

    def _targets(self) -> dict[str, Any]:
        return state.targets_of(self._canonical())

    def _load_canonical(self, loaded: dict[str, Any]) -> None:
        self.flats, self.opt_state = loaded["params"], loaded["opt_state"]
