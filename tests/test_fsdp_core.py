"""The engine core (jodc/fsdp/engine.py, sharding.py): the one microbatch loop, the one update step, the one shard
arithmetic, and the capabilities engines declare."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fsdp_toy
from conftest import cpu_mesh
from jodc.fsdp import (ENGINES, CollectiveEngine, Engine, ODCEngine, OptimizerConfig, ReferenceEngine,
                       XlaSpmdEngine, engine_class, make_engine, sharding)
from jodc.fsdp.engine import accumulate, microbatch_loop, update_step
from jodc.fsdp.optim import learning_rate_schedule, make_optimizer
from jodc.ops.transports import registration

OPT = OptimizerConfig(learning_rate=3e-2, max_grad_norm=0.5, weight_decay=0.01)


@pytest.mark.parametrize("devices", [1, 2, 3, 8])
def test_shard_numels_are_the_native_layout(devices):
    numels = {f"g{n}": n for n in (1, 2, 15, 16, 17, 63, 64, 65, 1000, 4097, 123457)}
    lib = registration.cpu_library()
    assert sharding.shard_numels(numels, devices) == {g: int(lib.shard_numel(n, devices, 4))
                                                      for g, n in numels.items()}


def test_every_sharded_engine_splits_groups_as_the_heap_does():
    model, groups = fsdp_toy.make_model(num_layers=1)
    mesh = cpu_mesh(2)
    odc = ODCEngine(model, groups, mesh, optimizer=OPT)
    try:
        native = {g: b.shard_numel for g, b in odc.buckets.items()}
        assert odc.shard_numels == native
        assert CollectiveEngine(model, groups, mesh, optimizer=OPT).shard_numels == native
        assert XlaSpmdEngine(model, groups, mesh, optimizer=OPT).padded == {g: 2 * n for g, n in native.items()}
    finally:
        odc.close()


def test_microbatch_loop_runs_count_microbatches_at_their_bucket_lengths():
    """Microbatch i sees its row block cut to lengths[bucket[i]] and the normaliser; losses, metrics and the
    carried state add up over the first `count` microbatches only."""
    rng = np.random.default_rng(0)
    arrays = {"x": jnp.asarray(rng.standard_normal((4, 2, 8)), jnp.float32)}
    lengths, bucket = (2, 5, 8), jnp.asarray([2, 0, 1, 1])

    def run(mb, i, state):
        loss = jnp.sum(mb["x"]) / mb["normalizer"]
        return loss, {"tokens": jnp.float32(mb["x"].size)}, state + i + 1

    fn = jax.jit(lambda a, count: microbatch_loop(run, a, count, jnp.int32(0), normalizer=jnp.float32(2.0),
                                                  lengths=lengths, bucket=bucket, metric_names=("tokens",)))
    x = np.asarray(arrays["x"])
    for count in (0, 3, 4):
        loss, metrics, state = fn(arrays, count)
        cut = [x[i, :, :lengths[int(bucket[i])]] for i in range(count)]
        np.testing.assert_allclose(float(loss), sum(float(c.sum()) for c in cut) / 2.0, rtol=1e-5, atol=1e-6)
        assert float(metrics["tokens"]) == sum(c.size for c in cut)
        assert int(state) == count * (count + 1) // 2


def test_update_step_is_optax_clipping_then_adamw():
    """On whole parameters the core's update equals optax's own chain (global-norm clipping, then AdamW)."""
    rng = np.random.default_rng(1)
    params = {"a": jnp.asarray(rng.standard_normal((5, 3)), jnp.float32), "b": jnp.asarray(rng.standard_normal(7))}
    grads = jax.tree.map(lambda p: 3.0 * jnp.ones_like(p), params)
    tx = make_optimizer(OPT, learning_rate_schedule(OPT))
    plain = optax.chain(optax.clip_by_global_norm(OPT.max_grad_norm),
                        optax.adamw(OPT.learning_rate, b1=OPT.b1, b2=OPT.b2, eps=OPT.eps,
                                    weight_decay=OPT.weight_decay))
    state, plain_state, want = tx.init(params), plain.init(params), params
    got = params
    core = jax.jit(lambda p, s: update_step(tx, OPT, grads, p, s, jnp.float32(1.5), {"m": jnp.float32(2.0)}))

    @jax.jit
    def reference(p, s):
        updates, s = plain.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    for _ in range(3):
        got, state, loss, norm, metrics, applied = core(got, state)
        want, plain_state = reference(want, plain_state)
        assert bool(applied) and float(loss) == 1.5 and float(metrics["m"]) == 2.0
        np.testing.assert_allclose(float(norm), float(optax.tree.norm(grads)), rtol=1e-6)
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6, atol=1e-7)


def test_accumulate_sums_gradients():
    run = accumulate(lambda mb, i: ((mb["x"], {}), {"w": mb["x"] * 2}))
    loss, metrics, grads = run({"x": jnp.float32(3.0)}, 0, {"w": jnp.float32(1.0)})
    assert float(loss) == 3.0 and metrics == {} and float(grads["w"]) == 7.0


def test_engines_declare_their_capabilities():
    assert ODCEngine.supports_timeline and CollectiveEngine.supports_timeline
    assert not XlaSpmdEngine.supports_timeline and not ReferenceEngine.supports_timeline
    assert CollectiveEngine.lockstep and XlaSpmdEngine.lockstep
    assert not ODCEngine.lockstep and not ReferenceEngine.lockstep
    assert ODCEngine.supports_deterministic and ReferenceEngine.supports_deterministic
    assert not CollectiveEngine.supports_deterministic and not XlaSpmdEngine.supports_deterministic
    assert [ENGINES[n].default_planner for n in ("odc", "collective", "xla_spmd", "reference")] == \
        ["lb_mini", "lb_micro", "lb_micro", "lb_mini"]


def test_every_registered_engine_states_its_facts_in_its_own_class():
    """`jodc.fsdp.ENGINES` is the one list of engines, keyed by each class's own `name`; every class states each fact
    in its body, and a class that leaves one out is refused when it is defined."""
    assert list(ENGINES) == ["odc", "collective", "xla_spmd", "reference"]
    for name, cls in ENGINES.items():
        assert cls.name == name and engine_class(name) is cls
        assert all(fact in vars(cls) for fact in Engine.FACTS), name
    with pytest.raises(ValueError, match="unknown engine 'mpi'; engines are odc, collective, xla_spmd, reference"):
        engine_class("mpi")
    with pytest.raises(TypeError, match=r"must state its facts \['supports_timeline', 'default_planner'"):
        class Unfinished(Engine):  # noqa: F841  (refused while it is defined)
            name, lockstep = "unfinished", False


@pytest.mark.parametrize("name", ["odc", "collective", "xla_spmd", "reference"])
def test_make_engine_builds_every_engine_with_one_shape_and_its_own_options(name):
    """One constructor shape; options an engine does not declare (`Engine.options`) are dropped, declared ones
    reach it."""
    model, groups = fsdp_toy.make_model(num_layers=1)
    engine = make_engine(name, model, groups, cpu_mesh(2), optimizer=OPT, compute_dtype=jnp.float32,
                         length_buckets=(8,), deterministic=True, barrier_timeout_s=7.0, remat=False)
    try:
        assert type(engine) is ENGINES[name] and engine.num_devices == 2 and engine.length_buckets == (8,)
        if name == "odc":
            assert engine.heap.deterministic
        if name == "xla_spmd":
            assert engine.remat is False
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["xla_spmd", "reference"])
def test_a_timeline_from_an_engine_without_one_is_refused_before_dispatch(kind):
    """The trainer used to ask every engine for timelines (`jodc-train sft --engine xla_spmd --timeline_every N`
    crashed at step N, inside the engine): now the engine says so up front and refuses with a clear error that
    leaves its state untouched."""
    model, groups = fsdp_toy.make_model(num_layers=1)
    if kind == "xla_spmd":
        engine = XlaSpmdEngine(model, groups, cpu_mesh(2), optimizer=OPT)
    else:
        engine = ReferenceEngine(model, groups, cpu_mesh(2), optimizer=OPT)
    batch = fsdp_toy.random_minibatch([1, 1])
    before = engine.flat_params()
    with pytest.raises(ValueError, match=f"the {kind} engine cannot record timelines.*supports_timeline"):
        engine.step(batch, record_timeline=True)
    assert engine.steps_done == 0
    for g, v in engine.flat_params().items():
        np.testing.assert_array_equal(v, before[g])
    assert engine.step(batch).timeline is None and engine.steps_done == 1  # and it still trains


def test_the_engine_reports_the_learning_rate_of_its_schedule():
    """The engine builds the schedule once, runs it and reports it: `learning_rate` is the rate its next update
    uses (`steps_done` applied updates so far), what the trainers log."""
    cosine = OptimizerConfig(learning_rate=1e-2, schedule="cosine", warmup_steps=2, total_steps=4)
    model, groups = fsdp_toy.make_model(num_layers=1)
    engine = ReferenceEngine(model, groups, cpu_mesh(2), optimizer=cosine)
    schedule = learning_rate_schedule(cosine)
    assert engine.learning_rate == float(schedule(0))
    engine.step(fsdp_toy.random_minibatch([1, 1]))
    assert engine.learning_rate == float(schedule(1)) == pytest.approx(7.5e-3)


def test_meshes_without_a_d_axis_are_refused_by_name():
    model, groups = fsdp_toy.make_model(num_layers=1)
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:2]), ("x",))
    for cls, name in ((ODCEngine, "ODC"), (CollectiveEngine, "collective"), (XlaSpmdEngine, "SPMD")):
        with pytest.raises(ValueError, match=rf"the {name} engine needs a mesh with axes \('d',\) or \('r', 'd'\)"):
            cls(model, groups, mesh, optimizer=OPT)
