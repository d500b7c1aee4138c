"""RL rollouts sampled in shares across processes (`RolloutSampler` under mpirun). Usage:

    mpirun -np 2 python -m mpi4py rl_sampling_case.py LOCAL_DEVICES OUT_DIR

Four phases in one launch (tests/test_multiprocess.py::test_rl_rollout_shares_across_processes checks them):
1. step 3 sampled over the 2 x LOCAL_DEVICES devices: each process samples and scores its devices' shares, the shares'
   metadata is exchanged; the whole rollout is gathered (as for a checkpoint) and process 0 writes it to
   OUT_DIR/mp.json, every process its reward calls to OUT_DIR/calls-<process>.json (the driver compares with one
   process sampling over 1 and 4 devices); then the step's minibatches are assembled without replication and
   compared with the replicated assembly (`assemble`);
2. step 4 with a reward that raises in process 1 only: every process raises RolloutShareError naming process 1 and
   its cause (printed as "RAISED <process>: ...");
3. the agreement check (`distributed.check_agreement`) on a value that differs in process 1: every process raises
   naming process 1 ("DISAGREE <process>: ...");
4. step 5 with process 1's reward hanging: process 0 raises, naming process 1, within the exchange timeout, and
   aborts the job (non-zero exit).
"""
import dataclasses
import json
import os
import sys
import time

import numpy as np

TIMEOUT_S = 3.0  # the hanging reward's phase: process 0 names process 1 within it
STARTUP_TIMEOUT_S = 120.0  # the other phases (the first compiles its programs)


class PhasedReward:
    """The counting reward; in process 1 it raises at step 4 (sample prompts are of that step) or hangs at step 5."""

    def __init__(self, counting, rank):
        self.counting, self.rank, self.mode = counting, rank, "ok"

    def __call__(self, prompt, response):
        if self.rank == 1 and self.mode == "fail":
            raise KeyError("process 1's reward fails")
        if self.rank == 1 and self.mode == "hang":
            time.sleep(120)
        return self.counting(prompt, response)


class CountingPolicy:
    """A `ReferencePolicy` that records the rows of every forward pass it runs."""

    def __init__(self, params):
        from jodc.train.rl.reference import ReferencePolicy
        from rl_sampling_setup import CONFIG

        self.policy, self.rows = ReferencePolicy(CONFIG, params, temperature=1.0, bucket=8), []

    def response_logprobs(self, rollout, width=0):
        self.rows.append(len(rollout))
        return self.policy.response_logprobs(rollout, width=width)

    def per_device_share(self, rollout, width):
        """Log-probs of `rollout` (whole device shares) one engine device's sampling share at a time (3 responses
        here), rows `width` wide: as the trainer runs its passes (`RLRun.forward_passes`)."""
        from rl_sampling_setup import GROUP

        return [x for start in range(0, len(rollout), GROUP)
                for x in self.response_logprobs(rollout.select(range(start, start + GROUP)), width=width)]


def assemble(jax, rank, scored, whole, params):
    """Step 3's minibatches assembled without replication (train/rl/assembly.py, as the trainer does under mpirun):
    the reference and recompute passes over this process's share only (rows counted; one pass per device share, as
    the trainer runs them), the KL-in-reward inputs
    exchanged, the plans computed here, each sequence sent to the process of its device. Every packed row of this
    process's devices equals the replicated assembly's (the whole rollout, every pass over all of it: the trainer
    before) bit for bit, the other devices' rows are zero placeholders, and the process received exactly the
    sequences the plans put on its devices that it did not sample. Prints "PASS assembled ..."."""
    import numpy as np

    from jodc.balance import LinearCost, get_planner
    from jodc.losses import grpo_advantages
    from jodc.train.rl.assembly import StepInputs, exchange_step_inputs, send_sequences, sequence_destinations
    from jodc.train.rl.batch import (extra_specs, local_sequences, pack_local_minibatch, pack_minibatch,
                                     plan_minibatch, split_minibatches, training_sequences, travelling_fields)
    from jodc.train.rl.advantages import kl_shaped_rewards
    from rl_sampling_setup import GROUP

    planner, updates, token_cap, k = get_planner("lb_mini"), 2, 64, 4
    device_processes = [d.process_index for d in jax.devices()]
    local = [d for d, p in enumerate(device_processes) if p == rank]
    reference, recompute = CountingPolicy(params), CountingPolicy(params)
    width = scored.width(8)
    own = scored.own.rollout
    inputs = exchange_step_inputs(
        3, lambda: StepInputs(ref_logprobs=reference.per_device_share(own, width),
                              old_logprobs=recompute.per_device_share(own, width), values=None),
        kl_in_reward=True, critic=False, behaviour_logprobs=own.logprobs, timeout_s=STARTUP_TIMEOUT_S)

    def advantages_of(logprobs, ref_logprobs):
        shaped, _ = kl_shaped_rewards(scored.rewards, logprobs, ref_logprobs, beta=0.1, estimator="k1")
        return np.asarray(grpo_advantages(np.asarray(shaped, np.float32), GROUP))

    advantages = advantages_of(inputs.kl_logprobs_all, inputs.ref_logprobs_all)
    splits = split_minibatches(len(scored), updates, seed=7, step=3)
    lengths = scored.sequence_lengths
    plans = [plan_minibatch(lengths[i], planner=planner, num_devices=len(device_processes), token_cap=token_cap,
                            cost_model=LinearCost()) for i in splits]
    destinations = sequence_destinations(plans, splits, device_processes, len(scored))
    extras = ["behaviour_logprobs", "advantages", "topk_ids", "topk_logprobs", "ref_logprobs", "trainer_logprobs"]
    received = send_sequences(3, scored, destinations, inputs, process=rank, processes=len(set(device_processes)),
                              fields=travelling_fields(extras), timeout_s=STARTUP_TIMEOUT_S)
    ids, sequences = local_sequences(received, advantages)
    specs = extra_specs(extras, k)
    mine = set(scored.held)
    placed = {int(i) for i in np.flatnonzero(destinations[:, rank])}
    foreign = sorted(set(received) - mine)
    assert set(ids) == placed and set(foreign) == placed - mine, (ids, placed, foreign)
    assert sum(reference.rows) == sum(recompute.rows) == len(mine), (reference.rows, recompute.rows)
    # the replicated assembly of the same step, from the whole rollout (its passes over every device's share)
    ref_all = CountingPolicy(params).per_device_share(whole.rollout, width)
    replicated_advantages = advantages_of(ref_all, ref_all)
    assert np.array_equal(replicated_advantages, advantages)
    whole_sequences = training_sequences(whole.rollout, replicated_advantages, with_topk=True, ref_logprobs=ref_all,
                                         trainer_logprobs=ref_all)
    for indices, plan in zip(splits, plans):
        sharded = pack_local_minibatch(plan, indices, ids, sequences, sequence_lengths=lengths,
                                       response_lengths=scored.response_lengths, local_devices=local, specs=specs,
                                       aggregation="token-mean")
        _, replicated = pack_minibatch(whole_sequences, indices, planner=planner, num_devices=len(device_processes),
                                       token_cap=token_cap, cost_model=LinearCost(), aggregation="token-mean")
        assert sharded.normalizer == replicated.normalizer and sharded.num_tokens == replicated.num_tokens
        assert np.array_equal(sharded.counts, replicated.counts)
        assert np.array_equal(sharded.microbatch_tokens, replicated.tokens_per_microbatch())
        for name, values in sharded.as_dict().items():
            rows = replicated.as_dict()[name]
            assert values.shape == rows.shape and values.dtype == rows.dtype, name
            assert np.array_equal(values[local], rows[local]), name
            others = [d for d in range(len(device_processes)) if d not in local]
            assert not np.any(values[others]), name
    print(f"PASS assembled process={rank} own={len(mine)} placed={len(placed)} received={len(foreign)} "
          f"forward_rows={sum(reference.rows)}+{sum(recompute.rows)}", flush=True)


def main():
    from _mp import init

    local, out_dir = sys.argv[1], sys.argv[2]
    jax, comm = init(local)
    rank, world = comm.Get_rank(), jax.device_count()
    from rl_sampling_setup import CountingReward, make_params, make_sampler
    from jodc.train.rl.layout import RolloutLayout
    from jodc.train.rl.rollout_exchange import RolloutShareError

    counting = CountingReward()
    reward = PhasedReward(counting, rank)
    # the phases that compile (and the failing reward's) wait long enough for a loaded machine; the hanging one 3 s
    layout = RolloutLayout.of_run(timeout_s=STARTUP_TIMEOUT_S)
    sampler = make_sampler(world, reward, layout=layout)
    params = make_params()
    scored = sampler(3, params, 3)  # this process's share and the whole rollout's metadata (assembly: sharded)
    with open(os.path.join(out_dir, f"calls-{rank}.json"), "w") as f:
        json.dump(counting.calls, f)
    started = time.monotonic()
    whole = layout.whole(scored)  # what a checkpoint holds (and the replicated baseline)
    assemble(jax, rank, scored, whole, params)
    print(f"assembly phase {rank}: {time.monotonic() - started:.1f} s", flush=True)
    if rank == 0:
        r = whole.rollout
        with open(os.path.join(out_dir, "mp.json"), "w") as f:
            json.dump({"prompts": r.prompts, "response_ids": [x.tolist() for x in r.response_ids],
                       "topk_ids": [x.tolist() for x in r.topk_ids], "rewards": scored.rewards.tolist(),
                       "logprobs": [x.tolist() for x in r.logprobs]}, f)
    print(f"PASS sampled process={rank} world={world} responses={len(scored)} own={len(scored.own.rollout)}",
          flush=True)
    reward.mode = "fail"
    try:
        sampler(4, params, 4)
        print(f"NOT RAISED {rank}", flush=True)
    except RolloutShareError as e:
        print(f"RAISED {rank}: {e}", flush=True)
    from jodc.train.core.distributed import check_agreement

    try:  # what the trainer checks before a step's first update (now that rewards are exchanged, not recomputed)
        check_agreement("a value that differs", np.array([rank, 7], np.uint32))
        print(f"NOT RAISED agreement {rank}", flush=True)
    except RuntimeError as e:
        print(f"DISAGREE {rank}: {e}", flush=True)
    reward.mode = "hang"
    started = time.monotonic()
    try:
        dataclasses.replace(sampler, layout=dataclasses.replace(layout, timeout_s=TIMEOUT_S))(5, params, 5)
    except RolloutShareError as e:
        print(f"TIMED OUT {rank} after {time.monotonic() - started:.1f} s: {e}", flush=True)
        comm.Abort(3)


if __name__ == "__main__":
    main()
