"""Schedule simulator: collective FSDP vs ODC step times, bubbles, timelines, and the step model behind them."""
import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jodc.balance import DEEPSEEK_R1_DISTILL_QWEN_1_5B, Microbatch, ModelShape, Plan, get_planner
from jodc.sim import (
    A100_SXM_80GB,
    HardwareSpec,
    StepConfig,
    bucket_steps,
    communication_times,
    compare_schedules,
    compute_times,
    simulate,
    simulate_collective,
    simulate_odc,
    transfer_time,
)

GOLDEN = DEEPSEEK_R1_DISTILL_QWEN_1_5B
FREE = A100_SXM_80GB.with_free_communication()
SMALL = ModelShape("small", num_layers=2, hidden=64, intermediate=128, num_heads=4, num_kv_heads=2, vocab=100)


def plan_of(*devices, cap=65536):
    """A plan from per-device lists of microbatches, each a list of sequence lengths; indices in order."""
    next_index = 0
    built = []
    for device in devices:
        mbs = []
        for lengths in device:
            indices = tuple(range(next_index, next_index + len(lengths)))
            next_index += len(lengths)
            mbs.append(Microbatch(indices, tuple(lengths), float(sum(lengths))))
        built.append(tuple(mbs))
    return Plan(tuple(built), cap)


@pytest.mark.parametrize("hardware", [A100_SXM_80GB, FREE], ids=["a100", "free"])
def test_identical_devices_have_no_bubbles(hardware):
    plan = plan_of(*[[[4096, 1024], [8192]]] * 4)
    for result in (simulate_collective(plan, GOLDEN, hardware), simulate_odc(plan, GOLDEN, hardware)):
        assert result.bubble_rate == pytest.approx(0.0, abs=1e-12)
        assert max(result.device_busy) == pytest.approx(result.step_time)


@given(
    st.lists(st.integers(1, 65536), min_size=1, max_size=48),
    st.integers(1, 8),
    st.sampled_from(["local_sort", "lb_micro", "lb_mini"]),
)
@settings(max_examples=40, deadline=None)
def test_odc_never_slower_than_collective_when_communication_is_free(lengths, devices, name):
    plan = get_planner(name)(lengths, devices, 65536)
    comparison = compare_schedules(plan, GOLDEN, FREE)
    assert comparison.odc.step_time <= comparison.collective.step_time * (1 + 1e-12)
    assert comparison.speedup >= 1 - 1e-12
    assert comparison.odc.bubble_rate <= comparison.collective.bubble_rate + 1e-12


@given(st.lists(st.integers(1, 65536), min_size=1, max_size=8))
@settings(max_examples=30, deadline=None)
def test_one_sequence_per_device_takes_the_same_time_under_both(lengths):
    plan = plan_of(*[[[s]] for s in lengths])
    free = compare_schedules(plan, GOLDEN, FREE)
    assert free.odc.step_time == pytest.approx(free.collective.step_time, rel=1e-12)
    # with real links both move the same bytes per bucket; ODC adds only its one synchronisation
    real = compare_schedules(plan, GOLDEN, A100_SXM_80GB)
    sync = 2 * A100_SXM_80GB.link_latency if len(lengths) > 1 else 0.0
    assert real.odc.step_time == pytest.approx(real.collective.step_time + sync, rel=1e-12)


def test_single_device_step_is_four_forward_passes_of_compute():
    lengths = [3000, 500, 12000]
    plan = plan_of([lengths[:2], lengths[2:]])
    expected = 4 * GOLDEN.sequence_forward_flops(lengths).sum() / A100_SXM_80GB.achieved_flops  # fwd + recompute + 2 x bwd
    for result in (simulate(plan, GOLDEN, A100_SXM_80GB, "collective"), simulate(plan, GOLDEN, A100_SXM_80GB, "odc")):
        assert result.step_time == pytest.approx(expected, rel=1e-12)
        assert result.samples_per_s == pytest.approx(3 / expected)
        assert result.tokens_per_s == pytest.approx(sum(lengths) / expected)
    no_recompute = simulate_odc(plan, GOLDEN, A100_SXM_80GB, StepConfig(recompute=False))
    assert no_recompute.step_time == pytest.approx(expected * 3 / 4, rel=1e-12)


def test_misaligned_microbatches_cost_collective_twice_the_heavy_one():
    # device 0 runs (heavy, light), device 1 (light, heavy): lock-step pays heavy twice, ODC heavy + light
    heavy, light = 32768, 1024
    plan = plan_of([[heavy], [light]], [[light], [heavy]])
    t_heavy = 4 * GOLDEN.sequence_forward_flops([heavy])[0] / FREE.achieved_flops
    t_light = 4 * GOLDEN.sequence_forward_flops([light])[0] / FREE.achieved_flops
    comparison = compare_schedules(plan, GOLDEN, FREE)
    assert comparison.collective.step_time == pytest.approx(2 * t_heavy, rel=1e-12)
    assert comparison.odc.step_time == pytest.approx(t_heavy + t_light, rel=1e-12)
    assert comparison.speedup == pytest.approx(2 * t_heavy / (t_heavy + t_light))
    assert comparison.collective.bubble_rate == pytest.approx(1 - (t_heavy + t_light) / (2 * t_heavy))


def test_collective_pays_communication_for_empty_slots_and_odc_skips_them():
    plan = plan_of([[1000], [1000]], [[1000]])  # device 1 has one microbatch fewer
    steps = bucket_steps(GOLDEN, StepConfig())
    per_microbatch = float(
        transfer_time(steps.gather_bytes, 2, 300e9, 10e-6).sum() + transfer_time(steps.scatter_bytes, 2, 300e9, 10e-6).sum()
    )
    collective = simulate_collective(plan, GOLDEN, A100_SXM_80GB)
    odc = simulate_odc(plan, GOLDEN, A100_SXM_80GB)
    assert collective.device_comm == pytest.approx((2 * per_microbatch, 2 * per_microbatch))
    assert odc.device_comm == pytest.approx((2 * per_microbatch, per_microbatch))


def test_bucket_steps_move_every_parameter_twice_and_every_gradient_once():
    steps = bucket_steps(GOLDEN, StepConfig())
    assert len(steps.names) == 2 * (GOLDEN.num_layers + 2)
    assert steps.names[0] == "fwd:embedding" and steps.names[-1] == "bwd:embedding"
    assert steps.gather_bytes.sum() == 2 * 4 * GOLDEN.total_params
    assert steps.scatter_bytes.sum() == 4 * GOLDEN.total_params


def test_compute_and_communication_times_by_visit():
    plan = plan_of([[1000, 24]], [[512]])  # device 0: one microbatch of two sequences; device 1: one of 512
    t = compute_times(plan, SMALL, A100_SXM_80GB, StepConfig())
    assert t.shape == (2, 1, 2 * (SMALL.num_layers + 2))
    # forward of one decoder layer on device 0: linear over 1024 tokens + attention over each sequence alone
    layer = 2 * SMALL.layer_matmul_params * 1024 + 2 * SMALL.attention_width * (1000 * 1001 + 24 * 25)
    assert t[0, 0, 1] == pytest.approx(layer / A100_SXM_80GB.achieved_flops)
    assert t[0, 0, 0] == 0.0  # the embedding lookup counts as free
    assert t[0, 0, -2] == pytest.approx(3 * t[0, 0, 1])  # backward of that layer: recompute + 2 x forward
    steps = bucket_steps(SMALL, StepConfig())
    c = communication_times(steps, 2, A100_SXM_80GB, p2p=False)
    assert c[1] == pytest.approx(1e-5 + 0.5 * 4 * SMALL.layer_params / 300e9)  # forward: gather only
    assert c[-2] == pytest.approx(2 * c[1])  # backward: gather again + scatter the fp32 gradient
    slow = dataclasses.replace(A100_SXM_80GB, p2p_efficiency=0.5)
    assert communication_times(steps, 2, slow, p2p=True)[1] == pytest.approx(1e-5 + 0.5 * 4 * SMALL.layer_params / 150e9)


def test_transfer_time():
    assert transfer_time(np.array([1e9]), 1, 1e9, 1e-5)[0] == 0.0
    assert transfer_time(np.array([8e9]), 8, 1e9, 1e-5)[0] == pytest.approx(1e-5 + 7.0)
    assert transfer_time(np.array([0.0]), 8, 1e9, 1e-5)[0] == 0.0
    assert transfer_time(np.array([8e9]), 8, math.inf, 0.0)[0] == 0.0


@pytest.mark.parametrize("schedule", ["collective", "odc"])
def test_timeline_segments_are_consistent_with_the_totals(schedule):
    plan = get_planner("lb_mini")([9000, 4000, 3000, 2000, 20000, 1000], 3, 32768)
    result = simulate(plan, SMALL, A100_SXM_80GB, schedule, with_timeline=True)
    for d in range(plan.num_devices):
        own = sorted((s for s in result.timeline if s.device == d), key=lambda s: s.start)
        assert all(a.end <= b.start + 1e-15 for a, b in zip(own, own[1:]))  # no overlap
        assert all(0 <= s.start < s.end <= result.step_time * (1 + 1e-12) for s in own)
        assert sum(s.end - s.start for s in own) == pytest.approx(result.device_busy[d], rel=1e-9)
    assert simulate(plan, SMALL, A100_SXM_80GB, schedule).timeline is None


def test_hardware_and_config_validation():
    with pytest.raises(ValueError, match="at most 1"):
        HardwareSpec("x", 1e12, 1.5, 1e9, 0.0)
    with pytest.raises(ValueError, match="peak_flops"):
        HardwareSpec("x", 0.0, 0.5, 1e9, 0.0)
    with pytest.raises(ValueError, match="link_bandwidth"):
        HardwareSpec("x", 1e12, 0.5, -1.0, 0.0)
    with pytest.raises(ValueError, match="link_latency"):
        HardwareSpec("x", 1e12, 0.5, 1e9, -1e-6)
    with pytest.raises(ValueError, match="p2p_efficiency"):
        HardwareSpec("x", 1e12, 0.5, 1e9, 0.0, p2p_efficiency=0.0)
    assert A100_SXM_80GB.achieved_flops == pytest.approx(312e12 * 0.45)
    with pytest.raises(ValueError, match="gather_bytes_per_param"):
        StepConfig(gather_bytes_per_param=0)
    with pytest.raises(ValueError, match="recompute"):
        StepConfig(recompute=1)


def test_simulator_rejects_bad_arguments():
    plan = plan_of([[100]])
    with pytest.raises(ValueError, match="unknown schedule"):
        simulate(plan, GOLDEN, A100_SXM_80GB, "pipeline")
    with pytest.raises(ValueError, match="plan must be a Plan"):
        simulate_odc([100], GOLDEN, A100_SXM_80GB)
    with pytest.raises(ValueError, match="hardware must be a HardwareSpec"):
        simulate_collective(plan, GOLDEN, "A100")
    with pytest.raises(ValueError, match="no sequences"):
        simulate_odc(Plan(((),), 16), GOLDEN, A100_SXM_80GB)
