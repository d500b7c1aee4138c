"""Greedy bin filling toward a target: a start for the small-instance partition that local moves cannot reach.

For a target ``T`` (a little above the lower bound), parts are filled one at a time: the heaviest remaining item
opens the part, which then takes the subset of at most ``max_others`` remaining items whose cost sum comes closest
to ``T`` from below (the minimum-slack rule of bin packing). The last part takes what is left. A sequence costing
0.92-0.96 of the per-device mean is thus paired with the companion that fits it best, which pairwise exchanges
started from Karmarkar-Karp often miss. Each part is one numpy reduction over the cached table of index
combinations, so a fill costs ``k`` numpy calls; the result is deterministic (ties go to the first combination in
a fixed order).
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from jodc.balance import _native

# Largest number of candidate subsets tabulated for one part (the subset size shrinks until the table fits).
MAX_SUBSETS = 6_000

_COMBINATIONS: dict[tuple[int, int], np.ndarray] = {}


def _combinations(m: int, size: int) -> np.ndarray:
    """Every subset of at most ``size`` of ``range(m)`` as rows of ``size`` indices, padded with ``m``; cached."""
    key = (m, size)
    if key not in _COMBINATIONS:
        rows = [combo + (m,) * (size - len(combo)) for r in range(size + 1)
                for combo in itertools.combinations(range(m), r)]
        _COMBINATIONS[key] = np.array(rows, dtype=np.int64).reshape(-1, size)
    return _COMBINATIONS[key]


def _table(m: int, max_others: int) -> np.ndarray:
    """The combination table for ``m`` items with the largest subset size up to ``max_others`` that keeps it
    within MAX_SUBSETS rows."""
    size = min(max_others, m)
    while size > 1 and sum(math.comb(m, r) for r in range(size + 1)) > MAX_SUBSETS:
        size -= 1
    return _combinations(m, size)


def _row_sums(values: np.ndarray) -> np.ndarray:
    """Each row's sum, its columns added left to right (one elementwise addition per column): a fixed order on every
    host, as the plan must be identical everywhere (the padding columns add 0.0, which changes no sum)."""
    sums = values[:, 0].copy()
    for column in range(1, values.shape[1]):
        sums += values[:, column]
    return sums


def fill_parts(cost: np.ndarray, k: int, target: float, *, max_others: int = 4) -> np.ndarray:
    """An assignment (item -> part) filling parts 0 .. k-2 toward ``target`` as in the module docstring; part
    ``k - 1`` takes the rest (it may exceed ``target``)."""
    cost = np.asarray(cost, dtype=np.float64)
    native = _native.op("balance_fill")
    if native is not None:  # the same fill compiled: the same answer
        return np.array(native.balance_fill(cost.tolist(), int(k), float(target), int(max_others), MAX_SUBSETS),
                        dtype=np.int64)
    n = cost.size
    remaining = np.lexsort((np.arange(n), -cost))  # heaviest first, ties by index
    assign = np.full(n, k - 1, dtype=np.int64)
    for part in range(k - 1):
        if remaining.size == 0:
            break
        first, others = remaining[0], remaining[1:]
        assign[first] = part
        room = target - cost[first]
        others = others[cost[others] <= room]  # only items that fit can join
        m = others.size
        if m:
            table = _table(m, max_others)
            sums = _row_sums(np.append(cost[others], 0.0)[table])
            best = int(np.argmax(np.where(sums <= room, sums, -1.0)))
            assign[others[table[best][table[best] < m]]] = part
        remaining = remaining[1:][assign[remaining[1:]] == k - 1]
    return assign
