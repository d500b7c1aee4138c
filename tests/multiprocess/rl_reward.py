"""Reward functions of the multi-process RL tests (`task.reward_fn: rl_reward.py:<name>`).

`varied` is deterministic and gives a randomly initialised policy's responses different rewards (so advantages are
not all zero without a warm start); `per_process` differs between processes, the kind of reward the trainer must
refuse instead of training each process's devices on different advantages."""
import os


def varied(prompt: str, response: str) -> float:
    return float(sum(map(ord, prompt + response)) % 3 == 0)


def per_process(prompt: str, response: str) -> float:
    """`varied` in process 0, its opposite elsewhere (a constant shift would leave group advantages unchanged)."""
    value = varied(prompt, response)
    return value if os.environ.get("OMPI_COMM_WORLD_RANK", "0") == "0" else 1.0 - value
