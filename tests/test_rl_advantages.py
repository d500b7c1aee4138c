"""`step_advantages`: the estimator over the rewards, shaped by the KL in the reward with the controller's beta (and
the controller moved by the step's KL), or GAE over the critic's values."""
import dataclasses

import numpy as np

from jodc.train.rl.advantages import critic_advantages, kl_shaped_rewards, step_advantages
from jodc.train.rl.config import LossConfig
from jodc.train.rl.loss import build_advantages, build_kl_controller

REWARDS = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
LENGTHS = np.array([2, 3, 1, 2, 2, 3])
LOGPROBS = [np.full(n, -0.5, np.float32) for n in LENGTHS]
REFERENCE = [np.full(n, -0.7, np.float32) for n in LENGTHS]


def test_without_kl_the_estimator_over_the_rewards():
    loss = LossConfig()
    estimator = build_advantages(loss)
    advantages, returns, controller, record = step_advantages(
        REWARDS, LENGTHS, loss=loss, group_size=3, critic=False, estimator=estimator, kl_controller=None,
        kl_inputs=None, values=None)
    np.testing.assert_array_equal(advantages, estimator(REWARDS, 3, LENGTHS))
    assert returns is None and controller is None and record == {}


def test_the_kl_in_the_reward_shapes_the_rewards_and_moves_the_controller():
    loss = dataclasses.replace(LossConfig(), kl_in_reward_coef=0.2, kl_in_reward_controller="adaptive",
                               kl_in_reward_target=0.05, kl_in_reward_horizon=100)
    controller = build_kl_controller(loss)
    estimator = build_advantages(loss)
    advantages, _, moved, record = step_advantages(
        REWARDS, LENGTHS, loss=loss, group_size=3, critic=False, estimator=estimator, kl_controller=controller,
        kl_inputs=(LOGPROBS, REFERENCE), values=None)
    shaped, kl = kl_shaped_rewards(REWARDS, LOGPROBS, REFERENCE, beta=0.2, estimator=loss.kl_in_reward_estimator)
    for a, b in zip(advantages, estimator(shaped, 3, LENGTHS)):
        np.testing.assert_array_equal(a, b)
    assert record == {"kl_in_reward": kl, "kl_in_reward_beta": 0.2}
    assert moved.value == controller.update(kl, len(REWARDS)).value != controller.value


def test_the_critic_takes_gae_over_its_values():
    loss = LossConfig()
    values = [np.linspace(0, 1, n).astype(np.float32) for n in LENGTHS]
    advantages, returns, _, _ = step_advantages(REWARDS, LENGTHS, loss=loss, group_size=3, critic=True,
                                                estimator=None, kl_controller=None, kl_inputs=None, values=values)
    expected, expected_returns, _ = critic_advantages(REWARDS, values, gamma=loss.critic_gamma, lam=loss.critic_lam)
    for a, b, r, q in zip(advantages, expected, returns, expected_returns):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(r, q)
