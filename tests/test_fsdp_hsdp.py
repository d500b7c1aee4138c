"""HSDP: the engines on a 2-D (replica, shard) mesh of 8 simulated CPU devices as 2x4 and 4x2, against the unsharded
reference, with uneven microbatch counts per device and per replica; the replicated heap's ops; deterministic mode;
resume across layouts; a failed or late device ends every replica's step; bad mesh settings refused."""
import threading
import time
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import fsdp_toy
from jodc import ops
from jodc.fsdp import CollectiveEngine, ODCEngine, OptimizerConfig, ReferenceEngine, XlaSpmdEngine, sharding

OPT = OptimizerConfig(learning_rate=3e-2, max_grad_norm=0.5, weight_decay=0.01)
# per device, 8 devices; as 2x4 the replicas run 6 and 7 microbatches (then 6 and 6); as 4x2 they run 4, 2, 2, 5
# (then 3, 3, 4, 2): uneven inside every group and across groups
COUNTS = [[3, 1, 0, 2, 1, 1, 2, 3], [1, 2, 2, 1, 1, 3, 0, 2]]


def mesh_of(replicas: int) -> Mesh:
    return sharding.hsdp_mesh(jax.devices("cpu")[:8], replicas)


def batches():
    return [fsdp_toy.random_minibatch(c, seed=s) for s, c in enumerate(COUNTS)]


def run(engine, minibatches):
    try:
        results = [engine.step(b) for b in minibatches]
        return results, engine.flat_params(), engine.state_dict()
    finally:
        engine.close()


def assert_params_close(a, b, rtol=1e-5):
    for g in a:
        scale = max(np.abs(a[g]).max(), 1e-6)
        np.testing.assert_allclose(a[g], b[g], rtol=rtol, atol=rtol * scale, err_msg=f"group {g}")


@pytest.fixture(scope="module")
def reference():
    model, groups = fsdp_toy.make_model(num_layers=2)
    results, params, _ = run(ReferenceEngine(model, groups, optimizer=OPT), batches())
    return model, groups, results, params


@pytest.mark.parametrize("engine_cls,replicas", [(ODCEngine, 2), (ODCEngine, 4), (CollectiveEngine, 2),
                                                 (XlaSpmdEngine, 4)])
def test_hsdp_engines_match_reference(reference, engine_cls, replicas):
    model, groups, want, want_params = reference
    results, params, _ = run(engine_cls(model, groups, mesh_of(replicas), optimizer=OPT), batches())
    np.testing.assert_allclose([r.loss for r in results], [r.loss for r in want], rtol=1e-5)
    # the global grad norm: the normaliser and the norm are over the whole data-parallel world, not one group
    np.testing.assert_allclose([r.grad_norm for r in results], [r.grad_norm for r in want], rtol=1e-5)
    assert [r.microbatches for r in results] == COUNTS
    assert_params_close(params, want_params)
    assert max(np.abs(want_params[g] - v).max() for g, v in model.flatten_groups(groups).items()) > 1e-3


def test_deterministic_hsdp_odc_is_bitwise_repeatable(reference):
    """Bit for bit from run to run on one layout. Across layouts the sums associate differently (a group adds its
    own devices' pushes, then the groups are added), so 2x4, 4x2 and flat agree to rounding, not bit for bit."""
    model, groups, _, want_params = reference
    runs = {}
    for key, replicas in (("2x4", 2), ("2x4 again", 2), ("4x2", 4)):
        runs[key] = run(ODCEngine(model, groups, mesh_of(replicas), optimizer=OPT, deterministic=True), batches())
    (r1, p1, _), (r2, p2, _) = runs["2x4"], runs["2x4 again"]
    assert [r.loss for r in r1] == [r.loss for r in r2] and [r.grad_norm for r in r1] == [r.grad_norm for r in r2]
    for g in p1:
        assert p1[g].tobytes() == p2[g].tobytes(), g
    assert_params_close(runs["4x2"][1], p1)
    assert_params_close(p1, want_params)


def test_resume_across_layouts_is_exact(reference):
    """A state written on 2x4 loads into 4x2 ODC and flat collective FSDP unchanged (the checkpoint form is one flat
    vector per group, whatever the layout), and training goes on as the reference does."""
    model, groups, want, want_params = reference
    first, second = batches()
    _, _, state = run(ODCEngine(model, groups, mesh_of(2), optimizer=OPT), [first])
    for make in (lambda: ODCEngine(model, groups, mesh_of(4), optimizer=OPT),
                 lambda: CollectiveEngine(model, groups, mesh_of(1), optimizer=OPT)):
        engine = make()
        try:
            engine.load_state_dict(state)
            restored = engine.state_dict()
            for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
                assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
            result = engine.step(second)
            params = engine.flat_params()
        finally:
            engine.close()
        np.testing.assert_allclose(result.loss, want[1].loss, rtol=1e-5)
        assert_params_close(params, want_params)


def test_hsdp_timeline_names_every_device():
    model, groups = fsdp_toy.make_model(num_layers=1)
    counts = [2, 1, 0, 1]
    engine = ODCEngine(model, groups, sharding.hsdp_mesh(jax.devices("cpu")[:4], 2), optimizer=OPT)
    try:
        events = engine.step(fsdp_toy.random_minibatch(counts, seed=3), record_timeline=True).timeline
    finally:
        engine.close()
    for device, n in enumerate(counts):  # device (r, d) is row r * shards + d of the plan
        labels = [e["label"] for e in events if e["device"] == device]
        assert sum(label.endswith("head fwd") for label in labels) == n, (device, labels)
    waits = [e for e in events if e["kind"] == "wait"]
    assert len(waits) == 8 and {e["device"] for e in waits} == {0, 1, 2, 3}  # two group barriers per device


def test_replicated_heap_keeps_each_group_to_itself():
    """Every device of group r pushes (r + 1) x its gathered bucket: each group's accumulators hold only its own
    devices' pushes, its barrier only its own devices; a psum over 'r' adds the groups (numpy reference)."""
    mesh = mesh_of(2)
    values = np.arange(40, dtype=np.float32) / 7
    axes = ("r", "d")
    with ops.ReplicatedHeap(mesh, "d", "r") as heap:
        bucket = heap.register(40, jnp.float32, name="x")
        bucket.set_full(values)

        def step(_):
            token = ops.new_token(axes)
            full, token = ops.gather(bucket, token)
            scale = (lax.axis_index("r") + 1).astype(jnp.float32)
            token = ops.scatter_accumulate(bucket, full * scale, token)
            token = ops.barrier(heap, token)
            token = ops.replica_barrier(heap, token)
            acc, token = ops.read_accumulator(bucket, token)
            token = ops.zero_accumulator(bucket, token)
            total = ops.depend_on(lax.psum(acc, "r"), token)
            return jnp.stack([acc, total])[None]

        fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
        out = np.asarray(fn(jnp.zeros((8, 1))))  # [device, (own group's, summed), shard]
        shard = bucket.shard_numel
        padded = np.zeros(4 * shard, np.float32)
        padded[:40] = values
        for r in range(2):
            for d in range(4):
                own = padded[d * shard:(d + 1) * shard] * 4 * (r + 1)  # four devices pushed into it
                np.testing.assert_allclose(out[r * 4 + d, 0], own, rtol=1e-6)
                np.testing.assert_allclose(out[r * 4 + d, 1], padded[d * shard:(d + 1) * shard] * 12, rtol=1e-6)
        assert heap.generations() == {0: [1] * 4, 1: [1] * 4} and heap.world_heap.generations() == [1] * 8
        assert np.abs(bucket.accumulated(1)).max() == 0  # zeroed
        np.testing.assert_array_equal(bucket.full(1), values)
        assert heap.positions[mesh.devices[1, 2]] == 6 and heap.transport == "local"
    assert heap.freed


def test_bad_mesh_settings_are_refused():
    from jodc.train import load_config
    from jodc.train.core.config import ConfigError

    with pytest.raises(ConfigError, match=r"engine.replicas: replicas=3 does not divide the 8 devices"):
        load_config(None, ["--devices", "8", "--replicas", "3"])
    with pytest.raises(ConfigError, match=r"engine.replicas"):
        load_config(None, ["--devices", "8", "--replicas", "0"])
    assert load_config(None, ["--devices", "8", "--replicas", "2"]).engine.replicas == 2
    assert sharding.hsdp_shards(8, 4) == 2
    with pytest.raises(ValueError, match="replicas must be a positive integer"):
        sharding.hsdp_shards(8, True)
    with pytest.raises(ValueError, match="replicas=3 does not divide"):
        sharding.hsdp_mesh(jax.devices("cpu")[:8], 3)
    flat = sharding.hsdp_mesh(jax.devices("cpu")[:8], 1)
    layout = sharding.MeshLayout.of(flat, "ODC")
    assert flat.axis_names == ("d",) and sharding.device_axes(flat) == "d"
    assert (layout.axes, layout.replicas, layout.shards, layout.devices, layout.hsdp) == ("d", 1, 8, 8, False)
    hsdp = mesh_of(4)
    layout = sharding.MeshLayout.of(hsdp, "ODC")
    assert sharding.device_axes(hsdp) == ("r", "d") and layout.rows().spec == P(("r", "d"))
    assert (layout.axes, layout.replicas, layout.shards, layout.devices, layout.hsdp) == (("r", "d"), 4, 2, 8, True)
    model, groups = fsdp_toy.make_model(num_layers=1)
    wrong = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("d", "r"))
    for cls in (ODCEngine, CollectiveEngine, XlaSpmdEngine):
        with pytest.raises(ValueError, match=r"needs a mesh with axes \('d',\) or \('r', 'd'\)"):
            cls(model, groups, wrong, optimizer=OPT)
    with pytest.raises(ValueError, match="would be shared by the replicas"):  # one heap for two groups: refused
        ops.SymmetricHeap(hsdp, "d")
    with pytest.raises(ValueError, match="needs mesh axes 'r' and 'd'"):
        ops.ReplicatedHeap(flat, "d", "r")
    engine = ODCEngine(model, groups, hsdp, optimizer=OPT)
    try:
        with pytest.raises(ValueError, match="runs on 8 devices, the minibatch was planned for 4"):
            engine.step(fsdp_toy.random_minibatch([1, 1, 1, 1]))
    finally:
        engine.close()


class StalledHSDP(ODCEngine):
    """ODC whose device 0 (replica 0) raises, or sleeps past the barrier timeout, before its first step's barrier."""

    def __init__(self, *args, fault, **kwargs):
        super().__init__(*args, **kwargs)
        self.fault = fault

    def _barrier(self, token, recorder, every_group=False):
        if every_group and not getattr(self, "_faulted", False):
            self._faulted = True

            def host(device):
                if int(device) == 0:
                    if self.fault == "raise":
                        raise ValueError("boom on device 0")
                    time.sleep(4.0)
                return np.int32(0)

            token = token + jax.pure_callback(host, jax.ShapeDtypeStruct((), jnp.int32), sharding.device_position())
        return super()._barrier(token, recorder, every_group)


@pytest.mark.parametrize("fault", ["raise", "late"])
def test_a_failed_or_late_device_ends_every_replicas_step(fault):
    """Device 0 of replica 0 fails (or never arrives within the timeout) before the minibatch barrier: every device
    of both groups leaves the step with that cause within seconds; none waits in the cross-replica psum."""
    model, groups = fsdp_toy.make_model(num_layers=1)
    engine = StalledHSDP(model, groups, sharding.hsdp_mesh(jax.devices("cpu")[:4], 2), optimizer=OPT,
                         barrier_timeout_s=120 if fault == "raise" else 1.0, fault=fault)
    outcome = {}

    def step():
        try:
            engine.step(fsdp_toy.random_minibatch([2, 1, 1, 2], seed=0))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome["error"] = e

    start = time.monotonic()
    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():
        engine.heap.abort("the test gave up")
        pytest.fail("the step still waits after 60 s")
    error = outcome.get("error")
    if fault == "raise":
        assert isinstance(error, ops.DeviceFailed) and error.device == 0, error
        assert "boom on device 0" in str(error)
    else:
        assert "jodc barrier timed out after 1 s" in str(error), error
    assert time.monotonic() - start < 30
    with pytest.raises(RuntimeError, match="aborted|timed out"):
        engine.heap.check_alive()  # poisoned until re-created
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        engine.close()


def test_replica_groups_across_processes_are_checked():
    from jodc.ops.replicated_heap import local_replicas

    def dev(process):
        return types.SimpleNamespace(process_index=process)

    per_process = np.array([[dev(0), dev(0)], [dev(1), dev(1)]])
    assert local_replicas(per_process, 1) == [1]
    spread = np.array([[dev(0), dev(1)], [dev(0), dev(1)]])
    assert local_replicas(spread, 0) == [0, 1]
    with pytest.raises(ValueError, match=r"replica groups over processes \[\[0, 1\], \[2\]\]"):
        local_replicas(np.array([[dev(0), dev(1)], [dev(2), dev(2)]]), 0)
    with pytest.raises(ValueError, match="no replica group holds a device of process 2"):
        local_replicas(per_process, 2)


def test_trainer_engine_follows_engine_replicas():
    """The trainer's engine (`jodc.train.core.model.make_engine`) runs on the HSDP mesh `engine.replicas` asks for,
    and takes minibatches planned for every device (`engine.devices`, which the planners are given)."""
    from jodc.train import load_config
    from jodc.train.core.model import make_engine

    model, groups = fsdp_toy.make_model(num_layers=1)
    for name, replicas in (("odc", 2), ("collective", 4)):
        config = load_config(None, ["--engine", name, "--devices", "8", "--replicas", str(replicas)])
        engine = make_engine(config, model, groups)
        try:
            assert dict(engine.mesh.shape) == {"r": replicas, "d": 8 // replicas} and engine.num_devices == 8
            if name == "odc":
                assert (engine.heap.replicas, engine.heap.world) == (2, 4)
        finally:
            engine.close()


def test_a_nan_gradient_in_one_replica_reaches_no_replica():
    """A NaN gradient on a device of replica 1 is summed into every replica's gradient: no replica applies the step
    (every group keeps the same parameters and optimizer state, bit for bit), and training goes on."""
    from jodc.fsdp import NonFiniteStepError

    model = fsdp_toy.poison_backward(fsdp_toy.make_model(num_layers=1)[0])
    groups = fsdp_toy.make_model(num_layers=1)[1]
    good = fsdp_toy.random_minibatch([1, 2, 0, 1], seed=4)
    bad = fsdp_toy.poison(fsdp_toy.random_minibatch([1, 1, 2, 1], seed=5), device=2, microbatch=1)
    engine = ODCEngine(model, groups, sharding.hsdp_mesh(jax.devices("cpu")[:4], 2), optimizer=OPT)
    try:
        before = engine.state_dict()
        with pytest.raises(NonFiniteStepError, match="not applied"):
            engine.step(bad)
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(engine.state_dict())):
            np.testing.assert_array_equal(a, b)
        for g, b in engine.buckets.items():  # both groups' heaps still hold the same, unchanged parameters
            np.testing.assert_array_equal(b.full(0), before["params"][g])
            np.testing.assert_array_equal(b.full(1), before["params"][g])
        assert engine.step(good).applied and engine.steps_done == 1
    finally:
        engine.close()
