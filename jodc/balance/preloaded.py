"""Balance items over devices that already carry some load (the CP groups' time): a partition around preloads.

LB-Mini's partition (:func:`jodc.balance.partition.partition`) balances items over empty parts. With preloads the
parts are matched to devices heaviest part to lightest device, then pairs (the heaviest device, the lightest) are
improved by moving one item or swapping two, whichever brings the pair closest to even, until neither helps or
``MAX_ROUNDS`` rounds pass. Deterministic: ties go to the lower device and item index.
"""
from __future__ import annotations

import math

import numpy as np

from jodc.balance.partition import partition
from jodc.balance.validation import costs_array

#: Move / swap rounds after the matching: each round touches two devices, so a few per device is plenty.
MAX_ROUNDS_PER_DEVICE = 4


def balance_around_loads(costs, loads, *, search_nodes: int = 0) -> list[list[int]]:
    """Item indices per device (``len(loads)`` devices), making ``loads[d] + sum(costs[items of d])`` even."""
    cost = costs_array(costs)
    load = costs_array(loads, "loads", allow_empty=False)
    num_devices = load.size
    parts = partition(cost, num_devices, search_nodes=search_nodes) if cost.size else [[] for _ in load]
    part_order = sorted(range(num_devices), key=lambda p: (-math.fsum(cost[parts[p]]), p))
    device_order = sorted(range(num_devices), key=lambda d: (load[d], d))
    shares: list[list[int]] = [[] for _ in range(num_devices)]
    for p, d in zip(part_order, device_order):
        shares[d] = list(parts[p])
    totals = load + np.array([math.fsum(cost[s]) for s in shares])
    for _ in range(MAX_ROUNDS_PER_DEVICE * num_devices):
        heavy, light = int(np.argmax(totals)), int(np.argmin(totals))
        gap = totals[heavy] - totals[light]
        if gap <= 0 or not shares[heavy]:
            break
        best = _best_exchange(cost, shares[heavy], shares[light], gap)
        if best is None:
            break
        out, back = best
        if out is not None:
            shares[heavy].remove(out)
            shares[light].append(out)
        if back is not None:
            shares[light].remove(back)
            shares[heavy].append(back)
        moved = (cost[out] if out is not None else 0.0) - (cost[back] if back is not None else 0.0)
        totals[heavy] -= moved
        totals[light] += moved
    return [sorted(s) for s in shares]


def _best_exchange(cost: np.ndarray, heavy: list[int], light: list[int], gap: float):
    """(item leaving the heavy device or None, item leaving the light one or None) whose net move ``m`` is in
    ``(0, gap)`` and closest to ``gap / 2`` (that lowers the pair's maximum most); None when no move or swap helps."""
    best, best_miss = None, gap / 2.0
    for out in heavy:
        candidates = [(out, None, cost[out])] + [(out, back, cost[out] - cost[back]) for back in light]
        for a, b, moved in candidates:
            if 0 < moved < gap:
                miss = abs(moved - gap / 2.0)
                if miss < best_miss:
                    best, best_miss = (a, b), miss
    return best
