"""Pairwise refinement of a partition: exchange small groups of items between two parts while that narrows them.

A partition from Karmarkar-Karp (or LPT) is usually near-balanced and can often be improved locally. For two parts
with sums ``S_p > S_q`` and gap ``D = S_p - S_q``, handing a group of items of total cost ``x`` from p to q in
exchange for a group of total cost ``y`` leaves the pair with gap ``|D - 2 (x - y)|``: the exchange helps exactly
when ``0 < x - y < D``, most when ``x - y`` is closest to ``D / 2``. Every accepted exchange lowers the sum of
squared part sums, so the search ends; ``max_rounds`` bounds it anyway.

Groups have at most one item per side first (a move or a pairwise swap, cheap); only when no such exchange helps
are groups of up to ``max_group`` (at most 2) items per side tried (2-for-1, 2-for-2), which escapes most local optima
that single swaps leave on small instances. Each round first tries to lower the heaviest part (the makespan)
against every lighter part, choosing the exchange that lowers it most; failing that it narrows the widest pair
that can be narrowed, which often unlocks a later makespan improvement.

The search stops early once the heaviest part is within ``LOWER_BOUND_TOLERANCE`` (relative) of the lower bound
``max(largest item, total / parts)``, which nothing can beat. Large parts skip the 2-item tables
(``MAX_PAIR_TABLE``) to bound memory.

Constraints: ``allow_moves=False`` only exchanges groups of equal size, so each part keeps its item count; and
``sizes`` + ``capacity`` keep every part's total size (e.g. tokens) within a cap.
"""
from __future__ import annotations

import math

import numpy as np

from jodc.balance import _native
from jodc.balance.descent import pair_indices
from jodc.balance.validation import check_partition, costs_array

# Largest give x take table of groups of up to 2 items tabulated at once (floats, about 2 MB): two parts of up to
# about 30 items each fit; larger pairs use single-item exchanges only.
MAX_PAIR_TABLE = 250_000
# Refinement stops once the heaviest part is within this relative distance of the lower bound max(item, mean).
LOWER_BOUND_TOLERANCE = 1e-6
# Give x take tables up to this many entries are scanned in plain Python (a few parts of a few items each: numpy's
# per-call overhead dominates there); larger ones with numpy. Both give identical answers (the same IEEE-754
# operations, the first best entry in row-major order).
PYTHON_TABLE = 1_024


def _groups(part: list[int], cost, size, max_items: int):
    """Every group of 0..max_items (1 or 2) items of ``part``: (members, cost sums, size sums, group sizes).

    ``members`` is an int array of shape [groups, 2] of item indices, -1 where a slot is unused. Groups come in a
    fixed order: the empty group, the single items, then the pairs (``np.triu_indices`` order).
    """
    items = np.asarray(part, dtype=np.int64)
    m = items.size
    i, j = pair_indices(m) if max_items >= 2 and m >= 2 else (_NONE, _NONE)
    members = np.empty((1 + m + i.size, 2), dtype=np.int64)
    members[0] = -1
    members[1:1 + m, 0], members[1:1 + m, 1] = items, -1
    members[1 + m:, 0], members[1 + m:, 1] = items[i], items[j]
    counts = np.concatenate([[0], np.ones(m, dtype=np.int64), np.full(i.size, 2, dtype=np.int64)])

    def total(values):  # the same IEEE sums as adding each group's members (x + y; a single item is itself)
        v = values[items]
        return np.concatenate([[0.0], v, v[i] + v[j]])

    return members, total(cost), (total(size) if size is not None else None), counts


_NONE = np.zeros(0, dtype=np.int64)


def _group_count(n: int) -> int:
    """Groups of 0, 1 or 2 items out of n."""
    return 1 + n + n * (n - 1) // 2


class _Refiner:
    """The state of one refinement: costs, optional size constraint, and the current parts."""

    def __init__(self, cost, size, capacity, parts, allow_moves, max_group):
        self.cost, self.size, self.capacity = cost, size, capacity
        self.parts = [sorted(int(i) for i in part) for part in parts]
        self.allow_moves, self.max_group = allow_moves, max_group
        self.memo: dict = {}
        self.group_memo: dict = {}
        self.py_group_memo: dict = {}
        self.sum_memo: dict = {}
        self.cost_list = cost.tolist()
        self.size_list = size.tolist() if size is not None else None
        self.tolerance = 1e-12 * max(math.fsum(cost), 1e-300)

    def sum_list(self):
        """Each part's exactly rounded cost sum as Python floats (memoised by content: a round changes two
        parts)."""
        memo = self.sum_memo
        out = []
        for part in self.parts:
            key = tuple(part)
            if key not in memo:
                memo[key] = math.fsum([self.cost_list[i] for i in part])
            out.append(memo[key])
        return out

    def sums(self):
        """:meth:`sum_list` as a float64 array."""
        return np.array(self.sum_list())

    def totals(self):
        if self.size is None:
            return None
        return np.array([math.fsum(self.size[part]) for part in self.parts])

    def best_exchange(self, p, q, gap, totals, max_items):
        """Best improving exchange from heavier part p to lighter part q: (new gap, give, take) or None.

        The answer depends only on the two parts' contents, and a round changes just two parts, so answers are
        memoised by content: the widest-pair scan then costs a dictionary look-up for almost every pair.
        """
        key = (tuple(self.parts[p]), tuple(self.parts[q]), max_items)
        if key not in self.memo:
            self.memo[key] = self._best_exchange(p, q, gap, totals, max_items)
        return self.memo[key]

    def groups(self, p, max_items):
        key = (tuple(self.parts[p]), max_items)
        if key not in self.group_memo:
            self.group_memo[key] = _groups(self.parts[p], self.cost, self.size, max_items)
        return self.group_memo[key]

    def py_groups(self, p, max_items):
        """:func:`_groups` as a list of (members, cost, size, count) tuples of Python numbers, the same order."""
        key = (tuple(self.parts[p]), max_items)
        if key not in self.py_group_memo:
            items = self.parts[p]
            cost, size = self.cost_list, self.size_list
            out = [((), 0.0, 0.0, 0)]
            out += [((i,), cost[i], size[i] if size is not None else 0.0, 1) for i in items]
            if max_items >= 2:
                out += [((i, j), cost[i] + cost[j], size[i] + size[j] if size is not None else 0.0, 2)
                        for a, i in enumerate(items) for j in items[a + 1:]]
            self.py_group_memo[key] = out
        return self.py_group_memo[key]

    def _best_exchange_python(self, p, q, gap, totals, max_items):
        """:meth:`_best_exchange` for small tables, in plain Python: the same answer. Entries with ``x - y`` outside
        ``(0, gap)`` are skipped before the arithmetic: they cannot narrow the pair (``|gap - 2 (x - y)| >= gap``,
        also after rounding), so the numpy table rejects them too."""
        give, take = self.py_groups(p, max_items), self.py_groups(q, max_items)
        gap = float(gap)
        limit = gap - self.tolerance
        capacity, moves = self.capacity, self.allow_moves
        if capacity is not None:
            total_p, total_q = float(totals[p]), float(totals[q])
        best, found = math.inf, None
        for g in give:
            g_cost = g[1]
            for t in take:
                delta = g_cost - t[1]
                if delta <= 0 or delta >= gap:
                    continue
                new_gap = abs(gap - 2.0 * delta)
                if not (new_gap < limit and new_gap < best):
                    continue
                if not moves and g[3] != t[3]:
                    continue
                if capacity is not None:
                    moved = g[2] - t[2]
                    if not (total_p - moved <= capacity and total_q + moved <= capacity):
                        continue
                best, found = new_gap, (g[0], t[0])
        if found is None:
            return None
        return best, list(found[0]), list(found[1])

    def _best_exchange(self, p, q, gap, totals, max_items):
        if max_items > 1 and _group_count(len(self.parts[p])) * _group_count(len(self.parts[q])) > MAX_PAIR_TABLE:
            return None  # too many 2-item groups to tabulate; single-item exchanges already did their best here
        m_p, m_q = len(self.parts[p]), len(self.parts[q])
        groups_p = 1 + m_p + (m_p * (m_p - 1) // 2 if max_items > 1 else 0)
        groups_q = 1 + m_q + (m_q * (m_q - 1) // 2 if max_items > 1 else 0)
        if groups_p * groups_q <= PYTHON_TABLE:
            return self._best_exchange_python(p, q, gap, totals, max_items)
        give, give_cost, give_size, give_count = self.groups(p, max_items)
        take, take_cost, take_size, take_count = self.groups(q, max_items)
        delta = give_cost[:, None] - take_cost[None, :]
        new_gap = np.abs(gap - 2.0 * delta)
        ok = (delta > 0) & (new_gap < gap - self.tolerance)
        if not self.allow_moves:
            ok &= give_count[:, None] == take_count[None, :]
        if self.capacity is not None:
            moved = give_size[:, None] - take_size[None, :]
            ok &= (totals[p] - moved <= self.capacity) & (totals[q] + moved <= self.capacity)
        if not ok.any():
            return None
        flat = int(np.argmin(np.where(ok, new_gap, np.inf)))
        i, j = divmod(flat, len(take))
        return float(new_gap[i, j]), [int(m) for m in give[i] if m >= 0], [int(m) for m in take[j] if m >= 0]

    def next_exchange(self, max_items):
        """(p, q, give, take) for the next improving exchange with groups of <= max_items, or None."""
        sums, totals = self.sum_list(), self.totals()  # Python floats: the same IEEE-754 arithmetic as float64
        order = sorted(range(len(self.parts)), key=lambda p: (-sums[p], p))
        heaviest = order[0]
        best = None
        for q in reversed(order[1:]):
            gap = sums[heaviest] - sums[q]
            if gap <= self.tolerance:
                continue
            found = self.best_exchange(heaviest, q, gap, totals, max_items)
            if found is not None:
                new_max = (sums[heaviest] + sums[q] + found[0]) / 2.0
                if best is None or new_max < best[0]:
                    best = (new_max, heaviest, q, found[1], found[2])
        if best is not None:
            return best[1:]
        pairs = [(p, q) for a, p in enumerate(order[1:], 1) for q in order[a + 1 :]]
        pairs.sort(key=lambda pq: (-(sums[pq[0]] - sums[pq[1]]), pq))
        for p, q in pairs:
            gap = sums[p] - sums[q]
            if gap <= self.tolerance:
                break
            found = self.best_exchange(p, q, gap, totals, max_items)
            if found is not None:
                return p, q, found[1], found[2]
        return None

    def apply(self, p, q, give, take):
        self.parts[p] = sorted([i for i in self.parts[p] if i not in give] + list(take))
        self.parts[q] = sorted([i for i in self.parts[q] if i not in take] + list(give))


def refine_by_swaps(
    costs,
    parts: list[list[int]],
    *,
    allow_moves: bool = True,
    sizes=None,
    capacity: float | None = None,
    max_group: int = 2,
    max_rounds: int | None = None,
) -> list[list[int]]:
    """Improve ``parts`` (lists of indices into ``costs``) by exchanging small groups of items between two parts.

    Args:
      costs: per-item cost (what is balanced).
      parts: the starting partition; every index must appear exactly once. Not modified.
      allow_moves: allow exchanges of unequal group sizes (a plain move is 1-for-0); ``False`` keeps every part's
        item count.
      sizes, capacity: if given, every exchange keeps each part's total ``sizes`` within ``capacity``.
      max_group: the largest group handed over from one side in one exchange: 1 (moves and swaps only) or 2.
      max_rounds: upper bound on accepted exchanges (default ``10 * len(costs) + 100``).

    Returns the refined partition, each part's indices ascending, in the same part order as given.
    """
    cost = costs_array(costs)
    check_partition(parts, cost.size)
    if (sizes is None) != (capacity is None):
        raise ValueError("sizes and capacity must be given together")
    size = costs_array(sizes, "sizes") if sizes is not None else None
    if size is not None and size.shape != cost.shape:
        raise ValueError(f"sizes has {size.size} entries for {cost.size} costs")
    if max_group not in (1, 2) or isinstance(max_group, bool):
        raise ValueError(f"max_group must be 1 or 2, got {max_group!r}")
    rounds = 10 * cost.size + 100 if max_rounds is None else max_rounds
    native = _native.module()
    if native is not None:  # the same loop compiled: the same exchanges, the same answer
        return native.balance_refine(cost.tolist(), size.tolist() if size is not None else [], capacity is not None,
                                     float(capacity) if capacity is not None else 0.0,
                                     [[int(i) for i in part] for part in parts], bool(allow_moves), max_group,
                                     int(rounds), MAX_PAIR_TABLE, LOWER_BOUND_TOLERANCE)
    refiner = _Refiner(cost, size, capacity, parts, allow_moves, max_group)
    lower_bound = max(float(cost.max(initial=0.0)), math.fsum(cost) / max(len(parts), 1))
    for _ in range(rounds):
        if refiner.sums().max(initial=0.0) <= lower_bound * (1.0 + LOWER_BOUND_TOLERANCE):
            break  # nothing can lower the heaviest part further
        step = None
        for max_items in range(1, max_group + 1):  # cheap single-item exchanges first
            step = refiner.next_exchange(max_items)
            if step is not None:
                break
        if step is None:
            break
        refiner.apply(*step)
    return refiner.parts
