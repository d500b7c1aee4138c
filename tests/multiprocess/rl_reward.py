"""Reward functions of the multi-process RL tests (`task.reward_fn: rl_reward.py:<name>`).

`varied` is deterministic and gives a randomly initialised policy's responses different rewards (so advantages are
not all zero without a warm start); `counted` is `varied` that also appends a line per call to
`$JODC_TEST_REWARD_CALLS/calls-<MPI rank>.txt` when that variable is set, so a test can count the calls per process."""
import os


def varied(prompt: str, response: str) -> float:
    return float(sum(map(ord, prompt + response)) % 3 == 0)


def counted(prompt: str, response: str) -> float:
    where = os.environ.get("JODC_TEST_REWARD_CALLS")
    if where:
        with open(os.path.join(where, f"calls-{os.environ.get('OMPI_COMM_WORLD_RANK', '0')}.txt"), "a") as f:
            f.write(f"{prompt!r} {response!r}\n")
    return varied(prompt, response)
