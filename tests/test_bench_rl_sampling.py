"""bench/rl_sampling.py's pieces: the replicated baseline is the same work as one process sampling the whole rollout
(the same tokens and rewards, every response scored once per call), and the shard_map contender samples the same
tokens as per-device dispatch."""
import argparse

from bench import rl_sampling


def test_the_baseline_and_the_contenders_sample_the_same_rollout():
    args = argparse.Namespace(**rl_sampling.QUICK)
    sampler, params, reward = rl_sampling.build(args, 2)
    scored = sampler.share(1, params, 1)  # one process: the whole rollout
    assert reward.calls == len(scored.rollout) == args.prompts * args.group
    baseline = rl_sampling.replicated_rollout(sampler, 1, params)
    assert reward.calls == 2 * len(scored.rollout)  # the baseline scores every response again
    assert baseline.prompts == scored.rollout.prompts
    assert [x.tolist() for x in baseline.response_ids] == [x.tolist() for x in scored.rollout.response_ids]
    dispatch, spmd = rl_sampling.shard_map_seconds(sampler, params, 2, repeats=1)  # raises if the tokens differ
    assert dispatch > 0 and spmd > 0
