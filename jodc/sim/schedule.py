"""The two schedules of the ODC paper, predicted from a plan, a model shape and a hardware description.

With ``t[d, i, l]`` the compute of device ``d``'s ``i``-th microbatch at bucket visit ``l`` and ``c[l]`` the
communication of visit ``l`` (:mod:`jodc.sim.step_model`):

* **collective FSDP** -- every all-gather / reduce-scatter is a barrier, so all devices advance visit by visit
  in lock-step and each visit lasts as long as its slowest device:
  ``wall = sum over i, l of (max over d of t[d, i, l] + c[l])``. Every device takes part in every slot ``i`` up
  to the largest microbatch count, doing nothing but communicate in slots where it has no microbatch.
* **ODC** -- each device runs its own non-empty microbatches back to back, pulling and pushing parameters
  point-to-point, and all devices meet once per minibatch:
  ``wall = max over d of sum over its microbatches i and visits l of (t[d, i, l] + c_p2p[l]) + sync``, where
  one synchronisation (a barrier) costs two link latencies (a signal out, an acknowledgement back).

Reported: step time, throughput (sequences and tokens per second), per-device busy time (compute plus own
communication), bubble rate ``1 - sum(busy) / (devices x wall)``, and optionally the per-device timeline.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jodc.balance.model_shape import ModelShape
from jodc.balance.plan import Plan
from jodc.sim.hardware import HardwareSpec
from jodc.sim.step_model import StepConfig, bucket_steps, communication_times, compute_times, microbatch_shapes

SCHEDULES = ("collective", "odc")


@dataclasses.dataclass(frozen=True)
class Segment:
    """One interval of one device's timeline: ``kind`` is ``compute``, ``comm`` or ``sync``."""

    device: int
    start: float
    end: float
    kind: str
    microbatch: int  # -1 for sync
    visit: str  # the bucket visit, e.g. "fwd:layer3"; "" for sync


@dataclasses.dataclass(frozen=True)
class ScheduleResult:
    """The predicted step of one schedule (times in seconds)."""

    schedule: str
    step_time: float
    device_compute: tuple[float, ...]
    device_comm: tuple[float, ...]
    device_busy: tuple[float, ...]
    bubble_rate: float
    samples_per_s: float
    tokens_per_s: float
    timeline: tuple[Segment, ...] | None = None


@dataclasses.dataclass(frozen=True)
class ScheduleComparison:
    """Both schedules on one plan; ``speedup`` = collective step time / ODC step time."""

    collective: ScheduleResult
    odc: ScheduleResult
    speedup: float


def _check_inputs(plan, shape, hardware, config) -> None:
    """``ValueError`` for arguments of the wrong kind or a plan with nothing to run."""
    for value, kind, name in ((plan, Plan, "plan"), (shape, ModelShape, "shape"), (hardware, HardwareSpec, "hardware"),
                              (config, StepConfig, "config")):
        if not isinstance(value, kind):
            raise ValueError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
    if plan.total_sequences == 0:
        raise ValueError("the plan has no sequences: nothing to simulate")


def _result(schedule, plan, wall, compute, comm, busy, timeline) -> ScheduleResult:
    devices = plan.num_devices
    bubble = 1.0 - float(np.sum(busy)) / (devices * wall) if wall > 0 else 0.0
    return ScheduleResult(
        schedule=schedule,
        step_time=float(wall),
        device_compute=tuple(float(x) for x in compute),
        device_comm=tuple(float(x) for x in comm),
        device_busy=tuple(float(x) for x in busy),
        bubble_rate=max(0.0, bubble),  # clamp float round-off; busy never exceeds wall
        samples_per_s=plan.total_sequences / wall if wall > 0 else float("inf"),
        tokens_per_s=plan.total_tokens / wall if wall > 0 else float("inf"),
        timeline=timeline,
    )


def _step_times(plan: Plan, shape: ModelShape, hardware: HardwareSpec, config: StepConfig, *, p2p: bool):
    """Checked inputs -> (bucket steps, compute times [D, M, L], communication time per bucket visit [L])."""
    _check_inputs(plan, shape, hardware, config)
    steps = bucket_steps(shape, config)
    return steps, compute_times(plan, shape, hardware, config), communication_times(steps, plan.num_devices,
                                                                                    hardware, p2p=p2p)


def simulate_collective(
    plan: Plan, shape: ModelShape, hardware: HardwareSpec, config: StepConfig = StepConfig(), *,
    with_timeline: bool = False,
) -> ScheduleResult:
    """Lock-step collective FSDP on ``plan`` (slots beyond a device's count are empty for it)."""
    steps, t, c = _step_times(plan, shape, hardware, config, p2p=False)
    slots = t.shape[1]
    visit_time = t.max(axis=0) + c  # [M, L]
    wall = float(visit_time.sum())
    compute = t.sum(axis=(1, 2))
    comm = np.full(plan.num_devices, slots * float(c.sum()))
    timeline = None
    if with_timeline:
        segments = []
        starts = np.concatenate([[0.0], np.cumsum(visit_time.ravel())[:-1]]).reshape(visit_time.shape)
        for d in range(plan.num_devices):
            for i in range(slots):
                for l, name in enumerate(steps.names):
                    start = starts[i, l]
                    if c[l] > 0:
                        segments.append(Segment(d, start, start + c[l], "comm", i, name))
                    if t[d, i, l] > 0:
                        segments.append(Segment(d, start + c[l], start + c[l] + t[d, i, l], "compute", i, name))
        timeline = tuple(segments)
    return _result("collective", plan, wall, compute, comm, compute + comm, timeline)


def simulate_odc(
    plan: Plan, shape: ModelShape, hardware: HardwareSpec, config: StepConfig = StepConfig(), *,
    with_timeline: bool = False,
) -> ScheduleResult:
    """ODC on ``plan``: each device runs its own non-empty microbatches, one barrier at the end."""
    steps, t, c = _step_times(plan, shape, hardware, config, p2p=True)
    _, _, nonempty = microbatch_shapes(plan)
    compute = t.sum(axis=(1, 2))
    comm = nonempty.sum(axis=1) * float(c.sum())
    sync = 2.0 * hardware.link_latency if plan.num_devices > 1 else 0.0
    own = compute + comm
    wall = float(own.max()) + sync
    timeline = None
    if with_timeline:
        segments = []
        for d in range(plan.num_devices):
            clock = 0.0
            for i in np.flatnonzero(nonempty[d]):
                for l, name in enumerate(steps.names):
                    if c[l] > 0:
                        segments.append(Segment(d, clock, clock + c[l], "comm", int(i), name))
                        clock += c[l]
                    if t[d, i, l] > 0:
                        segments.append(Segment(d, clock, clock + t[d, i, l], "compute", int(i), name))
                        clock += t[d, i, l]
            if sync > 0:
                segments.append(Segment(d, wall - sync, wall, "sync", -1, ""))
        timeline = tuple(segments)
    return _result("odc", plan, wall, compute, comm, own + sync, timeline)


def simulate(plan: Plan, shape: ModelShape, hardware: HardwareSpec, schedule: str,
             config: StepConfig = StepConfig(), *, with_timeline: bool = False) -> ScheduleResult:
    """Run ``schedule`` (``"collective"`` or ``"odc"``) on ``plan``."""
    if schedule == "collective":
        return simulate_collective(plan, shape, hardware, config, with_timeline=with_timeline)
    if schedule == "odc":
        return simulate_odc(plan, shape, hardware, config, with_timeline=with_timeline)
    raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


def compare_schedules(plan: Plan, shape: ModelShape, hardware: HardwareSpec,
                      config: StepConfig = StepConfig()) -> ScheduleComparison:
    """Both schedules on the same plan, and the speed-up of ODC over collective FSDP."""
    collective = simulate_collective(plan, shape, hardware, config)
    odc = simulate_odc(plan, shape, hardware, config)
    return ScheduleComparison(collective=collective, odc=odc, speedup=collective.step_time / odc.step_time)
