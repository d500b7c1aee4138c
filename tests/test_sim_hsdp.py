"""Multi-node layout simulator (jodc.sim.hsdp): its communication formulas by hand, agreement with the one-node
schedules, the per-minibatch vs per-microbatch cross-replica reduce, and what-if / crossover results."""
import dataclasses
import math

import numpy as np
import pytest

from jodc.balance import DEEPSEEK_R1_DISTILL_QWEN_1_5B, Microbatch, ModelShape, Plan, get_planner
from jodc.sim import (
    A100_NODES_400G,
    A100_SXM_80GB,
    FLAT_COLLECTIVE,
    FLAT_ODC,
    HSDP_COLLECTIVE,
    HSDP_ODC,
    Layout,
    NodeTopology,
    StepConfig,
    bucket_steps,
    compare_schedules,
    group_transfer_time,
    hsdp_what_if,
    inter_bandwidth_crossover,
    replica_all_reduce_time,
    simulate_layout,
)

GOLDEN = DEEPSEEK_R1_DISTILL_QWEN_1_5B
SMALL = ModelShape("small", num_layers=2, hidden=64, intermediate=128, num_heads=4, num_kv_heads=2, vocab=100)
TOPOLOGY = A100_NODES_400G


def plan_of(*devices, cap=65536):
    """A plan from per-device lists of microbatches (each a list of sequence lengths)."""
    index, built = 0, []
    for device in devices:
        mbs = []
        for lengths in device:
            mbs.append(Microbatch(tuple(range(index, index + len(lengths))), tuple(lengths), float(sum(lengths))))
            index += len(lengths)
        built.append(tuple(mbs))
    return Plan(tuple(built), cap)


def uneven_plan(devices, seed=0):
    rng = np.random.default_rng(seed)
    return plan_of(*[[[int(x) for x in rng.integers(256, 8192, size=int(rng.integers(1, 3)))]
                      for _ in range(int(rng.integers(1, 4)))] for _ in range(devices)])


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_inside_one_node_the_flat_layouts_are_the_one_node_schedules(devices):
    plan = uneven_plan(devices)
    comparison = compare_schedules(plan, GOLDEN, A100_SXM_80GB)
    assert simulate_layout(plan, GOLDEN, TOPOLOGY, FLAT_ODC).step_time == pytest.approx(
        comparison.odc.step_time, rel=1e-12)
    assert simulate_layout(plan, GOLDEN, TOPOLOGY, FLAT_COLLECTIVE).step_time == pytest.approx(
        comparison.collective.step_time, rel=1e-12)


def test_group_transfers_by_hand():
    B = 8e9
    link, inter = A100_SXM_80GB.link_bandwidth, TOPOLOGY.inter_bandwidth
    # inside a node: the ring / point-to-point formula of jodc.sim.step_model
    assert group_transfer_time(B, 4, TOPOLOGY, p2p=True) == pytest.approx(10e-6 + 3 / 4 * B / link)
    # 32 devices over 4 nodes, point to point: 24/32 of B crosses this device's own port at half its bandwidth,
    # 7/32 comes over NVLink at the same time
    far = 24 / 32 * B / (inter * 0.5)
    assert far > 7 / 32 * B / link
    assert group_transfer_time(B, 32, TOPOLOGY, p2p=True) == pytest.approx(20e-6 + far)
    # a ring per rail: the node's 8 ports carry the cross-node part, NVLink (300 GB/s < 8 x 50) bounds it
    assert group_transfer_time(B, 32, TOPOLOGY, p2p=False) == pytest.approx(20e-6 + 31 / 32 * B / link)
    slow_ports = dataclasses.replace(TOPOLOGY, inter_bandwidth=12.5e9)
    assert group_transfer_time(B, 32, slow_ports, p2p=False) == pytest.approx(20e-6 + 31 / 32 * B / 100e9)
    # nothing moves: no time, not even latency; one device: nothing to move
    assert group_transfer_time(0.0, 32, TOPOLOGY, p2p=True) == 0.0
    assert group_transfer_time(B, 1, TOPOLOGY, p2p=False) == 0.0
    # replicas on other nodes: a ring all-reduce over the device's rail; all in one node: over NVLink
    assert replica_all_reduce_time(B, 4, 8, TOPOLOGY) == pytest.approx(20e-6 + 2 * 3 / 4 * B / inter)
    assert replica_all_reduce_time(B, 2, 4, TOPOLOGY) == pytest.approx(10e-6 + B / link)
    assert replica_all_reduce_time(B, 1, 8, TOPOLOGY) == 0.0


def test_hsdp_odc_reduces_across_replicas_once_per_minibatch_and_collective_once_per_microbatch():
    one = plan_of(*[[[2048]]] * 16)
    three = plan_of(*[[[2048], [2048], [2048]]] * 16)
    steps = bucket_steps(SMALL, StepConfig())
    shard_reduce = float(replica_all_reduce_time(steps.scatter_bytes.sum() / 8, 2, 8, TOPOLOGY))
    odc_one, odc_three = (simulate_layout(p, SMALL, TOPOLOGY, HSDP_ODC) for p in (one, three))
    assert odc_one.per_minibatch_reduce == odc_three.per_minibatch_reduce == pytest.approx(shard_reduce)
    assert odc_one.replicas == 2 and odc_one.shard_size == 8
    # identical devices: the step is the own work + one barrier across nodes + the one reduce
    flat_odc = simulate_layout(one, SMALL, TOPOLOGY, Layout("odc", 16))
    assert flat_odc.per_minibatch_reduce == 0.0
    collective = [simulate_layout(p, SMALL, TOPOLOGY, HSDP_COLLECTIVE) for p in (one, three)]
    per_visit = replica_all_reduce_time(steps.scatter_bytes / 8, 2, 8, TOPOLOGY)
    in_group = (group_transfer_time(steps.gather_bytes, 8, TOPOLOGY, p2p=False)
                + group_transfer_time(steps.scatter_bytes, 8, TOPOLOGY, p2p=False))
    assert collective[0].comm_per_microbatch == pytest.approx(float((in_group + per_visit).sum()))
    assert collective[1].step_time - collective[0].step_time == pytest.approx(
        2 * (collective[0].step_time), rel=1e-9)  # three identical microbatches: three times one
    assert odc_three.step_time - odc_one.step_time == pytest.approx(
        2 * (odc_one.step_time - 2 * 20e-6 - shard_reduce), rel=1e-9)


def test_state_memory_shrinks_with_the_shard_group():
    plan = uneven_plan(16)
    flat, hsdp = (simulate_layout(plan, GOLDEN, TOPOLOGY, layout) for layout in (FLAT_ODC, HSDP_ODC))
    assert flat.state_gb_per_device == pytest.approx(GOLDEN.total_params * 16 / 16 / 1e9)
    assert hsdp.state_gb_per_device == pytest.approx(2 * flat.state_gb_per_device)


def test_free_cross_node_links_favour_flat_odc_and_slow_ones_hsdp():
    plan = uneven_plan(32, seed=3)
    free = dataclasses.replace(TOPOLOGY, inter_bandwidth=math.inf, inter_latency=0.0)
    assert (simulate_layout(plan, GOLDEN, free, FLAT_ODC).step_time
            <= simulate_layout(plan, GOLDEN, free, HSDP_ODC).step_time)
    assert (simulate_layout(plan, GOLDEN, TOPOLOGY, HSDP_ODC).step_time
            < simulate_layout(plan, GOLDEN, TOPOLOGY, FLAT_ODC).step_time)
    crossing = inter_bandwidth_crossover(plan, GOLDEN, TOPOLOGY, FLAT_ODC, HSDP_ODC)
    assert TOPOLOGY.inter_bandwidth < crossing < 1e13
    at = dataclasses.replace(TOPOLOGY, inter_bandwidth=crossing)
    flat, hsdp = (simulate_layout(plan, GOLDEN, at, layout).step_time for layout in (FLAT_ODC, HSDP_ODC))
    assert flat == pytest.approx(hsdp, rel=1e-6)
    # one that is still slower at the top of the range never catches up (None); a tie holds from the bottom
    assert inter_bandwidth_crossover(plan, GOLDEN, TOPOLOGY, HSDP_ODC, FLAT_ODC) is None
    assert inter_bandwidth_crossover(plan, GOLDEN, TOPOLOGY, HSDP_ODC, HSDP_ODC) == 1e8
    never = inter_bandwidth_crossover(plan, GOLDEN, TOPOLOGY, FLAT_COLLECTIVE, HSDP_ODC)
    assert never is None or never > TOPOLOGY.inter_bandwidth


def test_what_if_on_two_nodes_of_long_context_sft():
    result = hsdp_what_if(16, seqs_per_device=8, minibatches=2)
    assert result.devices == 16 and result.setting == "longalign_sft"
    assert [r.layout for r in result.rows] == ["flat ODC", "HSDP-ODC (8)", "HSDP-collective (8)", "flat collective"]
    assert result.winner == "HSDP-ODC (8)"
    assert result.row(HSDP_ODC).step_time < result.row("HSDP-collective (8)").step_time
    assert all(0 <= r.bubble_rate < 1 and r.samples_per_s > 0 for r in result.rows)
    with pytest.raises(KeyError, match="no layout"):
        result.row("HSDP-ODC (4)")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown schedule"):
        Layout("nccl", 8)
    with pytest.raises(ValueError, match="shard_size"):
        Layout("odc", 0)
    with pytest.raises(ValueError, match="does not divide 12 devices"):
        hsdp_what_if(12)
    with pytest.raises(ValueError, match="inter_p2p_efficiency"):
        NodeTopology("x", A100_SXM_80GB, inter_p2p_efficiency=1.5)
    with pytest.raises(ValueError, match="inter_latency"):
        NodeTopology("x", A100_SXM_80GB, inter_latency=-1)
    with pytest.raises(ValueError, match="device must be a HardwareSpec"):
        NodeTopology("x", "a100")
    with pytest.raises(ValueError, match="plan must be a Plan"):
        simulate_layout([1, 2], GOLDEN, TOPOLOGY, HSDP_ODC)
    with pytest.raises(ValueError, match="layouts is empty"):
        hsdp_what_if(8, layouts=())


def test_what_if_plans_the_whole_world_with_lb_mini():
    result = hsdp_what_if(16, seqs_per_device=4, layouts=(HSDP_ODC,), seed=5)
    from jodc.balance import FlopsCost
    from jodc.sim import LONGALIGN_SFT

    plan = get_planner("lb_mini")(LONGALIGN_SFT.sample(64, seed=5), 16, 65536, cost_model=FlopsCost(GOLDEN))
    assert result.rows[0].step_time == pytest.approx(simulate_layout(plan, GOLDEN, TOPOLOGY, HSDP_ODC).step_time)
