"""The context-parallel exchange over ODC with groups chosen at run time (jodc/ops/group/exchange.py): on 8 CPU
devices, two groups at once ([0, 3, 5, 6] and [1, 2], the others idle) in one compiled program, then other groups in the same
program; through two decoder layers each group's loss and gradients equal the one-device computation."""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import cp_group_checks as checks
from conftest import cpu_mesh
from jodc import ops
from jodc.ops.group.exchange import ExchangeSlots, OdcGroupExchange

# jaxlib 0.11 compiles the group ops with Shardy off only (docs/context_parallel.md, "Known issues")
pytestmark = pytest.mark.usefixtures("shardy_off_on_jaxlib_0_11")

WORLD = 8
SIZES = (4, 2)
GROUPINGS = [
    [[0, 3, 5, 6], [1, 2]],  # devices 4 and 7 idle
    [[7, 2, 4, 1], [6, 0]],  # other members, lists not sorted, other idle devices
]


@pytest.mark.parametrize("stream_kv", [False, True], ids=["all_gather", "streamed"])
def test_groups_chosen_at_run_time_give_the_one_device_loss_and_gradients(stream_kv, record_property):
    mesh = cpu_mesh(WORLD)
    layer_params = checks.params()
    cases = {k: checks.size_case(k, layer_params) for k in SIZES}
    with ops.SymmetricHeap(mesh, barrier_timeout_s=60) as heap:
        slots = ExchangeSlots.for_microbatch(heap, 1, checks.TOKEN_CAP, checks.CONFIG.num_kv_heads,
                                             checks.CONFIG.head_dim)
        program = jax.jit(jax.shard_map(checks.group_program(slots, SIZES, stream_kv=stream_kv), mesh=mesh, in_specs=(P("d"),) * 8,
                                        out_specs=P("d")))
        all_errors, seconds = {}, []
        for groups in GROUPINGS:
            inputs = checks.device_inputs(WORLD, groups, cases, SIZES, layer_params)
            start = time.monotonic()
            loss, dparams, dh, token = ops.block_until_ready(program(*inputs), heap)
            seconds.append(time.monotonic() - start)
            idle = sorted(set(range(WORLD)) - {d for g in groups for d in g})
            for d in idle:
                assert float(loss[d]) == 0.0 and not np.asarray(dh[d]).any()
            all_errors.update(checks.group_errors(groups, cases, loss, dparams, dh))
        assert program._cache_size() == 1  # one compiled program served both groupings
    worst = max(all_errors.values())
    record_property("relative_errors_max", worst)
    record_property("seconds_per_call", seconds)
    print(f"max relative error {worst:.2e}; seconds per call (first compiles) {seconds}")
    assert worst <= 1e-5, {k: v for k, v in all_errors.items() if v > 1e-5}


def test_exchange_refuses_what_does_not_fit_or_is_not_a_member_list():
    mesh = cpu_mesh(2)
    with ops.SymmetricHeap(mesh, barrier_timeout_s=60) as heap:
        with pytest.raises(ValueError, match="slot_numel must be a positive int"):
            ExchangeSlots(heap, 0)
        slots = ExchangeSlots(heap, 10)
        assert slots.float_buckets[0].shard_numel >= 10
        with pytest.raises(ValueError, match=r"members must be an int32 \[k\] array, got float32\[2\]"):
            OdcGroupExchange(slots, jnp.array([0.0, 1.0]))

        def gather_too_much(_):
            return OdcGroupExchange(slots, jnp.array([0, 1], jnp.int32)).all_gather(jnp.zeros(11))

        with pytest.raises(ValueError, match="an array of 11 elements .* does not fit the slots of 10"):
            jax.jit(jax.shard_map(gather_too_much, mesh=mesh, in_specs=P("d"), out_specs=P("d"))).trace(jnp.zeros(2))
