"""Sharded checkpoints (train/core/checkpoint.py over `Engine.sharded_state`): saved from one layout, restored into
another (device count, flat or HSDP, engine kind) bit for bit; checkpoints of the earlier host format load; another
model's checkpoint is refused before anything is read; initial parameters are placed per device range."""
import jax
import numpy as np
import pytest

import fsdp_toy
from jodc.fsdp import CollectiveEngine, ODCEngine, OptimizerConfig, ReferenceEngine, XlaSpmdEngine, sharding, state
from jodc.train.core.checkpoint import NUMELS_KEY, CheckpointStore

OPT = OptimizerConfig(learning_rate=3e-2, max_grad_norm=1.0, weight_decay=0.01)


def flat_mesh(n):
    return sharding.hsdp_mesh(jax.devices()[:n], 1)


def make(kind, model, groups, n, replicas=1):
    mesh = sharding.hsdp_mesh(jax.devices()[:n], replicas)
    if kind == "odc":
        return ODCEngine(model, groups, mesh, optimizer=OPT, deterministic=True)
    if kind == "collective":
        return CollectiveEngine(model, groups, mesh, optimizer=OPT)
    if kind == "xla_spmd":
        return XlaSpmdEngine(model, groups, mesh, optimizer=OPT)
    return ReferenceEngine(model, groups, mesh, optimizer=OPT)


def trained(kind, n, replicas=1, steps=2, num_layers=2, tied=True):
    model, groups = fsdp_toy.make_model(num_layers=num_layers, tied=tied)
    engine = make(kind, model, groups, n, replicas)
    for s in range(steps):
        engine.step(fsdp_toy.random_minibatch(np.full(n, 2), seed=s))
    return model, groups, engine


def assert_same_state(a: dict, b: dict):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), jax.tree_util.keystr(path)


# (saved by, restored into): device counts 1, 2, 4, 8, HSDP, every engine kind
LAYOUTS = [
    (("odc", 4, 1), ("odc", 2, 1)),
    (("odc", 2, 1), ("odc", 8, 1)),
    (("odc", 8, 1), ("collective", 1, 1)),
    (("collective", 4, 2), ("odc", 4, 1)),
    (("odc", 6, 3), ("xla_spmd", 4, 2)),
    (("xla_spmd", 2, 1), ("reference", 1, 1)),
    (("reference", 1, 1), ("odc", 4, 2)),
]


@pytest.mark.parametrize("saved_by,restored_into", LAYOUTS, ids=lambda x: f"{x[0]}{x[1]}x{x[2]}")
def test_a_checkpoint_restores_into_any_layout_bit_for_bit(tmp_path, saved_by, restored_into):
    model, groups, source = trained(*saved_by)
    store = CheckpointStore(str(tmp_path / "ck"), keep=2)
    try:
        store.save(2, source.sharded_state(), {NUMELS_KEY: source.numels})
        want = source.state_dict()
        engine = make(restored_into[0], model, groups, restored_into[1], restored_into[2])
        try:
            loaded, trainer_state = store.restore(2, engine.state_targets(), engine.numels)
            assert trainer_state["step"] == 2 and loaded.pop("step") == 2
            engine.load_sharded_state(loaded, 2)
            assert_same_state(engine.state_dict(), want)
            # the padding of the new layout is zero, and the restored engine trains on
            for g, v in engine.sharded_params().items():
                assert not np.asarray(state.host_copy(v))[engine.numels[g]:].any()
            engine.step(fsdp_toy.random_minibatch(np.full(engine.num_devices, 2), seed=9))
        finally:
            engine.close()
    finally:
        source.close()
        store.close()


def test_a_restore_into_the_same_layout_continues_exactly(tmp_path):
    """Save after 2 steps, restore into a fresh engine of the same layout, 2 more steps: the parameters equal an
    uninterrupted 4-step run bit for bit (deterministic ODC, HSDP 2 x 2)."""
    model, groups, straight = trained("odc", 4, 2, steps=4)
    want = straight.state_dict()
    straight.close()
    _, _, first = trained("odc", 4, 2, steps=2)
    store = CheckpointStore(str(tmp_path / "ck"), keep=2)
    store.save(2, first.sharded_state(), {NUMELS_KEY: first.numels})
    first.close()
    resumed = make("odc", model, groups, 4, 2)
    try:
        loaded, _ = store.restore(2, resumed.state_targets(), resumed.numels)
        loaded.pop("step")
        resumed.load_sharded_state(loaded, 2)
        for s in (2, 3):
            resumed.step(fsdp_toy.random_minibatch(np.full(4, 2), seed=s))
        got = resumed.state_dict()
        assert got.pop("step") == want.pop("step") == 4
        assert_same_state(got, want)
    finally:
        resumed.close()
        store.close()


def test_a_checkpoint_of_the_host_format_loads(tmp_path):
    """Checkpoints written before sharded saves held `state_dict()`'s host arrays (unpadded group vectors, numpy
    scalars), saved by orbax from numpy: they restore into a sharded engine unchanged."""
    model, groups, source = trained("odc", 2)
    want = source.state_dict()
    source.close()
    store = CheckpointStore(str(tmp_path / "ck"), keep=2)
    store.save(2, want, {})  # the earlier format: host arrays, no recorded group sizes
    engine = make("odc", model, groups, 4)
    try:
        loaded, _ = store.restore(2, engine.state_targets(), engine.numels)
        loaded.pop("step")
        engine.load_sharded_state(loaded, 2)
        assert_same_state(engine.state_dict(), want)
    finally:
        engine.close()
        store.close()


def test_another_models_checkpoint_is_refused_before_reading(tmp_path):
    model, groups, source = trained("xla_spmd", 2, num_layers=2)
    store = CheckpointStore(str(tmp_path / "ck"), keep=2)
    store.save(2, source.sharded_state(), {NUMELS_KEY: source.numels})
    store.save(3, source.state_dict(), {})  # host format: no recorded sizes, the vectors' lengths are checked
    other_model, other_groups = fsdp_toy.make_model(num_layers=2, tied=False)  # the head holds a matrix more
    other = make("xla_spmd", other_model, other_groups, 2)
    fewer_model, fewer_groups = fsdp_toy.make_model(num_layers=1)
    fewer = make("xla_spmd", fewer_model, fewer_groups, 2)
    try:
        for step in (2, 3):
            with pytest.raises(ValueError, match="another model"):
                store.restore(step, other.state_targets(), other.numels)
            with pytest.raises(ValueError, match="does not match this model|another model"):
                store.restore(step, fewer.state_targets(), fewer.numels)
    finally:
        for e in (source, other, fewer):
            e.close()
        store.close()


def test_load_sharded_state_refuses_another_layout():
    model, groups, a = trained("odc", 2, steps=0)
    b = make("odc", model, groups, 4)
    try:
        with pytest.raises(ValueError, match="engine needs"):
            b.load_sharded_state(a.sharded_state(), 0)
    finally:
        a.close()
        b.close()


class CountingSource:
    """A GroupSource that records every range it was asked for."""

    def __init__(self, model, groups):
        self.inner = state.PytreeSource(model.layouts, groups)
        self.asked: list[tuple[str, int, int]] = []

    def flat_slice(self, group, begin, end):
        self.asked.append((group, begin, end))
        return self.inner.flat_slice(group, begin, end)


@pytest.mark.parametrize("kind,n,replicas", [("odc", 4, 1), ("collective", 4, 2), ("xla_spmd", 2, 1),
                                             ("reference", 1, 1)])
def test_initial_parameters_are_placed_per_device_range(kind, n, replicas):
    """An engine asks its GroupSource for one device's range at a time, never a whole group at once (with more than
    one shard), and places exactly what pytrees give."""
    model, groups = fsdp_toy.make_model(num_layers=2)
    source = CountingSource(model, groups)
    engine = make(kind, model, source, n, replicas)
    reference = make("reference", model, groups, 1)
    try:
        assert_same_state(engine.state_dict(), reference.state_dict())
        shards = n // replicas
        if kind != "reference" and shards > 1:
            for g, begin, end in source.asked:
                assert end - begin < model.layouts[g].numel, (g, begin, end)
        assert {g for g, _, _ in source.asked} == set(model.group_names)
    finally:
        engine.close()
        reference.close()


def test_group_source_slices_pad_with_zeros():
    model, groups = fsdp_toy.make_model(num_layers=1)
    source = state.PytreeSource(model.layouts, groups)
    flat = np.asarray(model.layouts["head"].flatten(groups["head"]))
    n = flat.size
    assert np.array_equal(source.flat_slice("head", 3, n + 5), np.concatenate([flat[3:], np.zeros(5, np.float32)]))
    assert source.flat_slice("head", n + 1, n + 4).tolist() == [0.0, 0.0, 0.0]
    assert isinstance(source, state.GroupSource) and not isinstance(groups, state.GroupSource)


def test_nonfinite_groups_are_found_on_device():
    model, groups = fsdp_toy.make_model(num_layers=1)
    bad = dict(groups, layer_0={k: np.full_like(v, np.nan) if k == "pos" else v
                                for k, v in groups["layer_0"].items()})
    engine = make("odc", model, bad, 2)
    try:
        assert engine.nonfinite_groups() == ["layer_0"]
    finally:
        engine.close()
