"""Sequence balancing and packing for a minibatch: cost models, partitioning, microbatch packing, planners, metrics.

Pure Python + numpy (no JAX), deterministic, so every host computes the same plan with no communication::

    from jodc.balance import get_planner, FlopsCost, DEEPSEEK_R1_DISTILL_QWEN_1_5B, materialize

    plan = get_planner("lb_mini")(lengths, num_devices=8, token_cap=65536,
                                  cost_model=FlopsCost(DEEPSEEK_R1_DISTILL_QWEN_1_5B))
    packed = materialize(plan, device, token_arrays)   # tokens / segment_ids / positions, each [M, T]

See docs/balance.md for the algorithms and the conventions of the buffers.
"""
from jodc.balance.buckets import PaddedMicrobatchCost, padding_rate, rebalance_for_buckets, run_lengths
from jodc.balance.buffers import PackedMicrobatches, layout, materialize, pack_arrays
from jodc.balance.cost import (
    COST_MODEL_NAMES,
    CostModel,
    FlopsCost,
    LinearCost,
    QuadraticCost,
    make_cost_model,
    sequence_costs,
)
from jodc.balance.cp_cost import ContextParallelCost, causal_pairs, piece_pairs
from jodc.balance.cp_plan import CPGroup, CPMicrobatch, CPPlan
from jodc.balance.cp_planners import CP_PLANNERS, default_cp_cost, fixed_cp, lb_mini_cp, lockstep_cp
from jodc.balance.metrics import PlanMetrics, imbalance_ratio, microbatch_cost_table, plan_metrics
from jodc.balance.model_shape import DEEPSEEK_R1_DISTILL_QWEN_1_5B, ModelShape
from jodc.balance.packing import min_microbatches, pack_microbatches, try_pack
from jodc.balance.partition import karmarkar_karp, lpt, order_parts, part_sums, partition
from jodc.balance.plan import Microbatch, Plan
from jodc.balance.completion import complete_bins, optimal_partition
from jodc.balance.descent import balance_pairs, descend, equal_count_bound, lower_bound, resplit_heaviest
from jodc.balance.fill import fill_parts
from jodc.balance.exact import ExactResult, exact_partition
from jodc.balance.planners import ALL_PLANNERS, EXACT_PLANNERS, PLANNERS, get_planner, lb_micro, lb_mini, lb_mini_exact, local_sort
from jodc.balance.refine import refine_by_swaps
from jodc.balance.search import improve_by_search
from jodc.balance.zigzag import (
    ZigzagLayout,
    ZigzagRow,
    check_group_rows,
    segment_id_limit,
    zigzag_layout,
    zigzag_merge,
    zigzag_piece,
    zigzag_row,
    zigzag_split,
)

__all__ = [
    "ALL_PLANNERS",
    "CPGroup",
    "CPMicrobatch",
    "CPPlan",
    "CP_PLANNERS",
    "ContextParallelCost",
    "causal_pairs",
    "default_cp_cost",
    "fixed_cp",
    "lb_mini_cp",
    "lockstep_cp",
    "piece_pairs",
    "COST_MODEL_NAMES",
    "CostModel",
    "DEEPSEEK_R1_DISTILL_QWEN_1_5B",
    "EXACT_PLANNERS",
    "ExactResult",
    "FlopsCost",
    "LinearCost",
    "Microbatch",
    "ModelShape",
    "PLANNERS",
    "PaddedMicrobatchCost",
    "PackedMicrobatches",
    "Plan",
    "PlanMetrics",
    "QuadraticCost",
    "ZigzagLayout",
    "ZigzagRow",
    "balance_pairs",
    "check_group_rows",
    "complete_bins",
    "descend",
    "equal_count_bound",
    "exact_partition",
    "fill_parts",
    "get_planner",
    "imbalance_ratio",
    "improve_by_search",
    "karmarkar_karp",
    "layout",
    "lb_micro",
    "lb_mini",
    "lb_mini_exact",
    "lower_bound",
    "local_sort",
    "lpt",
    "make_cost_model",
    "materialize",
    "microbatch_cost_table",
    "min_microbatches",
    "optimal_partition",
    "order_parts",
    "pack_arrays",
    "pack_microbatches",
    "padding_rate",
    "part_sums",
    "partition",
    "plan_metrics",
    "rebalance_for_buckets",
    "refine_by_swaps",
    "resplit_heaviest",
    "run_lengths",
    "segment_id_limit",
    "sequence_costs",
    "try_pack",
    "zigzag_layout",
    "zigzag_merge",
    "zigzag_piece",
    "zigzag_row",
    "zigzag_split",
]
