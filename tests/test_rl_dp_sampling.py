"""Data-parallel RL sampling in one process: a step's prompts split in whole groups over 1, 2 or 4 devices give
the same prompts, groups, per-response keys and sampled tokens, and the reward function is called once per
response. Also: the per-row keys of the compiled sampler, the shares, joining shares, and the exchange's failure
paths (a share that raised, a process that sent nothing) with a stand-in for MPI."""
import dataclasses
import pickle

import jax
import numpy as np
import pytest

from jodc.models import SamplingParams, generate
from jodc.models.generate import row_keys
from jodc.train.rl.rollout import Rollout, device_shares, response_keys
from jodc.train.rl.rollout_exchange import RolloutShareError, allgather_bytes, gather_shares
from jodc.train.rl.layout import RolloutLayout
from jodc.train.rl.scored import ScoredRollout, StepRollout, logprob_mismatch
from rl_sampling_setup import CONFIG, GROUP, NEW, PROMPTS, TOKENIZER, CountingReward, make_params, make_sampler



@pytest.fixture(scope="module")
def params():
    return make_params()


def test_device_shares_are_whole_contiguous_prompts_of_near_equal_size():
    assert device_shares(5, 4) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert device_shares(8, 2) == [range(0, 4), range(4, 8)]
    assert device_shares(2, 4) == [range(0, 1), range(1, 2), range(2, 2), range(2, 2)]
    for n, d in ((7, 3), (16, 4), (1, 1)):
        shares = device_shares(n, d)
        assert [i for s in shares for i in s] == list(range(n)) and max(map(len, shares)) - min(map(len, shares)) <= 1
    with pytest.raises(ValueError, match="at least one device"):
        device_shares(3, 0)


def test_response_keys_depend_on_prompt_index_and_member_only():
    key = jax.random.PRNGKey(11)
    whole = np.asarray(response_keys(key, range(4), 3))
    expected = [np.asarray(jax.random.fold_in(jax.random.fold_in(key, i), j)) for i in range(4) for j in range(3)]
    np.testing.assert_array_equal(whole, np.stack(expected))
    np.testing.assert_array_equal(np.asarray(response_keys(key, [2, 3], 3)), whole[6:])  # a share: same keys
    assert len({tuple(k) for k in whole.tolist()}) == 12


def test_generate_rows_sample_with_their_own_keys(params):
    """A row's tokens depend on its prompt and key only: sampled alone (another batch, another device) it gives the
    same tokens; one key stands for `row_keys(key, B)`."""
    sampling = SamplingParams(max_new_tokens=NEW, temperature=1.0, prompt_bucket=8)
    prompts = [[1, 50, 60], [1, 70], [1, 80, 90, 100]]
    key = jax.random.PRNGKey(5)
    batch = generate(CONFIG, prompts, key=key, sampling=sampling, params=params)
    np.testing.assert_array_equal(
        np.asarray(generate(CONFIG, prompts, key=row_keys(key, 3), sampling=sampling, params=params).tokens),
        np.asarray(batch.tokens))
    keys = row_keys(key, 3)
    for row, device in ((1, jax.devices()[1]), (2, None)):
        alone = generate(CONFIG, prompts[row:row + 1], key=keys[row:row + 1], sampling=sampling, params=params,
                         prompt_width=8, device=device)
        np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(batch.tokens)[row])
        np.testing.assert_allclose(np.asarray(alone.logprobs)[0], np.asarray(batch.logprobs)[row], atol=1e-5)
    with pytest.raises(ValueError, match="2 keys for 3 prompts"):
        generate(CONFIG, prompts, key=keys[:2], sampling=sampling, params=params)


@pytest.fixture(scope="module")
def sampled(params):
    """{devices: (step 3's scored rollout sampled over that many devices, the reward function's calls)}."""
    out = {}
    for devices in (1, 2, 4):
        reward = CountingReward()
        sampler = make_sampler(devices, reward, top_k=4)
        mine, used = sampler.local_devices()
        assert mine == range(PROMPTS) and used == jax.devices()[:devices]
        step = sampler(3, params, 3)  # one process: the whole rollout, held here
        assert isinstance(step, StepRollout) and step.holds_all and len(step) == PROMPTS * GROUP
        out[devices] = step.own, reward.calls
    return out


def test_sampling_over_1_2_4_devices_is_the_same_rollout_scored_once(sampled):
    """The same prompts, groups, keys and sampled tokens (and behaviour top-k) over 1, 2 and 4 devices (every
    device's batch another shape), the behaviour log-probs equal to float rounding, each response scored once."""
    one = sampled[1][0]
    n = PROMPTS * GROUP
    for devices, (scored, calls) in sampled.items():
        r = scored.rollout
        assert len(r) == n and r.prompts == one.rollout.prompts and r.group_size == GROUP
        assert len(set(r.prompts[::GROUP])) == PROMPTS and all(len(set(r.prompts[i:i + GROUP])) == 1
                                                               for i in range(0, n, GROUP))
        assert [x.tolist() for x in r.response_ids] == [x.tolist() for x in one.rollout.response_ids], devices
        assert [x.tolist() for x in r.topk_ids] == [x.tolist() for x in one.rollout.topk_ids], devices
        for a, b in zip(r.logprobs, one.rollout.logprobs):
            np.testing.assert_allclose(a, b, atol=1e-5)
        np.testing.assert_array_equal(scored.rewards, one.rewards)
        assert (scored.versions == 3).all() and scored.trainer_logprobs is None
        # the reward function: once per response, on exactly the rollout's (prompt, response) pairs
        assert len(calls) == n and sorted(calls) == sorted(zip(r.prompts, r.responses)), devices
    assert len({tuple(x) for x in one.rollout.response_ids}) > PROMPTS  # the samples differ within groups


def test_joining_shares_gives_the_whole_rollout(sampled):
    """`ScoredRollout.concat` of a step's shares (what the processes exchange) equals the rollout in one piece,
    measures the mismatch over the whole, and survives the checkpoints' JSON round trip."""
    base = sampled[1][0]
    trainer = [lp - 0.01 * (i % 3) for i, lp in enumerate(base.rollout.logprobs)]
    whole = ScoredRollout(step=3, rollout=base.rollout, rewards=base.rewards, versions=base.versions,
                          trainer_logprobs=trainer, reward_seconds=0.25, mismatch_seconds=0.125)
    assert whole.mismatch == logprob_mismatch(base.rollout.logprobs, trainer)

    def cut(a, b):
        r = whole.rollout
        part = Rollout(**{**{f: getattr(r, f)[a:b] for f in ("prompts", "prompt_ids", "response_ids", "logprobs",
                                                                 "topk_ids", "topk_logprobs", "responses",
                                                                 "finished")},
                          "group_size": r.group_size, "seconds": r.seconds})
        return ScoredRollout(step=3, rollout=part, rewards=whole.rewards[a:b], versions=whole.versions[a:b],
                             trainer_logprobs=trainer[a:b], reward_seconds=0.25, mismatch_seconds=0.125)

    joined = ScoredRollout.concat([cut(0, 6), cut(6, 6), cut(6, 12)], exchange_seconds=0.5)
    assert joined.mismatch == whole.mismatch and joined.mismatch["logprob_mismatch"] > 0
    assert joined.rollout.prompts == whole.rollout.prompts and joined.seconds == whole.seconds + 0.5
    np.testing.assert_array_equal(joined.rewards, whole.rewards)
    again = ScoredRollout.from_json(joined.to_json())
    assert again.exchange_seconds == 0.5 and [x.tolist() for x in again.rollout.topk_ids] == \
        [x.tolist() for x in whole.rollout.topk_ids]
    with pytest.raises(ValueError, match="shares of steps"):
        ScoredRollout.concat([whole, dataclasses.replace(whole, step=4)])
    with pytest.raises(ValueError, match="some shares measured the mismatch"):
        ScoredRollout.concat([whole, dataclasses.replace(whole, trainer_logprobs=None)])


class FakeComm:
    """MPI_COMM_WORLD as seen by process `rank` of `size`, whose peers send `sent` (rank -> bytes) or nothing."""

    def __init__(self, rank, size, sent):
        self.rank, self.size, self.sent = rank, size, sent

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def Isend(self, buffer, dest, tag):
        return FakeRequest(lambda: None)

    def Irecv(self, buffer, source, tag):
        if source not in self.sent:
            return FakeRequest(None)
        data = np.frombuffer(self.sent[source], np.uint8)

        def fill():
            if buffer.dtype == np.int64:
                buffer[0] = data.size
            else:
                buffer[:] = data
        return FakeRequest(fill)


class FakeRequest:
    def __init__(self, complete):
        self.complete, self.cancelled = complete, False

    def Test(self):
        if self.complete is None:
            return False
        self.complete()
        return True

    def Wait(self):
        assert self.Test()

    def Cancel(self):
        self.cancelled = True


def test_exchange_names_the_process_that_failed_or_sent_nothing():
    ok = pickle.dumps(("ok", "share of 1"))
    assert gather_shares(lambda: "share of 0", what="step 1's rollout", timeout_s=5,
                         comm=FakeComm(0, 2, {1: ok})) == ["share of 0", "share of 1"]
    failed = pickle.dumps(("error", "RewardError: the reward function raised KeyError on step 1, sample 9"))
    with pytest.raises(RolloutShareError, match=r"(?s)failed in process\(es\) \[1\].*process 1: RewardError"):
        gather_shares(lambda: "share of 0", what="step 1's rollout", timeout_s=5, comm=FakeComm(0, 2, {1: failed}))

    def broken():
        raise ValueError("no sampler here")

    with pytest.raises(RolloutShareError, match=r"(?s)failed in process\(es\) \[0, 1\].*process 0: ValueError: no "
                                                r"sampler here") as info:
        gather_shares(broken, what="step 1's rollout", timeout_s=5, comm=FakeComm(0, 2, {1: failed}))
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(TimeoutError, match=r"process\(es\) \[2\] sent nothing within 0.2 s"):
        allgather_bytes(b"x", timeout_s=0.2, what="step 4's rollout", comm=FakeComm(0, 3, {1: b"y"}))
    with pytest.raises(RolloutShareError, match=r"step 4's rollout: process\(es\) \[1\] sent nothing"):
        gather_shares(lambda: 1, what="step 4's rollout", timeout_s=0.2, comm=FakeComm(0, 2, {}))


def test_empty_shares_and_mismatched_parts_are_handled():
    """A process whose devices got no prompt samples an empty rollout (joined like any share); parts of other group
    sizes or prompt indices that do not fit are refused before anything is dispatched."""
    from jodc.train.rl.rollout import sample_rollout, sampling_params

    from rl_sampling_setup import TOKENIZER

    sampling = sampling_params(TOKENIZER, CONFIG, max_new_tokens=NEW, temperature=1.0, top_k=2)
    empty = sample_rollout(CONFIG, None, TOKENIZER, [], group_size=GROUP, sampling=sampling,
                           key=jax.random.PRNGKey(0), prompt_indices=[])
    assert len(empty) == 0 and empty.topk_ids == [] and empty.finished.shape == (0,)
    with pytest.raises(ValueError, match="1 prompt indices for 2 prompts"):
        sample_rollout(CONFIG, None, TOKENIZER, ["1+1=", "2+2="], group_size=GROUP, sampling=sampling,
                       key=jax.random.PRNGKey(0), prompt_indices=[3])
    with pytest.raises(ValueError, match="parts of group sizes"):
        Rollout.concat([empty, dataclasses.replace(empty, group_size=GROUP + 1)])


def test_a_child_sampler_samples_the_shares_of_the_process_it_works_for():
    """A sampler process of MPI process 1 of 2 (outside the MPI job: its JAX sees one process; the layout is its
    trainer's) samples the shares of the second half of the engine's devices, on its own first devices, and says so
    when it has fewer devices than its process drives."""
    sampler = make_sampler(4, CountingReward(), layout=RolloutLayout(process=1, processes=2))
    assert sampler.local_devices() == (range(2, 4), jax.local_devices()[:2])
    assert dataclasses.replace(sampler, layout=RolloutLayout(0, 2)).local_devices()[0] == range(0, 2)
    assert make_sampler(4, CountingReward()).local_devices()[0] == range(0, 4)  # one process: all of them
    # every process's responses: its devices' prompt shares (5 prompts over 4 devices: 2, 1, 1, 1) x the group
    assert RolloutLayout(0, 2).response_shares(5, 3, 4) == [range(0, 9), range(9, 15)]
    assert RolloutLayout(0, 2).prompt_range(5, 4) == range(0, 3) and RolloutLayout(1, 2).prompt_range(5, 4) == range(3, 5)
    assert RolloutLayout().response_shares(5, 3, 4) == [range(0, 15)]
    with pytest.raises(RuntimeError, match=r"sampler of process 1 of 2 has 8 cpu device.*samples on 16 "
                                           r"\(engine.devices=32 over 2 process"):
        make_sampler(32, CountingReward(), layout=RolloutLayout(1, 2)).local_devices()


def test_evaluation_split_over_devices_gives_the_same_scores_each_response_scored_once(params):
    """`RLRun.evaluate` splits the held-out problems over the engine's devices as rollouts are split: the same
    greedy accuracy and sampled reward over 2 devices (3 problems: uneven shares) as sampling the whole set on one
    device, and one reward call per response."""
    import types

    from jodc.fsdp.stages import GroupLayout
    from jodc.train.rl.loop import EVAL_SAMPLES, RLRun
    from jodc.train.rl.rewards import score
    from jodc.train.rl.rollout import encode_prompts, sample_rollout

    problems = [types.SimpleNamespace(prompt=f"{a}+{a + 1}=") for a in range(3)]
    reference = CountingReward()
    greedy = dataclasses.replace(make_sampler(1, reference).sampling, temperature=0.0, top_k_logprobs=0)
    sampled = dataclasses.replace(greedy, temperature=1.0)
    config = types.SimpleNamespace(run=types.SimpleNamespace(seed=3), task=types.SimpleNamespace(success_reward=1.0),
                                   engine=types.SimpleNamespace(barrier_timeout_s=None))
    width = max(len(ids) for ids in encode_prompts(TOKENIZER, [p.prompt for p in problems]))  # as RLRun.build
    expected = {}
    for key, group, sampling in (("eval_accuracy", 1, greedy), ("eval_sampled_reward", EVAL_SAMPLES, sampled)):
        whole = sample_rollout(CONFIG, params, TOKENIZER, [p.prompt for p in problems], group_size=group,
                               sampling=sampling, key=jax.random.PRNGKey(3))
        rewards = score(reference, whole.prompts, whole.responses, step=1)
        expected[key] = float(np.mean(rewards >= 1.0) if group == 1 else np.mean(rewards))
    # an engine as the evaluation reads it: the flat fp32 groups (here on one device, as the reference engine's)
    layouts = {g: GroupLayout.of(tree) for g, tree in params.items()}
    engine = types.SimpleNamespace(model=types.SimpleNamespace(layouts=layouts),
                                   sharded_params=lambda: {g: layouts[g].flatten(params[g]) for g in params})
    for devices in (2,):  # uneven shares (2 + 1 problems); 1 device is the reference above
        reward = CountingReward()
        run = types.SimpleNamespace(eval_set=problems, engine=engine,
                                    sampler=make_sampler(devices, reward), model_config=CONFIG, tokenizer=TOKENIZER,
                                    greedy=greedy, eval_sampling=sampled, reward_fn=reward, config=config,
                                    eval_width=width, layout=RolloutLayout())
        assert RLRun.evaluate(run, 1) == expected, devices
        assert sorted(reward.calls) == sorted(reference.calls), devices
