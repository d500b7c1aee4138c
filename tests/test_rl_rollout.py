"""Rollouts and their training sequences on a tiny random decoder: the stored behaviour log-probs are the
training forward pass's log-probs of the same tokens (so the first update is exactly on-policy), the behaviour
top-k holds the sampled token, sequences put every response field at the position that predicts it, and
minibatches partition the rollout."""
import jax
import numpy as np
import pytest

from jodc.balance import LinearCost, get_planner
from jodc.models import DecoderConfig, init_params
from jodc.models.tokenizer import Tokenizer
from jodc.train.rl.batch import minibatch_normalizer, pack_minibatch, split_minibatches, training_sequences
from jodc.train.rl.reference import ReferencePolicy
from jodc.train.rl.rollout import encode_prompts, sample_rollout, sampling_params, stop_token_ids
from jodc.models.tokenizer import byte_level_tokenizer

TOKENIZER = byte_level_tokenizer()
CONFIG = DecoderConfig(vocab_size=264, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, eos_token_ids=(TOKENIZER.eos_token_id,), attention_block_size=16)
PROMPTS = ["12+7=", "305-44+1=", "9-9="]
GROUP, TEMPERATURE, NEW, K = 4, 0.8, 6, 5


@pytest.fixture(scope="module")
def params():
    return jax.tree.map(np.asarray, init_params(CONFIG, jax.random.PRNGKey(0)))


@pytest.fixture(scope="module")
def rollout(params):
    sampling = sampling_params(TOKENIZER, CONFIG, max_new_tokens=NEW, temperature=TEMPERATURE, top_k=K)
    return sample_rollout(CONFIG, params, TOKENIZER, PROMPTS, group_size=GROUP, sampling=sampling,
                          key=jax.random.PRNGKey(3))


def test_prompts_are_bos_then_text_and_responses_stop_at_eos():
    ids = encode_prompts(TOKENIZER, ["ab"])
    assert ids[0].tolist() == [TOKENIZER.bos_token_id, ord("a"), ord("b")]
    assert stop_token_ids(TOKENIZER, CONFIG) == (TOKENIZER.eos_token_id,)
    without_bos = Tokenizer(TOKENIZER.backend, eos_token="<|eos|>")
    assert encode_prompts(without_bos, ["ab"])[0].tolist() == [ord("a"), ord("b")]
    with pytest.raises(ValueError, match="encode to no tokens"):
        encode_prompts(without_bos, ["x", ""])


def test_rollout_layout_and_behaviour_topk(rollout):
    n = len(PROMPTS) * GROUP
    assert len(rollout) == n and rollout.prompts == [p for p in PROMPTS for _ in range(GROUP)]
    lengths = rollout.response_lengths
    assert ((lengths >= 1) & (lengths <= NEW)).all()
    eos = TOKENIZER.eos_token_id
    for ids, done, text in zip(rollout.response_ids, rollout.finished, rollout.responses):
        assert done == (ids[-1] == eos) and (eos not in ids[:-1].tolist())
        assert text == TOKENIZER.decode((ids[:-1] if done else ids).tolist())
    for i in range(n):
        top = rollout.topk_ids[i]
        assert top.shape == (lengths[i], K) and all(t in row for t, row in zip(rollout.response_ids[i], top))
        assert (np.diff(rollout.topk_logprobs[i][:, :-1], axis=1) <= 1e-6).all()  # sorted, except a forced slot


def test_training_sequences_put_fields_at_their_predicting_positions(rollout):
    advantages = np.arange(len(rollout), dtype=np.float32)
    ref = [lp - 1.0 for lp in rollout.logprobs]
    seqs = training_sequences(rollout, advantages, with_topk=True, ref_logprobs=ref)
    for i in range(len(rollout)):
        p, n = len(rollout.prompt_ids[i]), len(rollout.response_ids[i])
        assert seqs.lengths[i] == p + n - 1
        np.testing.assert_array_equal(seqs.targets[i][p - 1:], rollout.response_ids[i])
        np.testing.assert_array_equal(seqs.inputs[i][:p], rollout.prompt_ids[i])
        np.testing.assert_array_equal(seqs.loss_masks[i], [0] * (p - 1) + [1] * n)
        np.testing.assert_array_equal(seqs.extras["behaviour_logprobs"][i][p - 1:], rollout.logprobs[i])
        np.testing.assert_array_equal(seqs.extras["advantages"][i], np.where(seqs.loss_masks[i] > 0, i, 0))
        np.testing.assert_array_equal(seqs.extras["topk_ids"][i][p - 1:], rollout.topk_ids[i])
        np.testing.assert_array_equal(seqs.extras["ref_logprobs"][i][p - 1:], ref[i])
    assert set(training_sequences(rollout, advantages).extras) == {"behaviour_logprobs", "advantages"}
    with pytest.raises(ValueError, match="advantages must have shape"):
        training_sequences(rollout, advantages[:-1])


def test_minibatches_partition_the_rollout_and_pack_with_global_normalizers(rollout):
    parts = split_minibatches(12, 5, seed=1, step=2)
    assert sorted(np.concatenate(parts).tolist()) == list(range(12)) and {len(p) for p in parts} == {2, 3}
    assert [p.tolist() for p in parts] == [p.tolist() for p in split_minibatches(12, 5, seed=1, step=2)]
    assert [p.tolist() for p in parts] != [p.tolist() for p in split_minibatches(12, 5, seed=1, step=3)]
    with pytest.raises(ValueError, match="cannot split 3 sequences into 4"):
        split_minibatches(3, 4, seed=0, step=0)
    seqs = training_sequences(rollout, np.ones(len(rollout), np.float32))
    indices = np.arange(len(rollout))
    _, arrays = pack_minibatch(seqs, indices, planner=get_planner("lb_mini"), num_devices=2, token_cap=32,
                               cost_model=LinearCost(), aggregation="token-mean")
    assert arrays.normalizer == float(rollout.response_lengths.sum()) == arrays.loss_mask.sum()
    assert arrays.num_tokens == sum(seqs.lengths) and arrays.num_sequences == len(rollout)
    packed = arrays.extras["behaviour_logprobs"][arrays.loss_mask > 0]
    assert sorted(packed.tolist()) == sorted(np.concatenate(rollout.logprobs).tolist())
    assert minibatch_normalizer(rollout.response_lengths, "seq-mean-token-mean") == len(rollout)
    assert minibatch_normalizer([3, 0, 2], "seq-mean-token-mean") == 2.0
    assert minibatch_normalizer([3, 0, 2], "token-mean") == 5.0
    with pytest.raises(ValueError, match="exceeds engine.token_cap=8"):
        pack_minibatch(seqs, indices, planner=get_planner("lb_mini"), num_devices=2, token_cap=8,
                       cost_model=LinearCost(), aggregation="token-mean")


def test_behaviour_logprobs_are_the_training_forwards_and_the_reference_reproduces_them(rollout, params):
    """The reference policy is the training forward pass (`jodc.models.forward`, then log-softmax at the sampling
    temperature) on the whole sequence; with the rollout's weights it must give the behaviour log-probs."""
    reference = ReferencePolicy(CONFIG, params, temperature=TEMPERATURE)
    for got, want in zip(reference.response_logprobs(rollout), rollout.logprobs):
        np.testing.assert_allclose(got, want, atol=2e-5)
    other = ReferencePolicy(CONFIG, jax.tree.map(lambda x: x * 1.5, params), temperature=TEMPERATURE)
    assert not np.allclose(np.concatenate(other.response_logprobs(rollout)), np.concatenate(rollout.logprobs))


def test_continuous_batching_over_two_devices_samples_the_static_rollout(params, rollout):
    """`rollout.batching: continuous` (each device streams its share through a few slots over a paged cache) gives the
    static rollout's responses token for token, its behaviour top-k ids, and its log-probs to rounding."""
    from jodc.models.stream import StreamShape

    sampling = sampling_params(TOKENIZER, CONFIG, max_new_tokens=NEW, temperature=TEMPERATURE, top_k=K)
    devices = jax.devices()[:2]
    static = sample_rollout(CONFIG, params, TOKENIZER, PROMPTS, group_size=GROUP, sampling=sampling,
                            key=jax.random.PRNGKey(3), devices=devices, prompt_width=12)
    streamed = sample_rollout(CONFIG, params, TOKENIZER, PROMPTS, group_size=GROUP, sampling=sampling,
                              key=jax.random.PRNGKey(3), devices=devices, prompt_width=12,
                              stream=StreamShape(slots=3, page_size=16, chunk=3, prefill_rows=2))
    assert [r.tolist() for r in streamed.response_ids] == [r.tolist() for r in static.response_ids] == \
        [r.tolist() for r in rollout.response_ids]  # and the one-device rollout's
    assert streamed.responses == static.responses and (streamed.finished == static.finished).all()
    for a, b, ta, tb in zip(streamed.logprobs, static.logprobs, streamed.topk_ids, static.topk_ids):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(ta, tb)
