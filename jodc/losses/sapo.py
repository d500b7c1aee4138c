"""SAPO: a smooth, temperature-controlled gate in place of PPO's hard clip.

Gao et al., "Soft Adaptive Policy Optimization" (Qwen, arXiv 2511.20347). The token ratio r_t = pi / pi_old enters
through a sigmoid gate instead of a clip:

    f(r) = sigmoid(tau (r - 1)) * 4 / tau,     loss_t = -f(r_t) A_t,     tau = tau_pos if A_t > 0 else tau_neg

The factor 4 / tau makes f'(1) = 1, so on-policy the gradient equals the plain policy gradient; away from r = 1
the gradient weight 4 sigmoid (1 - sigmoid) decays smoothly instead of dropping to 0. tau_neg > tau_pos damps
negative-advantage updates faster (defaults 1.0 / 1.05). The paper normalises per sequence, so the default
aggregation is seq-mean-token-mean.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jodc.losses._checks import check_positive
from jodc.losses._policy import clamped_exp, finish, prepare


def sapo_loss(
    logits,
    tokens,
    old_logprobs,
    advantages,
    mask,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    aggregation: str = "seq-mean-token-mean",
    normalizer=None,
    segment_ids=None,
    norm_length: int | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """SAPO loss from logits (arguments as ``ppo_loss``).

    Returns (loss, metrics): ratio_mean, gate_weight_mean (mean of 4 s (1 - s), the gradient weight relative
    to the plain policy gradient; 1 on-policy), entropy."""
    fn = "sapo_loss"
    check_positive(fn, "tau_pos", tau_pos)
    check_positive(fn, "tau_neg", tau_neg)
    batch = prepare(
        fn, logits, tokens, mask, {"old_logprobs": old_logprobs, "advantages": advantages},
        temperature=temperature, chunk_size=chunk_size, aggregation=aggregation, segment_ids=segment_ids,
    )
    adv = batch.fields["advantages"]
    ratio = clamped_exp(batch.logprobs - batch.fields["old_logprobs"])
    tau = jnp.where(adv > 0, tau_pos, tau_neg).astype(ratio.dtype)
    sig = jax.nn.sigmoid(tau * (ratio - 1.0))
    per_token = -adv * sig * (4.0 / tau)
    sig_sg = lax.stop_gradient(sig)
    metrics = {"ratio_mean": ratio, "gate_weight_mean": 4.0 * sig_sg * (1.0 - sig_sg)}
    return finish(per_token, batch, metrics, aggregation=aggregation, normalizer=normalizer,
                  segment_ids=segment_ids, norm_length=norm_length)
