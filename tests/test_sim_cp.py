"""The context-parallel simulator: one group by hand, deadlock detection, timelines, the three layouts compared."""
import numpy as np
import pytest

from jodc.balance import CPGroup, CPMicrobatch, CPPlan, Microbatch, lb_mini_cp
from jodc.fsdp.timeline_analysis import bubble_rate, check_events, events_from_plan, label_cp_groups
from jodc.sim import (
    LONGALIGN_LONG_TAIL,
    cp_cost_for,
    cp_layouts_what_if,
    get_length_distribution,
    simulate_cp_lockstep,
    simulate_cp_odc,
    timeline_events,
)

from test_balance_cp import HAND  # round numbers, checked by hand there


def _one_group_plan():
    """Sequence 0 (8 tokens) over devices 0 and 1; device 2 runs sequence 1 (5 tokens) on its own."""
    group = CPGroup(0, (0, 1), (0,), (8,), HAND.group_time([8], (0, 1)))
    return CPPlan(((CPMicrobatch(group, 0),), (CPMicrobatch(group, 1),), (Microbatch((1,), (5,), 5.15),)), (group,), 10)


def test_one_group_by_hand():
    plan = _one_group_plan()
    group = 2.0 + 4.18 + 28.5  # microbatch, piece (4 columns + 18 pairs), 6 exchanges of 4.75
    short = 2.0 + 5 + 0.15
    odc = simulate_cp_odc(plan, HAND)
    assert odc.step_time == pytest.approx(group + 2 * 0.5)  # + the world's barrier: two latencies
    assert odc.device_busy == pytest.approx((group, group, short))
    assert odc.idle_fraction == pytest.approx(1 - (2 * group + short) / (3 * (group + 1.0)))
    lock = simulate_cp_lockstep(plan, HAND)
    assert lock.step_time == pytest.approx(group)


def test_a_member_waits_for_the_slowest_arrival():
    g0 = CPGroup(0, (0, 1), (0,), (8,), 1.0)
    plan = CPPlan(((Microbatch((1,), (5,), 1.0), CPMicrobatch(g0, 0)), (CPMicrobatch(g0, 1),)), (g0,), 10)
    result = simulate_cp_odc(plan, HAND)
    waits = [s for s in result.timeline if s.device == 1 and s.kind == "wait" and s.label == "cp0 members"]
    assert len(waits) == 1 and waits[0].end - waits[0].start == pytest.approx(HAND.microbatch_time([5]))
    with pytest.raises(ValueError, match="lock-step plan"):
        simulate_cp_lockstep(plan, HAND)


def test_timeline_marks_cp_rows_with_group_and_members():
    events = timeline_events(simulate_cp_odc(_one_group_plan(), HAND))
    check_events(events, 3)
    cp = [e for e in events if e.get("group") == 0 and e["kind"] == "busy"]
    assert sorted(e["device"] for e in cp) == [0, 1] and all(e["members"] == [0, 1] for e in cp)
    assert 0 < bubble_rate(events, 3) < 1


def test_engine_and_estimated_events_get_the_plans_groups():
    """`label_cp_groups` marks an engine's events of CP rows ('mb<i> ...' on a member) with the group and its members;
    `events_from_plan` estimates a CP plan's step (a CP row costs its group's planned time) and is labelled the same."""
    plan = _one_group_plan()
    engine_like = [{"device": 0, "start": 0.0, "end": 1.0, "kind": "busy", "label": "mb0 layer_0 fwd"},
                   {"device": 2, "start": 0.0, "end": 0.5, "kind": "busy", "label": "mb0 layer_0 fwd"},
                   {"device": 1, "start": 1.0, "end": 1.5, "kind": "wait", "label": "barrier"}]
    labelled = label_cp_groups(engine_like, plan)
    assert labelled[0]["group"] == 0 and labelled[0]["members"] == [0, 1]
    assert "group" not in labelled[1] and "group" not in labelled[2]  # a plain row; the barrier
    assert "group" not in engine_like[0]  # the input is left as it was
    for lockstep in (False, True):
        events = label_cp_groups(events_from_plan(plan, 2.0, lockstep=lockstep), plan)
        check_events(events, 3)
        cp = [e for e in events if e["kind"] == "busy" and "group" in e]
        assert sorted(e["device"] for e in cp) == [0, 1]
        assert max(e["end"] for e in events) == pytest.approx(2.0)


def test_long_tail_distribution_has_a_rare_tail_of_4_to_8_caps():
    x = LONGALIGN_LONG_TAIL.sample(20_000, seed=0)
    tail = x > 65536
    assert 0.01 < tail.mean() < 0.02
    assert x[tail].min() >= 4 * 65536 and x.max() <= 8 * 65536
    assert get_length_distribution("longalign_long_tail") is LONGALIGN_LONG_TAIL
    np.testing.assert_array_equal(LONGALIGN_LONG_TAIL.sample(64, seed=3), LONGALIGN_LONG_TAIL.sample(64, seed=3))


def test_data_aware_beats_lockstep_beats_fixed_cp_on_the_long_tail():
    result = cp_layouts_what_if(64, seqs_per_device=4, minibatches=1)
    assert result.cp_sequences >= 1
    assert result.data_aware_step <= result.lockstep_cp_step <= result.fixed_cp_step
    assert result.cp_idle_fraction < 0.15


def test_lb_mini_cp_plans_run_without_deadlock_at_scale():
    cost = cp_cost_for()
    lengths = LONGALIGN_LONG_TAIL.sample(64 * 4, seed=5)
    plan = lb_mini_cp(lengths, 64, 65536, cost_model=cost)
    result = simulate_cp_odc(plan, cost)
    assert result.step_time >= cost(lengths).sum() / 64  # never below the perfectly balanced compute


def test_a_rendered_timeline_shows_the_groups(tmp_path):
    from jodc.fsdp.timeline_analysis import plot_timeline

    path = tmp_path / "cp.png"
    rate = plot_timeline(timeline_events(simulate_cp_odc(_one_group_plan(), HAND)), str(path), num_devices=3)
    assert path.stat().st_size > 0 and 0 < rate < 1
