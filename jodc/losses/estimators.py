"""Advantage estimators by name, with what each needs besides the rewards, so a trainer can pick one from a
config string without inspecting signatures.

    adv = ADVANTAGE_ESTIMATORS[name](rewards, group_size, **inputs, **options)

``inputs`` are the arrays the estimator names in ``inputs`` (``lengths``: valid tokens per response, for
REINFORCE++'s token whitening, OPO's and GDPO's; ``greedy_rewards``: one greedy response's reward per prompt, for
ReMax; the OTB's per-token ``logprobs`` / ``sum_pi_squared`` / ``mask``), and optionally those in
``optional_inputs``; ``options`` the hyper-parameters it names in ``options`` (e.g. ``normalize_std``). Most
estimators take rewards [N] and return advantages [N]; the metadata says where not: ``reward_columns`` (GDPO:
rewards [N, D], one column per reward function) and ``per_token`` (the OTB: advantages [N, T]). Names follow
verl's ``AdvantageEstimator`` (``dr_grpo`` is GRPO without the std division). ``gae`` (critic PPO) takes
per-token rewards [N, T] (``token_rewards``) and the critic's ``values`` [N, T]; its returns (the value target)
come from ``jodc.losses.gae_advantages``.
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Callable, Mapping

import jax

from jodc.losses.advantages import (
    gdpo_advantages,
    gpg_advantages,
    grpo_advantages,
    opo_advantages,
    passk_advantages,
    reinforce_pp_advantages,
    remax_advantages,
    rloo_advantages,
)
from jodc.losses.gae import gae_estimator_advantages
from jodc.losses.token_baseline import optimal_token_baseline_advantages


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator:
    """An advantage function with its metadata: ``inputs`` (arrays it needs besides rewards), ``optional_inputs``
    (arrays it may take), ``options`` (hyper-parameters it accepts), ``presets`` (fixed option values),
    ``reward_columns`` (rewards are [N, D], one column per reward function, instead of [N]), ``token_rewards``
    (rewards are [N, T], one per token) and ``per_token`` (it returns advantages [N, T] instead of [N])."""

    fn: Callable[..., jax.Array]
    inputs: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    presets: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    optional_inputs: tuple[str, ...] = ()
    reward_columns: bool = False
    per_token: bool = False
    token_rewards: bool = False

    def __call__(self, rewards, group_size: int, **kwargs) -> jax.Array:
        """Advantages [N] ([N, T] when ``per_token``); ``kwargs`` are this estimator's ``inputs``,
        ``optional_inputs`` and ``options`` (others: TypeError)."""
        unknown = sorted(set(kwargs) - set(self.inputs) - set(self.optional_inputs) - set(self.options))
        if unknown:
            raise TypeError(f"{self.fn.__name__}: unexpected argument(s) {unknown}; inputs {list(self.inputs)}"
                            + (f" (optional {list(self.optional_inputs)})" if self.optional_inputs else "")
                            + f", options {list(self.options)}")
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
    "opo": AdvantageEstimator(opo_advantages, inputs=("lengths",)),
    "gdpo": AdvantageEstimator(gdpo_advantages, inputs=("lengths",), options=("weights", "normalize_std", "eps"),
                               reward_columns=True),
    "optimal_token_baseline": AdvantageEstimator(
        optimal_token_baseline_advantages, inputs=("logprobs", "sum_pi_squared", "mask"),
        optional_inputs=("is_weights",), options=("handle_zero_tail", "eps"), per_token=True),
    "gae": AdvantageEstimator(gae_estimator_advantages, inputs=("values", "mask"), options=("gamma", "lam"),
                              per_token=True, token_rewards=True),
})


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under ``name``; ``ValueError`` listing the names if unknown."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except (KeyError, TypeError):
        raise ValueError(f"get_advantage_estimator: unknown advantage estimator {name!r}; expected one of "
                         f"{sorted(ADVANTAGE_ESTIMATORS)}") from None
