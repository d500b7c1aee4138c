"""DPPO: a trust region on the divergence between the behaviour policy and the current policy.

Qi et al., "Rethinking the Trust Region in LLM Reinforcement Learning" (arXiv 2602.04879). PPO clips the ratio of
the sampled token, a one-sample estimate of how far the policy moved: it over-penalises low-probability tokens and
under-constrains large shifts of high-probability ones. DPPO keeps the plain importance-weighted policy gradient
and masks a token's update only when it would move pi further out of a divergence ball around mu:

    maximise  E_{y ~ mu} sum_t M_t r_t A_t,    r_t = pi(a_t) / mu(a_t)
    M_t = 0  if (A_t > 0 and r_t > 1 and D_t > delta_high) or (A_t < 0 and r_t < 1 and D_t > delta_low)
    D_t = D(mu(. | s_t) || pi(. | s_t)),  TV or KL, binary or Top-K approximation (``jodc.losses.divergence``)

mu is the rollout's own policy (its stored log-probs), not a recomputed old policy. No gradient flows through D_t
or M_t, and the weight is truncated: the per-token loss is -A_t M_t min(r_t, C) in value with gradient
-A_t M_t min(r_t, C) grad log pi(a_t) (C = ``ratio_cap``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jodc.losses._checks import check_btk, check_choice, check_nonnegative
from jodc.losses._policy import TokenBatch, clamped_exp, straight_through
from jodc.losses.divergence import binary_kl, binary_tv, topk_kl, topk_tv
from jodc.losses.spec import policy_loss

DIVERGENCES: tuple[str, ...] = ("tv", "kl")
APPROXIMATIONS: tuple[str, ...] = ("binary", "topk")
#: Published default thresholds: delta = 0.15 for TV, 0.05 for KL (used for both sides unless overridden).
DEFAULT_DELTA = {"tv": 0.15, "kl": 0.05}
#: Published default number of stored behaviour top-k entries for the Top-K approximation.
DEFAULT_TOPK = 20

_DIVERGENCE_FNS = {
    ("tv", "binary"): binary_tv,
    ("kl", "binary"): binary_kl,
    ("tv", "topk"): topk_tv,
    ("kl", "topk"): topk_kl,
}


TOPK_ARRAYS = ("topk_ids", "topk_logprobs")


def _topk_needed(options) -> tuple[str, ...]:
    """The Top-K arrays when the approximation asks for them."""
    return TOPK_ARRAYS if options["approximation"] == "topk" else ()


def _topk_ids(fn: str, bt: tuple[int, int], options) -> jax.Array | None:
    """The ids to gather log pi at besides the tokens: the behaviour top-k ids for ``approximation="topk"``
    (checked here, before the pass over the vocabulary that gathers them)."""
    approximation, topk_ids, topk_logprobs = (options[n] for n in ("approximation", *TOPK_ARRAYS))
    check_choice(fn, "approximation", approximation, APPROXIMATIONS)
    if approximation != "topk":
        return None
    if topk_ids is None or topk_logprobs is None:
        raise ValueError(
            f"{fn}: approximation='topk' needs topk_ids and topk_logprobs of shape [B, T, K]; got "
            f"topk_ids={None if topk_ids is None else jnp.shape(topk_ids)}, "
            f"topk_logprobs={None if topk_logprobs is None else jnp.shape(topk_logprobs)}"
        )
    k_ids = check_btk(fn, "topk_ids", topk_ids, bt, integer=True)
    k_lps = check_btk(fn, "topk_logprobs", topk_logprobs, bt)
    if k_ids != k_lps:
        raise ValueError(
            f"{fn}: topk_ids has shape {jnp.shape(topk_ids)} but topk_logprobs has shape "
            f"{jnp.shape(topk_logprobs)}; they must match"
        )
    return topk_ids


@policy_loss("dppo_loss", anchor="behaviour_logprobs", gather=_topk_ids, needs=_topk_needed)
def dppo_loss(
    t: TokenBatch,
    *,
    divergence: str = "tv",
    approximation: str = "binary",
    topk_ids=None,
    topk_logprobs=None,
    delta_low: float | None = None,
    delta_high: float | None = None,
    ratio_cap: float | None = 20.0,
):
    """DPPO policy loss from logits:
    ``dppo_loss(logits, tokens, behaviour_logprobs, advantages, mask, *, divergence="tv", approximation="binary",
    topk_ids=None, topk_logprobs=None, delta_low=None, delta_high=None, ratio_cap=20.0)``.

    Args:
      logits: [B, T, V] any float dtype (computed in fp32); ``logits[b, t]`` scores ``tokens[b, t]``.
      tokens: [B, T] int, the sampled tokens.
      behaviour_logprobs: [B, T] log mu(a_t) as stored by the rollout (at the sampling temperature).
      advantages: [B, T].
      mask: [B, T], nonzero where the token is trained on.
      divergence: "tv" or "kl".
      approximation: "binary" (sampled token vs the rest) or "topk" (needs ``topk_ids`` / ``topk_logprobs``).
      topk_ids, topk_logprobs: [B, T, K] the behaviour policy's top-K ids and log-probs, sampled token forced in
        (``jodc.losses.topk_logprobs`` produces them; K = 20 published).
      delta_low: threshold for A < 0 (default 0.15 TV / 0.05 KL).
      delta_high: threshold for A > 0 (same defaults).
      ratio_cap: truncation C of the importance weight (None: no truncation).
      aggregation, normalizer, segment_ids, norm_length, temperature, chunk_size: shared by every policy loss
        (``jodc.losses.PolicyInputs``; temperature is the sampling temperature).

    Returns:
      (loss, metrics): masked_fraction, masked_high_fraction (A > 0 side), masked_low_fraction (A < 0 side),
      truncated_fraction (r > C), ratio_mean, divergence_mean, divergence_max, entropy.
    """
    fn = "dppo_loss"
    check_choice(fn, "divergence", divergence, DIVERGENCES)
    delta_low = DEFAULT_DELTA[divergence] if delta_low is None else delta_low
    delta_high = DEFAULT_DELTA[divergence] if delta_high is None else delta_high
    check_nonnegative(fn, "delta_low", delta_low)
    check_nonnegative(fn, "delta_high", delta_high)
    if ratio_cap is not None:
        check_nonnegative(fn, "ratio_cap", ratio_cap)
    logprobs = t.logprobs
    behaviour = t.fields["behaviour_logprobs"]
    adv = t.fields["advantages"]

    log_ratio = lax.stop_gradient(logprobs - behaviour)
    ratio = clamped_exp(log_ratio)
    divergence_fn = _DIVERGENCE_FNS[(divergence, approximation)]
    if approximation == "binary":
        div = divergence_fn(behaviour, lax.stop_gradient(logprobs))
    else:
        mu_topk = jnp.asarray(topk_logprobs).astype(logprobs.dtype)
        div = divergence_fn(mu_topk, lax.stop_gradient(t.extra_logprobs))
    div = lax.stop_gradient(jnp.where(t.valid, div, 0.0))

    masked_high = (adv > 0) & (log_ratio > 0) & (div > delta_high)
    masked_low = (adv < 0) & (log_ratio < 0) & (div > delta_low)
    keep = ~(masked_high | masked_low)
    weight = ratio if ratio_cap is None else jnp.minimum(ratio, ratio_cap)
    per_token = -adv * jnp.where(keep, straight_through(weight, logprobs), 0.0)

    return per_token, {
        "masked_fraction": ~keep,
        "masked_high_fraction": masked_high,
        "masked_low_fraction": masked_low,
        "truncated_fraction": jnp.zeros_like(keep) if ratio_cap is None else ratio > ratio_cap,
        "ratio_mean": ratio,
        "divergence_mean": div,
        "divergence_max": jnp.max(div),
    }
