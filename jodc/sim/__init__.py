"""Schedule simulator: predicted step time of collective FSDP and ODC for a plan, a model and a device.

Pure Python + numpy. Also holds synthetic length generators shaped like published post-training data::

    from jodc.balance import get_planner, FlopsCost, DEEPSEEK_R1_DISTILL_QWEN_1_5B as MODEL
    from jodc.sim import A100_SXM_80GB, LONGALIGN_SFT, compare_schedules

    lengths = LONGALIGN_SFT.sample(32, seed=0)
    plan = get_planner("lb_mini")(lengths, 8, 65536, cost_model=FlopsCost(MODEL))
    result = compare_schedules(plan, MODEL, A100_SXM_80GB)   # .collective, .odc, .speedup

Multi-node layouts (flat vs hybrid sharding, ODC vs collective) are in :mod:`jodc.sim.hsdp`; plans with
context-parallel groups and the three CP layouts in :mod:`jodc.sim.context_parallel`. See docs/balance.md for
the model and the sources of every constant.
"""
from jodc.sim.cluster import ClusterWhatIf, cluster_what_if
from jodc.sim.context_parallel import (
    CPSegment,
    CPStepResult,
    CPWhatIf,
    cp_cost_for,
    cp_layouts_what_if,
    simulate_cp_lockstep,
    simulate_cp_odc,
    timeline_events,
)
from jodc.sim.hardware import A100_SXM_80GB, HardwareSpec
from jodc.sim.hsdp import (
    A100_NODES_400G,
    DEFAULT_LAYOUTS,
    FLAT_COLLECTIVE,
    FLAT_ODC,
    HSDP_COLLECTIVE,
    HSDP_ODC,
    HsdpWhatIf,
    Layout,
    LayoutResult,
    NodeTopology,
    group_transfer_time,
    hsdp_what_if,
    inter_bandwidth_crossover,
    replica_all_reduce_time,
    simulate_layout,
)
from jodc.sim.lengths import (
    AGENT_TRAJECTORIES,
    LENGTH_DISTRIBUTIONS,
    LONG_TAIL_DISTRIBUTIONS,
    LONGALIGN_LONG_TAIL,
    LONGALIGN_SFT,
    LongTailLengths,
    RL_RESPONSES,
    LengthDistribution,
    get_length_distribution,
)
from jodc.sim.schedule import (
    SCHEDULES,
    ScheduleComparison,
    ScheduleResult,
    Segment,
    compare_schedules,
    simulate,
    simulate_collective,
    simulate_odc,
)
from jodc.sim.step_model import BucketSteps, StepConfig, bucket_steps, communication_times, compute_times, transfer_time

__all__ = [
    "CPSegment",
    "CPStepResult",
    "CPWhatIf",
    "LONGALIGN_LONG_TAIL",
    "LONG_TAIL_DISTRIBUTIONS",
    "LongTailLengths",
    "cp_cost_for",
    "cp_layouts_what_if",
    "simulate_cp_lockstep",
    "simulate_cp_odc",
    "timeline_events",
    "A100_NODES_400G",
    "A100_SXM_80GB",
    "AGENT_TRAJECTORIES",
    "BucketSteps",
    "ClusterWhatIf",
    "DEFAULT_LAYOUTS",
    "FLAT_COLLECTIVE",
    "FLAT_ODC",
    "HSDP_COLLECTIVE",
    "HSDP_ODC",
    "HardwareSpec",
    "HsdpWhatIf",
    "LENGTH_DISTRIBUTIONS",
    "LONGALIGN_SFT",
    "Layout",
    "LayoutResult",
    "LengthDistribution",
    "NodeTopology",
    "RL_RESPONSES",
    "SCHEDULES",
    "ScheduleComparison",
    "ScheduleResult",
    "Segment",
    "StepConfig",
    "bucket_steps",
    "cluster_what_if",
    "communication_times",
    "compare_schedules",
    "compute_times",
    "get_length_distribution",
    "group_transfer_time",
    "hsdp_what_if",
    "inter_bandwidth_crossover",
    "replica_all_reduce_time",
    "simulate",
    "simulate_collective",
    "simulate_layout",
    "simulate_odc",
    "transfer_time",
]
