"""RL and SFT losses as pure JAX functions over logits.

Every loss takes logits [B, T, V] (any float dtype, computed in fp32) and per-token fields [B, T], and returns
``(loss, metrics)`` with a scalar loss and a dict of scalar metrics. Policy losses are ``PolicyLoss`` objects
(``jodc.losses.spec``): callable like functions, with the shared arguments also accepted as one ``PolicyInputs``,
and carrying the metadata a trainer needs (anchor, per-token arrays, default aggregation). All are usable under ``jit``, ``grad`` and
``vmap``. Formulas, defaults and references: docs/losses.md.
"""
from jodc.losses.advantages import gdpo_advantages, gpg_advantages, grpo_advantages, opo_advantages
from jodc.losses.advantages import passk_advantages, reinforce_pp_advantages, remax_advantages, rloo_advantages
from jodc.losses.aggregation import (
    AGGREGATIONS,
    aggregate,
    broadcast_sequence_mean,
    broadcast_sequence_sum,
    loss_normalizer,
)
from jodc.losses.cispo import cispo_loss
from jodc.losses.cov import clip_cov_loss, kl_cov_loss
from jodc.losses.dg import dg_loss
from jodc.losses.divergence import binary_kl, binary_tv, topk_kl, topk_tv
from jodc.losses.dro import dro_loss
from jodc.losses.dppo import DEFAULT_DELTA, DEFAULT_TOPK, dppo_loss
from jodc.losses.estimators import ADVANTAGE_ESTIMATORS, AdvantageEstimator, get_advantage_estimator
from jodc.losses.entropy import entropy_bonus
from jodc.losses.gae import discounted_returns, gae_advantages, masked_whiten, reinforce_pp_token_advantages
from jodc.losses.gmpo import geo_mean_loss
from jodc.losses.gpg import gpg_loss
from jodc.losses.gspo import gspo_loss
from jodc.losses.kl import KL_ESTIMATORS, kl_estimate, kl_penalty
from jodc.losses.kl_reward import (
    KL_CONTROLLERS,
    AdaptiveKLController,
    FixedKLController,
    kl_controller,
    kl_controller_from_state,
    kl_reward,
    last_token_rewards,
)
from jodc.losses.logprobs import (
    gather_logprobs,
    sum_pi_squared,
    token_logprobs,
    token_logprobs_and_entropy,
    topk_logprobs,
)
from jodc.losses.ppo import decoupled_ppo_loss, ppo_loss, tis_loss
from jodc.losses._policy import LOG_RATIO_CLAMP
from jodc.losses.registry import POLICY_LOSSES, get_policy_loss
from jodc.losses.rollout_correction import (
    REJECTION_CRITERIA,
    is_weight_totals,
    normalize_is_weights,
    off_policy_sequence_mask,
    rollout_is_weights,
    rollout_rejection_mask,
)
from jodc.losses.sapo import sapo_loss
from jodc.losses.sft import sft_loss_from_logits
from jodc.losses.spec import PolicyInputs, PolicyLoss
from jodc.losses.token_baseline import optimal_token_baseline_advantages
from jodc.losses.value import DEFAULT_VALUE_CLIP, clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "DEFAULT_DELTA",
    "DEFAULT_TOPK",
    "DEFAULT_VALUE_CLIP",
    "FixedKLController",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "LOG_RATIO_CLAMP",
    "POLICY_LOSSES",
    "PolicyInputs",
    "PolicyLoss",
    "REJECTION_CRITERIA",
    "aggregate",
    "binary_kl",
    "binary_tv",
    "broadcast_sequence_mean",
    "broadcast_sequence_sum",
    "cispo_loss",
    "clip_cov_loss",
    "clipped_value_loss",
    "decoupled_ppo_loss",
    "dg_loss",
    "discounted_returns",
    "dppo_loss",
    "dro_loss",
    "entropy_bonus",
    "gae_advantages",
    "gather_logprobs",
    "gdpo_advantages",
    "geo_mean_loss",
    "get_advantage_estimator",
    "get_policy_loss",
    "gpg_advantages",
    "gpg_loss",
    "grpo_advantages",
    "gspo_loss",
    "is_weight_totals",
    "kl_controller",
    "kl_controller_from_state",
    "kl_cov_loss",
    "kl_estimate",
    "kl_penalty",
    "kl_reward",
    "last_token_rewards",
    "loss_normalizer",
    "masked_whiten",
    "normalize_is_weights",
    "off_policy_sequence_mask",
    "opo_advantages",
    "optimal_token_baseline_advantages",
    "passk_advantages",
    "ppo_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_token_advantages",
    "remax_advantages",
    "rloo_advantages",
    "rollout_is_weights",
    "rollout_rejection_mask",
    "sapo_loss",
    "sft_loss_from_logits",
    "sum_pi_squared",
    "tis_loss",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "topk_kl",
    "topk_logprobs",
    "topk_tv",
]
