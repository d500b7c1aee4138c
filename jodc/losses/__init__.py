"""RL and SFT losses as pure JAX functions over logits.

Every loss takes logits [B, T, V] (any float dtype, computed in fp32) and per-token fields [B, T], and returns
``(loss, metrics)`` with a scalar loss and a dict of scalar metrics. Policy losses are ``PolicyLoss`` objects
(``jodc.losses.spec``): callable like functions, with the shared arguments also accepted as one ``PolicyInputs``,
and carrying the metadata a trainer needs (anchor, per-token arrays, default aggregation). All are usable under ``jit``, ``grad`` and
``vmap``. Formulas, defaults and references: docs/losses.md.
"""
from jodc.losses.advantages import grpo_advantages
from jodc.losses.aggregation import (
    AGGREGATIONS,
    aggregate,
    broadcast_sequence_mean,
    loss_normalizer,
)
from jodc.losses.cispo import cispo_loss
from jodc.losses.dg import dg_loss
from jodc.losses.divergence import binary_kl, binary_tv, topk_kl, topk_tv
from jodc.losses.dppo import DEFAULT_DELTA, DEFAULT_TOPK, dppo_loss
from jodc.losses.gspo import gspo_loss
from jodc.losses.kl import KL_ESTIMATORS, kl_estimate, kl_penalty
from jodc.losses.logprobs import (
    gather_logprobs,
    token_logprobs,
    token_logprobs_and_entropy,
    topk_logprobs,
)
from jodc.losses.ppo import decoupled_ppo_loss, ppo_loss, tis_loss
from jodc.losses._policy import LOG_RATIO_CLAMP
from jodc.losses.registry import POLICY_LOSSES, get_policy_loss
from jodc.losses.sapo import sapo_loss
from jodc.losses.spec import PolicyInputs, PolicyLoss

__all__ = [
    "AGGREGATIONS",
    "DEFAULT_DELTA",
    "DEFAULT_TOPK",
    "KL_ESTIMATORS",
    "LOG_RATIO_CLAMP",
    "POLICY_LOSSES",
    "PolicyInputs",
    "PolicyLoss",
    "aggregate",
    "binary_kl",
    "binary_tv",
    "broadcast_sequence_mean",
    "cispo_loss",
    "decoupled_ppo_loss",
    "dg_loss",
    "dppo_loss",
    "gather_logprobs",
    "get_policy_loss",
    "grpo_advantages",
    "gspo_loss",
    "kl_estimate",
    "kl_penalty",
    "loss_normalizer",
    "ppo_loss",
    "sapo_loss",
    "tis_loss",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "topk_kl",
    "topk_logprobs",
    "topk_tv",
]
