"""Context-parallel planning: the cost model by hand, the plan's invariants, the three CP planners, the refusal."""
import math

import numpy as np
import pytest

from jodc.balance import (
    CP_PLANNERS,
    ContextParallelCost,
    CPGroup,
    CPMicrobatch,
    CPPlan,
    Microbatch,
    check_group_rows,
    causal_pairs,
    fixed_cp,
    get_planner,
    lb_mini_cp,
    lockstep_cp,
    piece_pairs,
)
from jodc.balance.cp_planners import _choose_group
from jodc.balance.validation import min_group_size

# Round numbers, so every figure below can be checked by hand.
HAND = ContextParallelCost(num_layers=2, seconds_per_token=1.0, seconds_per_pair=0.01, exchange_bytes_per_token=300.0,
                           exchanges_per_layer=3, link_bandwidth=100.0, link_latency=0.5, layer_sync_seconds=0.25,
                           microbatch_seconds=2.0)
# Attention-heavy, exchange nearly free: larger groups always pay.
CHEAP_EXCHANGE = ContextParallelCost(num_layers=2, seconds_per_token=1.0, seconds_per_pair=0.05,
                                     exchange_bytes_per_token=1.0, link_bandwidth=1e9, link_latency=0.0)
LENGTHS = [300, 40, 90, 250, 60, 30, 100, 20, 170, 50, 80, 10, 70, 45]  # cap 100: 300, 250 and 170 are long


def test_pairs_and_piece_pairs_by_hand():
    assert causal_pairs([1, 4]).tolist() == [1.0, 10.0]
    # L = 8 over 2: chunks of 2; member 0 holds positions 0,1 and 6,7 (1+2 + 7+8), member 1 holds 2..5 (3+4+5+6)
    assert piece_pairs(8, 2).tolist() == [18.0, 18.0]
    # L = 7: position 7 is padding, so member 0 loses its 8 pairs
    assert piece_pairs(7, 2).tolist() == [10.0, 18.0]
    for length, k in ((1000, 8), (999, 3), (5, 4)):
        assert piece_pairs(length, k).sum() == causal_pairs(length)


def test_cost_model_by_hand():
    assert HAND([10]).tolist() == [10 + 0.01 * 55]
    # each member: 4 columns + 18 pairs
    assert HAND.member_compute([8], 2).tolist() == [4.18, 4.18]
    # per exchange: latency 0.5 + sync 0.25 + (1/2) x (8 tokens x 300 / 3 bytes) / 100 = 4.75; 2 layers x 3 of them
    assert HAND.exchange_time([8], 2) == pytest.approx(28.5)
    assert HAND.exchange_time([8], 1) == 0.0
    assert HAND.group_time([8], 2) == pytest.approx(2.0 + 4.18 + 28.5)
    # short sequences beside the piece make that member the slowest
    assert HAND.group_time([8], 2, [[3], []]) == pytest.approx(2.0 + 4.18 + 3.06 + 28.5)
    assert HAND.microbatch_time([5]) == pytest.approx(2.0 + 5 + 0.15)
    assert HAND.microbatch_time([]) == 0.0


def test_groups_across_nodes_exchange_at_the_network_rate():
    cost = ContextParallelCost(num_layers=2, seconds_per_token=1.0, seconds_per_pair=0.01,
                               exchange_bytes_per_token=300.0, link_bandwidth=100.0, link_latency=0.5,
                               layer_sync_seconds=0.25, devices_per_node=2, inter_node_bandwidth=50.0,
                               inter_node_latency=1.0)
    assert not cost.spans_nodes((2, 3)) and cost.spans_nodes((1, 2))
    assert cost.exchange_time([8], (2, 3)) == pytest.approx(28.5)
    assert cost.exchange_time([8], (1, 2)) == pytest.approx(6 * (1.0 + 0.25 + 0.5 * 800 / 50))


def test_from_shape_counts():
    from jodc.balance import DEEPSEEK_R1_DISTILL_QWEN_1_5B as shape

    cost = ContextParallelCost.from_shape(shape, flops_per_second=1.0, link_bandwidth=1.0)
    per_token = 2 * shape.layer_matmul_params * shape.num_layers + 2 * shape.vocab * shape.hidden
    assert cost.seconds_per_token == 4 * per_token
    assert cost.seconds_per_pair == 4 * 4 * shape.attention_width * shape.num_layers
    assert cost.exchange_bytes_per_token == 2 * 2 * 128 * (2 + 2 + 4)  # K and V, 2 kv heads of 128; bf16 x2 + fp32
    with pytest.raises(ValueError, match="link_bandwidth"):
        ContextParallelCost(num_layers=1, seconds_per_token=1.0, seconds_per_pair=0.0, exchange_bytes_per_token=1.0,
                            link_bandwidth=0.0)


def test_min_group_size_accounts_for_zigzag_rounding():
    assert min_group_size(100, 100) == 1
    assert min_group_size(300, 100) == 3
    assert min_group_size(201, 100) == 3  # over 3: 2 x ceil(201/6) = 68; ceil(201/100) = 3 anyway
    assert min_group_size(199, 99) == 3  # over 2 the piece would be 2 x ceil(199/4) = 100 > 99
    assert min_group_size(5, 1) is None


def _check_lb_mini_cp_plan(plan, lengths, cap):
    assert plan.sequence_lengths().tolist() == list(lengths)
    long = {i for i, n in enumerate(lengths) if n > cap}
    assert {g.seq_indices[0] for g in plan.groups} == long and plan.num_cp_sequences == len(long)
    for g in plan.groups:
        (length,) = g.seq_lengths
        assert g.size >= max(math.ceil(length / cap), min_group_size(length, cap))
        assert g.piece_columns <= cap
    for device in plan.devices:  # the deadlock-free order: CP rows in increasing group id on every device
        ids = [item.group.group_id for item in device if isinstance(item, CPMicrobatch)]
        assert ids == sorted(ids)
        assert all(item.num_columns <= cap if isinstance(item, CPMicrobatch) else item.num_tokens <= cap
                   for item in device)


def test_lb_mini_cp_properties():
    plan = lb_mini_cp(LENGTHS, 6, 100, cost_model=HAND)
    _check_lb_mini_cp_plan(plan, LENGTHS, 100)
    assert plan.planner == "lb_mini_cp" and not plan.is_lockstep
    # balanced: no device carries more than the heaviest group plus the heaviest short microbatch over the mean
    loads = plan.device_loads()
    assert loads.max() - loads.min() <= max(g.cost for g in plan.groups)


def test_lb_mini_cp_rows_lay_out_as_zigzag_rows():
    plan = lb_mini_cp(LENGTHS, 6, 100, cost_model=HAND)
    for group in plan.groups:
        rows = [next(item for item in plan.devices[d] if isinstance(item, CPMicrobatch) and item.group == group)
                for d in group.members]
        laid = [row.row(100) for row in rows]
        check_group_rows(np.stack([r.segment_ids for r in laid])[:, None], np.stack([r.positions for r in laid])[:, None],
                         np.ones((group.size, 1), np.int32))
        positions = np.concatenate([r.positions[r.segment_ids == 1] for r in laid])
        assert sorted(positions.tolist()) == list(range(group.seq_lengths[0]))


def test_groups_go_to_lightly_loaded_devices():
    ready = np.array([5.0, 0.0, 3.0, 0.0, 9.0])
    members, end = _choose_group(150, ready, 100, HAND, work_left=0.0)  # 150 > cap: at least 2 members
    assert members == [1, 3] and end == pytest.approx(HAND.group_time([150], 2))


def test_a_group_grows_when_that_balances_better():
    plan = lb_mini_cp([250], 8, 100, cost_model=CHEAP_EXCHANGE)
    assert plan.groups[0].size > min_group_size(250, 100)


def test_short_only_minibatch_is_plain_lb_mini_like():
    plan = lb_mini_cp([10, 20, 30, 40], 2, 100, cost_model=HAND)
    assert plan.groups == () and plan.num_cp_sequences == 0
    assert sorted(plan.device_loads().round(6).tolist()) == sorted([HAND([10, 40]).sum(), HAND([20, 30]).sum()])


def test_lockstep_cp_is_lockstep_with_disjoint_groups_per_step():
    plan = lockstep_cp(LENGTHS, 6, 100, cost_model=HAND)
    assert plan.is_lockstep and plan.planner == "lockstep_cp"
    assert plan.sequence_lengths().tolist() == LENGTHS
    for step in range(plan.microbatch_counts()[0]):
        members = [d for d in range(6) if isinstance(plan.devices[d][step], CPMicrobatch)]
        assert len(members) == len(set(members))
    for g in plan.groups:
        assert g.size >= min_group_size(g.seq_lengths[0], 100)


def test_lockstep_cp_keeps_small_groups_inside_a_node():
    cost = ContextParallelCost(num_layers=2, seconds_per_token=1.0, seconds_per_pair=0.01,
                               exchange_bytes_per_token=1e6, link_bandwidth=1.0, devices_per_node=4,
                               inter_node_bandwidth=0.1)
    plan = lockstep_cp([300, 300, 10], 8, 100, cost_model=cost)  # groups of 3: one per node
    assert not any(cost.spans_nodes(g.members) for g in plan.groups)


def test_fixed_cp_splits_every_sequence_over_every_device():
    plan = fixed_cp(LENGTHS, 4, 100, cost_model=HAND)
    assert plan.is_lockstep and plan.num_cp_sequences == len(LENGTHS)
    assert all(g.members == (0, 1, 2, 3) for g in plan.groups)
    assert all(g.piece_columns <= 100 for g in plan.groups)
    assert plan.sequence_lengths().tolist() == LENGTHS


def test_fixed_cp_rows_lay_out_several_split_sequences():
    """Each fixed_cp row holds several split sequences, laid out piece after piece on every member (segment j + 1
    for the row's j-th sequence), each sequence's positions over the group exactly its global positions."""
    plan = fixed_cp(LENGTHS, 4, 100, cost_model=HAND)
    assert max(len(g.seq_indices) for g in plan.groups) >= 3
    for group in plan.groups:
        laid = [item.row(100) for d in group.members for item in plan.devices[d] if item.group == group]
        assert [r.split_segments for r in laid] == [len(group.seq_indices)] * group.size
        check_group_rows(np.stack([r.segment_ids for r in laid])[:, None], np.stack([r.positions for r in laid])[:, None],
                         np.full((group.size, 1), len(group.seq_indices)))
        for s, length in enumerate(group.seq_lengths, start=1):
            positions = np.concatenate([r.positions[r.segment_ids == s] for r in laid])
            assert sorted(positions.tolist()) == list(range(length))
        assert (laid[0].segment_ids > len(group.seq_indices)).sum() == 0  # no short sequences of their own


def test_planners_are_registered():
    for name, planner in CP_PLANNERS.items():
        assert get_planner(name) is planner
        assert isinstance(planner([250, 30], 4, 100, cost_model=HAND), CPPlan)


def test_a_sequence_longer_than_the_world_is_refused_before_planning():
    for planner in CP_PLANNERS.values():
        with pytest.raises(ValueError, match=r"sequence 1 has 900 tokens, more than the world's capacity of 4 "
                                             r"devices x token_cap=100 = 400 tokens"):
            planner([50, 900], 4, 100, cost_model=HAND)
    with pytest.raises(ValueError, match="ContextParallelCost"):
        lb_mini_cp([50], 2, 100, cost_model=lambda x: x)


def _group(g, members, seqs=(0,), lengths=(150,)):
    return CPGroup(g, members, seqs, lengths, 1.0)


def test_plan_refuses_broken_invariants():
    g0, g1 = _group(0, (0, 1)), _group(1, (0, 1), (1,), (120,))
    ok = CPPlan(((CPMicrobatch(g0, 0), CPMicrobatch(g1, 0)), (CPMicrobatch(g0, 1), CPMicrobatch(g1, 1))),
                (g0, g1), 100)
    assert ok.is_lockstep and ok.total_sequences == 2
    with pytest.raises(ValueError, match="increasing group id"):
        CPPlan(((CPMicrobatch(g1, 0), CPMicrobatch(g0, 0)), (CPMicrobatch(g0, 1), CPMicrobatch(g1, 1))), (g0, g1), 100)
    with pytest.raises(ValueError, match=r"members \[1\] have no row"):
        CPPlan(((CPMicrobatch(g0, 0),), ()), (g0,), 100)
    with pytest.raises(ValueError, match="over token_cap"):
        CPPlan(((CPMicrobatch(g0, 0, Microbatch((1,), (30,), 1.0)),), (CPMicrobatch(g0, 1),)), (g0,), 100)
    with pytest.raises(ValueError, match="exactly once"):
        CPPlan(((CPMicrobatch(g0, 0), Microbatch((0,), (150,), 1.0)), (CPMicrobatch(g0, 1),)), (g0,), 200)
    with pytest.raises(ValueError, match="is member 1"):
        CPPlan(((CPMicrobatch(g0, 1),), (CPMicrobatch(g0, 0),)), (g0,), 100)


@pytest.mark.parametrize("seed", range(6))
def test_random_minibatches_give_valid_plans_that_run(seed):
    from jodc.sim import simulate_cp_lockstep, simulate_cp_odc

    rng = np.random.default_rng(seed)
    world, cap = int(rng.integers(2, 9)), 64
    lengths = rng.integers(1, cap + 1, int(rng.integers(1, 30))).tolist()
    lengths += rng.integers(cap + 1, world * cap // 2 + 2, int(rng.integers(0, 4))).tolist()
    plan = lb_mini_cp(lengths, world, cap, cost_model=HAND)
    _check_lb_mini_cp_plan(plan, lengths, cap)
    simulate_cp_odc(plan, HAND)  # raises if the groups deadlock
    for baseline in (lockstep_cp, fixed_cp):
        other = baseline(lengths, world, cap, cost_model=HAND)
        assert other.sequence_lengths().tolist() == lengths and other.is_lockstep
        simulate_cp_lockstep(other, HAND)


def test_short_sequences_balance_around_the_groups_loads():
    from jodc.balance.preloaded import balance_around_loads

    shares = balance_around_loads([4.0, 3.0, 3.0, 2.0], [10.0, 0.0, 0.0])
    totals = [load + sum([4.0, 3.0, 3.0, 2.0][i] for i in share) for load, share in zip([10.0, 0.0, 0.0], shares)]
    assert shares[0] == [] and max(totals) == 10.0
    assert sorted(i for share in shares for i in share) == [0, 1, 2, 3]


def test_short_sequences_balance_around_loads_far_apart():
    """Half the devices hold a group's rows (60 s), half nothing: the idle ones take every sequence. LB-Mini's equal
    parts matched to the devices start at 90 / 30 and one move per round leaves them at 82 / 38; LPT around the
    loads starts even."""
    from jodc.balance.preloaded import balance_around_loads, balance_around_loads_starts

    loads = [60.0] * 4 + [0.0] * 4
    shares = balance_around_loads([1.0] * 240, loads)
    assert [load + len(share) for load, share in zip(loads, shares)] == [60.0] * 8
    assert sorted(i for share in shares for i in share) == list(range(240))
    matched, lpt = balance_around_loads_starts([1.0] * 240, loads)
    assert lpt == shares and max(load + len(share) for load, share in zip(loads, matched)) > 60.0


def test_lb_mini_cp_weighs_the_microbatches_a_device_runs():
    """A 300-token sequence over devices 0-2 (110 s each: 100 tokens + a 10 s microbatch), forty 5-token ones around
    it. Balanced by their seconds alone, device 3 takes more than its share, and packs it into more microbatches than
    the balance saw (150 s). Each sequence carrying its share of a microbatch (5 / 100 of 10 s) gives the optimum:
    5 sequences in one microbatch on each member (110 + 10 + 25), 25 in two on device 3 (20 + 125), all at 145 s."""
    from jodc.sim import simulate_cp_odc

    cost = ContextParallelCost(num_layers=1, seconds_per_token=1.0, seconds_per_pair=0.0,
                               exchange_bytes_per_token=1.0, link_bandwidth=math.inf, link_latency=0.0,
                               microbatch_seconds=10.0)
    lengths = [300] + [5] * 40
    plan = lb_mini_cp(lengths, 4, 100, cost_model=cost)
    assert [g.members for g in plan.groups] == [(0, 1, 2)]
    result = simulate_cp_odc(plan, cost)
    assert result.step_time == 145.0 and result.idle_fraction == 0.0
