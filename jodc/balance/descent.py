"""Fast makespan descent for the free partition (part sizes may differ): vectorised moves, swaps and chains.

The state is an assignment (item -> part) and the part sums, updated incrementally (one subtraction and one addition
per moved item, in a fixed order, so every IEEE-754 host computes the same sums). Each round looks only at the
heaviest part ``p`` (sum ``S_p``) and applies the exchange that lowers it most while leaving every part it touches
strictly below ``S_p``; the sorted vector of part sums then falls lexicographically, so the descent ends. The
exchanges, each evaluated for all candidates at once with numpy:

* move: one item of ``p`` to the lightest part;
* swap: an item of ``p`` for a lighter item of any other part ``q`` (with more than ``PARTNER_PARTS`` parts, of
  one of the ``PARTNER_PARTS`` lightest: only they have the headroom to take much, which keeps a round's cost
  independent of the instance size);
* 2-for-1 and 1-for-2 exchanges between ``p`` and any ``q`` (instances of at most ``SMALL_ITEMS`` items);
* ejection chain: an item of ``p`` to ``q`` while an item of ``q`` goes on to the lightest third part ``r``
  (the multi-part rearrangement that pairwise exchanges cannot make);
* chain swap: an item of ``p`` to ``q``, one of ``q`` to ``r``, one of ``r`` back to ``p`` (small instances).

The descent stops as soon as ``S_p`` reaches the lower bound ``max(largest item, total / k)`` (within a relative
``1e-9``) or after ``max_rounds`` rounds: work is bounded by counts, never by time.
"""
from __future__ import annotations

import math

import numpy as np

from jodc.balance import _native

# Instances up to this many items also try 2-item exchanges and 3-cycles (their candidate tables grow as n^2).
SMALL_ITEMS = 160
# With more parts than this, exchanges look only at the items of the this many lightest parts (per round cost
# O(items of p x items of those parts), independent of the instance size).
PARTNER_PARTS = 32
BOUND_TOLERANCE = 1e-4  # 0.01%: far below any measurable difference in step time


def lower_bound(cost: np.ndarray, k: int) -> float:
    """``max(largest item, total / k)``: no partition into ``k`` parts has a lighter heaviest part."""
    if cost.size == 0:
        return 0.0
    return max(float(cost.max()), math.fsum(cost) / k)  # fsum: exactly rounded, the same on every host


def equal_count_bound(cost: np.ndarray, k: int) -> float:
    """The lower bound for partitions whose part sizes differ by at most one (lock-step engines): at least
    ``total / k``, and the part holding the costliest item holds at least ``floor(n / k) - 1`` others, at least the
    cheapest ones."""
    if cost.size == 0:
        return 0.0
    ordered = np.sort(cost)
    others = max(cost.size // k - 1, 0)
    return max(math.fsum(cost) / k, math.fsum([float(ordered[-1]), *ordered[:others].tolist()]))


def _best(values: np.ndarray):
    """(value, flat index) of the smallest entry; the first one wins ties (deterministic)."""
    flat = int(np.argmin(values))
    return float(values.flat[flat]), flat


def _prepare(cost, assign, k: int, bound: float | None):
    """(cost as float64, a fresh int64 copy of assign, the bound, the absolute tolerance), or None when there is
    nothing to do (no items or one part)."""
    cost = np.asarray(cost, dtype=np.float64)
    assign = np.array(assign, dtype=np.int64)
    if cost.size == 0 or k < 2:
        return None
    bound = lower_bound(cost, k) if bound is None else bound
    return cost, assign, bound, 1e-12 * max(math.fsum(cost), 1e-300)


def descend(cost: np.ndarray, assign: np.ndarray, k: int, *, max_rounds: int, bound: float | None = None,
            small: bool | None = None, equal_counts: bool = False) -> np.ndarray:
    """Lower the heaviest part of the assignment ``assign`` (int array, item -> part) by the exchanges above.

    With ``equal_counts`` (part sizes within one of each other, as ``assign``'s must be) only exchanges that keep
    the multiset of part sizes apply: swaps, 3-cycles and 2-for-2 exchanges always; a move, a chain or a 2-for-1
    only from a part holding one item more than the receiving part. Returns a new assignment whose heaviest part is
    no heavier (strictly lighter, if any exchange applied)."""
    prepared = _prepare(cost, assign, k, bound)
    if prepared is None:
        return np.array(assign, dtype=np.int64)
    cost, assign, bound, tol = prepared
    n = cost.size
    small = n <= SMALL_ITEMS if small is None else small
    native = _native.descend_module()
    if native is not None:  # the same loop compiled: the same exchanges, the same answer
        return np.array(native.balance_descend(cost.tolist(), assign.tolist(), k, int(max_rounds), float(bound),
                                               tol, bool(small), bool(equal_counts), BOUND_TOLERANCE,
                                               PARTNER_PARTS), dtype=np.int64)
    sums = np.bincount(assign, weights=cost, minlength=k).astype(np.float64)
    counts = np.bincount(assign, minlength=k) if equal_counts else None
    ids = np.arange(n)
    for _ in range(max_rounds):
        p = int(np.argmax(sums))
        top = float(sums[p])
        if top <= bound * (1.0 + BOUND_TOLERANCE) + tol:
            break
        limit = top - tol
        mine = ids[assign == p]
        cp = cost[mine]
        light = np.argsort(sums, kind="stable")
        light = light[light != p]
        if k - 1 > PARTNER_PARTS:  # many parts: only the lightest have the headroom to take much from p
            partner = np.zeros(k, dtype=bool)
            partner[light[:PARTNER_PARTS]] = True
            rest = ids[partner[assign]]
        else:
            rest = ids[assign != p]
        cr = cost[rest]
        qr = assign[rest]
        sq = sums[qr]
        if equal_counts:  # moves and chains may only end in a part holding one item fewer than p
            light = light[counts[light] == counts[p] - 1]
        l1 = int(light[0]) if light.size else -1
        l2 = int(light[1]) if light.size > 1 else l1
        options = []  # (new heaviest of the touched parts, kind, payload)
        # move: item of p to the lightest part
        if l1 >= 0:
            value, i = _best(np.maximum(top - cp, sums[l1] + cp))
            options.append((value, 0, (mine[i], l1)))
        if rest.size:
            # swap: item of p for an item of q
            d = cp[:, None] - cr[None, :]
            table = np.where(d > 0, np.maximum(top - d, sq[None, :] + d), np.inf)
            value, flat = _best(table)
            i, j = divmod(flat, rest.size)
            options.append((value, 1, (mine[i], rest[j])))
            # ejection chain: item of p to q (holding j), j on to r, the lightest part other than p and q
            if k >= 3 and l1 >= 0:
                r = np.where(qr == l1, l2, l1)
                table = np.maximum(np.maximum(top - cp[:, None], sq[None, :] + cp[:, None] - cr[None, :]),
                                   np.where(r == qr, np.inf, sums[r])[None, :] + cr[None, :])
                value, flat = _best(table)
                i, j = divmod(flat, rest.size)
                options.append((value, 2, (mine[i], rest[j], int(r[j]))))
        if small and rest.size:
            options.extend(_small_exchanges(cost, assign, sums, p, top, mine, cp, rest, cr, qr, sq,
                                            counts[qr] - counts[p] if equal_counts else None))
        if not options:
            break
        value, kind, payload = min(options, key=lambda o: (o[0], o[1]))
        if not value < limit:
            break
        moves = _moves(kind, payload, assign, p)
        for item, target in moves:  # fixed order: the same sums on every host
            sums[assign[item]] -= cost[item]
            sums[target] += cost[item]
            if equal_counts:
                counts[assign[item]] -= 1
                counts[target] += 1
        for item, target in moves:
            assign[item] = target
    return assign


def _moves(kind, payload, assign, p):
    """The (item, new part) pairs of an exchange."""
    if kind == 0:
        i, q = payload
        return [(int(i), int(q))]
    if kind == 1:
        i, j = payload
        return [(int(i), int(assign[j])), (int(j), p)]
    if kind == 2:
        i, j, r = payload
        return [(int(i), int(assign[j])), (int(j), int(r))]
    if kind == 3:  # 2-for-1: items i1, i2 of p for j of q
        i1, i2, j = payload
        q = int(assign[j])
        return [(int(i1), q), (int(i2), q), (int(j), p)]
    if kind == 4:  # 1-for-2: item i of p for j1, j2 of q
        i, j1, j2 = payload
        return [(int(i), int(assign[j1])), (int(j1), p), (int(j2), p)]
    if kind == 6:  # 2-for-2: items i1, i2 of p for j1, j2 of q
        i1, i2, j1, j2 = payload
        q = int(assign[j1])
        return [(int(i1), q), (int(i2), q), (int(j1), p), (int(j2), p)]
    i, j, l = payload  # kind 5, 3-cycle: i p->q, j q->r, l r->p
    return [(int(i), int(assign[j])), (int(j), int(assign[l])), (int(l), p)]


_PAIRS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def pair_indices(m: int) -> tuple[np.ndarray, np.ndarray]:
    """``np.triu_indices(m, 1)``, cached (descents ask for the same few sizes thousands of times)."""
    if m not in _PAIRS:
        _PAIRS[m] = np.triu_indices(m, 1)
    return _PAIRS[m]


def _small_exchanges(cost, assign, sums, p, top, mine, cp, rest, cr, qr, sq, count_gap=None):
    """2-for-1, 1-for-2 and 3-cycle candidates (small instances only): a list of options as in :func:`descend`.

    ``count_gap`` (equal counts only): per item of ``rest``, its part's size minus ``p``'s; then 2-for-1 goes only to
    parts one item smaller, 1-for-2 only from parts one item larger, and 2-for-2 exchanges are tried too."""
    options = []
    m = mine.size
    if m >= 2:
        a, b = pair_indices(m)
        pair = cp[a] + cp[b]
        d = pair[:, None] - cr[None, :]
        ok = d > 0 if count_gap is None else (d > 0) & (count_gap == -1)[None, :]
        table = np.where(ok, np.maximum(top - d, sq[None, :] + d), np.inf)
        value, flat = _best(table)
        g, j = divmod(flat, rest.size)
        options.append((value, 3, (mine[a[g]], mine[b[g]], rest[j])))
    if rest.size >= 2:
        a, b = pair_indices(rest.size)
        same = qr[a] == qr[b]
        a, b = a[same], b[same]
        if a.size:
            pair = cr[a] + cr[b]
            d = cp[:, None] - pair[None, :]
            ok = d > 0 if count_gap is None else (d > 0) & (count_gap[a] == 1)[None, :]
            table = np.where(ok, np.maximum(top - d, sq[a][None, :] + d), np.inf)
            value, flat = _best(table)
            i, g = divmod(flat, a.size)
            options.append((value, 4, (mine[i], rest[a[g]], rest[b[g]])))
            if count_gap is not None and m >= 2:  # 2-for-2
                pa, pb = pair_indices(m)
                d = (cp[pa] + cp[pb])[:, None] - pair[None, :]
                table = np.where(d > 0, np.maximum(top - d, sq[a][None, :] + d), np.inf)
                value, flat = _best(table)
                g, h = divmod(flat, a.size)
                options.append((value, 6, (mine[pa[g]], mine[pb[g]], rest[a[h]], rest[b[h]])))
        # 3-cycle i (p -> q), j (q -> r), l (r -> p), q != r
        j_idx, l_idx = np.nonzero(qr[:, None] != qr[None, :])
        if j_idx.size:
            cj, cl = cr[j_idx], cr[l_idx]
            new_q = sq[j_idx][None, :] + cp[:, None] - cj[None, :]
            new_r = (sq[l_idx] + cj - cl)[None, :]
            new_p = top - cp[:, None] + cl[None, :]
            table = np.maximum(np.maximum(new_p, new_q), new_r)
            value, flat = _best(table)
            i, g = divmod(flat, j_idx.size)
            options.append((value, 5, (mine[i], rest[j_idx[g]], rest[l_idx[g]])))
    return options


def balance_pairs(cost: np.ndarray, assign: np.ndarray, k: int, *, max_passes: int,
                  bound: float | None = None, equal_counts: bool = False) -> np.ndarray:
    """Pair the parts heaviest with lightest (1st with k-th, 2nd with (k-1)-th, ...) and, in every pair at once,
    apply the move or swap that narrows the pair's gap most; repeat while some pair narrows, at most ``max_passes``
    times or until the heaviest part is within ``BOUND_TOLERANCE`` of ``bound``.

    Vectorised over all pairs (one [pairs, slots, slots] table per pass), so a pass costs a few numpy calls whatever
    the part count: the large-instance fast path, before :func:`descend` polishes the heaviest part. Parts are rows
    of a slot table padded with empty slots (cost 0): swapping an item for an empty slot is a move. Part sums are
    updated by one subtraction and one addition per pair, in a fixed order (identical on every host). With
    ``equal_counts`` a move applies only from a part holding one item more than the receiving part."""
    prepared = _prepare(cost, assign, k, bound)
    if prepared is None:
        return np.array(assign, dtype=np.int64)
    cost, assign, bound, tol = prepared
    n = cost.size
    order = np.argsort(assign, kind="stable")
    counts = np.bincount(assign, minlength=k)
    width = int(counts.max()) + 1
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    slots = np.full((k, width), -1, dtype=np.int64)
    rank = np.arange(n) - np.repeat(starts, counts)
    slots[assign[order], rank] = order
    values = np.where(slots >= 0, cost[np.maximum(slots, 0)], 0.0)
    sums = np.bincount(assign, weights=cost, minlength=k).astype(np.float64)
    counts = counts.copy()
    half = k // 2
    rows = np.arange(half)
    for _ in range(max_passes):
        if float(sums.max()) <= bound * (1.0 + BOUND_TOLERANCE) + tol:
            break
        if not (slots < 0).any(axis=1).all():  # every part keeps an empty slot, so any part can take a move
            slots = np.concatenate([slots, np.full((k, 1), -1, dtype=np.int64)], axis=1)
            values = np.concatenate([values, np.zeros((k, 1))], axis=1)
            width += 1
        by_load = np.argsort(-sums, kind="stable")
        heavy, light = by_load[:half], by_load[::-1][:half]
        gap = sums[heavy] - sums[light]
        d = values[heavy][:, :, None] - values[light][:, None, :]
        ok = (d > tol) & (d < gap[:, None, None] - tol)
        if equal_counts:  # swaps between two items, or moves from a part one item larger
            filled_l = slots[light] >= 0
            movable = (counts[heavy] == counts[light] + 1)[:, None, None]
            ok &= filled_l[:, None, :] | movable
        new_gap = np.where(ok, np.abs(gap[:, None, None] - 2.0 * d), np.inf)
        flat = np.argmin(new_gap.reshape(half, -1), axis=1)
        ok = new_gap.reshape(half, -1)[rows, flat] < gap - tol
        if not ok.any():
            break
        h, l, f = heavy[ok], light[ok], flat[ok]
        i, j = np.divmod(f, width)
        moved = d[rows[ok], i, j]
        sums[h] -= moved
        sums[l] += moved
        item_h, item_l = slots[h, i].copy(), slots[l, j].copy()
        if equal_counts:
            shift = (item_l < 0).astype(np.int64)
            counts[h] -= shift
            counts[l] += shift
        slots[h, i], slots[l, j] = item_l, item_h
        values[h, i], values[l, j] = values[l, j].copy(), values[h, i].copy()
    out = np.empty(n, dtype=np.int64)
    part, slot = np.nonzero(slots >= 0)
    out[slots[part, slot]] = part
    return out


# Pair re-splits enumerate every subset of the two parts' items: at most this many items together (2^14 subsets).
RESPLIT_ITEMS = 14
def subset_sums(values: np.ndarray) -> np.ndarray:
    """float64 [rows, 2^u] for ``values`` [rows, u]: entry ``s`` of a row is the sum of the row's values at the set
    bits of ``s``, added in a fixed order (from 0.0, bit 0 first, each further bit added last), so the same on every
    host: ``s`` with highest bit ``j`` is ``(s without bit j) + values[j]``, one elementwise addition per bit. A
    matrix product with a 0/1 mask table would compute the same sums, but BLAS builds choose their own summation
    order (blocking, SIMD lanes, fused multiply-adds), so the plan could differ between hosts."""
    values = np.asarray(values, dtype=np.float64)
    rows, u = values.shape
    out = np.zeros((rows, 1 << u), dtype=np.float64)
    for j in range(u):
        width = 1 << j
        np.add(out[:, :width], values[:, j:j + 1], out=out[:, width:2 * width])
    return out


def resplit_heaviest(cost: np.ndarray, assign: np.ndarray, k: int, *, max_rounds: int,
                     bound: float | None = None, equal_counts: bool = False) -> np.ndarray:
    """Lower the heaviest part by re-splitting it optimally with one other part: for every other part ``q`` every
    subset of the two parts' items (together at most ``RESPLIT_ITEMS``) is a candidate new heaviest side, and the
    split with the lightest heavier side over all ``q`` is applied; repeated at most ``max_rounds`` times, while the
    heaviest part falls, or until the bound. Contains every move, swap and group exchange between two parts. With
    ``equal_counts`` only splits that keep the two parts' sizes (in either order) are candidates."""
    prepared = _prepare(cost, assign, k, bound)
    if prepared is None:
        return np.array(assign, dtype=np.int64)
    cost, assign, bound, tol = prepared
    native = _native.op("balance_resplit")
    if native is not None:  # the same re-splits compiled: the same answer
        return np.array(native.balance_resplit(cost.tolist(), assign.tolist(), k, int(max_rounds), float(bound), tol,
                                               bool(equal_counts), BOUND_TOLERANCE, RESPLIT_ITEMS), dtype=np.int64)
    sums = np.bincount(assign, weights=cost, minlength=k).astype(np.float64)
    for _ in range(max_rounds):
        p = int(np.argmax(sums))
        top = float(sums[p])
        if top <= bound * (1.0 + BOUND_TOLERANCE) + tol:
            break
        counts = np.bincount(assign, minlength=k)
        others = [q for q in range(k) if q != p and counts[p] + counts[q] <= RESPLIT_ITEMS]
        if not others:
            break
        u = int(max(counts[p] + counts[q] for q in others))
        members = np.full((len(others), u), -1, dtype=np.int64)
        mine = np.flatnonzero(assign == p)
        for row, q in enumerate(others):
            union = np.concatenate([mine, np.flatnonzero(assign == q)])
            members[row, :union.size] = union
        values = np.where(members >= 0, cost[np.maximum(members, 0)], 0.0)
        side = subset_sums(values)  # [others, subsets]: cost of the side that keeps the subset (fixed order)
        pair = (sums[p] + sums[others])[:, None]
        heavier = np.maximum(side, pair - side)
        if equal_counts:  # the side keeping the subset must end with p's or q's size
            size = subset_sums((members >= 0).astype(np.float64))  # item counts (exact)
            keep = (size == counts[p]) | (size == counts[others][:, None])
            heavier = np.where(keep, heavier, np.inf)
        flat = int(np.argmin(heavier))
        row, subset = divmod(flat, heavier.shape[1])
        if not heavier[row, subset] < top - tol:
            break
        q = others[row]
        bits = ((subset >> np.arange(u)) & 1).astype(bool)
        chosen = members[row][bits & (members[row] >= 0)]
        rest = members[row][~bits & (members[row] >= 0)]
        assign[chosen], assign[rest] = p, q
        sums[p] = math.fsum(cost[chosen])
        sums[q] = math.fsum(cost[rest])
    return assign
