"""Planners: local_sort, lb_micro, lb_mini; invariants, promises, determinism and bad input."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jodc.balance import (
    DEEPSEEK_R1_DISTILL_QWEN_1_5B,
    PLANNERS,
    FlopsCost,
    LinearCost,
    QuadraticCost,
    get_planner,
    lb_micro,
    lb_mini,
    local_sort,
    plan_metrics,
)

COST_MODELS = [LinearCost(), QuadraticCost.paper_7b(), FlopsCost(DEEPSEEK_R1_DISTILL_QWEN_1_5B)]


@st.composite
def minibatches(draw):
    cap = draw(st.sampled_from([256, 1000, 4096]))
    lengths = draw(st.lists(st.integers(1, cap), min_size=1, max_size=40))
    devices = draw(st.integers(1, 8))
    model = draw(st.sampled_from(COST_MODELS))
    return lengths, devices, cap, model


def check_common_invariants(plan, lengths, devices, cap):
    assert plan.num_devices == devices
    assert plan.token_cap == cap
    assert plan.total_sequences == len(lengths)
    assert plan.total_tokens == sum(lengths)
    indices = sorted(i for device in plan.devices for mb in device for i in mb.seq_indices)
    assert indices == list(range(len(lengths)))
    for device in plan.devices:
        for mb in device:
            assert mb.num_tokens <= cap
            assert list(mb.seq_lengths) == [lengths[i] for i in mb.seq_indices]
    np.testing.assert_array_equal(plan.sequence_lengths(), lengths)


@given(minibatches(), st.sampled_from(sorted(PLANNERS)))
@settings(max_examples=100, deadline=None)
def test_every_sequence_once_and_caps_respected(batch, name):
    lengths, devices, cap, model = batch
    plan = get_planner(name)(lengths, devices, cap, cost_model=model)
    check_common_invariants(plan, lengths, devices, cap)
    assert plan.planner == name and plan.cost_model == model.name


def planned(planner, batch):
    """(lengths, devices, the planner's plan) for a drawn minibatch."""
    lengths, devices, cap, model = batch
    return lengths, devices, planner(lengths, devices, cap, cost_model=model)


@given(minibatches())
@settings(max_examples=40, deadline=None)
def test_local_sort_deals_in_order_sorts_and_runs_one_sequence_per_microbatch(batch):
    lengths, devices, plan = planned(local_sort, batch)
    assert plan.is_lockstep
    for d, device in enumerate(plan.devices):
        real = [mb for mb in device if not mb.is_empty]
        assert all(len(mb.seq_indices) == 1 for mb in real)
        assert all(mb.is_empty for mb in device[len(real):])  # padding only at the end
        assert sorted(mb.seq_indices[0] for mb in real) == list(range(d, len(lengths), devices))
        assert [mb.num_tokens for mb in real] == sorted((mb.num_tokens for mb in real), reverse=True)


@given(minibatches())
@settings(max_examples=40, deadline=None)
def test_lb_micro_equal_sequence_and_microbatch_counts_heaviest_first(batch):
    _, _, plan = planned(lb_micro, batch)
    assert plan.is_lockstep
    sequences = [sum(len(mb.seq_indices) for mb in device) for device in plan.devices]
    assert max(sequences) - min(sequences) <= 1
    for device in plan.devices:
        costs = [mb.cost for mb in device]
        assert costs == sorted(costs, reverse=True)


@given(minibatches())
@settings(max_examples=40, deadline=None)
def test_lb_mini_balances_at_least_as_well_as_lb_micro_by_its_own_cost(batch):
    lengths, devices, cap, model = batch
    mini = plan_metrics(lb_mini(lengths, devices, cap, cost_model=model))
    micro = plan_metrics(lb_micro(lengths, devices, cap, cost_model=model))
    # lb_mini's partition is unconstrained in counts; its makespan can only be lower (up to the search's reach)
    assert max(mini.device_costs) <= max(micro.device_costs) * 1.01
    for device in lb_mini(lengths, devices, cap, cost_model=model).devices:
        assert not any(mb.is_empty for mb in device)  # no padding microbatches under ODC


def test_lb_mini_spreads_a_heavy_sequence_the_way_lb_micro_cannot():
    # one 8K sequence and seven 1K ones on 2 devices: equal counts force 4 + 4; LB-Mini puts the long one alone
    lengths = [8192] + [1024] * 7
    mini = lb_mini(lengths, 2, 8192)
    micro = lb_micro(lengths, 2, 8192)
    assert sorted(len(d_seqs) for d_seqs in ([i for mb in dev for i in mb.seq_indices] for dev in mini.devices)) == [1, 7]
    assert plan_metrics(mini).imbalance == pytest.approx(8192 / 7680)
    assert plan_metrics(micro).imbalance == pytest.approx((8192 + 3 * 1024) / 7680)
    assert mini.microbatch_counts() == (1, 1)


def test_lb_micro_pads_devices_that_need_fewer_microbatches():
    # cap 1000, 7 sequences on 3 devices (3 + 2 + 2): the device with three 700s needs 3 microbatches (no two
    # fit together), so the two devices with two sequences each get one empty microbatch at the end
    lengths = [1000, 1000, 700, 700, 700, 700, 700]
    plan = lb_micro(lengths, 3, 1000)
    assert plan.microbatch_counts() == (3, 3, 3)
    assert plan.is_lockstep
    for device in plan.devices:
        real = [mb for mb in device if not mb.is_empty]
        assert all(mb.is_empty for mb in device[len(real):])
    empty = [mb for device in plan.devices for mb in device if mb.is_empty]
    assert len(empty) == 2
    assert all(mb.num_tokens == 0 and mb.cost == 0 and mb.seq_indices == () for mb in empty)


@given(minibatches(), st.sampled_from(sorted(PLANNERS)))
@settings(max_examples=30, deadline=None)
def test_planners_are_deterministic(batch, name):
    lengths, devices, cap, model = batch
    planner = get_planner(name)
    first = planner(lengths, devices, cap, cost_model=model)
    assert planner(np.asarray(lengths), devices, cap, cost_model=model) == first
    assert planner(list(lengths), devices, cap, cost_model=model) == first


@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_bad_input_gives_clear_errors(name):
    planner = get_planner(name)
    with pytest.raises(ValueError, match="more than token_cap"):
        planner([10, 2000], 2, 1000)
    with pytest.raises(ValueError, match="num_devices must be a positive integer"):
        planner([10], 0, 1000)
    with pytest.raises(ValueError, match="empty"):
        planner([], 2, 1000)
    with pytest.raises(ValueError, match="negative"):
        planner([10, -1], 2, 1000)
    with pytest.raises(ValueError, match="zero"):
        planner([10, 0], 2, 1000)
    with pytest.raises(ValueError, match="integers"):
        planner([10.5], 2, 1000)
    with pytest.raises(ValueError, match="token_cap"):
        planner([10], 2, 0)
    with pytest.raises(ValueError, match="1-D"):
        planner([[10]], 2, 1000)
    with pytest.raises(ValueError, match="callable"):
        planner([10], 2, 1000, cost_model="linear")


def test_unknown_planner():
    with pytest.raises(ValueError, match="unknown planner"):
        get_planner("round_robin")
