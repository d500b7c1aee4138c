"""Advantage estimators by name, with what each needs besides the rewards, so a trainer can pick one from a
config string without inspecting signatures.

    adv = ADVANTAGE_ESTIMATORS[name](rewards, group_size, **inputs, **options)

``inputs`` are the per-response arrays the estimator names in ``inputs`` (``lengths``: valid tokens per response,
for REINFORCE++'s token whitening; ``greedy_rewards``: one greedy response's reward per prompt, for ReMax);
``options`` the hyper-parameters it names in ``options`` (e.g. ``normalize_std``). Names follow verl's
``AdvantageEstimator`` (``dr_grpo`` is GRPO without the std division).
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Callable, Mapping

import jax

from jodc.losses.advantages import (
    gpg_advantages,
    grpo_advantages,
    passk_advantages,
    reinforce_pp_advantages,
    remax_advantages,
    rloo_advantages,
)


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator:
    """An advantage function with its metadata: ``inputs`` (per-response arrays it needs besides rewards),
    ``options`` (hyper-parameters it accepts) and ``presets`` (fixed option values)."""

    fn: Callable[..., jax.Array]
    inputs: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    presets: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __call__(self, rewards, group_size: int, **kwargs) -> jax.Array:
        """Advantages [N]; ``kwargs`` are this estimator's ``inputs`` and ``options`` (others: TypeError)."""
        unknown = sorted(set(kwargs) - set(self.inputs) - set(self.options))
        if unknown:
            raise TypeError(f"{self.fn.__name__}: unexpected argument(s) {unknown}; inputs {list(self.inputs)}, "
                            f"options {list(self.options)}")
        return self.fn(rewards, group_size, **{**kwargs, **self.presets})


ADVANTAGE_ESTIMATORS: Mapping[str, AdvantageEstimator] = MappingProxyType({
    "grpo": AdvantageEstimator(grpo_advantages, options=("normalize_std", "eps")),
    "dr_grpo": AdvantageEstimator(grpo_advantages, options=("eps",), presets={"normalize_std": False}),
    "rloo": AdvantageEstimator(rloo_advantages),
    "reinforce_plus_plus": AdvantageEstimator(reinforce_pp_advantages, inputs=("lengths",),
                                              presets={"baseline": False}),
    "reinforce_plus_plus_baseline": AdvantageEstimator(reinforce_pp_advantages, inputs=("lengths",),
                                                       presets={"baseline": True}),
    "remax": AdvantageEstimator(remax_advantages, inputs=("greedy_rewards",)),
    "grpo_passk": AdvantageEstimator(passk_advantages, options=("normalize_std", "eps")),
    "gpg": AdvantageEstimator(gpg_advantages, options=("f_norm",)),
})


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under ``name``; ``ValueError`` listing the names if unknown."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except (KeyError, TypeError):
        raise ValueError(f"get_advantage_estimator: unknown advantage estimator {name!r}; expected one of "
                         f"{sorted(ADVANTAGE_ESTIMATORS)}") from None
