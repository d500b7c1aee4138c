"""Continuous batching over a paged KV cache (models/stream.py, models/paged_cache.py): every response equals the
static sampler's, pages never leak and page pressure makes rows wait, never corrupts them, and rows carried on under
new weights record each token's version and a log-prob equal to a recomputation under that version."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jodc.models import DecoderConfig, SamplingParams, generate, init_params, merge_params, split_params
from jodc.models.paged_cache import SCRATCH_PAGE, PagePool, pages_for
from jodc.models.stream import ContinuousSampler, StreamShape, stream_generate

CONFIG = DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                       num_kv_heads=2, qkv_bias=True, qk_norm=True, attention_block_size=8)
STOPS = (3, 7, 11, 13)


@pytest.fixture(scope="module")
def model():
    return merge_params(CONFIG, init_params(CONFIG, jax.random.key(0), init_std=0.1))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(1, 128, int(rng.integers(1, 30))).tolist() for _ in range(19)]


def assert_same_as_generate(model, prompts, sampling, shape, key=jax.random.key(1)):
    """The stream's completions equal `generate`'s rows token for token (log-probs to rounding); its stats."""
    static = jax.device_get(generate(model, prompts, key=key, sampling=sampling))
    completions, stats = stream_generate(model, prompts, key=key, sampling=sampling, shape=shape)
    for row, c in enumerate(completions):
        n = int(static.lengths[row])
        np.testing.assert_array_equal(c.tokens, static.tokens[row, :n], err_msg=f"row {row}")
        np.testing.assert_allclose(c.logprobs, static.logprobs[row, :n], atol=1e-5, rtol=0)
        np.testing.assert_array_equal(c.versions, 0)
        if sampling.top_k_logprobs:
            np.testing.assert_array_equal(c.topk_ids, static.topk_ids[row, :n])
            np.testing.assert_allclose(c.topk_logprobs, static.topk_logprobs[row, :n], atol=1e-5, rtol=0)
    assert stats.tokens == int(static.lengths.sum())
    return stats


@pytest.mark.parametrize("shape, temperature", [
    (StreamShape(slots=1, page_size=4, chunk=4, prefill_rows=1), 0.0),
    (StreamShape(slots=4, page_size=4, chunk=3, prefill_rows=2), 0.0),
    (StreamShape(slots=4, page_size=4, chunk=3, prefill_rows=2), 1.0),
    (StreamShape(slots=32, page_size=16, chunk=8, prefill_rows=4), 1.0)],
    ids=["1-slot-greedy", "4-slots-greedy", "4-slots-sampled", "more-slots-than-prompts-sampled"])
def test_every_response_equals_the_static_samplers(model, prompts, temperature, shape):
    sampling = SamplingParams(max_new_tokens=20, temperature=temperature, stop_token_ids=STOPS, top_k_logprobs=3,
                              top_p=0.9 if temperature else 1.0)
    stats = assert_same_as_generate(model, prompts, sampling, shape)
    assert stats.preempted == 0 and stats.held == 0
    assert stats.decode_calls >= -(-len(prompts) // shape.slots)


def test_page_pressure_makes_rows_wait_or_restart_never_corrupts_them_and_no_page_leaks(model, prompts):
    """A pool of a longest row's pages and 2 more, for 6 slots: rows wait for pages and some are preempted (restarted
    from their first token); the responses are still the static sampler's, and every page comes back."""
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0, stop_token_ids=STOPS)
    row_pages = pages_for(max(map(len, prompts)) + 24 - 1, 8)
    shape = StreamShape(slots=6, page_size=8, pages=row_pages + 3, chunk=4, prefill_rows=3)
    stats = assert_same_as_generate(model, prompts, sampling, shape)
    assert stats.held > 0 and stats.preempted > 0 and stats.peak_pages <= row_pages + 2
    sampler = ContinuousSampler(model, sampling, shape, max_prompt_tokens=max(map(len, prompts)))
    for round_key in (jax.random.key(5), jax.random.key(6)):  # one sampler, two batches: pages return each time
        ids = sampler.submit(prompts, round_key)
        done = sampler.run()
        assert sorted(done) == ids and sampler.pool.free == sampler.pool.usable and sampler.running == 0
        assert (sampler.pool.table == SCRATCH_PAGE).all()


def test_tokens_after_a_weight_update_record_the_new_version_and_its_log_probs(prompts):
    """Rows under way when the weights change carry on under the new ones: each token's log-prob equals a forward
    pass of the version it records over the prompt and the tokens before it."""
    models = [merge_params(CONFIG, init_params(CONFIG, jax.random.key(seed), init_std=0.1)) for seed in (0, 1)]
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0, stop_token_ids=STOPS)
    sampler = ContinuousSampler(CONFIG, sampling, StreamShape(slots=5, page_size=4, chunk=3, prefill_rows=2),
                                max_prompt_tokens=max(map(len, prompts)), params=split_params(models[0]))
    ids = sampler.submit(prompts, jax.random.key(2))
    done = {}
    for _ in range(3):
        done.update(sampler.advance())
    running = sampler.running
    sampler.set_params(split_params(models[1]), version=1)
    assert sampler.stats.refills == running > 0
    done.update(sampler.run())
    width = 64  # every sequence padded to one width (segment 0): one compiled forward

    @jax.jit
    def forward(m, tokens, n_real):
        segments = (jnp.arange(width) < n_real).astype(jnp.int32)[None]
        return jax.nn.log_softmax(m(tokens[None], None, segments)[0].astype(jnp.float32))

    both = 0
    for request_id in ids:
        prompt, c = prompts[request_id], done[request_id]
        assert (np.diff(c.versions) >= 0).all()
        both += len(set(c.versions.tolist())) == 2
        for version in (0, 1):
            steps = np.flatnonzero(c.versions == version)
            if steps.size:
                sequence = np.asarray(prompt + c.tokens.tolist(), np.int32)
                n_real = len(sequence)
                padded = np.zeros(width, np.int32)
                padded[:n_real] = sequence
                logprobs = np.asarray(forward(models[version], jnp.asarray(padded), n_real))
                expected = logprobs[len(prompt) - 1 + steps, c.tokens[steps]]
                np.testing.assert_allclose(c.logprobs[steps], expected, atol=2e-5, rtol=0)
    assert both > 0  # some responses hold tokens of both versions


def test_page_pool_hands_out_lowest_pages_first_and_takes_them_back():
    pool = PagePool(pages=6, page_size=4, slots=2, pages_per_row=3)
    assert pool.usable == 5 and pool.free == 5
    assert pool.grow(0, 5) and pool.table[0].tolist() == [1, 2, SCRATCH_PAGE]
    assert pool.grow(1, 12) and pool.table[1].tolist() == [3, 4, 5] and pool.free == 0
    assert pool.grow(0, 8) and not pool.grow(0, 9)  # needs a third page; none free: nothing taken
    assert pool.held(0) == 2
    pool.release(1)
    assert pool.free == 3 and (pool.table[1] == SCRATCH_PAGE).all()
    assert pool.grow(0, 12) and pool.table[0].tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="pages_per_row"):
        pool.grow(1, 13)


def test_bad_shapes_and_prompts_are_refused_before_anything_runs(model):
    sampling = SamplingParams(max_new_tokens=8)
    with pytest.raises(ValueError, match="slots"):
        StreamShape(slots=0)
    with pytest.raises(ValueError, match="pages"):
        StreamShape(pages=-1)
    with pytest.raises(ValueError, match="cannot hold one row"):
        ContinuousSampler(model, sampling, StreamShape(page_size=4, pages=3), max_prompt_tokens=10)
    sampler = ContinuousSampler(model, sampling, StreamShape(slots=2), max_prompt_tokens=4)
    assert sampler.max_prompt_tokens == sampling.prompt_bucket == 16  # rounded up to the prompt bucket
    with pytest.raises(ValueError, match="prompt lengths"):
        sampler.submit([list(range(1, 18))], jax.random.key(0))
    with pytest.raises(ValueError, match="outside"):
        sampler.submit([[1, 500]], jax.random.key(0))
    with pytest.raises(ValueError, match="no prompts"):
        sampler.submit([], jax.random.key(0))
    with pytest.raises(TypeError, match="StreamShape"):
        ContinuousSampler(model, sampling, (2, 16), max_prompt_tokens=4)


def test_a_snapshot_taken_before_a_weight_update_resumes_exactly(prompts):
    """A stream snapshotted between calls (rows under way, prompts waiting) and restored in a new sampler under the
    next weights finishes bit for bit as the original does after `set_params` with those weights."""
    import json

    models = [split_params(merge_params(CONFIG, init_params(CONFIG, jax.random.key(seed), init_std=0.1)))
              for seed in (0, 1)]
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0, stop_token_ids=STOPS, top_k_logprobs=2)
    shape = StreamShape(slots=4, page_size=4, pages=20, chunk=3, prefill_rows=2)

    def sampler():
        return ContinuousSampler(CONFIG, sampling, shape, max_prompt_tokens=max(map(len, prompts)),
                                 params=models[0])

    original = sampler()
    ids = original.submit(prompts, jax.random.key(2))
    before = {}
    for _ in range(4):
        before.update(original.advance())
    snapshot = json.loads(json.dumps(original.snapshot()))  # as a checkpoint stores it
    assert snapshot["rows"] and snapshot["waiting"]
    original.set_params(models[1], version=1)
    expected = original.run()
    resumed = sampler()
    resumed.restore(snapshot, models[1], version=1)
    got = resumed.run()
    assert sorted(got) == sorted(expected) == sorted(set(ids) - set(before))
    for request_id, c in expected.items():
        for field in ("tokens", "logprobs", "versions", "topk_ids", "topk_logprobs"):
            np.testing.assert_array_equal(getattr(got[request_id], field), getattr(c, field), err_msg=field)
    assert resumed.pool.free == resumed.pool.usable
