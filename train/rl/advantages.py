"""The advantages of a step's whole rollout: the group estimator over the rewards (shaped by the KL in the reward
when it is on), or GAE over the critic's values; and the KL-in-reward controller's move. Every process computes
them from the whole rollout's rewards and what the layout exchanged (the estimator is cheap and needs the groups)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from jodc.losses import gae_advantages, kl_reward, last_token_rewards

from .config import LossConfig


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


def kl_shaped_rewards(scores, logprobs, ref_logprobs, *, beta: float, estimator: str) -> tuple[np.ndarray, float]:
    """(per response the sum of its token rewards [N], the batch's KL): `scores` [N] minus beta times the
    per-token KL (`jodc.losses.kl_reward`) of `logprobs` (per response, the sampling policy's log-probs of its
    tokens) to `ref_logprobs`, summed over the response, which is what the trainer's per-response estimators
    see (as verl's GRPO sums its token-level rewards). The KL is the controller's `current_kl`."""
    n = len(scores)
    width = max([len(x) for x in logprobs] + [1])
    lp_nt, ref_nt, mask_nt = (np.zeros((n, width), np.float32) for _ in range(3))
    for i, (lp, ref) in enumerate(zip(logprobs, ref_logprobs)):
        lp_nt[i, :len(lp)], ref_nt[i, :len(ref)], mask_nt[i, :len(lp)] = lp, ref, 1.0
    # scores added on the host: an empty response (no token to place it on) keeps its score
    penalty_nt, current_kl = kl_reward(np.zeros(n, np.float32), lp_nt, ref_nt, mask_nt, beta=beta,
                                       estimator=estimator)
    return np.asarray(scores, np.float32) + np.asarray(penalty_nt).sum(axis=1), float(current_kl)


def _padded(arrays: Sequence[np.ndarray], width: int) -> np.ndarray:
    out = np.zeros((len(arrays), width), np.float32)
    for i, a in enumerate(arrays):
        out[i, :len(a)] = a
    return out


def critic_advantages(scores, values: Sequence[np.ndarray], *, gamma: float, lam: float, kl=None
                      ) -> tuple[list[np.ndarray], list[np.ndarray], float | None]:
    """(per response advantages [n_i], returns [n_i], the batch's KL or None) by GAE over token rewards: each
    response's score on its last token, minus beta x the per-token KL when `kl` = (logprobs, ref_logprobs, beta,
    estimator) is given (per response arrays). Advantages are whitened over the rollout's tokens (verl)."""
    lengths = [len(v) for v in values]
    width = max(lengths + [1])
    mask = _padded([np.ones(n) for n in lengths], width)
    current_kl = None
    if kl is None:
        rewards = last_token_rewards(np.asarray(scores, np.float32), mask)
    else:
        logprobs, ref_logprobs, beta, estimator = kl
        rewards, current_kl = kl_reward(np.asarray(scores, np.float32), _padded(logprobs, width),
                                        _padded(ref_logprobs, width), mask, beta=beta, estimator=estimator)
        current_kl = float(current_kl)
    adv, ret = gae_advantages(rewards, _padded(values, width), mask, gamma=gamma, lam=lam)
    adv, ret = np.asarray(adv), np.asarray(ret)
    return ([adv[i, :n].astype(np.float32) for i, n in enumerate(lengths)],
            [ret[i, :n].astype(np.float32) for i, n in enumerate(lengths)], current_kl)
