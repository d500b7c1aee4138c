"""Balance items over devices that already carry some load (the CP groups' time): a partition around preloads.

Two starts, each then improved pair by pair (the heaviest device, the lightest) by moving one item or swapping two,
whichever brings the pair closest to even, until neither helps or ``MAX_ROUNDS_PER_DEVICE`` rounds per device pass:

* LB-Mini's partition (:func:`jodc.balance.partition.partition`) into equal parts, matched heaviest part to lightest
  device: right when the loads are close (equal loads: LB-Mini's own partition);
* LPT around the loads, items heaviest first, each to the device whose total is lowest: right when the loads are far
  apart (some devices hold a long sequence's rows for most of the step, others nothing), where equal parts leave the
  pairwise refinement one item per round to move for hundreds of items.

:func:`balance_around_loads` keeps the start whose heaviest device is lightest; :func:`balance_around_loads_starts`
returns both, for a caller that prices the result more exactly (``lb_mini_cp`` counts each device's microbatches).
Deterministic: ties go to the lower device and item index.
"""
from __future__ import annotations

import heapq
import math

import numpy as np

from jodc.balance.partition import partition
from jodc.balance.validation import costs_array

#: Move / swap rounds after the matching: each round touches two devices, so a few per device is plenty.
MAX_ROUNDS_PER_DEVICE = 4


def balance_around_loads(costs, loads, *, search_nodes: int = 0) -> list[list[int]]:
    """Item indices per device (``len(loads)`` devices), making ``loads[d] + sum(costs[items of d])`` even: of the
    refined starts of :func:`balance_around_loads_starts`, the one whose heaviest device is lightest (on a tie the
    first)."""
    cost = costs_array(costs)
    load = costs_array(loads, "loads", allow_empty=False)
    starts = balance_around_loads_starts(cost, load, search_nodes=search_nodes)
    return min(starts, key=lambda shares: max(load[d] + math.fsum(cost[s]) for d, s in enumerate(shares)))


def balance_around_loads_starts(costs, loads, *, search_nodes: int = 0) -> list[list[list[int]]]:
    """Two balances of the items around the loads (each: item indices per device, ascending), for a caller that
    prices the result more exactly than by item costs (e.g. with each device's microbatch count) to pick one.

    Each start is refined by moves and swaps between the heaviest and the lightest device:

    1. LB-Mini's partition into equal parts, matched heaviest part to lightest device: the right start when the
       loads are close (equal loads give LB-Mini's own partition);
    2. LPT around the loads (items heaviest first, each to the device whose total is lowest): the right start when
       they are far apart (devices holding a long group's rows next to idle ones), where equal parts would leave the
       refinement one single-item move per round for thousands of moves.
    """
    cost = costs_array(costs)
    load = costs_array(loads, "loads", allow_empty=False)
    num_devices = load.size
    parts = partition(cost, num_devices, search_nodes=search_nodes) if cost.size else [[] for _ in load]
    part_order = sorted(range(num_devices), key=lambda p: (-math.fsum(cost[parts[p]]), p))
    device_order = sorted(range(num_devices), key=lambda d: (load[d], d))
    matched: list[list[int]] = [[] for _ in range(num_devices)]
    for p, d in zip(part_order, device_order):
        matched[d] = list(parts[p])
    return [[sorted(s) for s in _refine(cost, load, start)] for start in (matched, _lpt_around(cost, load))]


def _lpt_around(cost: np.ndarray, load: np.ndarray) -> list[list[int]]:
    """LPT with preloads: items heaviest first (ties by index), each to the device whose total is lowest (ties by
    device index). Its heaviest receiving device ends at most the last item it took above the lightest."""
    shares: list[list[int]] = [[] for _ in range(load.size)]
    heap = [(float(load[d]), d) for d in range(load.size)]
    heapq.heapify(heap)
    for i in sorted(range(cost.size), key=lambda i: (-cost[i], i)):
        total, d = heapq.heappop(heap)
        shares[d].append(i)
        heapq.heappush(heap, (total + float(cost[i]), d))
    return shares


def _refine(cost: np.ndarray, load: np.ndarray, shares: list[list[int]]):
    """The shares after moves and swaps between the heaviest and the lightest device, while one helps and at
    most ``MAX_ROUNDS_PER_DEVICE`` rounds per device."""
    shares = [list(s) for s in shares]
    totals = load + np.array([math.fsum(cost[s]) for s in shares])
    for _ in range(MAX_ROUNDS_PER_DEVICE * load.size):
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
    return shares


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
