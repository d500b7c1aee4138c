"""A node-bounded branch-and-bound search that improves a partition's makespan (its heaviest part).

Local refinement stops at local optima that only a three-part rearrangement escapes; on small instances (a few
sequences per device) those can leave the heaviest part several percent above the optimum. This search starts
from a known partition (the incumbent) and looks for a strictly lighter heaviest part by depth-first assignment
of the items, heaviest first, to parts:

* a part is skipped when the item would make it at least as heavy as the incumbent's heaviest part;
* parts in identical states (same load, count and size) are tried once, so part permutations are not revisited;
* a branch is cut when the room left below the incumbent in all parts cannot hold the remaining items;
* the search stops at the lower bound ``max(largest item, total / k)`` (nothing can beat it), or after
  ``node_budget`` nodes, returning the best partition found. Counting nodes rather than seconds keeps the result
  identical on every host.

It honours the same constraints as the planners: equal item counts (counts differing by at most one) and a cap on
each part's total size.
"""
from __future__ import annotations

import math

import numpy as np

from jodc.balance import _native
from jodc.balance.validation import check_partition, costs_array

DEFAULT_NODE_BUDGET = 3_000


def improve_by_search(costs, parts: list[list[int]], *, equal_sizes: bool = False, sizes=None,
                      capacity: float | None = None, node_budget: int = DEFAULT_NODE_BUDGET) -> list[list[int]]:
    """Return a partition whose heaviest part is no heavier than that of ``parts`` (lighter if one was found).

    Args:
      costs: per-item cost.
      parts: the incumbent partition (every index exactly once); it must satisfy the constraints below.
      equal_sizes: keep part item counts within one of each other.
      sizes, capacity: keep every part's total size within ``capacity``.
      node_budget: the most search nodes to visit (0 returns ``parts`` unchanged).
    """
    cost = costs_array(costs)
    if (sizes is None) != (capacity is None):
        raise ValueError("sizes and capacity must be given together")
    if isinstance(node_budget, bool) or not isinstance(node_budget, int) or node_budget < 0:
        raise ValueError(f"node_budget must be an integer >= 0, got {node_budget!r}")
    size = costs_array(sizes, "sizes") if sizes is not None else np.zeros_like(cost)
    if size.shape != cost.shape:
        raise ValueError(f"sizes has {size.size} entries for {cost.size} costs")
    k = len(parts)
    n = cost.size
    if k == 0:
        raise ValueError("parts is empty: a partition has at least one part")
    check_partition(parts, n)
    incumbent = [sorted(int(i) for i in part) for part in parts]
    best_max = max((math.fsum(cost[part]) for part in incumbent), default=0.0)
    total = math.fsum(cost)
    if node_budget == 0 or n == 0 or k == 1:
        return incumbent
    tolerance = 1e-12 * max(total, 1e-300)
    lower_bound = max(float(cost.max()), total / k)
    if best_max <= lower_bound + tolerance:
        return incumbent

    order = sorted(range(n), key=lambda i: (-cost[i], i))
    # Python floats (the same IEEE values as numpy's): per-node arithmetic on them is several times faster
    ordered_cost = cost[order].tolist()
    ordered_size = size[order].tolist()
    remaining_after = np.concatenate([np.cumsum(cost[order][::-1])[::-1], [0.0]]).tolist()
    count_cap = math.ceil(n / k) if equal_sizes else n
    count_floor = n // k if equal_sizes else 0
    cap = math.inf if capacity is None else float(capacity)

    native = _native.module()
    if native is not None:  # the same loops compiled: the same nodes, the same answer
        found = native.balance_search(ordered_cost, ordered_size, remaining_after, k, best_max, tolerance,
                                      lower_bound, node_budget, not equal_sizes and capacity is None, equal_sizes,
                                      count_cap, count_floor, cap)
    elif not equal_sizes and capacity is None:
        found = _search_free(ordered_cost, remaining_after, k, best_max, tolerance, lower_bound, node_budget)
    else:
        found = _search_general(ordered_cost, ordered_size, remaining_after, k, best_max, tolerance, lower_bound,
                                node_budget, equal_sizes, count_cap, count_floor, cap)

    if found is None:
        return incumbent
    result: list[list[int]] = [[] for _ in range(k)]
    for position, p in enumerate(found):
        result[p].append(order[position])
    return [sorted(part) for part in result]


def _search_general(ordered_cost, ordered_size, remaining_after, k, best_max, tolerance, lower_bound, node_budget,
                    equal_sizes, count_cap, count_floor, cap):
    """The depth-first search with equal counts or a size cap: the assignment (position -> part) of the lightest
    partition found, or None."""
    n = len(ordered_cost)
    loads = [0.0] * k
    counts = [0] * k
    totals = [0.0] * k
    assignment = [0] * n
    best = best_max
    found = None
    nodes = 0

    def candidates(depth: int) -> list[int]:
        """Parts that may take item ``depth``, lightest first, one per distinct part state; [] if pruned."""
        limit = best - tolerance
        room = 0.0  # the room below the incumbent, summed left to right (the same on every Python version)
        for load in loads:
            if load < limit:
                room += limit - load
        if room < remaining_after[depth] - tolerance:
            return []
        if equal_sizes and sum(max(0, count_floor - c) for c in counts) > n - depth:
            return []
        c, z = ordered_cost[depth], ordered_size[depth]
        chosen, seen = [], set()
        for p in sorted(range(k), key=loads.__getitem__):  # stable: ties by part number
            load = loads[p]
            if load + c >= limit or counts[p] >= count_cap or totals[p] + z > cap:
                continue
            key = (load, counts[p], totals[p])
            if key not in seen:
                seen.add(key)
                chosen.append(p)
        return chosen

    # Depth-first search with an explicit stack (no recursion limit): frame = [candidate parts, next index,
    # (part, its load and size before)].
    stack = [[candidates(0), 0, None]]
    while stack:
        depth = len(stack) - 1
        frame = stack[-1]
        if frame[2] is not None:  # undo this depth's previous choice, restoring the exact previous sums
            p, old_load, old_total = frame[2]
            loads[p], totals[p] = old_load, old_total
            counts[p] -= 1
            frame[2] = None
        if frame[1] >= len(frame[0]):
            stack.pop()
            continue
        p = frame[0][frame[1]]
        frame[1] += 1
        if loads[p] + ordered_cost[depth] >= best - tolerance:
            continue  # the incumbent improved since this frame's candidates were listed
        nodes += 1
        if nodes > node_budget:
            break
        frame[2] = (p, loads[p], totals[p])
        loads[p] += ordered_cost[depth]
        counts[p] += 1
        totals[p] += ordered_size[depth]
        assignment[depth] = p
        if depth + 1 == n:
            if not equal_sizes or min(counts) >= count_floor:
                best = max(loads)
                found = list(assignment)
                if best <= lower_bound + tolerance:
                    break
            continue
        stack.append([candidates(depth + 1), 0, None])
    return found


def _search_free(ordered_cost, remaining_after, k, best_max, tolerance, lower_bound, node_budget):
    """:func:`_search_general` without count or size constraints, specialised: the same nodes in the same order
    (part states reduce to (load, count): every size total is 0), with the same IEEE-754 arithmetic, about twice as
    fast. Returns the assignment (position -> part) of the lightest partition found, or None."""
    n = len(ordered_cost)
    loads = [0.0] * k
    counts = [0] * k
    parts = range(k)
    key_of = loads.__getitem__
    assignment = [0] * n
    frames = [None] * n  # per depth: the candidate parts
    position = [0] * n  # per depth: the next candidate to try
    placed = [-1] * n  # per depth: the part its item sits in (-1: none)
    before = [0.0] * n  # per depth: that part's load before it
    best = best_max
    found = None
    nodes = 0

    def candidates(depth):
        limit = best - tolerance
        room = 0.0  # summed left to right, as in _search_general
        for load in loads:
            if load < limit:
                room += limit - load
        if room < remaining_after[depth] - tolerance:
            return ()
        c = ordered_cost[depth]
        chosen = []
        last, run = None, None
        for p in sorted(parts, key=key_of):  # stable: ties by part number
            load = loads[p]
            if load + c >= limit:
                break  # loads ascend, so (rounding being monotone) every later part fails too
            if load == last:  # parts of equal load sit together: one per distinct count among them
                if counts[p] in run:
                    continue
                run.add(counts[p])
            else:
                last, run = load, {counts[p]}
            chosen.append(p)
        return chosen

    depth = 0
    frames[0] = candidates(0)
    while depth >= 0:
        p = placed[depth]
        if p >= 0:  # undo this depth's previous choice, restoring the exact previous load
            loads[p] = before[depth]
            counts[p] -= 1
            placed[depth] = -1
        frame = frames[depth]
        i = position[depth]
        if i >= len(frame):
            depth -= 1
            continue
        p = frame[i]
        position[depth] = i + 1
        c = ordered_cost[depth]
        if loads[p] + c >= best - tolerance:
            continue  # the incumbent improved since this frame's candidates were listed
        nodes += 1
        if nodes > node_budget:
            break
        placed[depth] = p
        before[depth] = loads[p]
        loads[p] += c
        counts[p] += 1
        assignment[depth] = p
        if depth + 1 == n:
            best = max(loads)
            found = list(assignment)
            if best <= lower_bound + tolerance:
                break
            continue
        depth += 1
        frames[depth] = candidates(depth)
        position[depth] = 0
    return found
