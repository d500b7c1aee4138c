"""Planning for padded microbatches (jodc.balance.buckets) and LB-Mini with length buckets."""
import math

import numpy as np
import pytest

from jodc.balance import (
    DEEPSEEK_R1_DISTILL_QWEN_1_5B,
    FlopsCost,
    LinearCost,
    PaddedMicrobatchCost,
    QuadraticCost,
    get_planner,
    lb_mini,
    padding_rate,
    rebalance_for_buckets,
    run_lengths,
    sequence_costs,
)
from jodc.balance.buckets import pack_device
from jodc.sim.lengths import get_length_distribution

BUCKETS = (256, 512)
CAP = 1024
QUAD = QuadraticCost(a=0.05, b=0.1, scale=1024)


def scaled_longalign(n, seed):
    lengths = get_length_distribution("longalign_sft").sample(n, seed=seed) / 64
    return np.clip(np.ceil(lengths).astype(np.int64), 1, CAP)


def device_costs(plan, cost):
    return [math.fsum(cost(mb.seq_lengths) for mb in device) for device in plan.devices]


def test_run_lengths():
    assert run_lengths((512, 256, 256), 1024) == (256, 512, 1024)
    assert run_lengths((256, 1024, 2048), 1024) == (256, 1024)
    assert run_lengths(None, 64) == (64,)
    assert run_lengths((), 64) == (64,)
    for bad in ((0,), (-3,), (2.5,), (True,)):
        with pytest.raises(ValueError, match="positive integers"):
            run_lengths(bad, 1024)
    with pytest.raises(ValueError, match="token_cap"):
        run_lengths((256,), 0)


def test_padding_rate_is_the_linear_coefficient():
    assert padding_rate(LinearCost()) == 1.0
    assert padding_rate(QuadraticCost(a=2.0, b=3.0, scale=10.0)) == pytest.approx(0.3)
    flops = FlopsCost(DEEPSEEK_R1_DISTILL_QWEN_1_5B)
    assert padding_rate(flops) == pytest.approx(flops.as_quadratic().b)

    class Custom:
        name = "custom"

        def __call__(self, lengths):
            return np.asarray(lengths, float) ** 1.5

    with pytest.raises(ValueError, match="padding_rate"):
        padding_rate(Custom())
    cost = PaddedMicrobatchCost.for_buckets(Custom(), BUCKETS, CAP, rate=0.5)
    assert cost([100]) == pytest.approx(100 ** 1.5 + 0.5 * 156)
    for bad in (-1.0, float("nan"), "1"):
        with pytest.raises(ValueError, match="padding rate"):
            PaddedMicrobatchCost.for_buckets(LinearCost(), BUCKETS, CAP, rate=bad)


def test_microbatch_cost_adds_padding_to_the_run_length():
    cost = PaddedMicrobatchCost.for_buckets(QUAD, BUCKETS, CAP)
    assert cost.lengths == (256, 512, 1024)
    assert [cost.run_length(t) for t in (0, 1, 256, 257, 512, 513, 1024)] == [0, 256, 256, 512, 512, 1024, 1024]
    seqs = np.array([200, 100])
    assert cost(seqs) == pytest.approx(QUAD(seqs).sum() + 0.1 / 1024 * (512 - 300))
    assert cost([]) == 0.0
    with pytest.raises(ValueError, match="exceeds the token cap"):
        cost([1000, 100])
    # without buckets (run length = the cap) only a full microbatch is unpadded
    plain = PaddedMicrobatchCost.for_buckets(LinearCost(), None, CAP)
    assert plain([CAP]) == CAP and plain([10]) == CAP


def test_pack_device_splits_when_shorter_buckets_are_cheaper():
    cost = PaddedMicrobatchCost.for_buckets(LinearCost(), BUCKETS, CAP)
    lengths = np.array([250, 500])
    packing, total = pack_device(lengths, sequence_costs(LinearCost(), lengths), CAP, cost)
    assert sorted(map(sorted, packing)) == [[0], [1]]  # 256 + 512 run lengths instead of one 1024
    assert total == 256 + 512
    # full buckets stay together
    lengths = np.array([200, 300, 500])
    packing, total = pack_device(lengths, sequence_costs(LinearCost(), lengths), CAP, cost)
    assert total == 1024 and len(packing) == 1


@pytest.mark.parametrize("seed", range(12))
def test_pack_device_is_a_valid_packing_priced_consistently(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, CAP + 1, size=rng.integers(1, 12))
    costs = sequence_costs(QUAD, lengths)
    cost = PaddedMicrobatchCost.for_buckets(QUAD, BUCKETS, CAP)
    packing, total = pack_device(lengths, costs, CAP, cost)
    assert sorted(i for part in packing for i in part) == list(range(lengths.size))
    assert all(lengths[part].sum() <= CAP for part in packing)
    assert total == pytest.approx(sum(cost(lengths[part]) for part in packing))
    part_costs = [cost(lengths[part]) for part in packing]
    assert part_costs == sorted(part_costs, reverse=True)  # costliest first, like pack_microbatches


def set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partial in set_partitions(rest):
        yield [[first]] + partial
        for k in range(len(partial)):
            yield partial[:k] + [[first] + partial[k]] + partial[k + 1:]


def brute_force_best_max(lengths, devices, cost):
    """The least max device cost over every assignment of sequences to devices, each device packed optimally."""
    best_device = {}
    for mask in range(2 ** len(lengths)):
        idx = [i for i in range(len(lengths)) if mask >> i & 1]
        best_device[mask] = min((sum(cost(lengths[p]) for p in parts) for parts in set_partitions(idx)
                                 if all(lengths[p].sum() <= CAP for p in parts)), default=math.inf)
    full = 2 ** len(lengths) - 1
    assert devices == 2
    return min(max(best_device[m], best_device[full ^ m]) for m in range(full + 1))


@pytest.mark.parametrize("seed", range(6))
def test_rebalance_never_worse_and_close_to_optimal_on_small_cases(seed):
    lengths = scaled_longalign(6, seed)
    cost = PaddedMicrobatchCost.for_buckets(QUAD, BUCKETS, CAP)
    plain = lb_mini(lengths, 2, CAP, cost_model=QUAD)
    aware = lb_mini(lengths, 2, CAP, cost_model=QUAD, length_buckets=BUCKETS)
    assert sorted(i for dev in aware.devices for mb in dev for i in mb.seq_indices) == list(range(6))
    assert max(device_costs(aware, cost)) <= max(device_costs(plain, cost)) * (1 + 1e-9)
    optimum = brute_force_best_max(lengths, 2, cost)
    assert max(device_costs(aware, cost)) <= 1.15 * optimum


def test_bucket_aware_lb_mini_beats_sequence_balancing_on_long_tailed_minibatches():
    """Averaged over minibatches like bench/e2e.py's, the padded cost of the busiest device drops."""
    cost = PaddedMicrobatchCost.for_buckets(QUAD, BUCKETS, CAP)
    ratios = []
    for seed in range(8):
        lengths = scaled_longalign(16, seed)
        plain = max(device_costs(lb_mini(lengths, 2, CAP, cost_model=QUAD), cost))
        aware = max(device_costs(lb_mini(lengths, 2, CAP, cost_model=QUAD, length_buckets=BUCKETS), cost))
        assert aware <= plain * (1 + 1e-9)
        ratios.append(plain / aware)
    assert np.mean(ratios) > 1.05


def test_rebalance_is_deterministic_and_respects_its_budget():
    lengths = scaled_longalign(64, 3)
    costs = sequence_costs(QUAD, lengths)
    cost = PaddedMicrobatchCost.for_buckets(QUAD, BUCKETS, CAP)
    shares = [list(range(d, 64, 4)) for d in range(4)]
    first = rebalance_for_buckets(lengths, costs, shares, CAP, cost)
    assert first == rebalance_for_buckets(lengths, costs, shares, CAP, cost)
    assert shares == [list(range(d, 64, 4)) for d in range(4)]  # inputs untouched
    untouched, _ = rebalance_for_buckets(lengths, costs, shares, CAP, cost, max_evaluations=0)
    assert untouched == shares


def test_planner_registry_and_bad_buckets():
    lengths = scaled_longalign(8, 0)
    plan = get_planner("lb_mini")(lengths, 2, CAP, cost_model=QUAD, length_buckets=[512, 256])
    assert plan.planner == "lb_mini" and plan.num_devices == 2
    with pytest.raises(ValueError, match="positive integers"):
        lb_mini(lengths, 2, CAP, length_buckets=(0,))


def test_microbatch_overhead_is_paid_once_per_microbatch_and_steers_packing():
    cost = PaddedMicrobatchCost.for_buckets(LinearCost(), BUCKETS, CAP, overhead=300.0)
    assert cost([100]) == 256 + 300 and cost([]) == 0.0
    lengths = np.array([250, 500])
    packing, total = pack_device(lengths, sequence_costs(LinearCost(), lengths), CAP, cost)
    assert len(packing) == 1 and total == 1024 + 300  # two microbatches would cost 256 + 512 + 2 x 300
    cheap = PaddedMicrobatchCost.for_buckets(LinearCost(), BUCKETS, CAP, overhead=100.0)
    packing, total = pack_device(lengths, sequence_costs(LinearCost(), lengths), CAP, cheap)
    assert len(packing) == 2 and total == 256 + 512 + 200
    for bad in (-1.0, float("inf"), None):
        with pytest.raises(ValueError, match="microbatch overhead"):
            PaddedMicrobatchCost.for_buckets(LinearCost(), BUCKETS, CAP, overhead=bad)


def test_lb_mini_microbatch_overhead():
    lengths = scaled_longalign(16, 1)
    with pytest.raises(ValueError, match="needs length_buckets"):
        lb_mini(lengths, 2, CAP, microbatch_overhead=1.0)
    few = lb_mini(lengths, 2, CAP, cost_model=QUAD, length_buckets=BUCKETS, microbatch_overhead=1e3)
    many = lb_mini(lengths, 2, CAP, cost_model=QUAD, length_buckets=BUCKETS)
    assert sum(map(len, few.devices)) <= sum(map(len, many.devices))
    costly = PaddedMicrobatchCost.for_buckets(QUAD, BUCKETS, CAP, overhead=1e3)
    assert max(device_costs(few, costly)) <= max(device_costs(many, costly)) * (1 + 1e-9)
