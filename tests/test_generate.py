"""Sampling with a KV cache: agreement with full forward passes, stop tokens, top-p and top-K log-probs."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jodc.models import (
    DecoderConfig,
    SamplingParams,
    generate,
    init_params,
    merge_params,
    sampling_logprobs,
    split_params,
)
from jodc.models.generate import left_pad_prompts

PROMPTS = [[5, 17, 3, 99, 42], [7, 8], list(range(30, 51))]  # 5, 2 and 21 tokens: different lengths


@pytest.fixture(scope="module")
def model():
    config = DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                           num_kv_heads=2, qkv_bias=True, qk_norm=True, attention_block_size=8)
    return merge_params(config, init_params(config, jax.random.key(0), init_std=0.1))


def packed_forward(model, rows):
    """Logits of each row (list of token lists), computed in one packed forward pass."""
    tokens = np.concatenate(rows)[None]
    seg = np.concatenate([np.full(len(r), i + 1) for i, r in enumerate(rows)])[None]
    logits = np.asarray(model(jnp.asarray(tokens, jnp.int32), None, jnp.asarray(seg, jnp.int32)))[0]
    out, start = [], 0
    for r in rows:
        out.append(logits[start:start + len(r)])
        start += len(r)
    return out


def test_greedy_with_cache_equals_argmax_of_full_forward(model):
    sampling = SamplingParams(max_new_tokens=7, temperature=0.0)
    gen = generate(model, PROMPTS, key=jax.random.key(0), sampling=sampling)
    assert gen.tokens.shape == (3, 7) and gen.logprobs.shape == (3, 7) and gen.topk_ids is None
    np.testing.assert_array_equal(gen.lengths, 7)
    rows = [p + gen.tokens[i].tolist() for i, p in enumerate(PROMPTS)]
    for i, (prompt, logits) in enumerate(zip(PROMPTS, packed_forward(model, rows))):
        steps = logits[len(prompt) - 1:-1]  # the logits that predicted each generated token
        np.testing.assert_array_equal(steps.argmax(-1), gen.tokens[i])
        expected = jax.nn.log_softmax(steps)[np.arange(7), gen.tokens[i]]
        np.testing.assert_allclose(gen.logprobs[i], expected, atol=1e-4)
    last_logits = jax.jit(lambda tokens, seg, last: model(tokens, None, seg)[0, last])
    for step in range(7):  # the literal step-by-step statement, for one row (padded to one shape: one compile)
        seq = PROMPTS[1] + gen.tokens[1, :step].tolist()
        tokens = jnp.asarray([seq + [0] * (10 - len(seq))], jnp.int32)
        seg = jnp.asarray([[1] * len(seq) + [0] * (10 - len(seq))], jnp.int32)
        assert int(jnp.argmax(last_logits(tokens, seg, len(seq) - 1))) == int(gen.tokens[1, step])


def test_sampled_logprobs_and_top_k_match_a_forward_pass(model):
    sampling = SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.9, top_k_logprobs=4)
    gen = generate(model, PROMPTS, key=jax.random.key(1), sampling=sampling)
    rows = [p + gen.tokens[i].tolist() for i, p in enumerate(PROMPTS)]
    for i, (prompt, logits) in enumerate(zip(PROMPTS, packed_forward(model, rows))):
        expected = np.asarray(sampling_logprobs(jnp.asarray(logits[len(prompt) - 1:-1]), 0.7, 0.9))
        np.testing.assert_allclose(gen.logprobs[i], expected[np.arange(6), gen.tokens[i]], atol=1e-4)
        assert np.isfinite(gen.logprobs[i]).all()  # sampled tokens are always inside the nucleus
        ids, lps = np.asarray(gen.topk_ids[i]), np.asarray(gen.topk_logprobs[i])
        np.testing.assert_allclose(lps, np.take_along_axis(expected, ids, -1), atol=1e-4)
        assert all(int(t) in ids[s] for s, t in enumerate(gen.tokens[i]))  # sampled token forced in
        assert len(set(ids[0].tolist())) == 4


def test_same_key_same_samples_and_padded_input_form(model):
    sampling = SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.9, top_k_logprobs=4)  # compiled above
    a = generate(model, PROMPTS, key=jax.random.key(3), sampling=sampling)
    b = generate(model, PROMPTS, key=jax.random.key(3), sampling=sampling)
    c = generate(model, PROMPTS, key=jax.random.key(4), sampling=sampling)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    padded = np.zeros((3, 21), np.int32)
    for i, p in enumerate(PROMPTS):
        padded[i, :len(p)] = p
    d = generate(model.config, padded, prompt_lengths=[5, 2, 21], key=jax.random.key(3), sampling=sampling,
                 params=split_params(model))
    np.testing.assert_array_equal(d.tokens, a.tokens)


def test_stop_tokens_end_rows_and_pad_the_rest(model):
    greedy = generate(model, PROMPTS, key=jax.random.key(0), sampling=SamplingParams(max_new_tokens=7, temperature=0))
    stop = int(greedy.tokens[0, 2])  # row 0 stops after its third token
    sampling = SamplingParams(max_new_tokens=7, temperature=0, stop_token_ids=(stop,), pad_token_id=1,
                              top_k_logprobs=2)
    gen = generate(model, PROMPTS, key=jax.random.key(0), sampling=sampling)
    for i in range(3):
        hits = np.flatnonzero(np.asarray(greedy.tokens[i]) == stop)
        n = int(hits[0]) + 1 if hits.size else 7
        assert int(gen.lengths[i]) == n
        np.testing.assert_array_equal(gen.tokens[i, :n], greedy.tokens[i, :n])
        np.testing.assert_array_equal(gen.tokens[i, n:], 1)
        np.testing.assert_array_equal(gen.logprobs[i, n:], 0.0)
        np.testing.assert_array_equal(gen.topk_ids[i, n:], 1)
    assert int(gen.lengths[0]) == 3


def test_sampling_logprobs_nucleus():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((3, 50)) * 3, jnp.float32)
    full = sampling_logprobs(logits, 1.0, 1.0)
    np.testing.assert_allclose(full, jax.nn.log_softmax(logits), atol=1e-6)
    np.testing.assert_allclose(sampling_logprobs(logits, 0.0, 0.5), jax.nn.log_softmax(logits), atol=1e-6)
    lp = np.asarray(sampling_logprobs(logits, 0.8, 0.6))
    np.testing.assert_allclose(np.log(np.exp(lp).sum(-1)), 0.0, atol=1e-5)  # renormalised
    tempered = np.exp(np.asarray(jax.nn.log_softmax(logits / 0.8)))
    for row in range(3):
        kept = np.isfinite(lp[row])
        assert tempered[row][kept].sum() >= 0.6  # nucleus reaches top_p ...
        assert tempered[row][kept].sum() - tempered[row][kept].min() < 0.6  # ... and is the smallest such set
        assert tempered[row][kept].min() >= tempered[row][~kept].max()  # made of the most likely tokens
    assert np.isfinite(np.asarray(sampling_logprobs(logits, 0.8, 1e-6))).sum(-1).tolist() == [1, 1, 1]


def test_bad_requests_are_named(model):
    greedy = SamplingParams(max_new_tokens=2, temperature=0)
    with pytest.raises(ValueError, match="prompts \\[1\\] are empty"):
        generate(model, [[1], []], key=jax.random.key(0), sampling=greedy)
    with pytest.raises(ValueError, match="token ids \\[500\\] are outside"):
        generate(model, [[1, 500]], key=jax.random.key(0), sampling=greedy)
    with pytest.raises(ValueError, match="params="):
        generate(model.config, [[1]], key=jax.random.key(0), sampling=greedy)
    with pytest.raises(ValueError, match="top_k_logprobs=200 exceeds"):
        generate(model, [[1]], key=jax.random.key(0), sampling=SamplingParams(max_new_tokens=1, top_k_logprobs=200))
    with pytest.raises(ValueError, match="prompt_lengths must be in"):
        generate(model, np.ones((2, 3), np.int32), prompt_lengths=[3, 4], key=jax.random.key(0), sampling=greedy)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_new_tokens=1, top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(max_new_tokens=1, temperature=-1.0)


def test_left_pad_prompts_rounds_width_to_the_bucket():
    tokens, lengths = left_pad_prompts([[1, 2, 3], [4]], bucket=4, pad_token_id=9)
    np.testing.assert_array_equal(tokens, [[9, 1, 2, 3], [9, 9, 9, 4]])
    np.testing.assert_array_equal(lengths, [3, 1])
    assert left_pad_prompts([[1] * 5], bucket=4, pad_token_id=0)[0].shape == (1, 8)
