"""Packing one device's sequences into microbatches of at most ``token_cap`` tokens each.

The number of microbatches starts at the fewest that could hold the tokens (``ceil(tokens / token_cap)``) and
grows until a packing is found in which every microbatch fits. For a given count ``m`` the packer tries, in order:

1. the cost-balanced partition into ``m`` parts (:func:`~jodc.balance.partition.partition`): balanced
   microbatch costs are what lock-step execution wants;
2. the token-balanced partition, and then first-fit decreasing by tokens, each followed by cost refinement that
   keeps every microbatch within the cap.

With ``m`` equal to the number of sequences every sequence gets its own microbatch, which always fits (each
sequence is at most ``token_cap`` long), so the loop ends. Microbatches come back heaviest first.
"""
from __future__ import annotations

import math

import numpy as np

from jodc.balance.descent import BOUND_TOLERANCE, descend
from jodc.balance.partition import lpt, order_parts, partition
from jodc.balance.refine import refine_by_swaps
from jodc.balance.search import DEFAULT_NODE_BUDGET, improve_by_search
from jodc.balance.validation import costs_array, lengths_within_cap, positive_int, sequence_lengths


def _fits(lengths: np.ndarray, parts: list[list[int]], token_cap: int) -> bool:
    return all(int(lengths[part].sum()) <= token_cap for part in parts if part)


def _first_fit_decreasing(lengths: np.ndarray, num_bins: int, token_cap: int) -> list[list[int]] | None:
    """Longest sequences first, each into the first of ``num_bins`` bins with room; None if one has no room."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    room = [token_cap] * num_bins
    for i in sorted(range(lengths.size), key=lambda i: (-lengths[i], i)):
        for b in range(num_bins):
            if lengths[i] <= room[b]:
                bins[b].append(i)
                room[b] -= int(lengths[i])
                break
        else:
            return None
    return bins


def _pack_for_fit(size: np.ndarray, cost: np.ndarray, token_cap: int, m: int) -> list[list[int]] | None:
    """The cheap packing (no search: balance among a device's microbatches matters little under ODC), first that
    fits of: LPT by cost; LPT by tokens; LPT by tokens lowered by :func:`~jodc.balance.descent.descend` on tokens
    (until the fullest microbatch fits); first-fit decreasing. None if none fits."""
    for parts in (lpt(cost, m), lpt(size.astype(np.float64), m)):
        if _fits(size, parts, token_cap):
            return order_parts(cost, parts)
    tokens = size.astype(np.float64)
    start = np.zeros(size.size, dtype=np.int64)
    for p, part in enumerate(lpt(tokens, m)):
        start[part] = p
    # descend stops once the fullest microbatch is within BOUND_TOLERANCE above this bound, i.e. within the cap
    assign = descend(tokens, start, m, max_rounds=10 * size.size + 100, bound=token_cap / (1.0 + BOUND_TOLERANCE))
    parts = [np.flatnonzero(assign == p).tolist() for p in range(m)]
    if _fits(size, parts, token_cap):
        return order_parts(cost, parts)
    parts = _first_fit_decreasing(size, m, token_cap)
    return order_parts(cost, parts) if parts is not None else None


def try_pack(lengths, costs, token_cap: int, num_microbatches: int, *,
             search_nodes: int = DEFAULT_NODE_BUDGET) -> list[list[int]] | None:
    """Pack into exactly ``num_microbatches`` microbatches (some may be empty), or None if no attempt fits.

    Returns lists of positions into ``lengths``, heaviest microbatch (by ``costs``) first. ``search_nodes`` bounds
    the exact searches that balance the microbatches' costs (LB-Mini passes 0: ODC runs a device's microbatches
    one after another, so their balance matters little).
    """
    size = sequence_lengths(lengths, allow_empty=True)
    cost = costs_array(costs)
    m = positive_int(num_microbatches, "num_microbatches")
    if cost.shape != size.shape:
        raise ValueError(f"lengths and costs differ in size: {size.size} vs {cost.size}")
    lengths_within_cap(size, token_cap)
    if int(size.sum()) > m * token_cap:
        return None
    if size.size <= m:
        return order_parts(cost, [[i] for i in range(size.size)] + [[] for _ in range(m - size.size)])
    if not search_nodes:
        return _pack_for_fit(size, cost, token_cap, m)
    by_cost = partition(cost, m, search_nodes=search_nodes)
    if _fits(size, by_cost, token_cap):
        return by_cost
    starts = [partition(size.astype(np.float64), m, search_nodes=search_nodes), _first_fit_decreasing(size, m, token_cap)]
    for start in starts:
        if start is not None and _fits(size, start, token_cap):
            refined = refine_by_swaps(cost, start, sizes=size, capacity=token_cap)
            refined = improve_by_search(cost, refined, sizes=size, capacity=token_cap, node_budget=search_nodes)
            return order_parts(cost, refined)
    return None


def min_microbatches(lengths, token_cap: int) -> int:
    """The fewest microbatches that could hold these sequences by token count alone (0 for none)."""
    size = sequence_lengths(lengths, allow_empty=True)
    return math.ceil(int(size.sum()) / positive_int(token_cap, "token_cap"))


def pack_microbatches(lengths, costs, token_cap: int, *, at_least: int = 0,
                      search_nodes: int = DEFAULT_NODE_BUDGET) -> list[list[int]]:
    """Pack one device's sequences into the fewest microbatches (and at least ``at_least``) that this packer fits.

    Args:
      lengths: the device's sequence lengths (each at most ``token_cap``); may be empty.
      costs: their costs (any cost model), balanced across microbatches.
      token_cap: the most tokens in one microbatch.
      at_least: a lower bound on the count (empty microbatches are added if there are fewer sequences).
      search_nodes: passed to :func:`try_pack` (0 when microbatch balance matters little: LB-Mini).

    Returns lists of positions into ``lengths``, heaviest microbatch first, each within ``token_cap`` tokens.
    """
    size = sequence_lengths(lengths, allow_empty=True)
    cap = positive_int(token_cap, "token_cap")
    if isinstance(at_least, bool) or not isinstance(at_least, int) or at_least < 0:
        raise ValueError(f"at_least must be an integer >= 0, got {at_least!r}")
    m = max(at_least, min_microbatches(size, cap))
    if m == 0:
        return []
    while True:
        packed = try_pack(size, costs, cap, m, search_nodes=search_nodes)
        if packed is not None:
            return packed
        m += 1  # terminates: with m >= len(lengths) every sequence gets its own microbatch
