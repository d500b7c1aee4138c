"""RL rollouts sampled in shares across processes (`RolloutSampler` under mpirun). Usage:

    mpirun -np 2 python -m mpi4py rl_sampling_case.py LOCAL_DEVICES OUT_DIR

Four phases in one launch (tests/test_multiprocess.py::test_rl_rollout_shares_across_processes checks them):
1. step 3 sampled over the 2 x LOCAL_DEVICES devices: each process samples and scores its devices' shares, the shares
   are exchanged; process 0 writes the whole rollout to OUT_DIR/mp.json, every process its reward calls to
   OUT_DIR/calls-<process>.json (the driver compares with one process sampling over 1 and 4 devices);
2. step 4 with a reward that raises in process 1 only: every process raises RolloutShareError naming process 1 and
   its cause (printed as "RAISED <process>: ...");
3. the agreement check (`distributed.check_agreement`) on a value that differs in process 1: every process raises
   naming process 1 ("DISAGREE <process>: ...");
4. step 5 with process 1's reward hanging: process 0 raises, naming process 1, within the exchange timeout, and
   aborts the job (non-zero exit).
"""
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 3.0


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


def main():
    from _mp import init

    local, out_dir = sys.argv[1], sys.argv[2]
    jax, comm = init(local)
    rank, world = comm.Get_rank(), jax.device_count()
    from rl_sampling_setup import CountingReward, make_params, make_sampler
    from jodc.train.rl.rollout_exchange import RolloutShareError

    counting = CountingReward()
    reward = PhasedReward(counting, rank)
    sampler = make_sampler(world, reward, exchange_timeout_s=TIMEOUT_S)
    params = make_params()
    scored = sampler(3, params, 3)
    with open(os.path.join(out_dir, f"calls-{rank}.json"), "w") as f:
        json.dump(counting.calls, f)
    if rank == 0:
        r = scored.rollout
        with open(os.path.join(out_dir, "mp.json"), "w") as f:
            json.dump({"prompts": r.prompts, "response_ids": [x.tolist() for x in r.response_ids],
                       "topk_ids": [x.tolist() for x in r.topk_ids], "rewards": scored.rewards.tolist(),
                       "logprobs": [x.tolist() for x in r.logprobs]}, f)
    print(f"PASS sampled process={rank} world={world} responses={len(scored.rollout)}", flush=True)
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
        sampler(5, params, 5)
    except RolloutShareError as e:
        print(f"TIMED OUT {rank} after {time.monotonic() - started:.1f} s: {e}", flush=True)
        comm.Abort(3)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.dirname(HERE))  # tests/: rl_sampling_setup
    main()
