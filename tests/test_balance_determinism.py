"""The plan must be identical on every host: every sum that steers a planning decision is added in a fixed order.

A BLAS matrix product (``@``, ``np.dot``, ``np.matmul``, ``einsum``) picks its own summation order (blocking, SIMD
lanes, fused multiply-adds, threads), which differs between BLAS builds and CPUs, so the re-splits' subset sums used
to depend on the host. Here: no planner module uses one, and the re-splits and fills equal pure-Python references
that add in the documented order, on instances where the order changes the rounding and the rounding changes the
decision."""
import ast
import itertools
import math
import pathlib

import numpy as np
import pytest

from jodc.balance import _native
from jodc.balance.descent import BOUND_TOLERANCE, RESPLIT_ITEMS, resplit_heaviest, subset_sums
from jodc.balance.fill import _table, fill_parts

BALANCE = pathlib.Path(__file__).resolve().parent.parent / "jodc" / "balance"
BLAS_CALLS = {"dot", "matmul", "einsum", "inner", "tensordot", "vdot", "lstsq", "solve", "multi_dot"}
# QuadraticCost.fit calibrates a cost model from measured step times (least squares, through LAPACK): it runs
# before planning, once, and its coefficients are what every host then plans with; it decides nothing in a plan.
CALIBRATION = {("cost.py", "fit")}


def _blas_uses(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    skipped = {id(node) for func in ast.walk(tree) if isinstance(func, ast.FunctionDef)
               and (path.name, func.name) in CALIBRATION for node in ast.walk(func)}
    for node in ast.walk(tree):
        if id(node) not in skipped:
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
                yield f"{path.name}:{node.lineno} uses @"
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in BLAS_CALLS:
                    yield f"{path.name}:{node.lineno} calls {name}"


def test_no_planner_module_sums_through_blas():
    uses = [use for path in sorted(BALANCE.glob("*.py")) for use in _blas_uses(path)]
    assert not uses, uses


def adversarial_costs(rng, n):
    """Costs near 2^53 (spacing 2) mixed with odd small ones: adding the small ones one at a time or together rounds
    differently, and many subsets tie exactly."""
    big = 2.0 ** 53 + 2.0 * rng.integers(0, 4, size=n)
    small = rng.choice([1.0, 3.0, 0.5, 1.5], size=n)
    return np.where(rng.random(n) < 0.5, big, small * 2.0 ** 51)


def test_subset_sums_add_bit_by_bit_from_zero():
    rng = np.random.default_rng(0)
    values = np.stack([adversarial_costs(rng, 9), rng.random(9) * 10.0 ** rng.integers(-8, 17, size=9)])
    sums = subset_sums(values)
    order_matters = False
    for row in range(values.shape[0]):
        for s in range(1 << values.shape[1]):
            total = 0.0
            for j in range(values.shape[1]):
                if s >> j & 1:
                    total += float(values[row, j])
            assert sums[row, s] == total, (row, s)
            order_matters |= total != math.fsum(values[row, j] for j in range(values.shape[1]) if s >> j & 1)
    assert order_matters  # the instances are adversarial: another order gives other sums


def reference_resplit(cost, assign, k, rounds, bound, equal_counts=False):
    """resplit_heaviest in plain Python: every subset of the heaviest part's and another part's items (the
    heaviest part's first, each part's ascending), its side summed item by item from 0.0; the first lightest
    heavier side wins (parts ascending, subsets by their bit pattern)."""
    cost = [float(c) for c in cost]
    assign = [int(a) for a in assign]
    n = len(cost)
    tol = 1e-12 * max(math.fsum(cost), 1e-300)
    sums = [0.0] * k
    for i, a in enumerate(assign):
        sums[a] += cost[i]
    for _ in range(rounds):
        p = max(range(k), key=lambda q: (sums[q], -q))
        top = sums[p]
        if top <= bound * (1.0 + BOUND_TOLERANCE) + tol:
            break
        counts = [assign.count(q) for q in range(k)]
        best = None
        for q in range(k):
            if q == p or counts[p] + counts[q] > RESPLIT_ITEMS:
                continue
            members = [i for i in range(n) if assign[i] == p] + [i for i in range(n) if assign[i] == q]
            pair = sums[p] + sums[q]
            for s in range(1 << len(members)):
                side = 0.0
                for j, i in enumerate(members):
                    if s >> j & 1:
                        side += cost[i]
                if equal_counts and bin(s).count("1") not in (counts[p], counts[q]):
                    continue
                heavier = max(side, pair - side)
                if best is None or heavier < best[0]:
                    best = (heavier, q, members, s)
        if best is None or not best[0] < top - tol:
            break
        _, q, members, s = best
        chosen = [i for j, i in enumerate(members) if s >> j & 1]
        rest = [i for j, i in enumerate(members) if not s >> j & 1]
        for i in chosen:
            assign[i] = p
        for i in rest:
            assign[i] = q
        sums[p] = math.fsum(cost[i] for i in chosen)
        sums[q] = math.fsum(cost[i] for i in rest)
    return assign


def resplit_instances(seed, count):
    rng = np.random.default_rng(seed)
    for r in range(count):
        k = int(rng.integers(2, 5))
        n = int(rng.integers(k + 1, 11))
        cost = adversarial_costs(rng, n) if r % 3 else rng.integers(1, 9, size=n).astype(np.float64)
        if r % 2:  # equal counts need sizes within one
            assign = np.arange(n) % k
        else:
            assign = rng.integers(0, k, size=n)
        yield r, cost, assign, k


@pytest.mark.parametrize("native", [False, True])
def test_resplit_matches_the_fixed_order_reference(native):
    if native and _native.module() is None:
        pytest.skip("jodc._ffi without the balance loops")
    was = _native.set_enabled(native)
    try:
        for r, cost, assign, k in resplit_instances(5, 120):
            equal = r % 2 == 1
            bound = 0.0 if r % 4 < 2 else float(np.bincount(assign, weights=cost, minlength=k).max()) * 0.9
            got = resplit_heaviest(cost, assign, k, max_rounds=5, bound=bound, equal_counts=equal)
            assert got.tolist() == reference_resplit(cost, assign, k, 5, bound, equal), r
    finally:
        _native.set_enabled(was)


def reference_fill(cost, k, target, max_others):
    """fill_parts in plain Python: each part opens with the heaviest remaining item and takes the first subset (by
    size, then lexicographically) of at most the table's size of the remaining items that fit whose sum, added item
    by item, comes closest to the target from below."""
    cost = [float(c) for c in cost]
    n = len(cost)
    remaining = sorted(range(n), key=lambda i: (-cost[i], i))
    assign = [k - 1] * n
    for part in range(k - 1):
        if not remaining:
            break
        first = remaining[0]
        assign[first] = part
        room = target - cost[first]
        others = [i for i in remaining[1:] if cost[i] <= room]
        if others:
            size = _table(len(others), max_others).shape[1]
            best, best_sum = (), -1.0
            for r in range(size + 1):
                for combo in itertools.combinations(range(len(others)), r):
                    total = 0.0
                    for c in combo:
                        total += cost[others[c]]
                    if total <= room and total > best_sum:
                        best, best_sum = combo, total
            for c in best:
                assign[others[c]] = part
        remaining = [i for i in remaining[1:] if assign[i] == k - 1]
    return assign


@pytest.mark.parametrize("native", [False, True])
def test_fill_matches_the_fixed_order_reference(native):
    if native and _native.module() is None:
        pytest.skip("jodc._ffi without the balance loops")
    was = _native.set_enabled(native)
    rng = np.random.default_rng(7)
    try:
        for r in range(80):
            k = int(rng.integers(2, 6))
            n = int(rng.integers(k, 5 * k + 1))
            cost = adversarial_costs(rng, n) if r % 2 else rng.integers(1, 20, size=n).astype(np.float64)
            target = math.fsum(cost) / k * (1.0 + [0.0, 1e-4, 1e-3, 0.05][r % 4])
            got = fill_parts(cost, k, target, max_others=4)
            assert got.tolist() == reference_fill(cost, k, target, 4), r
    finally:
        _native.set_enabled(was)
