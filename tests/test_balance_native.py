"""The compiled refinement and search loops (jodc._ffi's balance_refine / balance_search, bound in
jodc/balance/_native.py) give exactly the partitions of the Python reference loops (jodc/balance/refine.py and
search.py), on random instances where ties are common and on golden-setting minibatches, and so do the planners
built on them."""
import functools
import math
import operator

import numpy as np
import pytest

from jodc.balance import (
    DEEPSEEK_R1_DISTILL_QWEN_1_5B,
    FlopsCost,
    get_planner,
    improve_by_search,
    karmarkar_karp,
    lpt,
    partition,
    refine_by_swaps,
)
from jodc.balance import _native
from jodc.sim import LONGALIGN_SFT

FLOPS = DEEPSEEK_R1_DISTILL_QWEN_1_5B.sequence_forward_flops

pytestmark = pytest.mark.skipif(_native.module() is None, reason="jodc._ffi without the balance loops")


def both(fn, *args, **kwargs):
    """(native result, Python result) of fn(*args, **kwargs)."""
    assert _native.set_enabled(True)
    try:
        native = fn(*args, **kwargs)
        _native.set_enabled(False)
        python = fn(*args, **kwargs)
    finally:
        _native.set_enabled(True)
    return native, python


def instances(seed, count):
    """(costs, sizes, k): small integer lengths (many ties), wide integer lengths and golden-like LongAlign lengths,
    as tokens or FLOPs."""
    rng = np.random.default_rng(seed)
    for r in range(count):
        kind = r % 3
        n = int(rng.integers(2, 41))
        if kind == 0:
            lengths = rng.integers(1, 13, size=n)
        elif kind == 1:
            lengths = rng.integers(1, 65537, size=n)
        else:
            lengths = np.asarray(LONGALIGN_SFT.sample(n, seed=seed * 1000 + r))
        costs = FLOPS(lengths) if r % 2 else lengths.astype(np.float64)
        yield costs, lengths.astype(np.float64), int(rng.integers(2, 9))


@pytest.mark.parametrize("seed", [1, 2])
def test_refinement_matches_the_python_loop(seed):
    for r, (costs, sizes, k) in enumerate(instances(seed, 100)):
        equal = r % 4 == 0
        start = karmarkar_karp(costs, k, equal_sizes=True) if equal else lpt(costs, k)
        kwargs = {"allow_moves": not equal, "max_group": 1 + (r % 5 != 1)}
        if r % 3 == 0:
            kwargs.update(sizes=sizes, capacity=float(max(sizes[p].sum() for p in start)))
        if r % 7 == 0:
            kwargs["max_rounds"] = int(r % 4)
        native, python = both(refine_by_swaps, costs, start, **kwargs)
        assert native == python, (seed, r, kwargs)


@pytest.mark.parametrize("seed", [3, 4])
def test_search_matches_the_python_loops(seed):
    for r, (costs, sizes, k) in enumerate(instances(seed, 100)):
        start = lpt(costs, k) if r % 2 else karmarkar_karp(costs, k, equal_sizes=True)
        kwargs = {"node_budget": [0, 1, 7, 50, 400, 3000][r % 6]}
        if r % 3 == 1:
            kwargs["equal_sizes"] = True
            start = karmarkar_karp(costs, k, equal_sizes=True)
        if r % 4 == 2:
            kwargs.update(sizes=sizes, capacity=float(max(sizes[p].sum() for p in start)))
        native, python = both(improve_by_search, costs, start, **kwargs)
        assert native == python, (seed, r, kwargs)


@pytest.mark.parametrize("seed", [5, 6])
def test_descent_matches_the_python_loop(seed):
    # free and equal counts, small exchanges on and off, round limits, a zero bound (never stops early), and more
    # than PARTNER_PARTS parts (exchanges only with the lightest parts)
    from jodc.balance.descent import PARTNER_PARTS, descend
    from jodc.balance.partition import _snake

    changed = 0
    for r, (costs, _, k) in enumerate(instances(seed, 100)):
        if r % 5 == 4:
            k = PARTNER_PARTS + 2 + r % 5
            costs = np.concatenate([costs] * 3)
        n = costs.size
        for equal in (False, True):
            start = _snake(costs, k) if equal else np.random.default_rng(r).integers(0, k, n)
            kwargs = {"max_rounds": [10 * n + 100, 3, 1][r % 3], "equal_counts": equal,
                      "small": [None, False, True][(r // 2) % 3]}
            if r % 4 == 1:
                kwargs["bound"] = 0.0
            native, python = both(descend, costs, start, k, **kwargs)
            assert np.array_equal(native, python), (seed, r, k, kwargs)
            changed += not np.array_equal(python, start)
    assert changed > 100  # the descents do move items


@pytest.mark.parametrize("seed", [8, 9])
def test_resplits_fills_and_the_small_stage_match_the_python_loops(seed):
    # the small-instance step of the free partition (re-splits, fills toward targets, descents) compiled as separate
    # ops and as one call (balance_small_stage), from the fast path's start as _free_partition runs it
    from jodc.balance.descent import lower_bound, resplit_heaviest
    from jodc.balance.fill import fill_parts
    from jodc.balance.partition import FILL_OTHERS, FILL_STEPS, RESPLIT_ROUNDS, _fast_path, _resplit_and_fill

    moved = reached = 0
    for r, (costs, _, k) in enumerate(instances(seed, 60)):
        n = costs.size
        bound = lower_bound(costs, k)
        for step in (0.0, *FILL_STEPS[::2]):
            native, python = both(fill_parts, costs, k, bound * (1.0 + step), max_others=FILL_OTHERS - r % 3)
            assert np.array_equal(native, python), (seed, r, step)
        start = np.random.default_rng(r).integers(0, k, n)
        for equal in (False, True):
            if equal:
                start = np.arange(n) % k
            kwargs = {"max_rounds": [RESPLIT_ROUNDS, 1, 20][r % 3], "equal_counts": equal,
                      "bound": [None, 0.0][r % 2]}
            native, python = both(resplit_heaviest, costs, start, k, **kwargs)
            assert np.array_equal(native, python), (seed, r, kwargs)
            moved += not np.array_equal(python, start)
        _, best, _, bound = _fast_path(costs, k, equal=False)
        steps = FILL_STEPS if r % 4 else FILL_STEPS[:2]
        target = bound * (1.0 + [1e-4, 0.0][r % 2])  # 0.0: never reached early, every fill runs
        native, python = both(_resplit_and_fill, costs, k, best, bound, target, 10 * n + 100, steps)
        assert np.array_equal(native[0], python[0]) and native[1] == python[1], (seed, r)
        reached += python[1]
    assert moved > 30 and 0 < reached < 60  # the re-splits move items; some instances reach the target, some not


def test_small_stage_without_the_compiled_descent_runs_the_loop_over_the_compiled_steps(monkeypatch):
    # JODC_BALANCE_NATIVE_DESCENT=0: the Python loop with the compiled re-splits and fills, the same answer
    from jodc.balance.partition import FILL_STEPS, _fast_path, _resplit_and_fill

    for r in range(12):
        costs = FLOPS(np.asarray(LONGALIGN_SFT.sample(32, seed=7919 * 8 + r)))
        _, best, _, bound = _fast_path(costs, 8, equal=False)
        args = (costs, 8, best, bound, bound * (1.0 + 1e-4), 420, FILL_STEPS)
        whole = _resplit_and_fill(*args)
        monkeypatch.setattr(_native, "_descend_enabled", False)
        assert _native.descend_module() is None and _native.op("balance_resplit") is not None
        loop = _resplit_and_fill(*args)
        monkeypatch.setattr(_native, "_descend_enabled", True)
        assert np.array_equal(whole[0], loop[0]) and whole[1] == loop[1], r


def test_compiled_balance_ops_reject_bad_assignments():
    lib = _native.module()
    with pytest.raises(ValueError, match="balance_resplit: part 3 outside"):
        lib.balance_resplit([1.0, 2.0], [0, 3], 2, 5, 0.0, 0.0, False, 1e-4, 14)
    with pytest.raises(ValueError, match="balance_small_stage: assign has 1 entries for 2 costs"):
        lib.balance_small_stage([1.0, 2.0], [0], 2, [], 0.0, 0.0, 0.0, 1, True, 1e-4, 32, 5, 14, 4, 6000)
    with pytest.raises(ValueError, match="balance_fill: k must be >= 1"):
        lib.balance_fill([1.0], 0, 1.0, 4, 6000)
    # the re-split holds 2^resplit_items subset sums: more than 24 items is refused, not an 8 GiB allocation
    with pytest.raises(ValueError, match=r"balance_resplit: resplit_items must be in \[0, 24\]"):
        lib.balance_resplit([1.0, 2.0], [0, 1], 2, 5, 0.0, 0.0, False, 1e-4, 25)
    with pytest.raises(ValueError, match=r"balance_small_stage: resplit_items must be in \[0, 24\]"):
        lib.balance_small_stage([1.0, 2.0], [0, 1], 2, [], 0.0, 0.0, 0.0, 1, True, 1e-4, 32, 5, 25, 4, 6000)


def test_planners_match_on_golden_minibatches():
    # the golden setting of bench/balance.py: 8 devices x 4 LongAlign-like sequences, FLOP costs, T = 64K
    planner = get_planner("lb_mini")
    cost_model = FlopsCost(DEEPSEEK_R1_DISTILL_QWEN_1_5B)
    for r in range(24):
        lengths = LONGALIGN_SFT.sample(32, seed=7919 * 8 + r)
        native, python = both(planner, lengths, 8, 65536, cost_model=cost_model)
        assert native == python, r
        costs = FLOPS(np.asarray(lengths))
        for equal in (False, True):
            native, python = both(partition, costs, 8, equal_sizes=equal)
            assert native == python, (r, equal)


def test_exact_sums_match_fsum_through_refinement_and_search():
    # part sums decide which exchange wins: mixed magnitudes, where a naive left-to-right sum differs from math.fsum's
    # exactly rounded one, must steer the compiled loops the same way
    rng = np.random.default_rng(5)
    differs = 0
    for r in range(60):
        costs = rng.choice([1e16, 1e16 + 2.0, 1.0, 3.0, 0.5, 1e-3, 7.0], size=int(rng.integers(4, 25)))
        # an explicit loop: Python 3.12's sum() of floats is compensated (Neumaier), no longer left to right
        differs += math.fsum(costs) != functools.reduce(operator.add, costs.tolist(), 0.0)
        k = int(rng.integers(2, 6))
        native, python = both(refine_by_swaps, costs, lpt(costs, k))
        assert native == python, r
        native, python = both(improve_by_search, costs, lpt(costs, k), node_budget=200)
        assert native == python, r
    assert differs > 10  # the instances do exercise the exact sums
    # a naive left-to-right part sum picks another exchange here (found by comparing the Python loop with
    # math.fsum replaced by sum): the compiled loop must round like fsum
    h = 2.0 ** 52
    costs = np.array([0.2 * h, 0.3 * h, h, h, 0.1 * h, 0.1 * h, 0.2 * h])
    native, python = both(refine_by_swaps, costs, [[3, 2, 0, 4], [6, 5, 1]])
    assert native == python == [[0, 3, 4, 6], [1, 2, 5]]


def test_disabled_native_path_runs_the_python_loops(monkeypatch):
    from jodc.balance import refine as refine_module

    calls = []
    original = refine_module._Refiner.next_exchange
    monkeypatch.setattr(refine_module._Refiner, "next_exchange", lambda self, m: calls.append(m) or original(self, m))
    costs = np.array([5.0, 4.0, 3.0, 3.0, 2.0, 1.0])
    native, python = both(refine_by_swaps, costs, [[0, 1, 2], [3, 4, 5]])
    assert native == python and calls  # only the Python run called the reference's method


def _run(code, **env):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_planners_use_the_loops_without_importing_jax():
    out = _run("""
import sys
import numpy as np
from jodc.balance import _native, partition
partition(np.arange(1.0, 30.0), 4)
assert _native.module() is not None, "compiled loops not found"
assert "jax" not in sys.modules, "the planners imported jax"
print("ok")
""")
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_another_build_named_by_jodc_ffi_library_is_not_pinned(tmp_path):
    # with JODC_FFI_LIBRARY (make bazel-test) planning before jodc.ops loads the named build must not import the
    # setuptools build as jodc._ffi (jodc.ops would then refuse the named one); once it is loaded the loops use it
    import glob
    import os
    import shutil

    built = glob.glob(os.path.join(os.path.dirname(_native.__file__), "..", "_ffi.*so"))
    if not built:
        pytest.skip("no setuptools build of jodc._ffi")
    copy = tmp_path / "_ffi.so"
    shutil.copy(built[0], copy)
    out = _run(f"""
import importlib.util, sys
import numpy as np
from jodc.balance import _native, partition
partition(np.arange(1.0, 30.0), 4)
assert "jodc._ffi" not in sys.modules and _native.module() is None
spec = importlib.util.spec_from_file_location("jodc._ffi", {str(copy)!r})  # what jodc.ops.transports.registration does
lib = importlib.util.module_from_spec(spec); spec.loader.exec_module(lib); sys.modules["jodc._ffi"] = lib
assert _native.module() is lib
print("ok")
""", JODC_FFI_LIBRARY=str(copy))
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
