"""The held-out evaluation of an RL run: the current policy on a fixed set of problems the training never draws.

`evaluate_policy` gives `eval_accuracy` (greedy decoding: the fraction of problems whose reward reaches
`success_reward`) and `eval_sampled_reward` (the mean reward of `EVAL_SAMPLES` responses per problem at the rollout
temperature, with a fixed key: the quantity RL optimises). It samples as the rollouts are: the problems are split
over the engine's devices (`RolloutSampler.local_devices`), each process samples and scores its devices' share, and
the layout exchanges the rewards (not the tokens) across processes. Response j of problem i samples with the same key
wherever it runs (`response_keys`), so every layout gives the same figures.
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from jodc.models import DecoderConfig, SamplingParams
from jodc.models.tokenizer import Tokenizer

from .policy_weights import sampler_weights_on_devices
from .rewards import RewardFunction, score
from .rollout import sample_rollout
from .rollout_exchange import EVALUATION_TAGS
from .sampler import RolloutSampler

EVAL_SAMPLES = 4  # sampled responses per evaluation problem


def evaluate_policy(engine, prompts: Sequence[str], *, step: int, sampler: RolloutSampler,
                    model_config: DecoderConfig, tokenizer: Tokenizer, greedy: SamplingParams,
                    sampled: SamplingParams, reward_fn: RewardFunction, seed: int, prompt_width: int,
                    success_reward: float) -> dict[str, float]:
    """`eval_accuracy` and `eval_sampled_reward` of `engine`'s current parameters on `prompts` (see the module
    docstring); `step` names the evaluation in error messages; `prompt_width` is the set's (every device's share
    pads to it, so the shapes are the same in any layout)."""
    mine, devices = sampler.local_devices(len(prompts))
    params = sampler_weights_on_devices(engine, devices=devices, dtype="float32")  # fp32, on device

    def share() -> dict[str, np.ndarray]:  # this process's rewards per measure
        rewards = {}
        for key, group_size, sampling in (("eval_accuracy", 1, greedy), ("eval_sampled_reward", EVAL_SAMPLES, sampled)):
            rollout = sample_rollout(model_config, params, tokenizer, list(prompts[mine.start:mine.stop]),
                                     group_size=group_size, sampling=sampling, prompt_indices=mine, devices=devices,
                                     prompt_width=prompt_width, key=jax.random.PRNGKey(seed))
            rewards[key] = score(reward_fn, rollout.prompts, rollout.responses, step=step,
                                 first_sample=mine.start * group_size)
        return rewards

    parts = sampler.layout.gather(share, what=f"the evaluation at step {step}", tags=EVALUATION_TAGS)
    rewards = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    return {"eval_accuracy": float(np.mean(rewards["eval_accuracy"] >= success_reward)),
            "eval_sampled_reward": float(np.mean(rewards["eval_sampled_reward"]))}
