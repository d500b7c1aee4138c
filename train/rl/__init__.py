"""GRPO-style RL: the task and its rewards, rollouts, the reference policy, packing rollouts into minibatches, the
policy loss, metrics, the SFT warm start, and the loop (`loop.run_rl`)."""
