"""The reward interface: a function `reward(prompt: str, response: str) -> float`, scored over a rollout with
errors that name the sample.

A user's reward function is given in the config as `"package.module:function"` or `"path/to/file.py:function"`
(`task.reward_fn`), or passed to `run_rl(..., reward_fn=callable)`. It sees the prompt and the response as text
(special tokens removed) and returns a finite real number (a bool counts as 0 / 1). A function that raises, or
returns anything else (None, a string, NaN, an array), stops the run with a `RewardError` naming the step, the
sample, its prompt and its response; nothing of that step is applied or saved.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import os
from typing import Callable, Sequence

import numpy as np

from ..core.config import ConfigError

RewardFunction = Callable[[str, str], float]


class RewardError(RuntimeError):
    """A reward function failed on one sample; the message names the step, the sample, its prompt and response."""

    def __init__(self, message: str, *, step: int, sample: int, prompt: str, response: str):
        super().__init__(message)
        self.step, self.sample, self.prompt, self.response = step, sample, prompt, response


def load_reward_function(spec: str) -> RewardFunction:
    """The callable named by `spec`: `"module.path:name"` (imported) or `"file.py:name"` (loaded from the file)."""
    target, sep, attribute = spec.rpartition(":")
    if not sep or not target or not attribute:
        raise ValueError(f"task.reward_fn must look like 'package.module:function' or 'path/to/file.py:function', "
                         f"got {spec!r}")
    if target.endswith(".py"):
        if not os.path.exists(target):
            raise FileNotFoundError(f"task.reward_fn: file {target} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"jodc_user_reward_{abs(hash(target))}", target)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ImportError(f"task.reward_fn: cannot import module {target!r}: {e}") from None
    function = getattr(module, attribute, None)
    if function is None:
        raise AttributeError(f"task.reward_fn: {target} has no attribute {attribute!r}")
    if not callable(function):
        raise TypeError(f"task.reward_fn: {spec} is a {type(function).__name__}, not a function")
    return function


def resolve_reward_function(given: RewardFunction | None, task_config, task) -> tuple[RewardFunction, str | None]:
    """(the run's reward function, its `task.reward_fn` spec when it came from there). In order: the one passed to
    `run_rl`, the config's `task.reward_fn` ('module:function' or 'file.py:function'), the task's own reward;
    a task without one (jsonl) needs one of the first two (ConfigError)."""
    if given is not None:
        return given, None
    if task_config.reward_fn:
        return load_reward_function(task_config.reward_fn), task_config.reward_fn
    if task_config.name == "jsonl":
        raise ConfigError("task.name=jsonl has no built-in reward: set task.reward_fn ('module:function' "
                          "or 'file.py:function'), or pass reward_fn= to run_rl")
    return task.reward, None


def _excerpt(text: str, limit: int = 200) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def score(reward_fn: RewardFunction, prompts: Sequence[str], responses: Sequence[str], *, step: int,
          first_sample: int = 0) -> np.ndarray:
    """Rewards (float64 [N]) of N (prompt, response) pairs, one call each; `step` is the 1-based step and
    `first_sample` the step's index of the first pair (a share of the step's rollout), for error messages.

    Raises RewardError for the first sample whose reward raises or is not a finite real number."""
    if len(prompts) != len(responses):
        raise ValueError(f"score: {len(prompts)} prompts but {len(responses)} responses")
    rewards = np.empty(len(prompts), np.float64)
    for i, (prompt, response) in enumerate(zip(prompts, responses), start=first_sample):
        where = f"step {step}, sample {i} (prompt {_excerpt(prompt)}, response {_excerpt(response)})"
        try:
            value = reward_fn(prompt, response)
        except Exception as e:
            raise RewardError(f"the reward function raised {type(e).__name__} on {where}: {e}", step=step, sample=i,
                              prompt=prompt, response=response) from e
        if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise RewardError(f"the reward function returned {value!r} ({type(value).__name__}) on {where}; it must "
                              "return a finite real number", step=step, sample=i, prompt=prompt, response=response)
        rewards[i - first_sample] = float(value)
    return rewards
