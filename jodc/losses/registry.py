"""Policy losses by name, with one calling convention, so a trainer can pick a loss from a config string.

Every entry is called as

    loss, metrics = POLICY_LOSSES[name](logits, tokens, anchor_logprobs, advantages, mask, **options)

where ``anchor_logprobs`` [B, T] are the log-probs the loss's ratio is taken against: the rollout's behaviour
log-probs for DPPO (its trust region is anchored at the behaviour policy), the old / proximal policy's for the
PPO family, GSPO, SAPO and CISPO. DG needs none and ignores the argument (pass None). Options are the function's
keyword arguments (e.g. ``clip_high``, ``divergence``, ``topk_ids``, ``behaviour_logprobs`` for
``decoupled_ppo``, ``rollout_logprobs`` for ``tis``); the keywords shared by all are ``aggregation``,
``normalizer``, ``segment_ids``, ``norm_length``, ``temperature`` and ``chunk_size``.

Aliases pre-set published hyper-parameters: ``dapo`` = PPO with clip_high 0.28 and no dual clip, ``grpo`` = PPO,
``dppo_tv`` / ``dppo_kl`` pick the divergence, ``dppo_topk`` the Top-K approximation (TV). Options passed at call
time override the presets.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping

import jax

from jodc.losses.cispo import cispo_loss
from jodc.losses.dg import dg_loss
from jodc.losses.dppo import dppo_loss
from jodc.losses.gspo import gspo_loss
from jodc.losses.ppo import decoupled_ppo_loss, ppo_loss, tis_loss
from jodc.losses.sapo import sapo_loss

PolicyLoss = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


def _dg_with_anchor(logits, tokens, anchor_logprobs, advantages, mask, **options):
    """``dg_loss`` under the uniform convention: the anchor log-probs are not used."""
    del anchor_logprobs
    return dg_loss(logits, tokens, advantages, mask, **options)


def _preset(fn: PolicyLoss, **presets) -> PolicyLoss:
    """``fn`` with default options that call-time options override."""

    def loss(logits, tokens, anchor_logprobs, advantages, mask, **options):
        return fn(logits, tokens, anchor_logprobs, advantages, mask, **{**presets, **options})

    loss.__name__ = f"{fn.__name__}[{', '.join(f'{k}={v!r}' for k, v in presets.items())}]"
    loss.__doc__ = fn.__doc__
    return loss


POLICY_LOSSES: Mapping[str, PolicyLoss] = MappingProxyType(
    {
        "dppo": dppo_loss,
        "dppo_tv": _preset(dppo_loss, divergence="tv"),
        "dppo_kl": _preset(dppo_loss, divergence="kl"),
        "dppo_topk": _preset(dppo_loss, approximation="topk"),
        "ppo": ppo_loss,
        "grpo": ppo_loss,
        "dapo": _preset(ppo_loss, clip_low=0.2, clip_high=0.28, dual_clip=None, aggregation="token-mean"),
        "gspo": gspo_loss,
        "sapo": sapo_loss,
        "cispo": cispo_loss,
        "dg": _dg_with_anchor,
        "decoupled_ppo": decoupled_ppo_loss,
        "tis": tis_loss,
    }
)


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered under ``name`` (see ``POLICY_LOSSES``); ``ValueError`` listing the names if
    unknown."""
    try:
        return POLICY_LOSSES[name]
    except (KeyError, TypeError):
        raise ValueError(f"get_policy_loss: unknown policy loss {name!r}; expected one of "
                         f"{sorted(POLICY_LOSSES)}") from None
