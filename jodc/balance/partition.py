"""Multiway number partitioning: split items with costs into k parts whose cost sums are as equal as possible.

* :func:`karmarkar_karp` -- the largest differencing method generalised to k parts. Every item starts as a
  k-tuple of part sums (the item in one part, the others empty). Repeatedly the two tuples with the largest
  spread (max - min) are merged, pairing the heaviest part of one with the lightest of the other, so that large
  differences cancel early. With ``equal_sizes`` the sorted items are first grouped k at a time, one per part,
  so every merge keeps the part sizes equal (item counts differ by at most one when k does not divide n).
* :func:`lpt` -- greedy longest-processing-time: items heaviest first, each to the currently lightest part. The
  classic baseline (within 4/3 of optimal).
* :func:`partition` -- Karmarkar-Karp followed by :func:`~jodc.balance.refine.refine_by_swaps` (also trying the
  refined LPT result), then a node-bounded exact search (:mod:`jodc.balance.search`).

All three are deterministic: ties are broken by item index and creation order, never by hashing or randomness,
and part sums are exactly rounded (``math.fsum``, independent of summation order or SIMD width), so every host
computes the same partition from the same costs. Returned parts are lists of item indices (ascending)
ordered heaviest first (ties: the part holding the smaller first index first; empty parts last).
"""
from __future__ import annotations

import heapq
import itertools
import math

import numpy as np

from jodc.balance.completion import complete_bins
from jodc.balance.descent import BOUND_TOLERANCE, SMALL_ITEMS, descend, lower_bound
from jodc.balance.refine import refine_by_swaps
from jodc.balance.search import DEFAULT_NODE_BUDGET, improve_by_search
from jodc.balance.validation import costs_array, positive_int

# Karmarkar-Karp (pure Python, O(n k log k)) is a start only while n * k is at most this; LPT always is.
KK_WORK = 40_000
_PADDING = -1  # a zero-cost placeholder item used to make n a multiple of k in the equal-size variant


def order_parts(costs, parts: list[list[int]]) -> list[list[int]]:
    """Sort each part's indices and the parts themselves: heaviest first, ties by first index, empty parts last."""
    cost = np.asarray(costs, dtype=np.float64)
    sorted_parts = [sorted(int(i) for i in part) for part in parts]

    def key(part):
        return (0, -math.fsum(cost[part]), part[0]) if part else (1, 0.0, 0)

    return sorted(sorted_parts, key=key)


def _state_key(part):
    total, items = part
    return (-total, items)


def karmarkar_karp(costs, num_parts: int, *, equal_sizes: bool = False) -> list[list[int]]:
    """Largest-differencing partition of ``costs`` into ``num_parts`` parts (see the module docstring)."""
    cost = costs_array(costs)
    k = positive_int(num_parts, "num_parts")
    order = sorted(range(cost.size), key=lambda i: (-cost[i], i))
    counter = itertools.count()
    heap: list = []

    def push(state):
        spread = state[0][0] - state[-1][0]
        heapq.heappush(heap, (-spread, next(counter), state))

    if equal_sizes:
        padded = order + [_PADDING] * (-len(order) % k)
        for start in range(0, len(padded), k):
            group = padded[start : start + k]
            state = [(float(cost[i]) if i != _PADDING else 0.0, (i,)) for i in group]
            push(sorted(state, key=_state_key))
    else:
        for i in order:
            push([(float(cost[i]), (i,))] + [(0.0, ())] * (k - 1))
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, heavy = heapq.heappop(heap)
        _, _, light = heapq.heappop(heap)
        merged = [
            (heavy[j][0] + light[k - 1 - j][0], heavy[j][1] + light[k - 1 - j][1]) for j in range(k)
        ]
        push(sorted(merged, key=_state_key))
    final = heap[0][2]
    parts = [[i for i in items if i != _PADDING] for _, items in final]
    return order_parts(cost, parts)


def lpt(costs, num_parts: int) -> list[list[int]]:
    """Greedy LPT: items in decreasing cost (ties by index) each go to the lightest part (ties by part number)."""
    cost = costs_array(costs)
    k = positive_int(num_parts, "num_parts")
    parts: list[list[int]] = [[] for _ in range(k)]
    loads = [(0.0, p) for p in range(k)]
    for i in sorted(range(cost.size), key=lambda i: (-cost[i], i)):
        load, p = heapq.heappop(loads)
        parts[p].append(i)
        heapq.heappush(loads, (load + float(cost[i]), p))
    return order_parts(cost, parts)


def partition(
    costs,
    num_parts: int,
    *,
    equal_sizes: bool = False,
    refine: bool = True,
    search_nodes: int = DEFAULT_NODE_BUDGET,
) -> list[list[int]]:
    """Balanced partition of ``costs`` into ``num_parts`` parts (minimising the heaviest part).

    Karmarkar-Karp, then pairwise refinement (equal-size exchanges only when ``equal_sizes``, so counts stay
    within one). Without ``equal_sizes`` the refined LPT partition is computed as well and the better of the two
    kept: on a few small instances KK's local optimum is worse than LPT's. Last, a branch-and-bound search of at
    most ``search_nodes`` nodes looks for a lighter heaviest part (:mod:`jodc.balance.search`); on small
    instances it completes and the result is optimal. ``refine=False`` returns plain Karmarkar-Karp.
    """
    cost = costs_array(costs)
    if refine and not equal_sizes:
        return order_parts(cost, _free_partition(cost, positive_int(num_parts, "num_parts"), search_nodes))
    parts = karmarkar_karp(cost, num_parts, equal_sizes=equal_sizes)
    if not refine:
        return parts
    candidates = [refine_by_swaps(cost, parts, allow_moves=not equal_sizes)]
    if not equal_sizes:
        candidates.append(refine_by_swaps(cost, lpt(cost, num_parts)))
    best = min(candidates, key=lambda c: float(part_sums(cost, c).max()))  # first wins ties: KK
    best = improve_by_search(cost, best, equal_sizes=equal_sizes, node_budget=search_nodes)
    return order_parts(cost, best)


def _as_assignment(parts: list[list[int]], n: int) -> np.ndarray:
    assign = np.zeros(n, dtype=np.int64)
    for p, part in enumerate(parts):
        assign[part] = p
    return assign


def _as_parts(assign: np.ndarray, k: int) -> list[list[int]]:
    order = np.argsort(assign, kind="stable")
    bounds = np.searchsorted(assign[order], np.arange(k + 1))
    return [order[bounds[p]:bounds[p + 1]].tolist() for p in range(k)]


def _pairwise_partition(cost: np.ndarray, k: int, search_nodes: int) -> list[list[int]]:
    """The free partition as computed before the descent existed: Karmarkar-Karp and LPT, each refined by pairwise
    exchanges, the better searched item-wise (:func:`~jodc.balance.search.improve_by_search`)."""
    candidates = [refine_by_swaps(cost, karmarkar_karp(cost, k)), refine_by_swaps(cost, lpt(cost, k))]
    best = min(candidates, key=lambda c: float(part_sums(cost, c).max()))  # first wins ties: KK
    return improve_by_search(cost, best, node_budget=search_nodes)


def _free_partition(cost: np.ndarray, k: int, search_nodes: int) -> list[list[int]]:
    """The free partition (sizes may differ), every step bounded by counts, never by time:

    1. fast path: Karmarkar-Karp (when ``n * k <= KK_WORK``) and LPT starts, each lowered by
       :func:`~jodc.balance.descent.descend`, the better kept; done if it is within ``BOUND_TOLERANCE`` of the lower
       bound, or if the instance has more than ``SMALL_ITEMS`` items;
    2. small instances: pairwise refinement of that result and the previous pipeline (:func:`_pairwise_partition`)
       compete, then bin completion (:func:`~jodc.balance.completion.complete_bins`, ``search_nodes`` nodes);
       with ``search_nodes=0`` only the pairwise refinement."""
    n = cost.size
    if n <= k:
        return [[i] for i in range(n)] + [[] for _ in range(k - n)]
    bound = lower_bound(cost, k)
    rounds = 10 * n + 100
    starts = [karmarkar_karp(cost, k)] if n * k <= KK_WORK else []
    starts.append(lpt(cost, k))
    best, best_max = None, math.inf
    for start in starts:
        assign = descend(cost, _as_assignment(start, n), k, max_rounds=rounds, bound=bound)
        span = float(np.bincount(assign, weights=cost, minlength=k).max())
        if span < best_max:
            best, best_max = assign, span
        if best_max <= bound * (1.0 + BOUND_TOLERANCE):
            break
    parts = _as_parts(best, k)
    if n > SMALL_ITEMS or best_max <= bound * (1.0 + BOUND_TOLERANCE):
        return parts
    # Small instances: plateau moves (narrowing pairs below the heaviest part) unlock what the strict descent
    # cannot, and the previous pipeline (pairwise refinement of KK and LPT, item-wise search) competes too, so
    # the result is never worse than it; bin completion then looks for a lighter partition still.
    if not search_nodes:  # no search asked for (packing that only needs a fit): pairwise refinement only
        return refine_by_swaps(cost, parts)
    candidates = [refine_by_swaps(cost, parts), _pairwise_partition(cost, k, search_nodes)]
    parts = min(candidates, key=lambda c: float(part_sums(cost, c).max()))
    best_max = float(part_sums(cost, parts).max())
    if best_max > bound * (1.0 + BOUND_TOLERANCE) and search_nodes:
        found = complete_bins(cost, k, best_max, bound=bound, node_budget=search_nodes)
        if found is not None:
            parts = found
    return parts


def part_sums(costs, parts: list[list[int]]) -> np.ndarray:
    """Cost sum of each part, as a float64 array."""
    cost = np.asarray(costs, dtype=np.float64)
    return np.array([math.fsum(cost[part]) for part in parts])
