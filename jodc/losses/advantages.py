"""Outcome-reward advantage estimators: one scalar reward per response, responses laid out group after group.

Every estimator takes rewards [N] (N = num_prompts * group_size) and returns per-response advantages [N] in fp32
(fp64 for fp64 rewards); broadcast to tokens with ``advantages[:, None] * mask`` (or per segment for packed rows).
With an outcome reward every token of a response gets the same advantage, so the token-level estimators of
verl (REINFORCE++, ReMax) are per-response values here too.

* ``grpo_advantages``: (r_i - mean_g) / (std_g + eps), unbiased std (GRPO, Shao et al. 2024, arXiv 2402.03300);
  ``normalize_std=False`` is Dr.GRPO (Liu et al. 2025, arXiv 2503.20783).
* ``rloo_advantages``: r_i - mean_{j != i} r_j, the leave-one-out baseline (Ahmadian et al. 2024, arXiv
  2402.14740).
* ``reinforce_pp_advantages``: REINFORCE++ (Hu 2025, arXiv 2501.03262): the reward (minus the group mean with
  ``baseline=True``), whitened over the batch's *tokens*: mean and unbiased std over all valid tokens, so each
  response counts with its length (``lengths``), then (x - mean) / sqrt(var + 1e-8).
* ``remax_advantages``: r_i - b_p, b_p the reward of the greedy response to the same prompt (ReMax, Li et al.
  2023, arXiv 2310.10505).
* ``passk_advantages``: pass@k training (Chen et al. 2025, arXiv 2503.19595): only the group's best response
  gets an advantage, r_max - r_second (divided by std_g + eps when ``normalize_std``); the others get 0.
* ``gpg_advantages``: GPG (arXiv 2504.02546): (r_i - mean_g) * N / max(count(r != 0), 1).
* ``opo_advantages``: OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585):
  r_i minus the length-weighted group mean sum_j l_j r_j / sum_j l_j.
* ``gdpo_advantages``: GDPO (arXiv 2601.05242), for several reward functions: rewards [N, D], each column
  group-normalised on its own (GRPO), the weighted sum then whitened over the batch's tokens.

Per-token advantages (a baseline per position) are in ``jodc.losses.token_baseline``.

Singleton groups (``group_size == 1``) have no baseline: jodc gives them advantage 0 in every estimator that
subtracts a group statistic. verl instead uses a group mean of 0 (and std 1), so its singleton advantage is the
raw reward; that is a deliberate difference (a lone sample's reward is not a relative signal).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jodc.losses._checks import shape_of
from jodc.losses.logprobs import compute_dtype

#: verl's variance epsilon in ``masked_whiten`` (REINFORCE++).
WHITEN_EPS = 1e-8


def _grouped(fn: str, rewards, group_size: int, *, min_group: int = 1) -> tuple[jax.Array, tuple[int]]:
    """Rewards as [G, K] in the compute dtype, after checking the layout; returns (r_gk, shape)."""
    shape = jnp.shape(rewards)
    if len(shape) != 1:
        raise ValueError(f"{fn}: rewards must have shape [N], got shape {shape}")
    if not isinstance(group_size, int) or group_size < min_group:
        raise ValueError(f"{fn}: group_size must be an int >= {min_group}, got {group_size!r}")
    if shape[0] % group_size != 0:
        raise ValueError(f"{fn}: rewards has shape {shape}, not a multiple of group_size={group_size}")
    rewards = jnp.asarray(rewards)
    dtype = compute_dtype(rewards.dtype) if jnp.issubdtype(rewards.dtype, jnp.floating) else jnp.float32
    return rewards.astype(dtype).reshape(-1, group_size), shape


def _check_eps(fn: str, eps: float) -> None:
    if not eps >= 0:
        raise ValueError(f"{fn}: eps must be >= 0, got {eps!r}")


def _centred(r_gk: jax.Array) -> jax.Array:
    """Rewards minus their group mean (0 for singleton groups, which have no baseline)."""
    return r_gk - jnp.mean(r_gk, axis=1, keepdims=True)


def _group_std(centred_gk: jax.Array) -> jax.Array:
    """Unbiased standard deviation per group [G, 1] (groups of at least 2)."""
    return jnp.sqrt(jnp.sum(jnp.square(centred_gk), axis=1, keepdims=True) / (centred_gk.shape[1] - 1))


def grpo_advantages(rewards, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6) -> jax.Array:
    """GRPO / Dr.GRPO advantages [N]. The standard deviation is the unbiased one (ddof = 1); a group of one
    response, or whose rewards are all equal, has advantage 0 when ``normalize_std``."""
    fn = "grpo_advantages"
    r_gk, shape = _grouped(fn, rewards, group_size)
    _check_eps(fn, eps)
    centered_gk = _centred(r_gk)
    if normalize_std:
        if group_size == 1:
            return jnp.zeros(shape, r_gk.dtype)
        std_g1 = _group_std(centered_gk)
        # A group whose rewards are all equal carries no signal: advantage 0 (also when eps = 0).
        centered_gk = jnp.where(std_g1 > 0, centered_gk / (std_g1 + eps), 0.0)
    return centered_gk.reshape(shape)


def rloo_advantages(rewards, group_size: int) -> jax.Array:
    """RLOO advantages [N]: r_i - mean of the other responses of the group = (K r_i - sum_g) / (K - 1)."""
    r_gk, shape = _grouped("rloo_advantages", rewards, group_size)
    if group_size == 1:
        return jnp.zeros(shape, r_gk.dtype)
    return (_centred(r_gk) * (group_size / (group_size - 1))).reshape(shape)


def reinforce_pp_advantages(rewards, group_size: int, *, lengths, baseline: bool = True) -> jax.Array:
    """REINFORCE++ advantages [N] (``baseline=True``: REINFORCE++-baseline, the group mean subtracted first).

    ``lengths`` [N] are the responses' numbers of valid tokens: the whitening statistics are over tokens, as in
    verl's ``masked_whiten`` (mean, unbiased variance, (x - mean) / sqrt(var + 1e-8)). Responses of length 0
    get 0."""
    fn = "reinforce_pp_advantages"
    r_gk, shape = _grouped(fn, rewards, group_size)
    n = _lengths(fn, lengths, shape, r_gk.dtype)
    return _token_whiten((_centred(r_gk) if baseline else r_gk).reshape(shape), n)


def _lengths(fn: str, lengths, shape: tuple[int], dtype) -> jax.Array:
    """The responses' numbers of valid tokens [N] (shape checked against the rewards'), in ``dtype``."""
    if shape_of(lengths) != tuple(shape):
        raise ValueError(f"{fn}: lengths has shape {shape_of(lengths)} but rewards has shape {tuple(shape)}")
    return jnp.asarray(lengths).astype(dtype)


def _token_whiten(x_n: jax.Array, n_n: jax.Array) -> jax.Array:
    """Per-response values whitened over the batch's tokens, as verl's ``masked_whiten`` of the values broadcast
    to every valid token: each response counts with its length ``n_n``; mean, unbiased variance, then
    (x - mean) / sqrt(var + 1e-8). Responses of length 0 get 0."""
    total = jnp.sum(n_n)
    mean = jnp.sum(n_n * x_n) / jnp.maximum(total, 1)
    var = jnp.sum(n_n * jnp.square(x_n - mean)) / jnp.maximum(total - 1, 1)
    return jnp.where(n_n > 0, (x_n - mean) * jax.lax.rsqrt(var + WHITEN_EPS), 0.0)


def remax_advantages(rewards, group_size: int, *, greedy_rewards) -> jax.Array:
    """ReMax advantages [N]: each response's reward minus the greedy response's reward for its prompt
    (``greedy_rewards`` [N / group_size], one per prompt)."""
    fn = "remax_advantages"
    r_gk, shape = _grouped(fn, rewards, group_size)
    if jnp.shape(greedy_rewards) != (r_gk.shape[0],):
        raise ValueError(f"{fn}: greedy_rewards has shape {jnp.shape(greedy_rewards)}; expected one reward per "
                         f"prompt, shape ({r_gk.shape[0]},)")
    return (r_gk - jnp.asarray(greedy_rewards).astype(r_gk.dtype)[:, None]).reshape(shape)


def passk_advantages(rewards, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6) -> jax.Array:
    """Pass@k advantages [N]: the best response of each group (first on ties) gets r_max - r_second_max
    (divided by the group's unbiased std + eps when ``normalize_std``), every other response 0. Needs groups
    of at least 2."""
    fn = "passk_advantages"
    r_gk, shape = _grouped(fn, rewards, group_size, min_group=2)
    _check_eps(fn, eps)
    top2, _ = jax.lax.top_k(r_gk, 2)
    gap_g1 = top2[:, :1] - top2[:, 1:]
    if normalize_std:
        gap_g1 = gap_g1 / (_group_std(_centred(r_gk)) + eps)
    best = jnp.arange(group_size)[None, :] == jnp.argmax(r_gk, axis=1)[:, None]
    return jnp.where(best, gap_g1, 0.0).reshape(shape)


def gpg_advantages(rewards, group_size: int, *, f_norm: float = 1.0) -> jax.Array:
    """GPG advantages [N]: group-centred rewards times N / max(number of non-zero rewards, 1), over ``f_norm``."""
    fn = "gpg_advantages"
    r_gk, shape = _grouped(fn, rewards, group_size)
    if not f_norm > 0:
        raise ValueError(f"{fn}: f_norm must be > 0, got {f_norm!r}")
    alpha = r_gk.size / jnp.maximum(jnp.count_nonzero(r_gk), 1).astype(r_gk.dtype)
    return (alpha * _centred(r_gk) / f_norm).reshape(shape)


def opo_advantages(rewards, group_size: int, *, lengths) -> jax.Array:
    """OPO advantages [N]: r_i - b_g with the length-weighted group baseline b_g = sum_j l_j r_j / sum_j l_j
    (``lengths`` [N]: valid tokens per response), the optimal baseline of a sequence-level policy gradient whose
    gradient norm grows with the response length. A group whose responses are all empty gets 0."""
    fn = "opo_advantages"
    r_gk, shape = _grouped(fn, rewards, group_size)
    l_gk = _lengths(fn, lengths, shape, r_gk.dtype).reshape(r_gk.shape)
    if group_size == 1:
        return jnp.zeros(shape, r_gk.dtype)
    total_g1 = jnp.sum(l_gk, axis=1, keepdims=True)
    baseline_g1 = jnp.sum(l_gk * r_gk, axis=1, keepdims=True) / jnp.where(total_g1 > 0, total_g1, 1)
    return jnp.where(total_g1 > 0, r_gk - baseline_g1, 0.0).reshape(shape)


def gdpo_advantages(rewards, group_size: int, *, lengths, weights=None, normalize_std: bool = True,
                    eps: float = 1e-6) -> jax.Array:
    """GDPO advantages [N] from several reward functions' rewards [N, D] (D >= 1, one column per reward function).

    Each column is group-normalised on its own (``grpo_advantages``: (r - mean_g) / (std_g + eps), or only
    centred without ``normalize_std``), the columns are summed with ``weights`` [D] (default all 1), and the sum
    is whitened over the batch's tokens as REINFORCE++ does (``lengths`` [N]: valid tokens per response). A
    reward function with a small spread is therefore not drowned by one with a large spread, as it is when the
    rewards are summed first."""
    fn = "gdpo_advantages"
    shape = jnp.shape(rewards)
    if len(shape) != 2 or shape[1] < 1:
        raise ValueError(f"{fn}: rewards must have shape [N, D] (one column per reward function, D >= 1), got "
                         f"shape {shape}")
    num, dims = shape
    _grouped(fn, jnp.asarray(rewards)[:, 0], group_size)  # the layout's checks, under this function's name
    _check_eps(fn, eps)
    if weights is None:
        weights = jnp.ones((dims,))
    elif shape_of(weights) != (dims,):
        raise ValueError(f"{fn}: weights has shape {shape_of(weights)}; expected one weight per reward function, "
                         f"shape ({dims},)")
    rewards = jnp.asarray(rewards)
    summed = None
    for d in range(dims):
        adv_n = grpo_advantages(rewards[:, d], group_size, normalize_std=normalize_std, eps=eps)
        term = jnp.asarray(weights)[d].astype(adv_n.dtype) * adv_n
        summed = term if summed is None else summed + term
    return _token_whiten(summed, _lengths(fn, lengths, (num,), summed.dtype))
