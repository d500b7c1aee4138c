"""`jodc.fsdp.from_nnx`: a user's Flax NNX model trained by the engines. The example of docs/engines.md (run from the
guide itself) gives the parameters plain `jax.grad` + optax reach on one device; bad modules are refused by name."""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fsdp_toy
from jodc import fsdp

GUIDE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "engines.md")


def readme_example() -> str:
    """The python block of docs/engines.md's "Bring your own Flax model" section."""
    text = open(GUIDE).read()
    section = text[text.index("## Bring your own Flax model"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def plain_training(module, batches, cfg: fsdp.OptimizerConfig):
    """What a JAX user writes on one device: the module's own __call__ on every microbatch of the minibatch at once
    (rows [R, T]; padded to one R with loss-free rows, so it compiles once), jax.grad of the summed normalised loss,
    optax clipping + AdamW."""
    from jodc.losses import sft_loss_from_logits

    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    tx = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm),
                     optax.adamw(cfg.learning_rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))

    def loss(params, rows):
        logits = nnx.merge(graphdef, params, rest)(rows["tokens"], rows["segment_ids"])
        return sft_loss_from_logits(logits, rows)

    @jax.jit
    def step(params, state, rows):
        grads = jax.grad(loss)(params, rows)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    most = max(int(b.counts.sum()) for b in batches)
    for batch in batches:
        real = [(d, m) for d in range(batch.num_devices) for m in range(int(batch.counts[d]))]
        rows = {k: np.stack([v[d, m] for d, m in real] + [np.zeros_like(v[0, 0])] * (most - len(real)))
                for k, v in batch.as_dict().items()}
        params, state = step(params, state, {**rows, "normalizer": np.float32(batch.normalizer)})
    return nnx.to_pure_dict(params)


def assert_trees_close(got, want, tol=1e-5):
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    flat_want = dict(jax.tree_util.tree_flatten_with_path(want)[0])
    assert len(flat_got) == len(flat_want)
    for path, value in flat_got:
        ref = np.asarray(flat_want[path])
        np.testing.assert_allclose(np.asarray(value), ref, rtol=tol, atol=tol, err_msg=jax.tree_util.keystr(path))


def test_readme_gpt_trained_by_odc_equals_plain_jax_grad_and_optax():
    """Runs the guide's block as written (3 ODC steps on 2 devices, uneven packing), then trains a fresh copy of
    its GPT with jax.grad + optax on the same minibatches: the parameters agree within 1e-5 (each step moves them by
about the learning rate, 3e-3)."""
    namespace = {"__name__": "readme_example"}
    exec(compile(readme_example(), "docs/engines.md", "exec"), namespace)
    gpt, batches, cfg = namespace["gpt"], namespace["batches"], namespace["optimizer"]
    assert len(batches) >= 3 and namespace["engine"].heap.freed  # the example ran every step and closed its engine
    fresh = namespace["GPT"](vocab=64, dim=16, depth=2, rngs=nnx.Rngs(0))
    start = pure_params(fresh)
    want = plain_training(fresh, batches, cfg)
    got = pure_params(gpt)  # written back by staged.update
    assert_trees_close(got, want)
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(start)))
    assert moved > 1e-3  # training really changed the parameters


# -- a minimal model for the structural tests ---------------------------------------------------------------------

class Layer(nnx.Module):
    def __init__(self, dim, rngs, out=None):
        self.linear = nnx.Linear(dim, out or dim, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.linear(x))


class Tiny(nnx.Module):
    def __init__(self, rngs, depth=2, tied=False, dim=8):
        self.embed = nnx.Embed(fsdp_toy.VOCAB, dim, rngs=rngs)
        self.layers = nnx.List([Layer(dim, rngs) for _ in range(depth)])
        if tied:
            self.norm = nnx.LayerNorm(dim, rngs=rngs)
        else:
            self.head = nnx.Linear(dim, fsdp_toy.VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.embed.attend(self.norm(x)) if hasattr(self, "norm") else self.head(x)


def pure_params(module):
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def microbatch(batch, d=0, m=0):
    mb = {k: jnp.asarray(v[d, m][None]) for k, v in batch.as_dict().items()}
    mb["normalizer"] = jnp.float32(batch.normalizer)
    return mb


def test_groups_and_stages_follow_the_module():
    tiny = Tiny(nnx.Rngs(0), depth=3)
    staged = fsdp.from_nnx(tiny)
    model = staged.model
    assert model.group_names == ("embed", "layer_0", "layer_1", "layer_2", "head")
    assert [s.groups for s in model.stages] == [("embed",), ("layer_0",), ("layer_1",), ("layer_2",), ("head",)]
    np.testing.assert_array_equal(staged.groups["layer_1"]["linear"]["kernel"],
                                  pure_params(tiny)["layers"][1]["linear"]["kernel"])
    # the staged forward pass is the module's own
    mb = microbatch(fsdp_toy.random_minibatch([1]))
    from jodc.losses import sft_loss_from_logits

    want = sft_loss_from_logits(tiny(mb["tokens"]), mb)
    np.testing.assert_allclose(float(jax.jit(model.loss)(staged.groups, mb)), float(want), rtol=1e-6)


def test_tied_embedding_is_one_group_read_by_the_head():
    tiny = Tiny(nnx.Rngs(1), tied=True)
    staged = fsdp.from_nnx(tiny, head=("norm", "embed"),
                           head_call=lambda mods, h, mb: mods[1].attend(mods[0](h)))
    model = staged.model
    assert model.group_names == ("embed", "layer_0", "layer_1", "head")
    assert model.stages[-1].groups == ("head", "embed") and set(staged.groups["head"]) == {"norm"}
    mb = microbatch(fsdp_toy.random_minibatch([1], seed=2))
    from jodc.losses import sft_loss_from_logits

    # the loss and the embedding's gradient (both uses: input and output) are the module's own
    loss, grads = jax.jit(jax.value_and_grad(model.loss))(staged.groups, mb)
    graphdef, params, rest = nnx.split(tiny, nnx.Param, ...)
    want_loss, want = jax.jit(jax.value_and_grad(
        lambda p: sft_loss_from_logits(nnx.merge(graphdef, p, rest)(mb["tokens"]), mb)))(params)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads["embed"]["embed"]["embedding"]),
                               nnx.to_pure_dict(want)["embed"]["embedding"], rtol=1e-5, atol=1e-7)


def test_update_writes_engine_params_back_with_the_module_dtypes():
    tiny = Tiny(nnx.Rngs(0))
    staged = fsdp.from_nnx(tiny)
    engine = fsdp.ReferenceEngine(staged.model, staged.groups, optimizer=fsdp.OptimizerConfig(learning_rate=1e-2))
    engine.step(fsdp_toy.random_minibatch([1, 1], seed=3))
    params = engine.params()
    assert staged.update(tiny, params) is tiny
    now = pure_params(tiny)
    np.testing.assert_array_equal(now["layers"][0]["linear"]["kernel"], params["layer_0"]["linear"]["kernel"])
    np.testing.assert_array_equal(now["head"]["bias"], params["head"]["head"]["bias"])
    assert isinstance(now["head"]["kernel"], jax.Array) and now["head"]["kernel"].dtype == jnp.float32


class NoLayers(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(4, 2, rngs=rngs)
        self.blocks = nnx.List([Layer(2, rngs), Layer(2, rngs, out=2)])
        self.head = nnx.Linear(2, 4, rngs=rngs)


class Mixed(nnx.Module):
    def __init__(self, rngs, kind):
        self.embed = nnx.Embed(4, 2, rngs=rngs)
        if kind == "class":
            self.layers = nnx.List([Layer(2, rngs), nnx.Linear(2, 2, rngs=rngs)])
        elif kind == "shape":
            self.layers = nnx.List([Layer(2, rngs), Layer(2, rngs, out=3)])
        elif kind == "module":
            self.layers = Layer(2, rngs)
        else:
            self.layers = nnx.List([])
        self.head = nnx.Linear(2, 4, rngs=rngs)
        if kind == "stray":
            self.layers = nnx.List([Layer(2, rngs)])
            self.pos = nnx.Embed(4, 2, rngs=rngs)


@pytest.mark.parametrize("make, kwargs, error, match", [
    (lambda r: NoLayers(r), {}, AttributeError, r"NoLayers has no attribute 'layers' \(its attributes: .*blocks"),
    (lambda r: Tiny(r), {"head": "lm_head"}, AttributeError, "Tiny has no attribute 'lm_head'"),
    (lambda r: Tiny(r), {"embed": "embed.missing"}, AttributeError, "no attribute 'embed.missing'"),
    (lambda r: Mixed(r, "class"), {}, TypeError, r"not homogeneous: layers\[1\] is a Linear"),
    (lambda r: Mixed(r, "shape"), {}, ValueError, r"not homogeneous: the parameters of layers\[1\]"),
    (lambda r: Mixed(r, "module"), {}, TypeError, "layers='layers' is a Layer; it must be a homogeneous sequence"),
    (lambda r: Mixed(r, "empty"), {}, ValueError, "layers='layers' is empty"),
    (lambda r: Mixed(r, "stray"), {}, ValueError, r"would not be trained: \['pos'\]"),
])
def test_bad_modules_are_refused_by_name(make, kwargs, error, match):
    with pytest.raises(error, match=match):
        fsdp.from_nnx(make(nnx.Rngs(0)), **kwargs)
