"""GRPO-style RL: the task and its rewards, rollouts, the reference policy, packing rollouts into minibatches, the
policy loss, metrics, the SFT warm start, the CLI, and the loop (`loop.run_rl`).

Importing the package does not import JAX (the CLI sets XLA flags first); `run_rl` is loaded on first use.
"""

__all__ = ["run_rl"]


def __getattr__(name):
    if name == "run_rl":
        from .loop import run_rl

        return run_rl
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
