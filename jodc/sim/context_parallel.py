"""Predicted step of a plan with context-parallel (CP) groups, and the three CP layouts compared at cluster scale.

Costs come from a :class:`~jodc.balance.cp_cost.ContextParallelCost`: per-device rates (seconds per token, per
causal pair, per microbatch; link bandwidth and latency; per-exchange synchronisation), so a cluster's step is
predicted from what one device measures. Two schedules:

* **ODC** (:func:`simulate_cp_odc`) -- each device runs its own microbatches in order, with no synchronisation but
  its groups': a CP microbatch starts when the last of its members reaches it and lasts
  :meth:`~ContextParallelCost.group_time` on every member (members meet at every layer's exchange). The world meets
  once at the end (two link latencies). A plan that breaks the deadlock-free order raises.
* **lock-step** (:func:`simulate_cp_lockstep`) -- collective FSDP: step ``i`` of every device runs together and lasts
  as long as its slowest device (an empty step still pays the microbatch's parameter traffic).

A device is *busy* while it computes or moves its own data (its pieces, short sequences and exchanges); waiting for a
group's members, for the slowest device of a lock-step step, or at the end is idle. ``idle_fraction = 1 - sum(busy)
/ (devices x step time)``.

:func:`cp_layouts_what_if` draws minibatches from a long-tailed length distribution and compares the data-aware
layout (``lb_mini_cp`` under ODC) with fixed CP over all devices and lock-step dynamic CP, reporting the ratios the
CP benchmark reads (``cp_vs_fixed_cp``, ``cp_vs_lockstep_cp``, ``cp_idle_fraction``).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from jodc.balance.cp_cost import ContextParallelCost
from jodc.balance.cp_plan import CPMicrobatch, CPPlan
from jodc.balance.cp_planners import default_cp_cost, fixed_cp, lb_mini_cp, lockstep_cp
from jodc.balance.plan import Microbatch
from jodc.balance.validation import positive_int
from jodc.balance.model_shape import DEEPSEEK_R1_DISTILL_QWEN_1_5B, ModelShape
from jodc.sim.hsdp import A100_NODES_400G, NodeTopology
from jodc.sim.lengths import LONGALIGN_LONG_TAIL


def cp_cost_for(shape: ModelShape = DEEPSEEK_R1_DISTILL_QWEN_1_5B, topology: NodeTopology = A100_NODES_400G, *,
                layer_sync_seconds: float = 0.0) -> ContextParallelCost:
    """The CP cost model of ``shape`` on ``topology``'s devices: compute at the device's achieved FLOP/s, groups
    inside a node exchange over its link, groups across nodes over the network port (full bandwidth: the exchange
    is one all-gather / reduce-scatter per layer, whichever engine carries it)."""
    device = topology.device
    return ContextParallelCost.from_shape(
        shape, flops_per_second=device.achieved_flops, link_bandwidth=device.link_bandwidth,
        link_latency=device.link_latency, layer_sync_seconds=layer_sync_seconds,
        devices_per_node=topology.devices_per_node, inter_node_bandwidth=topology.inter_bandwidth,
        inter_node_latency=topology.inter_latency)


@dataclasses.dataclass(frozen=True)
class CPSegment:
    """One interval of a device's predicted timeline: ``kind`` is ``busy`` or ``wait``; CP rows carry their group."""

    device: int
    start: float
    end: float
    kind: str
    label: str
    group: int = -1  # the CP group's id, -1 for a data-parallel microbatch or a wait
    members: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class CPStepResult:
    """A predicted step (seconds)."""

    schedule: str
    step_time: float
    device_busy: tuple[float, ...]
    idle_fraction: float
    timeline: tuple[CPSegment, ...]


def _group_costs(plan: CPPlan, g: int, cost: ContextParallelCost) -> tuple[float, np.ndarray]:
    """(duration, busy time of each member) of group ``g``'s microbatch. A member is busy for the microbatch's fixed
    cost, its pieces, the short sequences it packs beside them and the exchange; the microbatch lasts as long as
    the slowest member's compute plus the exchange (members meet at every exchange)."""
    group = plan.groups[g]
    compute = cost.member_compute(group.seq_lengths, group.size)
    for d in group.members:
        for item in plan.devices[d]:
            if isinstance(item, CPMicrobatch) and item.group.group_id == g:
                compute[item.member] += float(np.sum(cost(np.asarray(item.short.seq_lengths, dtype=np.int64))))
    fixed = cost.microbatch_seconds + cost.exchange_time(group.seq_lengths, group.members)
    return fixed + float(compute.max()), fixed + compute


def _result(schedule: str, plan: CPPlan, wall: float, busy: np.ndarray, segments) -> CPStepResult:
    idle = 1.0 - float(busy.sum()) / (plan.num_devices * wall) if wall > 0 else 0.0
    return CPStepResult(schedule, float(wall), tuple(float(b) for b in busy), max(0.0, idle), tuple(segments))


def simulate_cp_odc(plan: CPPlan, cost: ContextParallelCost | None = None) -> CPStepResult:
    """The ODC step of ``plan`` (see the module docstring); ValueError if its groups cannot all run (deadlock)."""
    cost = cost or default_cp_cost()
    world = plan.num_devices
    clock, busy, pos = np.zeros(world), np.zeros(world), [0] * world
    arrived: dict[int, dict[int, float]] = {}
    segments: list[CPSegment] = []
    while True:
        progress = False
        for d in range(world):
            while pos[d] < len(plan.devices[d]):
                item = plan.devices[d][pos[d]]
                if isinstance(item, Microbatch):
                    took = cost.microbatch_time(item.seq_lengths)
                    if took > 0:
                        segments.append(CPSegment(d, clock[d], clock[d] + took, "busy", f"mb{pos[d]}"))
                    clock[d] += took
                    busy[d] += took
                    pos[d] += 1
                    progress = True
                    continue
                g = item.group.group_id
                waiting = arrived.setdefault(g, {})
                if d not in waiting:
                    waiting[d] = float(clock[d])
                    progress = True
                if len(waiting) < item.group.size:
                    break
                _run_group(plan, g, waiting, cost, clock, busy, pos, segments)
                progress = True
        if all(pos[d] == len(plan.devices[d]) for d in range(world)):
            break
        if not progress:
            stuck = sorted(g for g, w in arrived.items() if len(w) < plan.groups[g].size)
            raise ValueError(f"the plan deadlocks: groups {stuck[:5]} wait for members that never reach them")
    sync = 2.0 * cost.link_latency if world > 1 else 0.0
    wall = float(clock.max()) + sync
    for d in range(world):
        if wall > clock[d]:
            segments.append(CPSegment(d, float(clock[d]), wall, "wait", "barrier"))
    return _result("odc", plan, wall, busy, segments)


def _run_group(plan, g, arrivals, cost, clock, busy, pos, segments) -> None:
    """Runs group ``g`` once all its members have arrived: advances their clocks past it."""
    group = plan.groups[g]
    start = max(arrivals.values())
    duration, member_busy = _group_costs(plan, g, cost)
    end = start + duration
    for d in group.members:
        own = float(member_busy[plan.devices[d][pos[d]].member])
        if start > arrivals[d]:
            segments.append(CPSegment(d, arrivals[d], start, "wait", f"cp{g} members"))
        segments.append(CPSegment(d, start, start + own, "busy", f"cp{g}", g, group.members))
        if end > start + own:
            segments.append(CPSegment(d, start + own, end, "wait", f"cp{g} slowest member", g, group.members))
        clock[d] = end
        busy[d] += own
        pos[d] += 1


def simulate_cp_lockstep(plan: CPPlan, cost: ContextParallelCost | None = None) -> CPStepResult:
    """The lock-step (collective FSDP) step of ``plan``, which must be lock-step (:attr:`CPPlan.is_lockstep`)."""
    cost = cost or default_cp_cost()
    if not plan.is_lockstep:
        raise ValueError("a lock-step schedule needs a lock-step plan: equal microbatch counts and every group at the "
                         "same step on all its members")
    world = plan.num_devices
    busy, clock, segments = np.zeros(world), 0.0, []
    group_costs = [_group_costs(plan, g, cost) for g in range(len(plan.groups))]
    for step in range(plan.microbatch_counts()[0]):
        took, own = np.zeros(world), np.zeros(world)
        for d in range(world):
            item = plan.devices[d][step]
            if isinstance(item, CPMicrobatch):
                duration, member_busy = group_costs[item.group.group_id]
                took[d], own[d] = duration, member_busy[item.member]
            else:  # an empty step still gathers the parameters with everyone
                took[d] = own[d] = cost.microbatch_time(item.seq_lengths) if not item.is_empty else cost.microbatch_seconds
        length = float(took.max())
        for d in range(world):
            item = plan.devices[d][step]
            g, members = (item.group.group_id, item.group.members) if isinstance(item, CPMicrobatch) else (-1, ())
            if own[d] > 0:
                segments.append(CPSegment(d, clock, clock + own[d], "busy", f"step{step}", g, members))
            if length > own[d]:
                segments.append(CPSegment(d, clock + own[d], clock + length, "wait", f"step{step}", g, members))
        busy += own
        clock += length
    return _result("lockstep", plan, clock, busy, segments)


def timeline_events(result: CPStepResult) -> list[dict]:
    """The predicted step as timeline events (:mod:`jodc.fsdp.timeline_analysis`: ``plot_timeline`` draws them);
    CP rows carry ``group`` and ``members``."""
    events = []
    for seg in result.timeline:
        event = {"device": seg.device, "start": seg.start, "end": seg.end, "kind": seg.kind, "label": seg.label}
        if seg.group >= 0:
            event.update(group=seg.group, members=list(seg.members))
        events.append(event)
    return events


@dataclasses.dataclass(frozen=True)
class CPWhatIf:
    """The three CP layouts on the same minibatches (means over them; times in seconds)."""

    devices: int
    seqs_per_device: int
    token_cap: int
    minibatches: int
    cp_sequences: float  # sequences per minibatch split over a group
    data_aware_step: float  # lb_mini_cp under ODC
    lockstep_cp_step: float  # lockstep_cp, lock-step schedule
    fixed_cp_step: float  # fixed_cp (every sequence over all devices), lock-step schedule
    cp_idle_fraction: float  # the data-aware layout's idle fraction
    lockstep_idle_fraction: float
    fixed_idle_fraction: float
    plan_ms: float  # wall time of one lb_mini_cp plan

    @property
    def cp_vs_fixed_cp(self) -> float:
        """Data-aware step time / fixed CP's (below 1: faster)."""
        return self.data_aware_step / self.fixed_cp_step

    @property
    def cp_vs_lockstep_cp(self) -> float:
        """Data-aware step time / lock-step dynamic CP's."""
        return self.data_aware_step / self.lockstep_cp_step


def cp_layouts_what_if(devices: int, *, seqs_per_device: int = 8, token_cap: int = 65536, lengths=LONGALIGN_LONG_TAIL,
                       cost: ContextParallelCost | None = None, minibatches: int = 1, seed: int = 0) -> CPWhatIf:
    """Plan ``minibatches`` minibatches of ``devices x seqs_per_device`` sequences three ways and simulate them."""
    devices = positive_int(devices, "devices")
    seqs_per_device = positive_int(seqs_per_device, "seqs_per_device")
    minibatches = positive_int(minibatches, "minibatches")
    cost = cost or cp_cost_for()
    totals = np.zeros(8)
    for r in range(minibatches):
        sample = lengths.sample(devices * seqs_per_device, seed=seed + r)
        start = time.perf_counter()
        aware = lb_mini_cp(sample, devices, token_cap, cost_model=cost)
        planned = time.perf_counter() - start
        odc = simulate_cp_odc(aware, cost)
        lock = simulate_cp_lockstep(lockstep_cp(sample, devices, token_cap, cost_model=cost), cost)
        fixed = simulate_cp_lockstep(fixed_cp(sample, devices, token_cap, cost_model=cost), cost)
        totals += [aware.num_cp_sequences, odc.step_time, lock.step_time, fixed.step_time, odc.idle_fraction,
                   lock.idle_fraction, fixed.idle_fraction, 1e3 * planned]
    mean = totals / minibatches
    return CPWhatIf(devices, seqs_per_device, token_cap, minibatches, *(float(x) for x in mean))
