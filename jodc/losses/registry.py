"""Policy losses by name, with one calling convention, so a trainer can pick a loss from a config string.

Every entry is a ``jodc.losses.spec.PolicyLoss``, called as

    loss, metrics = POLICY_LOSSES[name](logits, tokens, anchor_logprobs, advantages, mask, **options)
    loss, metrics = POLICY_LOSSES[name].apply(logits, PolicyInputs(tokens, anchor_logprobs, advantages, mask), **options)

where ``anchor_logprobs`` [B, T] are the log-probs the loss's ratio is taken against (its ``anchor``): the
rollout's behaviour log-probs for DPPO (its trust region is anchored at the behaviour policy), the old / proximal
policy's for the PPO family, GSPO, SAPO, CISPO, Clip-Cov, KL-Cov, GMPO and DRO (DRO's quadratic penalty). DG and
GPG need none and ignore the argument (pass None). Options are the loss's hyper-parameters (``option_defaults``)
and the per-token arrays ``required_arrays`` names beyond the anchor (``behaviour_logprobs`` for
``decoupled_ppo``, ``rollout_logprobs`` for ``tis``, ``topk_ids`` / ``topk_logprobs`` for DPPO Top-K);
``default_aggregation`` is the aggregation used when none is given.

Aliases pre-set published hyper-parameters: ``dapo`` = PPO with clip_high 0.28 and no dual clip, ``grpo`` = PPO,
``dppo_tv`` / ``dppo_kl`` pick the divergence, ``dppo_topk`` the Top-K approximation (TV), ``tis_seq`` is TIS with
sequence-level weights. ``clip_cov``, ``kl_cov``, ``geo_mean``, ``gpg`` and ``dro`` are verl's names. Options passed
at call time override the presets.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from jodc.losses.cispo import cispo_loss
from jodc.losses.cov import clip_cov_loss, kl_cov_loss
from jodc.losses.dg import dg_loss
from jodc.losses.dppo import dppo_loss
from jodc.losses.dro import dro_loss
from jodc.losses.gmpo import geo_mean_loss
from jodc.losses.gpg import gpg_loss
from jodc.losses.gspo import gspo_loss
from jodc.losses.ppo import decoupled_ppo_loss, ppo_loss, tis_loss
from jodc.losses.sapo import sapo_loss
from jodc.losses.spec import PolicyLoss

POLICY_LOSSES: Mapping[str, PolicyLoss] = MappingProxyType(
    {
        "dppo": dppo_loss,
        "dppo_tv": dppo_loss.preset(divergence="tv"),
        "dppo_kl": dppo_loss.preset(divergence="kl"),
        "dppo_topk": dppo_loss.preset(approximation="topk"),
        "ppo": ppo_loss,
        "grpo": ppo_loss,
        "dapo": ppo_loss.preset(clip_low=0.2, clip_high=0.28, dual_clip=None, aggregation="token-mean"),
        "gspo": gspo_loss,
        "sapo": sapo_loss,
        "cispo": cispo_loss,
        "dg": dg_loss.with_anchor_slot(),
        "decoupled_ppo": decoupled_ppo_loss,
        "tis": tis_loss,
        "tis_seq": tis_loss.preset(level="sequence"),
        "gpg": gpg_loss.with_anchor_slot(),
        "clip_cov": clip_cov_loss,
        "kl_cov": kl_cov_loss,
        "geo_mean": geo_mean_loss,
        "dro": dro_loss,
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
