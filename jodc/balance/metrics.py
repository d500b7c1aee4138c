"""How good a plan is, in cost-model units (no hardware needed; :mod:`jodc.sim` turns plans into seconds).

* ``device_costs`` -- total cost per device; ``imbalance`` = max / mean of it (1.0 is perfect).
* ``padding_waste`` -- the fraction of the ``[T]`` buffers of non-empty microbatches that holds padding. It costs
  nothing with segment-aware attention and unpadded linear layers, but it is memory, and compute for an engine
  that runs linear layers over the whole buffer.
* predicted step cost under the two schedules of the ODC paper, ignoring communication:
  collective FSDP waits for the slowest device at every microbatch (``sum over i of max over d`` of the ``i``-th
  microbatch's cost, missing microbatches costing 0); ODC waits once per minibatch (``max over d of sum``).
  ``predicted_speedup`` is their ratio (>= 1 always).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from jodc.balance.cost import CostModel, sequence_costs
from jodc.balance.plan import Plan


@dataclasses.dataclass(frozen=True)
class PlanMetrics:
    """The metrics of one plan (fields as described in the module docstring)."""

    device_costs: tuple[float, ...]
    imbalance: float
    padding_waste: float
    collective_step_cost: float
    odc_step_cost: float
    predicted_speedup: float
    microbatch_counts: tuple[int, ...]


def microbatch_cost_table(plan: Plan, cost_model: CostModel | None = None) -> np.ndarray:
    """Costs as a ``[num_devices, max microbatch count]`` float64 array, 0 where a device has no microbatch.

    With ``cost_model`` the microbatches are re-costed with it (e.g. to judge a plan made with the linear model
    by FLOPs); otherwise the plan's own ``cost`` fields are used.
    """
    counts = plan.microbatch_counts()
    table = np.zeros((plan.num_devices, max(counts, default=0)), dtype=np.float64)
    for d, device in enumerate(plan.devices):
        for m, mb in enumerate(device):
            if cost_model is None:
                table[d, m] = mb.cost
            elif not mb.is_empty:
                table[d, m] = math.fsum(sequence_costs(cost_model, np.asarray(mb.seq_lengths)))
    return table


def imbalance_ratio(device_costs) -> float:
    """max / mean of per-device costs; 1.0 when all are equal (or all zero)."""
    costs = np.asarray(device_costs, dtype=np.float64)
    if costs.ndim != 1 or costs.size == 0:
        raise ValueError(f"device_costs must be a non-empty 1-D array, got shape {costs.shape}")
    mean = costs.mean()
    return float(costs.max() / mean) if mean > 0 else 1.0


def plan_metrics(plan: Plan, cost_model: CostModel | None = None) -> PlanMetrics:
    """All of the module's metrics for ``plan`` (re-costed with ``cost_model`` if given)."""
    table = microbatch_cost_table(plan, cost_model)
    device_costs = table.sum(axis=1)
    nonempty = sum(1 for device in plan.devices for mb in device if not mb.is_empty)
    waste = 1.0 - plan.total_tokens / (nonempty * plan.token_cap) if nonempty else 0.0
    collective = float(table.max(axis=0).sum()) if table.size else 0.0
    odc = float(device_costs.max())
    return PlanMetrics(
        device_costs=tuple(float(c) for c in device_costs),
        imbalance=imbalance_ratio(device_costs),
        padding_waste=float(waste),
        collective_step_cost=collective,
        odc_step_cost=odc,
        predicted_speedup=collective / odc if odc > 0 else 1.0,
        microbatch_counts=plan.microbatch_counts(),
    )
