"""The optimal token baseline (OTB): a baseline per response position, weighted by the realised path variance.

"Optimal Token Baseline" (OTB, arXiv 2602.07078; verl's ``optimal_token_baseline``). The variance of the
policy gradient sum_t G_t grad log pi(a_t) is smallest with the per-position baseline

    B_t = E[G_t W_t] / E[W_t],   W_t = sum_{j <= t} ||grad_logits log pi(a_j)||^2 = sum_{j <= t} (1 - 2 pi(a_j) + sum_i pi_i^2)

(the "realised energy" of the response up to t, from forward-pass probabilities only), estimated over the
responses to the same prompt: B_t = sum_i G_{i,t} W_{i,t} m_{i,t} / (sum_i W_{i,t} m_{i,t} + eps), and
A_{i,t} = G_{i,t} - B_t. With one outcome reward per response the return G_{i,t} is the response's reward at
every one of its tokens; what varies along the response is the baseline.

Responses are rows of [N, T] arrays that start at column 0 (right-padded, as verl's response tensors): column t
is the response's step t, and the baseline at column t averages the group's responses still running at step t.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jodc.losses._checks import check_nonnegative, shape_of
from jodc.losses.advantages import _grouped
from jodc.losses.logprobs import compute_dtype

#: verl's default stabiliser of the baseline's denominator.
OTB_EPS = 1e-8


def _per_token(fn: str, name: str, x, shape: tuple[int, int]) -> jax.Array:
    if shape_of(x) != shape:
        raise ValueError(f"{fn}: {name} has shape {shape_of(x)} but must be [N, T] = {shape} (N responses)")
    return jnp.asarray(x)


def optimal_token_baseline_advantages(rewards, group_size: int, *, logprobs, sum_pi_squared, mask,
                                      is_weights=None, handle_zero_tail: bool = True,
                                      eps: float = OTB_EPS) -> jax.Array:
    """Per-token OTB advantages [N, T] (0 where ``mask`` is 0) for outcome ``rewards`` [N] laid out group after
    group (see the module docstring).

    Args:
      rewards: [N], one reward per response.
      group_size: responses per prompt.
      logprobs: [N, T] log pi(a_t) of the sampled tokens under the policy that sampled them (verl: the old
        policy's log-probs).
      sum_pi_squared: [N, T] sum_i pi_i^2 of that policy at each position (``jodc.losses.sum_pi_squared``).
      mask: [N, T], nonzero at response tokens (rows start at column 0).
      is_weights: optional [N, T] (truncated) rollout importance weights rho; each step's variance term is then
        scaled by rho^2, the baseline that minimises the variance of the importance-weighted gradient.
      handle_zero_tail: where a group's longest response is longer than all the others, it alone defines the
        baseline past the second-longest one's end, so its advantage there would be ~0; with this flag that tail's
        baseline is 0 instead (its advantage is its reward), as verl's option of the same name, on by default as
        there (verl's function and trainer default to True; a long correct response keeps a signal in its tail).
      eps: added to the baseline's denominator.

    Groups of one response get advantage 0 (no baseline to compare with; verl gives the raw reward)."""
    fn = "optimal_token_baseline_advantages"
    r_gk, (num,) = _grouped(fn, rewards, group_size)
    if len(shape_of(mask)) != 2 or shape_of(mask)[0] != num:
        raise ValueError(f"{fn}: mask must have shape [N, T] with N = {num} (the rewards'), got {shape_of(mask)}")
    shape = shape_of(mask)
    logprobs = _per_token(fn, "logprobs", logprobs, shape)
    sum_pi_squared = _per_token(fn, "sum_pi_squared", sum_pi_squared, shape)
    check_nonnegative(fn, "eps", eps)
    dtype = compute_dtype(jnp.result_type(r_gk.dtype, logprobs.dtype, sum_pi_squared.dtype))
    valid_nt = jnp.asarray(mask) != 0
    if group_size == 1:
        return jnp.zeros(shape, dtype)

    def clean(x):  # padding may hold anything (NaN, -inf): it must not enter the cumulative sum
        return jnp.where(valid_nt, jnp.asarray(x).astype(dtype), 0.0)

    step_nt = 1.0 - 2.0 * jnp.exp(clean(logprobs)) + clean(sum_pi_squared)
    if is_weights is not None:
        step_nt = step_nt * jnp.square(clean(_per_token(fn, "is_weights", is_weights, shape)))
    energy_nt = jnp.cumsum(jnp.where(valid_nt, step_nt, 0.0), axis=1)
    groups, t = r_gk.shape[0], shape[1]
    energy_gkt = jnp.where(valid_nt, energy_nt, 0.0).reshape(groups, group_size, t)
    return_gkt = jnp.broadcast_to(r_gk.astype(dtype)[:, :, None], energy_gkt.shape)
    baseline_g1t = (jnp.sum(return_gkt * energy_gkt, axis=1, keepdims=True)
                    / (jnp.sum(energy_gkt, axis=1, keepdims=True) + eps))
    baseline_gkt = jnp.broadcast_to(baseline_g1t, energy_gkt.shape)
    if handle_zero_tail:
        lengths_gk = jnp.sum(valid_nt, axis=1).reshape(groups, group_size)
        top2_g2, _ = lax.top_k(lengths_gk, 2)
        longest_gk = jnp.arange(group_size)[None, :] == jnp.argmax(lengths_gk, axis=1)[:, None]
        alone_g1 = (top2_g2[:, :1] > top2_g2[:, 1:])[:, :, None]
        tail_gkt = longest_gk[:, :, None] & (jnp.arange(t)[None, None, :] >= top2_g2[:, 1:, None]) & alone_g1
        baseline_gkt = jnp.where(tail_gkt, 0.0, baseline_gkt)
    return jnp.where(valid_nt, (return_gkt - baseline_gkt).reshape(shape), 0.0)
