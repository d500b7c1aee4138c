"""A non-finite step is never applied, on every engine: a NaN gradient on one device only (a finite loss), a
non-finite loss, or updated parameters that overflow leave the parameters and the optimizer state as they were
(selected on device inside the compiled step), the step raises `NonFiniteStepError` (or reports applied=False),
and training goes on as if the step had never been dispatched."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fsdp_toy
from conftest import cpu_mesh
from jodc.fsdp import ENGINES, NonFiniteStepError, OptimizerConfig
from jodc.fsdp.optim import guarded_update

OPT = OptimizerConfig(learning_rate=3e-2, max_grad_norm=0.5, weight_decay=0.01)
COUNTS = [[2, 1], [1, 2], [2, 2]]


def build(kind, model, groups, devices=2, **kwargs):
    return ENGINES[kind](model, groups, cpu_mesh(devices), optimizer=OPT, **kwargs)


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("kind", ["odc", "collective", "xla_spmd", "reference"])
def test_a_nan_gradient_on_one_device_is_not_applied(kind):
    model, groups = fsdp_toy.make_model(num_layers=1)
    model = fsdp_toy.poison_backward(model)
    good = [fsdp_toy.random_minibatch(c, seed=s) for s, c in enumerate(COUNTS)]
    bad = fsdp_toy.poison(fsdp_toy.random_minibatch([1, 2], seed=7), device=1, microbatch=1)
    engine = build(kind, model, groups)
    clean = build(kind, model, groups)
    try:
        engine.step(good[0])
        before = engine.state_dict()
        with pytest.raises(NonFiniteStepError, match="not applied") as caught:
            engine.step(bad)
        result = caught.value.result
        assert not result.applied and np.isfinite(result.loss) and not np.isfinite(result.grad_norm)
        after = engine.state_dict()
        assert after["step"] == before["step"] == 1
        for a, b in zip(leaves(before), leaves(after)):
            np.testing.assert_array_equal(a, b)  # parameters and optimizer state untouched, bit for bit
        skipped = engine.step(bad, skip_nonfinite=True)  # the same, reported instead of raised
        assert not skipped.applied and engine.steps_done == 1
        for b in good[1:]:
            assert engine.step(b).applied
        for b in good:
            clean.step(b)
        # the run goes on exactly as if the bad minibatch had never been seen
        for g, v in clean.flat_params().items():
            np.testing.assert_allclose(engine.flat_params()[g], v, rtol=1e-6, atol=1e-7, err_msg=g)
            assert np.isfinite(engine.flat_params()[g]).all()
    finally:
        engine.close()
        clean.close()


@pytest.mark.parametrize("kind", ["odc", "reference"])
def test_a_non_finite_loss_is_not_applied(kind):
    model, groups = fsdp_toy.make_model(num_layers=1)
    bad = fsdp_toy.random_minibatch([1, 1], seed=3)
    bad.loss_mask[0, 0, 0] = np.inf
    engine = build(kind, model, groups)
    try:
        start = engine.flat_params()
        with pytest.raises(NonFiniteStepError, match="non-finite loss"):
            engine.step(bad)
        for g, v in engine.flat_params().items():
            np.testing.assert_array_equal(v, start[g])
    finally:
        engine.close()


def test_guarded_update_checks_the_updated_parameters():
    """Finite loss and gradients, but an update that overflows a parameter: not applied either."""
    params = {"a": jnp.array([3e38, 1.0], jnp.float32)}
    grads = {"a": jnp.array([-1.0, 1.0], jnp.float32)}
    cfg = OptimizerConfig(learning_rate=1e38, max_grad_norm=None)
    tx = optax.sgd(1e38)
    state = tx.init(params)
    new, new_state, norm, applied = guarded_update(tx, cfg, grads, params, state, global_sq_norm=jnp.float32(2.0),
                                                   loss=jnp.float32(1.0))
    assert not bool(applied) and np.isfinite(float(norm))
    np.testing.assert_array_equal(np.asarray(new["a"]), np.asarray(params["a"]))
    ok, _, _, applied = guarded_update(optax.sgd(0.5), cfg, grads, params, optax.sgd(0.5).init(params),
                                       global_sq_norm=jnp.float32(2.0), loss=jnp.float32(1.0))
    assert bool(applied)
    np.testing.assert_allclose(np.asarray(ok["a"]), [3e38, 0.5])


@pytest.mark.parametrize("field, value", [("learning_rate", float("nan")), ("learning_rate", float("inf")),
                                          ("max_grad_norm", float("nan")), ("b1", float("nan")),
                                          ("weight_decay", float("inf")), ("eps", float("nan"))])
def test_optimizer_config_refuses_non_finite_values(field, value):
    with pytest.raises(ValueError, match=f"optimizer.{field} must be a finite number"):
        OptimizerConfig(**{field: value})
