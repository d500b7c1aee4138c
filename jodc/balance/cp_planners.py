"""Planners for minibatches with sequences longer than the token cap: context-parallel (CP) groups.

Signature, as for every planner: ``planner(lengths, num_devices, token_cap, *, cost_model=None) -> CPPlan``, with
``cost_model`` a :class:`~jodc.balance.cp_cost.ContextParallelCost` (default: DeepSeek-R1-Distill-Qwen-1.5B on an
A100, :func:`default_cp_cost`). A sequence of at most ``token_cap`` tokens is *short*; a longer one is *long* and
split (zigzag, :mod:`jodc.balance.zigzag`) over a group of at least ``min_group_size(L, token_cap)`` devices. A
sequence no group of the world can hold (its piece would exceed the cap even over every device) is refused before
anything runs (:func:`jodc.balance.validation.lengths_within_world`).

* :func:`lb_mini_cp` -- data-aware, for ODC. Long sequences, heaviest first, each get the group size (from the
  smallest that fits up to ``GROUP_SCALE`` times it) and the members (the devices whose CP work ends earliest, i.e.
  the most lightly loaded) that minimise a bound on the step: ``max(group end, (all work placed + left) /
  devices)``. Short sequences are then balanced around those loads (:mod:`jodc.balance.preloaded`, four ways: two
  starts, each weighing a sequence by its seconds alone or with its share of a microbatch's fixed cost) and packed
  per device as LB-Mini does; the plan that finishes first by the cost model is kept. Each device runs its CP rows
  in group order (the deadlock-free rule of :mod:`jodc.balance.cp_plan`) and fills the wait before a group with its
  own short microbatches where they fit. Microbatch counts differ across devices.
* :func:`lockstep_cp` -- lock-step dynamic CP (the baseline collective FSDP allows): the same kind of groups, each
  of the smallest size, run in *waves* of disjoint groups; every device runs the same number of steps, step ``i``
  of all devices together. Devices outside a wave's groups run a short microbatch in that step (as long as the wave
  lasts, for free); the remaining short sequences follow in LB-Micro steps.
* :func:`fixed_cp` -- the fixed layout of MaxText / Megatron context parallelism: every sequence split over all
  devices, sequences packed into rows (each member's pieces within the cap), one group per row, all devices in
  every group.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from jodc.balance.cp_cost import ContextParallelCost
from jodc.balance.cp_plan import CPGroup, CPMicrobatch, CPPlan
from jodc.balance.model_shape import DEEPSEEK_R1_DISTILL_QWEN_1_5B
from jodc.balance.packing import min_microbatches, pack_microbatches, try_pack
from jodc.balance.partition import partition
from jodc.balance.plan import Microbatch
from jodc.balance.preloaded import balance_around_loads_starts
from jodc.balance.validation import lengths_within_world, min_group_size, positive_int, sequence_lengths
from jodc.balance.zigzag import zigzag_layout

CPPlanner = Callable[..., CPPlan]

#: Largest group :func:`lb_mini_cp` considers, as a multiple of the smallest that fits: a bigger group costs more
#: exchange and padding than it saves once its pieces are a small share of a device's work.
GROUP_SCALE = 8
#: Load levels (groups of devices that finish their CP work together) whose devices :func:`_choose_group` tries as a
#: group, lightest first: heavier levels end later, so a few bound the planning time at no cost in balance.
LOAD_LEVELS = 8
#: Group sizes :func:`lockstep_cp` tries, as multiples of the smallest that fits (None: every device).
LOCKSTEP_GROUP_SCALES = (1, 2, 4, None)


def default_cp_cost() -> ContextParallelCost:
    """DeepSeek-R1-Distill-Qwen-1.5B on an A100 SXM in an NVSwitch node (:meth:`ContextParallelCost.from_shape`)."""
    return ContextParallelCost.from_shape(DEEPSEEK_R1_DISTILL_QWEN_1_5B)


def _inputs(lengths, num_devices, token_cap, cost_model):
    lengths = sequence_lengths(lengths)
    world = positive_int(num_devices, "num_devices")
    cap = positive_int(token_cap, "token_cap")
    lengths_within_world(lengths, world, cap)
    cost = default_cp_cost() if cost_model is None else cost_model
    if not isinstance(cost, ContextParallelCost):
        raise ValueError(f"the CP planners need a ContextParallelCost (it prices the exchanges), got "
                         f"{type(cost).__name__}")
    return lengths, world, cap, cost


def _microbatch(indices, lengths: np.ndarray, costs: np.ndarray) -> Microbatch:
    ordered = sorted(int(i) for i in indices)
    return Microbatch(tuple(ordered), tuple(int(lengths[i]) for i in ordered), math.fsum(costs[ordered]))


def _packed(share: list[int], lengths: np.ndarray, costs: np.ndarray, cap: int) -> list[Microbatch]:
    """A device's short sequences (global indices) packed into the fewest microbatches, heaviest first."""
    if not share:
        return []
    packed = pack_microbatches(lengths[share], costs[share], cap, search_nodes=0)
    return [_microbatch([share[p] for p in part], lengths, costs) for part in packed]


def _group(group_id: int, members, seqs, lengths: np.ndarray, cost: ContextParallelCost) -> CPGroup:
    seqs = [int(i) for i in seqs]
    split = [int(lengths[i]) for i in seqs]
    members = tuple(int(d) for d in members)
    return CPGroup(group_id, members, tuple(seqs), tuple(split), cost.group_time(split, members))


def _choose_group(length: int, ready: np.ndarray, cap: int, cost: ContextParallelCost, work_left: float, *,
                  levels: bool = True):
    """(members, end time) of the group for one long sequence, given each device's CP finish time ``ready``.

    Candidates for each size ``k``: the ``k`` most lightly loaded devices; with ``levels``, the ``k`` next ones from
    each level of load (devices that finish together wait less for each other); the ``k`` most lightly loaded of each node (a
    faster exchange). The score is a bound on the step, ``max(group end, (work placed + work left) / devices)``, in
    which a member's wait for the others counts as placed work."""
    world = ready.size
    order = np.argsort(ready, kind="stable")  # most lightly loaded first, ties by device index
    level_starts = [0] + [j for j in range(1, world) if levels and ready[order[j]] != ready[order[j - 1]]]
    level_starts = level_starts[:LOAD_LEVELS]
    smallest = min_group_size(length, cap)
    node = cost.devices_per_node
    total = float(ready.sum())
    times: dict[tuple[int, bool], float] = {}
    best = None
    for k in range(smallest, min(world, GROUP_SCALE * smallest) + 1):
        candidates = [order[j:j + k] for j in level_starts if j + k <= world]
        if 0 < node and k <= node:
            candidates += [n + np.argsort(ready[n:n + node], kind="stable")[:k] for n in range(0, world, node)
                           if min(n + node, world) - n >= k]
        for members in candidates:
            members = sorted(int(d) for d in members)
            key = (k, cost.spans_nodes(members))
            if key not in times:
                times[key] = cost.group_time([length], members)
            end = float(ready[members].max()) + times[key]
            placed = total - float(ready[members].sum()) + k * end
            score = max(end, (placed + work_left) / world)
            # lower bound first; on a tie, the earlier end (e.g. a group inside a node over one across nodes)
            if best is None or score < best[0] * (1 - 1e-12) or (score <= best[0] * (1 + 1e-12) and
                                                                 end < best[2] * (1 - 1e-12)):
                best = (score, members, end)
    return best[1], best[2]


def lb_mini_cp(lengths, num_devices: int, token_cap: int, *, cost_model: ContextParallelCost | None = None
               ) -> CPPlan:
    """Data-aware CP for ODC: groups on lightly loaded devices, short sequences balanced around them.

    Two greedy placements of the groups (with and without the load-level candidates of :func:`_choose_group`; one
    when both place the same groups), each with the short sequences balanced four ways (:func:`_balanced_plans`);
    of these plans the one whose last device finishes first (:func:`_planned_finish`) is returned, on a tie the
    first."""
    lengths, world, cap, cost = _inputs(lengths, num_devices, token_cap, cost_model)
    costs = cost(lengths)
    placements = [_place_groups(lengths, costs, world, cap, cost, True)]
    if not placements[0][0]:  # no group to place: LB-Mini's balance of the short sequences
        return _balanced_plans(lengths, costs, cap, cost, *placements[0], starts=1)[0][0]
    other = _place_groups(lengths, costs, world, cap, cost, False)
    if [g.members for g in other[0]] != [g.members for g in placements[0][0]]:
        placements.append(other)
    plans = [plan for placement in placements for plan in _balanced_plans(lengths, costs, cap, cost, *placement)]
    return min(plans, key=lambda plan_spans: _planned_finish(*plan_spans, cost))[0]


def _place_groups(lengths, costs, world: int, cap: int, cost: ContextParallelCost, levels: bool):
    """(groups, planned (start, end) of each group, each device's CP finish time) of one greedy placement: long
    sequences heaviest first, each on the group :func:`_choose_group` picks."""
    long = sorted(np.flatnonzero(lengths > cap).tolist(), key=lambda i: (-costs[i], i))
    ready = np.zeros(world)
    work_left = math.fsum(costs)
    groups, spans = [], []
    for i in long:
        work_left -= costs[i]
        members, end = _choose_group(int(lengths[i]), ready, cap, cost, work_left, levels=levels)
        group = _group(len(groups), members, [i], lengths, cost)
        spans.append((end - group.cost, end))
        ready[members] = end
        groups.append(group)
    return groups, spans, ready


def _balanced_plans(lengths, costs, cap: int, cost: ContextParallelCost, groups, spans, ready, *,
                    starts: int | None = None):
    """[(plan, spans)]: the short sequences balanced around the groups' loads ``ready`` in up to four ways, each
    packed and ordered per device (:func:`_order_device`), duplicates left out.

    The balances (:func:`balance_around_loads_starts`: LB-Mini's partition matched to the devices, and LPT around
    the loads) weigh each sequence by its one-device seconds, then again with its share of a microbatch's fixed cost
    added (a device packs its tokens into about tokens / cap microbatches, so one given many sequences also runs
    many microbatches, which the first weighing does not see). ``starts``: only the first that many."""
    short = np.flatnonzero(lengths <= cap)
    balances = []
    for weights in (costs[short], costs[short] + cost.microbatch_seconds * lengths[short] / cap):
        balances += balance_around_loads_starts(weights, ready)
        if starts is not None and len(balances) >= starts:
            break
    plans, seen = [], []
    for shares in balances[:starts]:
        if shares in seen:
            continue
        seen.append(shares)
        devices = [_order_device(d, groups, spans, [int(short[p]) for p in shares[d]], lengths, costs, cap, cost)
                   for d in range(ready.size)]
        plans.append((CPPlan(tuple(devices), tuple(groups), cap, planner="lb_mini_cp", cost_model=cost.name), spans))
    return plans


def _planned_finish(plan: CPPlan, spans, cost: ContextParallelCost) -> float:
    """When the last device finishes if every group runs at its planned span (the wait-filling microbatches are
    chosen to end before their group starts, so members arrive on time)."""
    finish = 0.0
    for device in plan.devices:
        clock = 0.0
        for item in device:
            if isinstance(item, CPMicrobatch):
                clock = max(clock, spans[item.group.group_id][0]) + item.group.cost
            else:
                clock += cost.microbatch_time(item.seq_lengths)
        finish = max(finish, clock)
    return finish


def _order_device(device: int, groups: list[CPGroup], spans, share: list[int], lengths: np.ndarray,
                  costs: np.ndarray, cap: int, cost: ContextParallelCost):
    """Device ``device``'s items: its CP rows in group order, each preceded by microbatches of its own short
    sequences (``share``) that fill the wait before the group starts (largest first, as long as they fit); the rest
    packed at the end."""
    items, clock, left = [], 0.0, sorted(share, key=lambda i: (-costs[i], i))
    for group, (start, end) in zip(groups, spans):
        if device not in group.members:
            continue
        room, chosen = start - clock - cost.microbatch_seconds, []
        for i in left:
            if costs[i] + cost.microbatch_seconds * (len(chosen) > 0) <= room:  # a microbatch more at worst
                chosen.append(i)
                room -= costs[i] + cost.microbatch_seconds * (len(chosen) > 1)
        if chosen:
            taken = set(chosen)
            left = [i for i in left if i not in taken]
            items += _packed(chosen, lengths, costs, cap)
        items.append(CPMicrobatch(group, group.member_index(device)))
        clock = end
    return tuple(items + _packed(left, lengths, costs, cap))


def lockstep_cp(lengths, num_devices: int, token_cap: int, *, cost_model: ContextParallelCost | None = None
                ) -> CPPlan:
    """Lock-step dynamic CP: groups in waves of disjoint groups, every device the same step count. Group sizes are
    the smallest that fit times a scale (``LOCKSTEP_GROUP_SCALES``, or the whole world), the one whose plan has the
    shortest lock-step step (sum over steps of the slowest device) by the cost model."""
    lengths, world, cap, cost = _inputs(lengths, num_devices, token_cap, cost_model)
    plans = [_lockstep_plan(lengths, world, cap, cost, scale) for scale in LOCKSTEP_GROUP_SCALES]
    return min(plans, key=lambda plan: _lockstep_estimate(plan, cost))


def _lockstep_estimate(plan: CPPlan, cost: ContextParallelCost) -> float:
    """Sum over steps of the slowest device's item (a lock-step step lasts as long as its slowest device)."""
    def took(item) -> float:
        if isinstance(item, CPMicrobatch):
            return item.group.cost
        return cost.microbatch_time(item.seq_lengths) if not item.is_empty else cost.microbatch_seconds
    return math.fsum(max(took(device[s]) for device in plan.devices) for s in range(plan.microbatch_counts()[0]))


def _lockstep_plan(lengths, world: int, cap: int, cost: ContextParallelCost, scale: int | None) -> CPPlan:
    """The lock-step plan with groups of ``scale`` x the smallest size (None: the whole world)."""
    costs = cost(lengths)
    long = sorted(np.flatnonzero(lengths > cap).tolist(), key=lambda i: (-costs[i], i))
    node = cost.devices_per_node
    waves: list[list] = []  # per wave: [next free device, [(sequence, first member, group size), ...]]
    for i in long:
        k = world if scale is None else min(world, scale * min_group_size(int(lengths[i]), cap))
        for wave in waves + [None]:
            if wave is None:
                waves.append(wave := [0, []])
            first = wave[0]
            if 0 < node and k <= node and first % node + k > node:  # keep a group inside a node when it fits one
                first += node - first % node
            if first + k <= world:
                wave[1].append((i, first, k))
                wave[0] = first + k
                break
    steps: list[list] = []  # steps[s][d]
    groups: list[CPGroup] = []
    free_slots: list[tuple[int, int, float]] = []  # (step, device, wave time) where a device has no group
    for s, (_, wave) in enumerate(waves):
        row = [None] * world
        for i, first, k in wave:
            group = _group(len(groups), range(first, first + k), [i], lengths, cost)
            groups.append(group)
            for m in range(k):
                row[first + m] = CPMicrobatch(group, m)
        wave_time = max(groups[-1 - j].cost for j in range(len(wave)))
        free_slots += [(s, d, wave_time) for d in range(world) if row[d] is None]
        steps.append(row)
    shorts = sorted(np.flatnonzero(lengths <= cap).tolist(), key=lambda i: (-costs[i], i))
    for s, d, wave_time in free_slots:  # a short microbatch no longer than the wave runs for free beside it
        chosen, tokens, took = [], 0, cost.microbatch_seconds
        for i in shorts:
            if tokens + lengths[i] <= cap and took + costs[i] <= wave_time:
                chosen.append(i)
                tokens += int(lengths[i])
                took += costs[i]
        if chosen:
            steps[s][d] = _microbatch(chosen, lengths, costs)
            taken = set(chosen)
            shorts = [i for i in shorts if i not in taken]
    steps += _lockstep_steps(sorted(shorts), lengths, costs, world, cap)
    devices = tuple(tuple(step[d] if step[d] is not None else Microbatch.empty() for step in steps)
                    for d in range(world))
    return CPPlan(devices, tuple(groups), cap, planner="lockstep_cp", cost_model=cost.name)


def _lockstep_steps(indices: list[int], lengths, costs, world: int, cap: int) -> list[list]:
    """LB-Micro's layout of the sequences ``indices``: equal counts per device, the same number of steps."""
    if not indices:
        return []
    ids = np.asarray(indices)
    shares = [[int(ids[p]) for p in part] for part in partition(costs[ids], world, equal_sizes=True)]
    count = max(min_microbatches(lengths[share], cap) for share in shares)
    while True:
        packings = [try_pack(lengths[share], costs[share], cap, count) if share else [[]] * count for share in shares]
        if all(p is not None for p in packings):
            break
        count += 1
    steps = [[None] * world for _ in range(count)]
    for d, (share, packed) in enumerate(zip(shares, packings)):
        for s, part in enumerate(packed):
            if part:
                steps[s][d] = _microbatch([share[p] for p in part], lengths, costs)
    return steps


def fixed_cp(lengths, num_devices: int, token_cap: int, *, cost_model: ContextParallelCost | None = None) -> CPPlan:
    """Every sequence split over all devices; rows packed first fit, longest first, one group per row."""
    lengths, world, cap, cost = _inputs(lengths, num_devices, token_cap, cost_model)
    rows: list[list] = []  # [sequences, columns used]
    for i in sorted(range(lengths.size), key=lambda i: (-lengths[i], i)):
        columns = zigzag_layout(int(lengths[i]), world).piece_length
        row = next((r for r in rows if r[1] + columns <= cap), None)
        if row is None:
            rows.append([[i], columns])
        else:
            row[0].append(i)
            row[1] += columns
    groups = tuple(_group(g, range(world), seqs, lengths, cost) for g, (seqs, _) in enumerate(rows))
    devices = tuple(tuple(CPMicrobatch(group, d) for group in groups) for d in range(world))
    return CPPlan(devices, groups, cap, planner="fixed_cp", cost_model=cost.name)


CP_PLANNERS: dict[str, CPPlanner] = {"lb_mini_cp": lb_mini_cp, "lockstep_cp": lockstep_cp, "fixed_cp": fixed_cp}
