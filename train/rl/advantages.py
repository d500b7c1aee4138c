"""The advantages of a step's whole rollout: the group estimator over the rewards (shaped by the KL in the reward
when it is on), or GAE over the critic's values; and the KL-in-reward controller's move. Every process computes
them from the whole rollout's rewards and what the layout exchanged (the estimator is cheap and needs the groups)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from .config import LossConfig
from .critic import critic_advantages
from .loss import kl_shaped_rewards


def step_advantages(rewards: np.ndarray, response_lengths: np.ndarray, *, loss: LossConfig, group_size: int,
                    critic: bool, estimator: Callable | None, kl_controller, kl_inputs: tuple | None,
                    values: Sequence[np.ndarray] | None) -> tuple[Any, Any, Any, dict[str, float]]:
    """(advantages: [N] or per response token arrays, returns or None, the KL controller after this step, the
    KL-in-reward record) of the whole rollout: `estimator` over the rewards (shaped by the KL in the reward with the
    controller's beta when `kl_controller` is set; `kl_inputs` = (log-probs, reference log-probs) per response), or
    with `critic` GAE over `values`."""
    kl_args, beta = None, None
    if kl_controller is not None:  # KL in the reward, at the policy before this step's updates
        beta = kl_controller.value
        kl_args = (*kl_inputs, beta, loss.kl_in_reward_estimator)
    returns = None
    if critic:
        advantages, returns, current_kl = critic_advantages(rewards, values, gamma=loss.critic_gamma,
                                                            lam=loss.critic_lam, kl=kl_args)
    else:
        shaped, current_kl = (kl_shaped_rewards(rewards, *kl_args[:2], beta=kl_args[2], estimator=kl_args[3])
                              if kl_args else (rewards, None))
        advantages = estimator(shaped, group_size, response_lengths)
    if kl_controller is None:
        return advantages, returns, None, {}
    return (advantages, returns, kl_controller.update(current_kl, len(rewards)),
            {"kl_in_reward": current_kl, "kl_in_reward_beta": beta})
