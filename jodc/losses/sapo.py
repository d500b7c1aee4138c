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
from jodc.losses._policy import TokenBatch, clamped_exp
from jodc.losses.spec import policy_loss


@policy_loss("sapo_loss", anchor="old_logprobs", aggregation="seq-mean-token-mean")
def sapo_loss(t: TokenBatch, *, tau_pos: float = 1.0, tau_neg: float = 1.05):
    """SAPO loss from logits (arguments as ``ppo_loss``).

    Returns (loss, metrics): ratio_mean, gate_weight_mean (mean of 4 s (1 - s), the gradient weight relative
    to the plain policy gradient; 1 on-policy), entropy."""
    check_positive("sapo_loss", "tau_pos", tau_pos)
    check_positive("sapo_loss", "tau_neg", tau_neg)
    adv = t.fields["advantages"]
    ratio = clamped_exp(t.logprobs - t.fields["old_logprobs"])
    tau = jnp.where(adv > 0, tau_pos, tau_neg).astype(ratio.dtype)
    sig = jax.nn.sigmoid(tau * (ratio - 1.0))
    per_token = -adv * sig * (4.0 / tau)
    sig_sg = lax.stop_gradient(sig)
    return per_token, {"ratio_mean": ratio, "gate_weight_mean": 4.0 * sig_sg * (1.0 - sig_sg)}
