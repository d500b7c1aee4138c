"""The Flax decoder under the engines, fed by the planners: ODC with lb_mini and collective with lb_micro give the
parameters of the unsharded reference."""
import numpy as np
import pytest

from conftest import cpu_mesh
from jodc.balance import get_planner
from jodc.fsdp import CollectiveEngine, ODCEngine, OptimizerConfig, ReferenceEngine, XlaSpmdEngine
from jodc.fsdp.batch import minibatch_from_plan
from jodc.train.core.staged_decoder import decoder_staged_model
from jodc.models.config import DecoderConfig

OPT = OptimizerConfig(learning_rate=1e-2, max_grad_norm=1.0)
# Parameters after AdamW steps agree to a thousandth of a step: each engine sums a gradient element over the tokens in
# its own order, and an element whose contributions nearly cancel keeps ~1e-3 of relative float32 rounding, which
# AdamW's normalised update passes on scaled by the learning rate (seen on jax 0.11.2: 2.7e-6 on one element of 2048).
PARAM_TOL = dict(rtol=1e-5, atol=1e-3 * OPT.learning_rate)


def tiny_config(**overrides):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                attention_block_size=8)
    base.update(overrides)
    return DecoderConfig(**base)


def random_sequences(n, seed, max_len=20):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, max_len, n)
    seqs = [rng.integers(0, 64, s + 1) for s in lengths]
    inputs = [s[:-1] for s in seqs]
    targets = [s[1:] for s in seqs]
    masks = [(np.arange(len(s) - 1) >= (len(s) - 1) // 3).astype(np.float32) for s in seqs]  # "completion" part
    return lengths, inputs, targets, masks


def batches(planner, devices, steps=2, token_cap=32):
    out = []
    for s in range(steps):
        lengths, inputs, targets, masks = random_sequences(3 * devices, seed=s)
        plan = get_planner(planner)(lengths, devices, token_cap)
        out.append(minibatch_from_plan(plan, inputs, targets, masks))
    return out


def test_minibatch_from_plan_places_every_token_once():
    lengths, inputs, targets, masks = random_sequences(9, seed=3)
    plan = get_planner("lb_mini")(lengths, 2, 32)
    mb = minibatch_from_plan(plan, inputs, targets, masks)
    assert mb.num_tokens == int(np.sum(lengths))
    assert mb.normalizer == pytest.approx(sum(m.sum() for m in masks))
    assert float(mb.loss_mask.sum()) == pytest.approx(mb.normalizer)
    got = sorted(int(x) for x in mb.tokens[mb.segment_ids > 0])
    assert got == sorted(int(x) for s in inputs for x in s)
    np.testing.assert_array_equal(mb.counts, [len(p) for p in plan.devices])


@pytest.mark.parametrize("tied", [False, True])
def test_decoder_engines_match_reference(tied):
    config = tiny_config(tie_word_embeddings=tied, qk_norm=tied, family="qwen3" if tied else "llama")
    model, groups = decoder_staged_model(config, seed=1)
    mesh = cpu_mesh(2)
    ref = ReferenceEngine(model, groups, optimizer=OPT)
    odc_batches = batches("lb_mini", 2)
    ref_losses = [ref.step(b).loss for b in odc_batches]
    odc = ODCEngine(model, groups, mesh, optimizer=OPT)
    try:
        odc_losses = [odc.step(b).loss for b in odc_batches]
        odc_params = odc.flat_params()
    finally:
        odc.close()
    np.testing.assert_allclose(odc_losses, ref_losses, rtol=2e-5)
    ref_params = ref.flat_params()
    for g in ref_params:
        np.testing.assert_allclose(odc_params[g], ref_params[g], **PARAM_TOL, err_msg=g)
    if not tied:
        col_batches = batches("lb_micro", 2)
        ref2 = ReferenceEngine(model, groups, optimizer=OPT)
        col = CollectiveEngine(model, groups, mesh, optimizer=OPT)
        np.testing.assert_allclose([col.step(b).loss for b in col_batches], [ref2.step(b).loss for b in col_batches],
                                   rtol=2e-5)
        for g, v in ref2.flat_params().items():
            np.testing.assert_allclose(col.flat_params()[g], v, **PARAM_TOL, err_msg=g)


def test_custom_head_loss_with_extras_and_metrics():
    """An RL-style head: a per-token weight field from the minibatch extras, and a metric summed by the engine."""
    import jax.numpy as jnp

    from jodc.losses import token_logprobs

    def weighted_loss(logits, mb):
        logp = token_logprobs(logits, mb["targets"])
        loss = -jnp.sum(logp * mb["advantages"] * mb["loss_mask"]) / mb["normalizer"]
        return loss, {"trained_tokens": jnp.sum(mb["loss_mask"])}

    config = tiny_config()
    model, groups = decoder_staged_model(config, seed=2, head_loss=weighted_loss, metric_names=("trained_tokens",))
    lengths, inputs, targets, masks = random_sequences(6, seed=9)
    advantages = [np.full(len(x), (-1.0) ** i, np.float32) for i, x in enumerate(inputs)]
    plan = get_planner("lb_mini")(lengths, 2, 32)
    batch = minibatch_from_plan(plan, inputs, targets, masks, extras={"advantages": advantages})
    assert batch.extras["advantages"].shape == batch.tokens.shape
    ref = ReferenceEngine(model, groups, optimizer=OPT)
    odc = ODCEngine(model, groups, cpu_mesh(2), optimizer=OPT)
    try:
        r_ref, r_odc = ref.step(batch), odc.step(batch)
        odc_params = odc.flat_params()
    finally:
        odc.close()
    assert r_odc.metrics["trained_tokens"] == pytest.approx(sum(m.sum() for m in masks))
    assert r_ref.metrics == pytest.approx(r_odc.metrics)
    assert r_odc.loss == pytest.approx(r_ref.loss, rel=1e-5)
    for g, v in ref.flat_params().items():
        # one Adam step normalises each gradient element: near-zero gradients (advantages of both signs cancel)
        # amplify float reassociation, hence an absolute tolerance of 1% of the learning rate
        np.testing.assert_allclose(odc_params[g], v, rtol=1e-5, atol=1e-4, err_msg=g)


@pytest.mark.parametrize("engine_cls", [ODCEngine, CollectiveEngine, XlaSpmdEngine])
def test_length_buckets_change_cost_not_results(engine_cls):
    """Microbatches run at the smallest bucket length that holds them; parameters equal the full-length run. One
    layer: the buckets are a property of the whole microbatch, and every bucket compiles a branch of the step, so
    each layer more costs seconds of compile per engine without testing anything new."""
    config = tiny_config(num_layers=1)
    model, groups = decoder_staged_model(config, seed=4)
    planner = "lb_mini" if engine_cls is ODCEngine else "lb_micro"
    data = batches(planner, 2, steps=2, token_cap=32)
    engine = engine_cls(model, groups, cpu_mesh(2), optimizer=OPT, length_buckets=(8, 16))
    assert engine.bucket_lengths(32) == (8, 16, 32)
    idx = engine.bucket_indices(data[0])
    used = (data[0].segment_ids > 0).sum(-1)
    assert np.all(np.asarray((8, 16, 32))[idx] >= used)
    assert np.all((idx == 0) | (np.asarray((0, 8, 16))[idx] < used))  # the smallest that fits
    ref = ReferenceEngine(model, groups, optimizer=OPT)
    try:
        losses = [engine.step(b).loss for b in data]
        params = engine.flat_params()
    finally:
        engine.close()
    np.testing.assert_allclose(losses, [ref.step(b).loss for b in data], rtol=2e-5)
    for g, v in ref.flat_params().items():
        np.testing.assert_allclose(params[g], v, rtol=1e-5, atol=1e-5, err_msg=g)
