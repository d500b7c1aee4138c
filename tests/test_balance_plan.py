"""Plan objects, buffer conventions (segment ids, positions), materialising buffers, and plan metrics."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jodc.balance import (
    LinearCost,
    Microbatch,
    Plan,
    QuadraticCost,
    get_planner,
    imbalance_ratio,
    layout,
    lb_mini,
    materialize,
    microbatch_cost_table,
    pack_arrays,
    plan_metrics,
)


def test_segment_ids_and_positions_follow_the_documented_convention():
    mb = Microbatch(seq_indices=(7, 2), seq_lengths=(3, 2), cost=5.0)
    assert mb.num_tokens == 5
    np.testing.assert_array_equal(mb.segment_ids(8), [1, 1, 1, 2, 2, 0, 0, 0])
    np.testing.assert_array_equal(mb.positions(8), [0, 1, 2, 0, 1, 0, 0, 0])
    assert mb.segment_ids(8).dtype == np.int32 and mb.positions(8).dtype == np.int32
    empty = Microbatch.empty()
    assert empty.is_empty and empty.num_tokens == 0
    np.testing.assert_array_equal(empty.segment_ids(4), [0, 0, 0, 0])
    with pytest.raises(ValueError, match="shorter"):
        mb.segment_ids(4)


def test_microbatch_rejects_inconsistent_fields():
    with pytest.raises(ValueError, match="one length per sequence"):
        Microbatch((1, 2), (3,), 1.0)
    with pytest.raises(ValueError, match="lengths must be >= 1"):
        Microbatch((1,), (0,), 1.0)
    with pytest.raises(ValueError, match="cost"):
        Microbatch((1,), (3,), float("nan"))


def test_plan_checks_every_sequence_once_and_the_cap():
    a, b = Microbatch((0,), (5,), 5.0), Microbatch((1,), (6,), 6.0)
    plan = Plan(((a,), (b,)), token_cap=8)
    assert (plan.total_tokens, plan.total_sequences, plan.num_devices) == (11, 2, 2)
    with pytest.raises(ValueError, match="duplicated"):
        Plan(((a,), (a,)), token_cap=8)
    with pytest.raises(ValueError, match="missing"):
        Plan(((b,),), token_cap=8)
    with pytest.raises(ValueError, match="over token_cap"):
        Plan(((a,), (b,)), token_cap=5)
    with pytest.raises(ValueError, match="at least one device"):
        Plan((), token_cap=8)


def test_padding_to_equal_counts_appends_empty_microbatches():
    plan = lb_mini([8] + [1] * 9, 2, 8)  # 17 tokens, cap 8: one device holds 9 tokens (2 microbatches), one 8 (1)
    assert sorted(plan.microbatch_counts()) == [1, 2]
    padded = plan.padded_to_equal_counts()
    assert padded.is_lockstep
    assert padded.microbatch_counts() == (max(plan.microbatch_counts()),) * 2
    assert padded.total_tokens == plan.total_tokens
    assert sum(mb.is_empty for device in padded.devices for mb in device) == 1
    np.testing.assert_array_equal(padded.device_costs(), plan.device_costs())


@given(st.lists(st.integers(1, 64), min_size=1, max_size=20), st.integers(1, 4), st.sampled_from(["local_sort", "lb_micro", "lb_mini"]))
@settings(max_examples=30, deadline=None)
def test_materialize_places_every_token_where_the_plan_says(lengths, devices, name):
    cap = 64
    plan = get_planner(name)(lengths, devices, cap)
    # token value encodes (sequence, position) so every placement can be checked
    tokens = [1000 * (i + 1) + np.arange(s) for i, s in enumerate(lengths)]
    seen = 0
    for d in range(devices):
        packed = materialize(plan, d, tokens, pad_token=-1)
        m = len(plan.devices[d])
        assert packed.tokens.shape == packed.segment_ids.shape == packed.positions.shape == (m, cap)
        for row, mb in enumerate(plan.devices[d]):
            for j, i in enumerate(mb.seq_indices):
                where = packed.segment_ids[row] == j + 1
                np.testing.assert_array_equal(packed.tokens[row][where], tokens[i])
                np.testing.assert_array_equal(packed.positions[row][where], np.arange(lengths[i]))
                seen += 1
            assert np.all(packed.tokens[row][packed.segment_ids[row] == 0] == -1)
    assert seen == len(lengths)


def test_pack_arrays_handles_trailing_dimensions_and_checks_lengths():
    plan = Plan(((Microbatch((1, 0), (2, 1), 3.0),),), token_cap=4)
    per_sequence = [np.full((1, 3), 0.5), np.arange(6, dtype=np.float64).reshape(2, 3)]
    packed = pack_arrays(plan, 0, per_sequence, pad_value=-1.0)
    assert packed.shape == (1, 4, 3)
    np.testing.assert_array_equal(packed[0, :2], per_sequence[1])
    np.testing.assert_array_equal(packed[0, 2], per_sequence[0][0])
    np.testing.assert_array_equal(packed[0, 3], [-1.0, -1.0, -1.0])
    segment_ids, positions = layout(plan, 0)
    np.testing.assert_array_equal(segment_ids, [[1, 1, 2, 0]])
    np.testing.assert_array_equal(positions, [[0, 1, 0, 0]])
    with pytest.raises(ValueError, match="length 1 in the plan"):
        pack_arrays(plan, 0, [np.zeros(2), np.zeros(2)])
    with pytest.raises(ValueError, match="arrays for 2 sequences"):
        pack_arrays(plan, 0, [np.zeros(1)])
    with pytest.raises(ValueError, match="device"):
        layout(plan, 1)
    with pytest.raises(ValueError, match="integer"):
        materialize(plan, 0, [np.zeros(1), np.zeros(2)])


def test_metrics_on_a_hand_made_plan():
    # device 0: microbatches of cost 4 and 1; device 1: one microbatch of cost 3
    plan = Plan(
        ((Microbatch((0,), (4,), 4.0), Microbatch((1,), (1,), 1.0)), (Microbatch((2,), (3,), 3.0),)),
        token_cap=4,
    )
    m = plan_metrics(plan)
    assert m.device_costs == (5.0, 3.0)
    assert m.imbalance == pytest.approx(5.0 / 4.0)
    assert m.padding_waste == pytest.approx(1 - 8 / 12)
    assert m.collective_step_cost == pytest.approx(max(4, 3) + max(1, 0))
    assert m.odc_step_cost == pytest.approx(5.0)
    assert m.predicted_speedup == pytest.approx(1.0)
    np.testing.assert_array_equal(microbatch_cost_table(plan), [[4.0, 1.0], [3.0, 0.0]])
    # re-costed with a quadratic model: c = s^2
    squared = plan_metrics(plan, QuadraticCost(a=1.0, b=0.0))
    assert squared.device_costs == (17.0, 9.0)
    assert squared.collective_step_cost == pytest.approx(16 + 1)


@given(st.lists(st.integers(1, 4096), min_size=1, max_size=40), st.integers(1, 8), st.sampled_from(["local_sort", "lb_micro", "lb_mini"]))
@settings(max_examples=30, deadline=None)
def test_metrics_relations_hold_for_any_plan(lengths, devices, name):
    m = plan_metrics(get_planner(name)(lengths, devices, 4096))
    assert m.imbalance >= 1.0
    assert 0.0 <= m.padding_waste < 1.0
    assert m.collective_step_cost >= m.odc_step_cost * (1 - 1e-12)  # waiting per microbatch never beats once
    assert sum(m.device_costs) == pytest.approx(sum(lengths))  # linear cost model: tokens


def test_imbalance_ratio():
    assert imbalance_ratio([2.0, 2.0]) == 1.0
    assert imbalance_ratio([3.0, 1.0]) == 1.5
    assert imbalance_ratio([0.0, 0.0]) == 1.0
    with pytest.raises(ValueError, match="non-empty"):
        imbalance_ratio([])


def test_linear_cost_is_the_default():
    assert lb_mini([3, 4], 2, 8).cost_model == LinearCost().name
