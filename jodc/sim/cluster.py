"""Cluster-scale what-if: the modelled ODC gain and the planning cost at hundreds to thousands of devices.

For each device count, draws minibatches of ``seqs_per_device`` sequences per device from a length distribution,
plans them with LB-Mini and with the data-parallel baseline (local sort), and simulates the schedules
(:mod:`jodc.sim.schedule`). Reports two modelled gains, each a ratio of step times summed over the minibatches:
collective FSDP over ODC on the same LB-Mini plan, and collective FSDP on the local-sort plan over ODC on the
LB-Mini plan; LB-Mini's heaviest device over the lower bound; and LB-Mini's planning time, as process CPU time (the planner's own
cost) and wall time (which on a shared machine also counts other processes), both measured here; the plan itself
never depends on them. LB-Micro, whose equal-count refinement is not built for a thousand
parts, is left out at this scale. Communication scales with the device count through
the hardware model's ring transfers; everything else is the same model as the 8-device benchmark.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from jodc.balance import FlopsCost, get_planner, sequence_costs
from jodc.balance.descent import lower_bound
from jodc.balance.model_shape import DEEPSEEK_R1_DISTILL_QWEN_1_5B, ModelShape
from jodc.balance.validation import positive_int
from jodc.sim.hardware import A100_SXM_80GB, HardwareSpec
from jodc.sim.lengths import LONGALIGN_SFT, LengthDistribution
from jodc.sim.schedule import compare_schedules


@dataclasses.dataclass(frozen=True)
class ClusterWhatIf:
    """One device count's result (see the module docstring); times in seconds."""

    devices: int
    seqs_per_device: int
    minibatches: int
    odc_gain_same_plan: float  # collective / ODC step time, both on the LB-Mini plan
    odc_gain_over_local_sort: float  # collective + local sort / ODC + LB-Mini step time
    collective_step_time: float  # mean over minibatches, LB-Mini plan
    odc_step_time: float
    lb_mini_gap_to_bound: float  # mean heaviest device / max(largest sequence, mean per device)
    plan_ms_lb_mini: float  # mean wall time of one LB-Mini plan
    plan_cpu_ms_lb_mini: float  # mean process CPU time of one LB-Mini plan

    @property
    def plan_fraction_of_step(self) -> float:
        """LB-Mini's planning CPU time as a fraction of the modelled ODC step time."""
        return self.plan_cpu_ms_lb_mini / 1e3 / self.odc_step_time


def cluster_what_if(devices: int, *, seqs_per_device: int = 16, minibatches: int = 1, token_cap: int = 65536,
                    lengths: LengthDistribution = LONGALIGN_SFT, shape: ModelShape = DEEPSEEK_R1_DISTILL_QWEN_1_5B,
                    hardware: HardwareSpec = A100_SXM_80GB, seed: int = 0) -> ClusterWhatIf:
    """Plan and simulate ``minibatches`` minibatches at ``devices`` devices (see the module docstring)."""
    devices = positive_int(devices, "devices")
    seqs_per_device = positive_int(seqs_per_device, "seqs_per_device")
    minibatches = positive_int(minibatches, "minibatches")
    cost_model = FlopsCost(shape)
    collective = odc = baseline = 0.0
    gaps, plan_lb_mini, plan_cpu_lb_mini = [], 0.0, 0.0
    for r in range(minibatches):
        sample = lengths.sample(devices * seqs_per_device, seed=seed + r)
        start, start_cpu = time.perf_counter(), time.process_time()
        mini = get_planner("lb_mini")(sample, devices, token_cap, cost_model=cost_model)
        plan_lb_mini += time.perf_counter() - start
        plan_cpu_lb_mini += time.process_time() - start_cpu
        local = get_planner("local_sort")(sample, devices, token_cap, cost_model=cost_model)
        same = compare_schedules(mini, shape, hardware)
        collective += same.collective.step_time
        odc += same.odc.step_time
        baseline += compare_schedules(local, shape, hardware).collective.step_time
        costs = sequence_costs(cost_model, sample)
        gaps.append(max(sum(mb.cost for mb in d) for d in mini.devices) / lower_bound(costs, devices))
    return ClusterWhatIf(devices, seqs_per_device, minibatches, collective / odc, baseline / odc,
                         collective / minibatches, odc / minibatches, float(np.mean(gaps)),
                         1e3 * plan_lb_mini / minibatches, 1e3 * plan_cpu_lb_mini / minibatches)
