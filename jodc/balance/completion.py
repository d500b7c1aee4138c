"""Bin completion: a node-bounded exact search for a lighter heaviest part, filling one part at a time.

Pairwise refinement and chains stop at local optima such as a sequence costing 0.92-0.96 of the per-device mean paired
with a short one, where the optimum needs a rearrangement across several parts. Item-by-item branch and bound (the
older :mod:`jodc.balance.search`) proves little there: every part can take almost every item. Filling whole parts
is much stronger when parts hold few items (Korf's bin completion, applied to the decision "do the items fit into
``k`` parts of capacity ``T``?"):

* the heaviest remaining item opens the next part, which is completed by a subset of the other remaining items;
* the part must reach ``remaining total - (parts left - 1) * T`` (the others cannot hold more than ``T`` each), so
  with ``T`` near the mean only subsets in a narrow window qualify;
* subsets are enumerated largest items first; equal costs are tried once per position (no symmetric branches).

The search starts with ``T`` just below the incumbent's heaviest part; whenever it finds a partition it lowers
``T`` below that partition's heaviest part and continues, until the lower bound is reached, no lighter partition
exists (proven optimal) or ``node_budget`` nodes (subset extensions) have been spent. Counting nodes, never time,
keeps the result identical on every host.
"""
from __future__ import annotations

import math

import numpy as np

from jodc.balance.descent import BOUND_TOLERANCE


# Relative distances above the lower bound tried as targets, in order (then just below the incumbent).
TARGET_STEPS = (5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2)


class _OutOfBudget(Exception):
    pass


def _searcher(cost: np.ndarray, k: int):
    """(place, order, total, eps, state) for one instance: ``place(positions, sum, parts, cap)`` packs the
    positions (into the cost-descending ``order``) into the parts within ``cap``, or returns None; it raises
    _OutOfBudget after ``state["budget"]`` nodes (reset ``state["nodes"]`` between calls)."""
    n = cost.size
    order = sorted(range(n), key=lambda i: (-cost[i], i))
    vals = [float(cost[i]) for i in order]
    total = math.fsum(vals)
    eps = 1e-12 * max(total, 1e-300)
    state = {"nodes": 0, "budget": 0}

    def place(rem: list[int], rem_sum: float, parts_left: int, cap: float):
        """Bins for the positions ``rem`` (heaviest first) into ``parts_left`` parts of capacity ``cap``, or None."""
        if not rem:
            return [[] for _ in range(parts_left)]
        if parts_left == 1:
            return [rem] if rem_sum <= cap else None
        first = rem[0]
        v0 = vals[first]
        if v0 > cap:
            return None
        rest = rem[1:]
        lo = rem_sum - (parts_left - 1) * cap - v0  # what the first part must take beyond its opening item
        hi = cap - v0
        m = len(rest)
        suffix = [0.0] * (m + 1)
        for a in range(m - 1, -1, -1):
            suffix[a] = suffix[a + 1] + vals[rest[a]]
        chosen: list[int] = []

        def extend(pos: int, s: float):
            state["nodes"] += 1
            if state["nodes"] > state["budget"]:
                raise _OutOfBudget
            if s + suffix[pos] < lo - eps:
                return None  # even every remaining item cannot fill the part enough
            a = pos
            while a < m:
                v = vals[rest[a]]
                if s + v <= hi:
                    chosen.append(rest[a])
                    found = extend(a + 1, s + v)
                    chosen.pop()
                    if found is not None:
                        return found
                    if s + suffix[a + 1] < lo - eps:
                        return None
                b = a + 1  # skip items of the same cost: their branches mirror this one
                while b < m and vals[rest[b]] == v:
                    b += 1
                a = b
            if s >= lo - eps:  # fuller completions were tried above: this one takes nothing more
                taken = set(chosen)
                left = [r for r in rest if r not in taken]
                found = place(left, rem_sum - v0 - s, parts_left - 1, cap)
                if found is not None:
                    return [[first] + list(chosen)] + found
            return None

        return extend(0, 0.0)

    return place, order, total, eps, state


def _parts(found, order, k):
    parts = [sorted(order[p] for p in part) for part in found]
    return parts + [[] for _ in range(k - len(parts))]


def complete_bins(costs, num_parts: int, incumbent_max: float, *, bound: float,
                  node_budget: int) -> list[list[int]] | None:
    """A partition whose heaviest part is below ``incumbent_max`` (item indices, ascending), or None.

    Tries the targets ``bound * (1 + TARGET_STEPS)`` below the incumbent, then just below the incumbent, each with
    an equal share of ``node_budget``; the first partition found is returned."""
    cost = np.asarray(costs, dtype=np.float64)
    n, k = cost.size, int(num_parts)
    place, order, total, eps, state = _searcher(cost, k)
    best = None
    # Targets rise from just above the lower bound: a feasible target with some slack is found quickly, a tight
    # infeasible one can take the whole budget, so each target gets a share and the first success stands.
    targets = [bound * (1.0 + step) for step in TARGET_STEPS if bound * (1.0 + step) < incumbent_max - eps]
    targets.append(incumbent_max - eps)
    state["budget"] = max(1, node_budget // len(targets))
    for cap in targets:
        state["nodes"] = 0
        try:
            found = place(list(range(n)), total, k, cap)
        except _OutOfBudget:
            continue
        if found is None:
            continue  # proven infeasible: try the next, looser target
        best = _parts(found, order, k)
        break
    return best


def optimal_partition(costs, num_parts: int, incumbent: list[list[int]], *, node_budget: int = 10_000_000,
                      ) -> tuple[list[list[int]], bool]:
    """Lower the incumbent's heaviest part until no lighter partition exists: (best partition, proven optimal).

    For validation (bench/balance.py): each partition found sets the capacity just below its heaviest part; the
    search ends proven (``True``) when one fails, or at the lower bound, or unproven after ``node_budget`` nodes.
    """
    cost = np.asarray(costs, dtype=np.float64)
    n, k = cost.size, int(num_parts)
    best = [sorted(int(i) for i in part) for part in incumbent]
    if n <= k:
        return [[i] for i in range(n)] + [[] for _ in range(k - n)], True
    place, order, total, eps, state = _searcher(cost, k)
    bound = max(float(cost.max()), total / k)
    state["budget"] = node_budget
    span = max(math.fsum(cost[part]) for part in best)
    try:
        while span > bound * (1.0 + BOUND_TOLERANCE):
            found = place(list(range(n)), total, k, span - eps)
            if found is None:
                return best, True
            best = _parts(found, order, k)
            span = max(math.fsum(cost[part]) for part in best)
        return best, True
    except _OutOfBudget:
        return best, False
