"""Multiway number partitioning: split items with costs into k parts whose cost sums are as equal as possible.

* :func:`karmarkar_karp` -- the largest differencing method generalised to k parts. Every item starts as a
  k-tuple of part sums (the item in one part, the others empty). Repeatedly the two tuples with the largest
  spread (max - min) are merged, pairing the heaviest part of one with the lightest of the other, so that large
  differences cancel early. With ``equal_sizes`` the sorted items are first grouped k at a time, one per part,
  so every merge keeps the part sizes equal (item counts differ by at most one when k does not divide n).
* :func:`lpt` -- greedy longest-processing-time: items heaviest first, each to the currently lightest part. The
  classic baseline (within 4/3 of optimal).
* :func:`partition` -- the free partition (:func:`_free_partition`: Karmarkar-Karp or LPT, vectorised descent,
  re-splits, fills, then the previous pipeline's refinements and search as a never-worse step, bin completion) or
  the equal-count one (:func:`_equal_partition`), every step bounded by counts.

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

from jodc.balance import _native
from jodc.balance.completion import complete_bins
from jodc.balance.descent import (
    BOUND_TOLERANCE,
    PARTNER_PARTS,
    RESPLIT_ITEMS,
    SMALL_ITEMS,
    balance_pairs,
    descend,
    equal_count_bound,
    lower_bound,
    resplit_heaviest,
)
from jodc.balance.fill import MAX_SUBSETS, fill_parts
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

    Free part sizes: :func:`_free_partition`; with ``equal_sizes`` sizes within one: :func:`_equal_partition`. Both
    are never heavier than the previous pipeline (Karmarkar-Karp refined pairwise, then the item-wise search),
    up to the ``BOUND_TOLERANCE`` at which they stop above the lower bound. ``search_nodes`` bounds the searches
    (``0``: the fast path only). ``refine=False`` returns plain Karmarkar-Karp.
    """
    cost = costs_array(costs)
    if refine:
        k = positive_int(num_parts, "num_parts")
        if cost.size <= k:
            return order_parts(cost, [[i] for i in range(cost.size)] + [[] for _ in range(k - cost.size)])
        split = _equal_partition if equal_sizes else _free_partition
        return order_parts(cost, split(cost, k, search_nodes))
    return karmarkar_karp(cost, num_parts, equal_sizes=equal_sizes)


def _as_assignment(parts: list[list[int]], n: int) -> np.ndarray:
    assign = np.zeros(n, dtype=np.int64)
    for p, part in enumerate(parts):
        assign[part] = p
    return assign


def _as_parts(assign: np.ndarray, k: int) -> list[list[int]]:
    order = np.argsort(assign, kind="stable")
    bounds = np.searchsorted(assign[order], np.arange(k + 1))
    return [order[bounds[p]:bounds[p + 1]].tolist() for p in range(k)]


# Small instances also try greedy fills toward these relative distances above the lower bound, filling each part
# with its opening item and at most 4 others (jodc.balance.fill).
FILL_STEPS = (1e-4, 5e-4, 1e-3, 2e-3, 4e-3)
FILL_OTHERS = 4  # fills run only while the parts average at most 1 + FILL_OTHERS items
# Passes of the vectorised pair balancing on large instances (each pass: a few numpy calls over all parts).
PAIR_PASSES = 20
# Rounds of optimal two-part re-splits of the heaviest part after each small-instance descent.
RESPLIT_ROUNDS = 5
# The previous LB-Mini's item-wise search budget: small instances still above the bound after the fills run the
# previous pipeline's refinements and this search (:func:`_never_worse`), so no plan is worse than before.
PREVIOUS_SEARCH_NODES = DEFAULT_NODE_BUDGET


def _span(cost: np.ndarray, assign: np.ndarray, k: int) -> float:
    return float(np.bincount(assign, weights=cost, minlength=k).max())


def _fast_path(cost: np.ndarray, k: int, *, equal: bool):
    """The fast path of both partitions: (the Karmarkar-Karp start or None, the descended assignment, its heaviest
    part, the bound).

    Karmarkar-Karp (equal-size with ``equal``) when ``n * k <= KK_WORK``; else LPT (equal: the snake deal), then
    :func:`~jodc.balance.descent.balance_pairs`; then :func:`~jodc.balance.descent.descend` (equal: swaps and
    chains first, the cheap exchanges, keeping the sizes). Each stops at the bound (equal: the equal-count bound)."""
    n = cost.size
    bound = equal_count_bound(cost, k) if equal else lower_bound(cost, k)
    kk = karmarkar_karp(cost, k, equal_sizes=equal) if n * k <= KK_WORK else None
    if kk is not None:
        start = _as_assignment(kk, n)
    else:
        start = _snake(cost, k) if equal else _as_assignment(lpt(cost, k), n)
        start = balance_pairs(cost, start, k, max_passes=PAIR_PASSES, bound=bound, equal_counts=equal)
    best = descend(cost, start, k, max_rounds=10 * n + 100, bound=bound, small=False if equal else None,
                   equal_counts=equal)
    return kk, best, _span(cost, best, k), bound


def _free_partition(cost: np.ndarray, k: int, search_nodes: int) -> list[list[int]]:
    """The free partition (sizes may differ), every step bounded by counts, never by time, each stopping as soon as
    the heaviest part is within ``BOUND_TOLERANCE`` of the lower bound:

    1. fast path: Karmarkar-Karp (when ``n * k <= KK_WORK``; else LPT, then
       :func:`~jodc.balance.descent.balance_pairs`), lowered by :func:`~jodc.balance.descent.descend`; done here for
       instances of more than ``SMALL_ITEMS`` items, or with ``search_nodes=0`` (packing microbatches, where only a
       fit matters);
    2. small instances: optimal two-part re-splits of the heaviest part
       (:func:`~jodc.balance.descent.resplit_heaviest`), then greedy fills toward targets just above the bound
       (:func:`~jodc.balance.fill.fill_parts`, ``FILL_STEPS``; while parts average at most ``1 + FILL_OTHERS``
       items), each descended and re-split, the best kept;
    3. still above the bound: the previous pipeline's pairwise refinements compete and its item-wise search runs from
       the lightest (:func:`_never_worse`), so the result is never heavier than the previous LB-Mini's;
    4. bin completion (:func:`~jodc.balance.completion.complete_bins`, ``search_nodes`` nodes)."""
    kk, best, best_max, bound = _fast_path(cost, k, equal=False)
    target, rounds = bound * (1.0 + BOUND_TOLERANCE), 10 * cost.size + 100
    if cost.size > SMALL_ITEMS or best_max <= target or not search_nodes:
        return _as_parts(best, k)
    # fills complete a part with at most FILL_OTHERS items besides its opening one: only for parts that small
    steps = FILL_STEPS if cost.size <= k * (1 + FILL_OTHERS) else ()
    best, reached = _resplit_and_fill(cost, k, best, bound, target, rounds, steps)
    if reached:
        return _as_parts(best, k)
    parts = _never_worse(cost, k, _as_parts(best, k), kk)
    best_max = float(part_sums(cost, parts).max())
    if best_max <= target:
        return parts
    found = complete_bins(cost, k, best_max, bound=bound, node_budget=search_nodes)
    return found if found is not None else parts


def _resplit_and_fill(cost: np.ndarray, k: int, best: np.ndarray, bound: float, target: float, rounds: int,
                      steps) -> tuple[np.ndarray, bool]:
    """Step 2 of :func:`_free_partition`: (the lightest assignment found, whether its heaviest part is within
    ``target``). One call of the compiled ``balance_small_stage`` when built (the same steps, each the compiled op the
    Python step calls, so the same answer), else this loop."""
    native = _native.op("balance_small_stage")
    if native is not None and _native.descend_module() is not None:
        assign, reached = native.balance_small_stage(
            cost.tolist(), best.tolist(), k, [bound * (1.0 + step) for step in steps], bound, target,
            1e-12 * max(math.fsum(cost), 1e-300), rounds, cost.size <= SMALL_ITEMS, BOUND_TOLERANCE, PARTNER_PARTS,
            RESPLIT_ROUNDS, RESPLIT_ITEMS, FILL_OTHERS, MAX_SUBSETS)
        return np.array(assign, dtype=np.int64), bool(reached)
    starts = (fill_parts(cost, k, bound * (1.0 + step), max_others=FILL_OTHERS) for step in steps)
    best_max = 0.0
    for index, assign in enumerate(itertools.chain([best], starts)):
        if index:
            assign = descend(cost, assign, k, max_rounds=rounds, bound=bound)
        assign = resplit_heaviest(cost, assign, k, max_rounds=RESPLIT_ROUNDS, bound=bound)
        span = _span(cost, assign, k)
        if span < best_max or not index:
            best, best_max = assign, span
        if best_max <= target:
            return best, True
    return best, False


def _never_worse(cost: np.ndarray, k: int, parts: list[list[int]], kk: list[list[int]] | None) -> list[list[int]]:
    """``parts``, or a lighter partition, whose heaviest part is never heavier than the previous LB-Mini's.

    The previous pipeline refined Karmarkar-Karp and LPT pairwise (:func:`~jodc.balance.refine.refine_by_swaps`)
    and searched item-wise from the better (:func:`~jodc.balance.search.improve_by_search`, ``PREVIOUS_SEARCH_NODES``
    nodes). Here the same two refinements compete with ``parts`` and the same search starts from the lightest of
    the three. The search visits its nodes in a fixed order and prunes every branch at least as heavy as its
    incumbent, so from a lighter (or equal) incumbent it visits a subsequence of the nodes it would visit from the
    previous pipeline's incumbent and, within the same node budget, ends no heavier (up to its relative 1e-12
    tolerance): the result is never worse than the previous LB-Mini's, by construction."""
    kk = karmarkar_karp(cost, k) if kk is None else kk
    candidates = [parts, refine_by_swaps(cost, kk), refine_by_swaps(cost, lpt(cost, k))]
    incumbent = min(candidates, key=lambda c: float(part_sums(cost, c).max()))  # first wins ties: ours
    return improve_by_search(cost, incumbent, node_budget=PREVIOUS_SEARCH_NODES)


def _snake(cost: np.ndarray, k: int) -> np.ndarray:
    """Items heaviest first dealt to parts 0, 1, ..., k-1, k-1, ..., 0, 0, 1, ...: sizes within one (a start for
    equal counts too large for Karmarkar-Karp)."""
    n = cost.size
    order = np.lexsort((np.arange(n), -cost))
    rank = np.arange(n)
    lap, pos = np.divmod(rank, k)
    assign = np.empty(n, dtype=np.int64)
    assign[order] = np.where(lap % 2 == 0, pos, k - 1 - pos)
    return assign


def _equal_partition(cost: np.ndarray, k: int, search_nodes: int) -> list[list[int]]:
    """The equal-count partition (part sizes within one, LB-Micro): :func:`_equal_heaviest` lowers the heaviest
    part, then every pair of parts is narrowed, which never raises it. Lock-step engines wait for the slowest device
    in every microbatch slot, so the other devices' sums matter too: without this step the simulated collective
    step of LB-Micro's plans was 1-2% slower than with the previous partition (whose pairwise refinement narrows
    every pair). Small instances (at most ``SMALL_ITEMS`` items): the size-keeping pairwise refinement
    (:func:`~jodc.balance.refine.refine_by_swaps`); larger ones: :func:`~jodc.balance.descent.balance_pairs` run
    past the bound (``PAIR_PASSES`` passes)."""
    parts = _equal_heaviest(cost, k, search_nodes)
    if cost.size <= SMALL_ITEMS:
        return refine_by_swaps(cost, parts, allow_moves=False)
    assign = balance_pairs(cost, _as_assignment(parts, cost.size), k, max_passes=PAIR_PASSES, bound=0.0,
                           equal_counts=True)
    return _as_parts(assign, k)


def _equal_heaviest(cost: np.ndarray, k: int, search_nodes: int) -> list[list[int]]:
    """The equal-count partition's heaviest part, lowered with every step bounded by counts, stopping within
    ``BOUND_TOLERANCE`` of :func:`~jodc.balance.descent.equal_count_bound`:

    1. equal-size Karmarkar-Karp (when ``n * k <= KK_WORK``; else the snake deal, then
       :func:`~jodc.balance.descent.balance_pairs`), lowered by :func:`~jodc.balance.descent.descend` (swaps; moves
       and chains only from a part one item larger), all keeping the sizes;
    2. small instances (at most ``SMALL_ITEMS`` items) still above the bound: the descent with 2-for-2 exchanges
       and 3-cycles too, then size-keeping two-part re-splits of the heaviest part
       (:func:`~jodc.balance.descent.resplit_heaviest`), each followed by the descent, while they lower it;
    3. the previous LB-Micro partition (equal-size KK refined by size-keeping pairwise exchanges) competes, and the
       equal-size item-wise search (:func:`~jodc.balance.search.improve_by_search`, ``search_nodes`` nodes) starts
       from the lighter of the two: never worse than the previous LB-Micro partition (see :func:`_never_worse`)."""
    kk, best, best_max, bound = _fast_path(cost, k, equal=True)
    target, rounds = bound * (1.0 + BOUND_TOLERANCE), 10 * cost.size + 100
    if cost.size > SMALL_ITEMS or best_max <= target or not search_nodes:
        return _as_parts(best, k)
    best = descend(cost, best, k, max_rounds=rounds, bound=bound, equal_counts=True)
    best_max = _span(cost, best, k)
    for _ in range(RESPLIT_ROUNDS):
        assign = resplit_heaviest(cost, best, k, max_rounds=RESPLIT_ROUNDS, bound=bound, equal_counts=True)
        assign = descend(cost, assign, k, max_rounds=rounds, bound=bound, equal_counts=True)
        span = _span(cost, assign, k)
        if not span < best_max:
            break
        best, best_max = assign, span
        if best_max <= target:
            return _as_parts(best, k)
    # never worse than the previous LB-Micro partition: its size-keeping pairwise refinement of equal-size KK
    # competes, and its search starts from the lighter (the argument of _never_worse)
    parts = _as_parts(best, k)
    previous = refine_by_swaps(cost, kk if kk is not None else karmarkar_karp(cost, k, equal_sizes=True),
                               allow_moves=False)
    incumbent = min([parts, previous], key=lambda c: float(part_sums(cost, c).max()))  # first wins ties: ours
    return improve_by_search(cost, incumbent, equal_sizes=True, node_budget=search_nodes)


def part_sums(costs, parts: list[list[int]]) -> np.ndarray:
    """Cost sum of each part, as a float64 array."""
    cost = np.asarray(costs, dtype=np.float64)
    return np.array([math.fsum(cost[part]) for part in parts])
