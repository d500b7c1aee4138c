"""The ODC and collective engines against the unsharded reference: same parameters after three steps."""
import numpy as np
import pytest

import fsdp_toy
from conftest import compilations, cpu_mesh
from jodc.fsdp import CollectiveEngine, ODCEngine, OptimizerConfig, ReferenceEngine, XlaSpmdEngine

OPT = OptimizerConfig(learning_rate=3e-2, max_grad_norm=0.5, weight_decay=0.01)
UNEVEN = {1: [[3], [1], [2]], 2: [[3, 1], [0, 2], [2, 2]], 4: [[3, 1, 0, 2], [1, 1, 2, 3], [2, 0, 1, 1]],
          8: [[3, 1, 0, 2, 1, 1, 2, 0], [1, 2, 2, 1, 1, 3, 0, 1], [1, 1, 1, 1, 2, 1, 1, 1]]}


def run_steps(engine, batches):
    losses = [engine.step(b).loss for b in batches]
    params = engine.flat_params()
    return losses, params


def assert_params_close(a, b, rtol=1e-5):
    for g in a:
        scale = max(np.abs(a[g]).max(), 1e-6)
        np.testing.assert_allclose(a[g], b[g], rtol=rtol, atol=rtol * scale, err_msg=f"group {g}")


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_engines_match_reference(devices):
    model, groups = fsdp_toy.make_model(num_layers=2, tied=devices == 4)
    batches = [fsdp_toy.random_minibatch(c, seed=s) for s, c in enumerate(UNEVEN[devices])]
    mesh = cpu_mesh(devices)
    ref_losses, ref_params = run_steps(ReferenceEngine(model, groups, optimizer=OPT), batches)
    odc = ODCEngine(model, groups, mesh, optimizer=OPT)
    try:
        odc_losses, odc_params = run_steps(odc, batches)
    finally:
        odc.close()
    col_losses, col_params = run_steps(CollectiveEngine(model, groups, mesh, optimizer=OPT), batches)
    if devices in (2, 4):
        spmd_losses, spmd_params = run_steps(XlaSpmdEngine(model, groups, mesh, optimizer=OPT), batches)
        np.testing.assert_allclose(spmd_losses, ref_losses, rtol=1e-5)
        assert_params_close(spmd_params, ref_params)
    np.testing.assert_allclose(odc_losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(col_losses, ref_losses, rtol=1e-5)
    assert_params_close(odc_params, ref_params)
    assert_params_close(col_params, ref_params)
    # the parameters really moved
    assert max(np.abs(ref_params[g] - v).max() for g, v in model.flatten_groups(groups).items()) > 1e-3


def test_deterministic_odc_is_bitwise_repeatable():
    model, groups = fsdp_toy.make_model(num_layers=2)
    batches = [fsdp_toy.random_minibatch(c, seed=s) for s, c in enumerate(UNEVEN[8])]
    results = []
    for _ in range(2):
        engine = ODCEngine(model, groups, cpu_mesh(8), optimizer=OPT, deterministic=True)
        try:
            results.append(run_steps(engine, batches))
        finally:
            engine.close()
    (l1, p1), (l2, p2) = results
    assert l1 == l2
    for g in p1:
        assert p1[g].tobytes() == p2[g].tobytes(), g


def test_state_dict_round_trip_resumes_exactly():
    model, groups = fsdp_toy.make_model(num_layers=1)
    batches = [fsdp_toy.random_minibatch(c, seed=s) for s, c in enumerate(UNEVEN[2] * 2)]
    mesh = cpu_mesh(2)
    straight = ODCEngine(model, groups, mesh, optimizer=OPT, deterministic=True)
    try:
        losses, params = run_steps(straight, batches)
    finally:
        straight.close()
    first = ODCEngine(model, groups, mesh, optimizer=OPT, deterministic=True)
    try:
        run_steps(first, batches[:3])
        state = first.state_dict()
    finally:
        first.close()
    # resume on a different engine kind and device count, then back on ODC: the state is canonical
    resumed = ODCEngine(model, groups, mesh, optimizer=OPT, deterministic=True)
    try:
        resumed.load_state_dict(state)
        assert resumed.steps_done == 3
        more, params2 = run_steps(resumed, batches[3:])
    finally:
        resumed.close()
    assert more == losses[3:]
    for g in params:
        assert params[g].tobytes() == params2[g].tobytes()
    ref = ReferenceEngine(model, groups, optimizer=OPT)
    ref.load_state_dict(state)
    _, ref_params = run_steps(ref, batches[3:])
    assert_params_close(ref_params, params)


def test_bad_batches_are_rejected():
    model, groups = fsdp_toy.make_model(num_layers=1)
    engine = ODCEngine(model, groups, cpu_mesh(2), optimizer=OPT)
    try:
        with pytest.raises(ValueError, match="planned for 4"):
            engine.step(fsdp_toy.random_minibatch([1, 1, 1, 1]))
    finally:
        engine.close()
    with pytest.raises(ValueError, match="lack groups"):
        ODCEngine(model, {"embed": groups["embed"]}, cpu_mesh(2), optimizer=OPT)
    # a decaying schedule needs its length: the config may leave it to the trainer, the engine refuses it
    decaying = OptimizerConfig(schedule="cosine")
    with pytest.raises(ValueError, match="needs optimizer.total_steps"):
        ODCEngine(model, groups, cpu_mesh(2), optimizer=decaying)


@pytest.mark.parametrize("engine_cls", [ODCEngine, CollectiveEngine])
def test_timeline_records_every_stage_of_every_microbatch(engine_cls):
    from jodc.fsdp.timeline_analysis import bubble_rate

    model, groups = fsdp_toy.make_model(num_layers=2)
    counts = [3, 1]
    batch = fsdp_toy.random_minibatch(counts, seed=1)
    engine = engine_cls(model, groups, cpu_mesh(2), optimizer=OPT)
    try:
        plain = engine.step(batch)
        recorded = engine.step(batch, record_timeline=True)
    finally:
        engine.close()
    assert plain.timeline is None
    events = recorded.timeline
    ran = counts if engine_cls is ODCEngine else [max(counts)] * 2
    for device, n in enumerate(ran):
        labels = [e["label"] for e in events if e["device"] == device]
        for mb in range(n):
            for stage in ("embed", "layer_0", "layer_1", "head"):
                assert f"mb{mb} {stage} fwd" in labels, (device, mb, stage, labels)
            for stage in ("embed", "layer_0", "layer_1"):
                assert f"mb{mb} {stage} bwd" in labels, (device, mb, stage, labels)
        for e in events:
            assert e["end"] >= e["start"] >= 0
    if engine_cls is ODCEngine:
        waits = [e for e in events if e["kind"] == "wait"]
        assert len(waits) == 4 and {e["device"] for e in waits} == {0, 1}  # two barriers per device
    assert 0.0 <= bubble_rate(events) < 1.0


def test_no_engine_compiles_its_step_twice():
    """The second minibatch of the same shapes reuses the first's program: every engine's initial state is placed
    as its step's outputs are (an uncommitted optimizer count used to cost the reference and SPMD engines a second
    compilation of the whole step)."""
    with compilations() as compiles:
        _check_second_steps_compile_nothing(compiles)


def _check_second_steps_compile_nothing(compiles):
    model, groups = fsdp_toy.make_model(num_layers=1)
    mesh = cpu_mesh(2)
    engines = {"reference": lambda: ReferenceEngine(model, groups, mesh, optimizer=OPT),
               "odc": lambda: ODCEngine(model, groups, mesh, optimizer=OPT),
               "collective": lambda: CollectiveEngine(model, groups, mesh, optimizer=OPT),
               "xla_spmd": lambda: XlaSpmdEngine(model, groups, mesh, optimizer=OPT)}
    batch = fsdp_toy.random_minibatch([2, 1], seed=0)
    for name, build in engines.items():
        engine = build()
        try:
            engine.step(batch)
            before = len(compiles)
            engine.step(batch)
            engine.step(batch)
            assert len(compiles) == before, f"the {name} engine compiled again on steps 2-3"
        finally:
            getattr(engine, "close", lambda: None)()


def test_spmd_step_gathers_one_stage_at_a_time():
    """The XLA-SPMD engine's forward + backward holds one stage's parameters gathered at a time, as FSDP does: the
    temporary memory of its compiled loss gradient does not grow with the number of layers beyond the activations
    (under 1 byte per parameter per device between 2 and 6 layers). Before, every group was constrained to be
    replicated at once: 8.0 bytes per parameter per device here, 0.1 now. (A per-stage `jax.checkpoint` was not
    enough: XLA hoisted or front-scheduled every stage's gathers and reduced every stage's gradient at the end of the
    backward; bench/step_memory.py, docs/mpi.md.)"""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from conftest import cpu_mesh
    from jodc.fsdp import OptimizerConfig, XlaSpmdEngine
    from jodc.train.core.staged_decoder import decoder_staged_model
    from jodc.models import DecoderConfig

    mesh = cpu_mesh(2)
    sizes = {}
    for layers in (2, 6):
        config = DecoderConfig(vocab_size=64, hidden_size=128, intermediate_size=384, num_layers=layers, num_heads=2,
                               num_kv_heads=1, attention_block_size=32, max_position_embeddings=64)
        model, groups = decoder_staged_model(config, seed=0)
        engine = XlaSpmdEngine(model, groups, mesh, optimizer=OptimizerConfig(learning_rate=1e-3))
        tokens = jnp.zeros((2, 64), jnp.int32)
        microbatch = jax.device_put({"tokens": tokens, "targets": tokens, "loss_mask": jnp.ones((2, 64), jnp.float32),
                                     "positions": jnp.tile(jnp.arange(64, dtype=jnp.int32), (2, 1)),
                                     "segment_ids": jnp.ones((2, 64), jnp.int32)}, NamedSharding(mesh, P("d")))
        microbatch["normalizer"] = jnp.float32(1.0)
        grad = jax.jit(jax.value_and_grad(engine._loss, has_aux=True))
        stats = grad.lower(engine.flats, microbatch).compile().memory_analysis()
        sizes[layers] = (sum(engine.numels.values()), stats.temp_size_in_bytes)
        engine.close()
    (n2, t2), (n6, t6) = sizes[2], sizes[6]
    assert (t6 - t2) / (n6 - n2) < 1.0, sizes
