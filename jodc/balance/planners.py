"""Planners: a minibatch's sequence lengths and a device count in, a :class:`~jodc.balance.plan.Plan` out.

Every planner has the signature ``planner(lengths, num_devices, token_cap, *, cost_model=LinearCost())`` and is
a pure function of its arguments: the same input gives the same plan on every host, with no communication.

* :func:`local_sort` -- the usual data-parallel baseline. Sequences are dealt to devices in order, like cards
  (sequence ``i`` to device ``i mod num_devices``); each device sorts its share by length, longest first, and
  runs one sequence per microbatch. Devices with fewer sequences get empty microbatches at the end, so the plan
  is lock-step.
* :func:`lb_micro` -- balance for lock-step collective FSDP. Sequence counts per device are equal (within one)
  and the partition balances cost; each device packs its share into the same number of microbatches (the
  smallest count every device can fit), balanced by cost and sorted heaviest first, so the ``i``-th microbatches
  of all devices, which run together, have similar costs. Devices that need fewer get empty microbatches.
* :func:`lb_mini` -- balance for ODC. The partition balances total cost per device over the whole minibatch
  (counts may differ); each device packs its share into as few microbatches as fit, on its own. Microbatch
  counts may differ across devices: the plan is not lock-step (see :meth:`Plan.padded_to_equal_counts`).
  Given the engine's ``length_buckets`` it balances what the packed microbatches cost at their padded lengths.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from jodc.balance.buckets import PaddedMicrobatchCost, rebalance_for_buckets
from jodc.balance.cost import CostModel, LinearCost, sequence_costs
from jodc.balance.cp_planners import CP_PLANNERS
from jodc.balance.exact import DEFAULT_NODE_LIMIT, exact_partition
from jodc.balance.packing import min_microbatches, pack_microbatches, try_pack
from jodc.balance.partition import partition
from jodc.balance.plan import Microbatch, Plan
from jodc.balance.validation import planner_inputs

Planner = Callable[..., Plan]

# Bin-completion nodes LB-Mini's partition may spend after its fills (jodc.balance.partition): a small, fixed count,
# so that planning stays cheap next to a step and identical on every host.
LB_MINI_SEARCH_NODES = 200


def _microbatch(indices, lengths: np.ndarray, costs: np.ndarray) -> Microbatch:
    """A microbatch of the given global sequence indices, kept in ascending index order."""
    ordered = sorted(int(i) for i in indices)
    return Microbatch(tuple(ordered), tuple(int(lengths[i]) for i in ordered), math.fsum(costs[ordered]))


def _device_microbatches(share: list[int], packed: list[list[int]], lengths, costs) -> tuple[Microbatch, ...]:
    """Map a packing of a device's share (positions into ``share``) to microbatches of global indices."""
    return tuple(_microbatch([share[p] for p in part], lengths, costs) for part in packed)


def local_sort(lengths, num_devices: int, token_cap: int, *, cost_model: CostModel = LinearCost()) -> Plan:
    """Deal sequences round-robin, sort each device's share longest first, one sequence per microbatch."""
    lengths, num_devices, token_cap = planner_inputs(lengths, num_devices, token_cap)
    costs = sequence_costs(cost_model, lengths)
    devices = []
    for d in range(num_devices):
        share = sorted(range(d, lengths.size, num_devices), key=lambda i: (-lengths[i], i))
        devices.append(tuple(_microbatch([i], lengths, costs) for i in share))
    plan = Plan(tuple(devices), token_cap, planner="local_sort", cost_model=cost_model.name)
    return plan.padded_to_equal_counts()


def lb_micro(lengths, num_devices: int, token_cap: int, *, cost_model: CostModel = LinearCost()) -> Plan:
    """Equal sequence counts (within one), cost-balanced; equal microbatch counts, aligned heaviest first."""
    lengths, num_devices, token_cap = planner_inputs(lengths, num_devices, token_cap)
    costs = sequence_costs(cost_model, lengths)
    shares = partition(costs, num_devices, equal_sizes=True)
    count = max(min_microbatches(lengths[share], token_cap) for share in shares)
    while True:  # the smallest common count every device packs into; ends by len(share) at the latest
        packings = [try_pack(lengths[share], costs[share], token_cap, count) if share else [[]] * count
                    for share in shares]
        if all(p is not None for p in packings):
            break
        count += 1
    devices = tuple(_device_microbatches(share, packed, lengths, costs) for share, packed in zip(shares, packings))
    return Plan(devices, token_cap, planner="lb_micro", cost_model=cost_model.name)


def lb_mini(lengths, num_devices: int, token_cap: int, *, cost_model: CostModel = LinearCost(),
            length_buckets=None, microbatch_overhead: float = 0.0) -> Plan:
    """Cost-balanced over the whole minibatch (counts may differ); each device packs its share on its own.

    With ``length_buckets`` (the engine's: a microbatch runs at the smallest bucket that holds it, else at
    ``token_cap``) every device packs for the least padded length and the partition is rebalanced for what the
    microbatches cost at their padded lengths (:mod:`jodc.balance.buckets`), each microbatch also costing
    ``microbatch_overhead`` (cost-model units) for existing."""
    lengths, num_devices, token_cap = planner_inputs(lengths, num_devices, token_cap)
    costs = sequence_costs(cost_model, lengths)
    shares = partition(costs, num_devices, search_nodes=LB_MINI_SEARCH_NODES)
    if length_buckets is None:
        if microbatch_overhead:
            raise ValueError("microbatch_overhead needs length_buckets: without them LB-Mini already packs every "
                             "device into the fewest microbatches")
        # ODC runs a device's microbatches one after another: balancing them is refinement only, no search
        packings = [pack_microbatches(lengths[share], costs[share], token_cap, search_nodes=0) for share in shares]
    else:
        microbatch_cost = PaddedMicrobatchCost.for_buckets(cost_model, length_buckets, token_cap,
                                                           overhead=microbatch_overhead)
        shares, packings = rebalance_for_buckets(lengths, costs, shares, token_cap, microbatch_cost)
    devices = tuple(_device_microbatches(share, packed, lengths, costs) for share, packed in zip(shares, packings))
    return Plan(devices, token_cap, planner="lb_mini", cost_model=cost_model.name)


def lb_mini_exact(lengths, num_devices: int, token_cap: int, *, cost_model: CostModel = LinearCost(),
                  node_limit: int = DEFAULT_NODE_LIMIT) -> Plan:
    """LB-Mini with the partition solved by MILP (HiGHS through scipy, at most ``node_limit`` nodes): for
    validating the fast planner. Never heavier than :func:`lb_mini` (its partition is the incumbent); optimal when
    the solver finishes within the limit. Needs scipy; slow (seconds at 32 sequences)."""
    lengths, num_devices, token_cap = planner_inputs(lengths, num_devices, token_cap)
    costs = sequence_costs(cost_model, lengths)
    incumbent = partition(costs, num_devices)
    shares = exact_partition(costs, num_devices, node_limit=node_limit, incumbent=incumbent).parts
    packings = [pack_microbatches(lengths[share], costs[share], token_cap, search_nodes=0) for share in shares]
    devices = tuple(_device_microbatches(share, packed, lengths, costs) for share, packed in zip(shares, packings))
    return Plan(devices, token_cap, planner="lb_mini_exact", cost_model=cost_model.name)


PLANNERS: dict[str, Planner] = {"local_sort": local_sort, "lb_micro": lb_micro, "lb_mini": lb_mini}
# Validation only (slow, needs scipy): reachable through get_planner but not among the planners the trainer offers.
EXACT_PLANNERS: dict[str, Planner] = {"lb_mini_exact": lb_mini_exact}


# Context parallelism (sequences longer than the cap split over groups; they return a CPPlan, which no engine runs
# yet): reachable through get_planner, not among the planners the trainer offers.
ALL_PLANNERS: dict[str, Planner] = {**PLANNERS, **EXACT_PLANNERS, **CP_PLANNERS}


def get_planner(name: str) -> Planner:
    """The planner called ``name``: one of ``local_sort``, ``lb_micro``, ``lb_mini`` (or ``lb_mini_exact``; or a
    context-parallel planner of :data:`CP_PLANNERS`: ``lb_mini_cp``, ``lockstep_cp``, ``fixed_cp``)."""
    if name not in ALL_PLANNERS:
        raise ValueError(f"unknown planner {name!r}; choose one of {', '.join(ALL_PLANNERS)}")
    return ALL_PLANNERS[name]
