"""jodc.models core: config, norm, RoPE, parameter groups, flat layout, the layer-wise view and the NNX Decoder."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from conftest import cpu_mesh
from jodc.fsdp import GroupLayout
from jodc.models import (
    Decoder, DecoderConfig, RopeScaling, check_group_params, embed_apply, forward, group_flat_layout, group_numel,
    group_param_shapes, head_apply, init_params, layer_apply, layer_group_name, merge_params, param_groups,
    positions_from_segment_ids, split_params,
)
from jodc.models.norm import rms_norm
from jodc.models.rope import apply_rope, rope_cos_sin, rope_inverse_frequencies


def tiny_config(**changes) -> DecoderConfig:
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                attention_block_size=8)
    base.update(changes)
    return DecoderConfig(**base)


def perturbed_params(config: DecoderConfig, seed: int = 0) -> dict:
    """Random params with non-trivial norms and biases (init has ones / zeros, which would hide mistakes)."""
    rng = np.random.default_rng(seed)
    params = {}
    for group in param_groups(config):
        params[group] = {}
        for name, shape in group_param_shapes(config, group).items():
            if name.endswith("_norm"):
                value = 1.0 + 0.2 * rng.standard_normal(shape)
            elif name.endswith("_bias"):
                value = 0.1 * rng.standard_normal(shape)
            else:
                value = 0.08 * rng.standard_normal(shape)
            params[group][name] = jnp.asarray(value, config.params_dtype)
    return params


forward_jit = jax.jit(forward, static_argnums=0)


def random_tokens(shape, vocab=128, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


# ---------------------------------------------------------------------------------------------- config


def test_config_defaults_and_validation():
    config = tiny_config()
    assert config.head_dim == 16 and config.q_size == 64 and config.kv_size == 32
    assert hash(config) == hash(tiny_config())  # usable as a static jit argument
    assert tiny_config(head_dim=24).q_size == 96
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        tiny_config(num_kv_heads=3)
    with pytest.raises(ValueError, match="compute_dtype"):
        tiny_config(compute_dtype="int8")
    with pytest.raises(ValueError, match="family"):
        tiny_config(family="gpt2")
    with pytest.raises(ValueError, match="even"):
        tiny_config(head_dim=15)
    with pytest.raises(ValueError, match="attention_impl"):
        tiny_config(attention_impl="flashy")
    with pytest.raises(ValueError, match="num_layers"):
        tiny_config(num_layers=0)
    with pytest.raises(ValueError, match="high_freq_factor"):
        RopeScaling(kind="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0)
    assert tiny_config().replace(compute_dtype="bfloat16").activation_dtype == jnp.bfloat16


# ---------------------------------------------------------------------------------------------- norm, rope


def test_rms_norm_matches_numpy_and_rejects_bad_scale():
    x = np.random.default_rng(0).standard_normal((3, 5, 8)).astype(np.float32)
    scale = np.linspace(0.5, 1.5, 8).astype(np.float32)
    expected = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-6) * scale
    np.testing.assert_allclose(rms_norm(jnp.asarray(x), jnp.asarray(scale), 1e-6), expected, rtol=1e-5, atol=1e-6)
    out_bf16 = rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(scale), 1e-6)
    assert out_bf16.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="scale shape"):
        rms_norm(jnp.asarray(x), jnp.ones(7), 1e-6)


@pytest.mark.parametrize("scaling", [
    None,
    RopeScaling(kind="linear", factor=4.0),
    RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64),
])
def test_rope_inverse_frequencies_match_transformers(scaling, hf_reference):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": 500000.0}
    if scaling is not None:
        rope = {"rope_type": scaling.kind, "rope_theta": 500000.0, "factor": scaling.factor}
        if scaling.kind == "llama3":
            rope.update(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    hf = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=rope)
    if scaling is None:
        reference, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        reference, _ = ROPE_INIT_FUNCTIONS[scaling.kind](hf, "cpu")
    ours = rope_inverse_frequencies(64, 500000.0, scaling)
    np.testing.assert_allclose(ours, reference.numpy(), rtol=1e-6)
    if scaling is not None:
        assert not np.allclose(ours, rope_inverse_frequencies(64, 500000.0, None))


def test_rope_scores_depend_only_on_relative_position():
    config = tiny_config()
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 1, 1, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 1, 16)), jnp.float32)

    def score(m, n):
        cos_q, sin_q = rope_cos_sin(config, jnp.array([[m]]))
        cos_k, sin_k = rope_cos_sin(config, jnp.array([[n]]))
        return float(jnp.sum(apply_rope(q, cos_q, sin_q) * apply_rope(k, cos_k, sin_k)))

    assert score(7, 3) == pytest.approx(score(24, 20), rel=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 5), rel=1e-3)
    cos, sin = rope_cos_sin(config, jnp.array([[5]]))
    np.testing.assert_allclose(jnp.linalg.norm(apply_rope(q, cos, sin)), jnp.linalg.norm(q), rtol=1e-5)


# ---------------------------------------------------------------------------------------------- groups, layout


def test_param_groups_and_shapes_follow_the_config():
    config = tiny_config(num_layers=3)
    assert param_groups(config) == ["embed", "layer_0", "layer_1", "layer_2", "head"]
    assert layer_group_name(2) == "layer_2"
    plain = group_param_shapes(config, "layer_1")
    assert list(plain) == ["input_norm", "q_proj", "k_proj", "v_proj", "o_proj", "post_attention_norm",
                           "gate_proj", "up_proj", "down_proj"]
    assert plain["q_proj"] == (64, 64) and plain["k_proj"] == (64, 32) and plain["down_proj"] == (96, 64)
    qwen3 = group_param_shapes(tiny_config(qk_norm=True, head_dim=24), "layer_0")
    assert qwen3["q_norm"] == (24,) and qwen3["q_proj"] == (64, 96)
    qwen2 = group_param_shapes(tiny_config(qkv_bias=True), "layer_0")
    assert [k for k in qwen2 if k.endswith("_bias")] == ["q_bias", "k_bias", "v_bias"]
    assert list(group_param_shapes(config, "head")) == ["final_norm", "lm_head"]
    assert list(group_param_shapes(tiny_config(tie_word_embeddings=True), "head")) == ["final_norm"]
    assert group_param_shapes(config, "embed") == {"embedding": (128, 64)}
    with pytest.raises(ValueError, match="unknown parameter group 'layer_3'"):
        group_param_shapes(config, "layer_3")
    with pytest.raises(ValueError, match="unknown parameter group"):
        group_param_shapes(config, "norm")


def test_engine_group_layout_round_trips_a_decoder_layer():
    """jodc.fsdp.GroupLayout (the one flat layout: models' own copy was removed) on a decoder group: fp32 bucket,
    any-dtype and padded unflatten, and a wrong leaf count named."""
    params = perturbed_params(tiny_config(qkv_bias=True, qk_norm=True))["layer_0"]
    layout = GroupLayout.of(params)
    assert layout.numel == sum(int(np.prod(np.shape(v))) for v in params.values())
    flat = layout.flatten(params)
    assert flat.shape == (layout.numel,) and flat.dtype == jnp.float32
    back = layout.unflatten(jnp.concatenate([flat, jnp.zeros(5)]))  # a padded bucket
    for name in params:
        np.testing.assert_array_equal(back[name], params[name])
    assert layout.unflatten(flat.astype(jnp.bfloat16))["q_proj"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="expected .* leaves"):
        layout.flatten({k: v for k, v in params.items() if k != "q_norm"})


@pytest.mark.parametrize("changes", [dict(), dict(qkv_bias=True, qk_norm=True, head_dim=24),
                                     dict(tie_word_embeddings=True, mlp_bias=True, o_bias=True)])
def test_group_flat_layout_is_the_engine_layout(changes):
    """group_flat_layout describes GroupLayout's flat vector (jax's sorted key order, not group_param_shapes')
    without building the group: each parameter's slice of the flattened group is that parameter."""
    config = tiny_config(**changes)
    params = perturbed_params(config)
    for group in param_groups(config):
        layout = group_flat_layout(config, group)
        flat = np.asarray(GroupLayout.of(params[group]).flatten(params[group]))
        assert group_numel(config, group) == flat.size == GroupLayout.of(params[group]).numel
        assert [p for p, _, _ in layout] == sorted(group_param_shapes(config, group))
        offsets = [o for _, _, o in layout]
        assert offsets == [0] + list(np.cumsum([np.prod(s) for _, s, _ in layout]))[:-1]
        for param, shape, offset in layout:
            assert shape == group_param_shapes(config, group)[param]
            np.testing.assert_array_equal(flat[offset:offset + int(np.prod(shape))].reshape(shape),
                                          params[group][param])
    assert list(group_param_shapes(config, "layer_0"))[:2] == ["input_norm", "q_proj"]  # not sorted: they differ
    with pytest.raises(ValueError, match="unknown parameter group 'value_head'"):
        group_flat_layout(config, "value_head")


def test_check_group_params_names_the_problem():
    config = tiny_config()
    params = init_params(config, jax.random.key(0))
    check_group_params(config, "layer_0", params["layer_0"])
    broken = dict(params["layer_0"], extra=jnp.zeros(3))
    del broken["o_proj"]
    with pytest.raises(ValueError, match=r"missing parameters \['o_proj'\], unexpected parameters \['extra'\]"):
        check_group_params(config, "layer_0", broken)
    with pytest.raises(ValueError, match="'q_proj' has shape"):
        check_group_params(config, "layer_0", dict(params["layer_0"], q_proj=jnp.zeros((64, 63))))


def test_init_params_dtype_and_determinism():
    config = tiny_config(param_dtype="bfloat16")
    a, b = init_params(config, jax.random.key(3)), init_params(config, jax.random.key(3))
    assert a["layer_1"]["q_proj"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(a["layer_1"]["q_proj"], b["layer_1"]["q_proj"])
    np.testing.assert_array_equal(a["head"]["final_norm"], np.ones(64))
    assert not np.array_equal(a["layer_0"]["q_proj"], a["layer_1"]["q_proj"])


def test_positions_from_segment_ids_restart_per_segment():
    seg = jnp.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], jnp.int32)
    np.testing.assert_array_equal(positions_from_segment_ids(seg), [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))])


# ---------------------------------------------------------------------------------------------- layer-wise view


def test_decoder_call_equals_the_group_functions_chain():
    config = tiny_config(qkv_bias=True, qk_norm=True)
    params = perturbed_params(config)
    model = merge_params(config, params)
    tokens = random_tokens((2, 13))

    @jax.jit
    def by_group_functions(params, tokens):
        h = embed_apply(config, params["embed"], tokens)
        for i in range(config.num_layers):
            h = layer_apply(config, params[layer_group_name(i)], h)
        return head_apply(config, params["head"], h)

    by_groups = by_group_functions(params, tokens)
    np.testing.assert_array_equal(model(tokens), by_groups)
    np.testing.assert_array_equal(forward_jit(config, params, tokens), by_groups)
    assert by_groups.shape == (2, 13, 128) and by_groups.dtype == jnp.float32
    round_trip = split_params(merge_params(config, split_params(model)))
    for group in params:
        for name in params[group]:
            np.testing.assert_array_equal(round_trip[group][name], params[group][name])


def test_layer_apply_from_a_flat_bucket_equals_from_the_pytree():
    config = tiny_config()
    params = perturbed_params(config)
    layout = GroupLayout.of(params["layer_1"])  # the engines' flat layout of a group
    h = jax.random.normal(jax.random.key(0), (2, 12, 64))
    bucket = jnp.concatenate([layout.flatten(params["layer_1"]), jnp.zeros(7)])  # padded, as an engine holds it

    @jax.jit
    def from_bucket(vec, h):
        return layer_apply(config, layout.unflatten(vec), h)

    np.testing.assert_allclose(from_bucket(bucket, h), layer_apply(config, params["layer_1"], h), rtol=1e-6,
                               atol=1e-6)


def test_tied_head_needs_the_embedding():
    config = tiny_config(tie_word_embeddings=True)
    params = perturbed_params(config)
    h = jax.random.normal(jax.random.key(0), (1, 4, 64))
    with pytest.raises(ValueError, match="embed_params"):
        head_apply(config, params["head"], h)
    logits = head_apply(config, params["head"], h, params["embed"])
    normed = rms_norm(h, params["head"]["final_norm"], config.rms_norm_eps)
    np.testing.assert_allclose(logits, normed @ params["embed"]["embedding"].T, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_named():
    config = tiny_config()
    params = init_params(config, jax.random.key(0))
    with pytest.raises(ValueError, match="hidden states must be"):
        layer_apply(config, params["layer_0"], jnp.zeros((1, 4, 32)))
    with pytest.raises(ValueError, match="segment_ids shape"):
        layer_apply(config, params["layer_0"], jnp.zeros((1, 4, 64)), None, jnp.ones((1, 5), jnp.int32))
    with pytest.raises(ValueError, match="positions shape"):
        layer_apply(config, params["layer_0"], jnp.zeros((1, 4, 64)), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="integer array"):
        embed_apply(config, params["embed"], jnp.zeros((1, 4)))
    with pytest.raises(ValueError, match=r"groups \['head'\] are missing"):
        forward(config, {k: v for k, v in params.items() if k != "head"}, jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="exactly one of"):
        Decoder(config)
    with pytest.raises(ValueError, match=r"missing parameter groups \['layer_1'\]"):
        Decoder(config, params={k: v for k, v in params.items() if k != "layer_1"})


def test_layer_apply_under_vjp_and_shard_map(cpu_devices):
    """The engines run layer_apply inside shard_map and differentiate it with jax.vjp."""
    config = tiny_config()
    params = perturbed_params(config)["layer_0"]
    h = jax.random.normal(jax.random.key(1), (4, 16, 64))
    seg = jnp.array([[1] * 16, [1] * 9 + [2] * 7, [1] * 5 + [2] * 5 + [0] * 6, [1] * 16], jnp.int32)
    pos = positions_from_segment_ids(seg)
    cotangent = jax.random.normal(jax.random.key(2), h.shape)

    def layer_vjp(p, h, pos, seg, ct):
        out, pullback = jax.vjp(lambda p, h: layer_apply(config, p, h, pos, seg), p, h)
        dp, dh = pullback(ct)
        return out, dp, dh

    mesh = cpu_mesh(2)
    P = jax.sharding.PartitionSpec
    # params are replicated (invariant over "d"), so their cotangent comes back already summed over devices
    sharded = jax.jit(jax.shard_map(layer_vjp, mesh=mesh, in_specs=(P(), P("d"), P("d"), P("d"), P("d")),
                                    out_specs=(P("d"), P(), P("d"))))
    out_s, dp_s, dh_s = sharded(params, h, pos, seg, cotangent)
    out, dp, dh = jax.jit(layer_vjp)(params, h, pos, seg, cotangent)
    np.testing.assert_allclose(out_s, out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dh_s, dh, rtol=1e-4, atol=1e-5)
    for name in dp:
        np.testing.assert_allclose(dp_s[name], dp[name], rtol=1e-4, atol=1e-4)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(dp))


def test_fp32_masters_with_bf16_compute():
    config32 = tiny_config()
    config16 = config32.replace(compute_dtype="bfloat16")
    params = perturbed_params(config32)
    tokens = random_tokens((2, 10))
    logits32 = forward_jit(config32, params, tokens)
    logits16 = forward_jit(config16, params, tokens)
    assert logits16.dtype == jnp.float32  # logits are always fp32
    assert float(jnp.max(jnp.abs(logits16 - logits32))) < 0.05 * float(jnp.max(jnp.abs(logits32)))
    h16 = embed_apply(config16, params["embed"], tokens)
    assert h16.dtype == jnp.bfloat16 and layer_apply(config16, params["layer_0"], h16).dtype == jnp.bfloat16
    grads = jax.jit(jax.grad(lambda p: jnp.mean(forward(config16, p, tokens) ** 2)))(params)
    assert grads["layer_0"]["q_proj"].dtype == jnp.float32  # gradients arrive in the master dtype


def test_packed_rows_give_each_sequence_its_own_logits():
    config = tiny_config(qkv_bias=True, qk_norm=True)
    params = perturbed_params(config)
    lengths = [5, 11, 3, 7]
    seqs = [random_tokens((1, n), seed=i) for i, n in enumerate(lengths)]
    tokens = jnp.concatenate(seqs + [jnp.zeros((1, 6), jnp.int32)], axis=1)  # 26 real + 6 padding
    seg = jnp.asarray(np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(6)])[None],
                      jnp.int32)
    for impl in ("blockwise", "dense"):
        cfg = config.replace(attention_impl=impl)
        packed = forward_jit(cfg, params, tokens, None, seg)
        assert np.isfinite(np.asarray(packed)).all()
        start = 0
        for seq, n in zip(seqs, lengths):
            alone = jnp.pad(seq, ((0, 0), (0, 11 - n)))  # one shape for all sequences: one compilation
            alone_seg = (jnp.arange(11) < n).astype(jnp.int32)[None]
            np.testing.assert_allclose(packed[0, start:start + n], forward_jit(cfg, params, alone, None, alone_seg)[0, :n],
                                       rtol=1e-4, atol=1e-4)
            start += n


def test_nnx_grad_and_jit_on_the_decoder_match_the_functional_gradient():
    config = tiny_config()
    model = Decoder(config, rngs=nnx.Rngs(0))
    tokens = random_tokens((2, 9))
    loss = lambda m: jnp.mean(m(tokens) ** 2)
    grads = nnx.jit(nnx.grad(loss))(model)
    functional = jax.jit(jax.grad(lambda p: jnp.mean(forward(config, p, tokens) ** 2)))(split_params(model))
    np.testing.assert_allclose(grads["layers"][1]["q_proj"][...], functional["layer_1"]["q_proj"], rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_allclose(nnx.jit(lambda m, t: m(t))(model, tokens), model(tokens), rtol=1e-5, atol=1e-5)
    assert isinstance(model.layers[0].q_proj, nnx.Param)
    assert model.layers[0].arrays().keys() == group_param_shapes(config, "layer_0").keys()
