"""OPO, GDPO and the optimal token baseline (OTB) advantage estimators, and `sum_pi_squared`, each against a float64
numpy reference written from verl's definitions (`compute_opo_outcome_advantage`,
`compute_gdpo_outcome_advantage`, `compute_optimal_token_baseline_advantage`): per-group loops as verl writes
them, with jodc's deliberate difference that a group of one response gets advantage 0. Advantages carry no
gradient (they are data for the loss); `sum_pi_squared` is checked to carry none either."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_losses import np_lp

from jodc.losses import (
    ADVANTAGE_ESTIMATORS,
    gdpo_advantages,
    get_advantage_estimator,
    grpo_advantages,
    opo_advantages,
    optimal_token_baseline_advantages,
    reinforce_pp_advantages,
    sum_pi_squared,
)

REWARDS = np.array([1.0, 0.0, 0.0, 0.5, 2.0, 2.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0])
LENGTHS = np.array([3, 5, 1, 4, 2, 6, 6, 1, 2, 3, 0, 5])
K = 4


def x64(fn, *args, **kwargs):
    with jax.enable_x64(True):
        return np.asarray(fn(*args, **kwargs))


# ------------------------------------------------------------------------------------------------------------
# OPO
# ------------------------------------------------------------------------------------------------------------


def np_opo(rewards, lengths, k):
    out = np.zeros_like(rewards)
    for g in range(len(rewards) // k):
        idx = slice(g * k, (g + 1) * k)
        r, n = rewards[idx], lengths[idx].astype(np.float64)
        out[idx] = r - np.sum(n * r) / np.sum(n)
    return out


def test_opo_against_reference():
    np.testing.assert_allclose(x64(opo_advantages, REWARDS, K, lengths=LENGTHS), np_opo(REWARDS, LENGTHS, K),
                               rtol=1e-14, atol=1e-15)
    # equal lengths: the length-weighted baseline is the group mean (Dr.GRPO)
    np.testing.assert_allclose(x64(opo_advantages, REWARDS, K, lengths=np.full(12, 7)),
                               x64(grpo_advantages, REWARDS, K, normalize_std=False), rtol=1e-14, atol=1e-15)
    # a long response weighs more in the baseline: [1, 0] with lengths [9, 1] -> baseline 0.9
    np.testing.assert_allclose(x64(opo_advantages, np.array([1.0, 0.0]), 2, lengths=np.array([9, 1])), [0.1, -0.9],
                               rtol=1e-14)


def test_opo_singleton_and_empty_groups_get_no_advantage():
    np.testing.assert_array_equal(opo_advantages(np.array([1.0, 3.0]), 1, lengths=np.array([2, 2])), 0.0)
    np.testing.assert_array_equal(opo_advantages(np.array([1.0, 3.0, 1.0, 0.0]), 2, lengths=np.array([0, 0, 1, 1])),
                                  [0.0, 0.0, 0.5, -0.5])


def test_opo_bad_input():
    with pytest.raises(ValueError, match=r"opo_advantages: lengths has shape \(11,\) but rewards has shape \(12,\)"):
        opo_advantages(REWARDS, K, lengths=LENGTHS[:11])
    with pytest.raises(ValueError, match="not a multiple of group_size=5"):
        opo_advantages(REWARDS, 5, lengths=LENGTHS)


# ------------------------------------------------------------------------------------------------------------
# GDPO
# ------------------------------------------------------------------------------------------------------------

REWARD_COLUMNS = np.stack([REWARDS, 10.0 * np.array([0, 1, 1, 1, 0, 0, 1, 0, 1, 0, 1, 1.0]),
                           np.array([0.2, 0.1, 0.3, 0.2, 0.9, 0.1, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0])], axis=1)


def np_grpo_column(r, k, normalize_std, eps):
    out = np.zeros_like(r)
    for g in range(len(r) // k):
        group = r[g * k:(g + 1) * k]
        centred = group - group.mean()
        std = group.std(ddof=1)  # torch.std
        out[g * k:(g + 1) * k] = centred / (std + eps) if normalize_std else centred
    return out


def np_masked_whiten(values_n, lengths, max_len=6):
    """verl's masked_whiten of per-response values broadcast over [N, T] with the response mask."""
    mask = (np.arange(max_len)[None, :] < lengths[:, None]).astype(np.float64)
    values = np.repeat(values_n[:, None], max_len, 1)
    mean = np.sum(values * mask) / mask.sum()
    var = np.sum((values - mean) ** 2 * mask) / mask.sum() * mask.sum() / (mask.sum() - 1)
    return ((values - mean) / np.sqrt(var + 1e-8) * mask)[:, 0] * (lengths > 0)


def np_gdpo(columns, lengths, k, weights, normalize_std=True, eps=1e-6):
    summed = sum(w * np_grpo_column(columns[:, d], k, normalize_std, eps) for d, w in enumerate(weights))
    return np_masked_whiten(summed, lengths)


@pytest.mark.parametrize("weights, normalize_std", [(None, True), ([0.3, 0.7, 2.0], True), ([1.0, 1.0, 1.0], False)])
def test_gdpo_against_reference(weights, normalize_std):
    got = x64(gdpo_advantages, REWARD_COLUMNS, K, lengths=LENGTHS, weights=weights, normalize_std=normalize_std)
    np.testing.assert_allclose(got, np_gdpo(REWARD_COLUMNS, LENGTHS, K, weights or [1.0] * 3, normalize_std),
                               rtol=1e-12, atol=1e-14)
    assert got[LENGTHS == 0].tolist() == [0.0]


def test_gdpo_keeps_a_small_reward_from_being_drowned():
    """Two reward functions, one with a 100x larger spread. Summed first (GRPO), a difference in the small one moves
    the advantage 1/100 as much as one in the large one; normalised each first (GDPO), as much."""
    big = np.array([0.0, 100.0, 0.0, 100.0])
    small = np.array([1.0, 0.0, 0.0, 1.0])  # responses 0 and 2 differ in `small` only, 1 and 2 in `big` only
    grpo = x64(grpo_advantages, big + small, 4)
    gdpo = x64(gdpo_advantages, np.stack([big, small], 1), 4, lengths=np.full(4, 3))
    np.testing.assert_allclose((grpo[0] - grpo[2]) / (grpo[1] - grpo[2]), 0.01, rtol=1e-9)
    np.testing.assert_allclose((gdpo[0] - gdpo[2]) / (gdpo[1] - gdpo[2]), 1.0, rtol=1e-5)
    # one column: GRPO, then whitened over tokens (REINFORCE++'s whitening of the group-normalised rewards)
    one = x64(gdpo_advantages, REWARDS[:, None], K, lengths=LENGTHS)
    np.testing.assert_allclose(one, np_masked_whiten(x64(grpo_advantages, REWARDS, K), LENGTHS), rtol=1e-12,
                               atol=1e-14)


def test_gdpo_bad_input():
    with pytest.raises(ValueError, match=r"rewards must have shape \[N, D\]"):
        gdpo_advantages(REWARDS, K, lengths=LENGTHS)
    with pytest.raises(ValueError, match=r"weights has shape \(2,\); expected one weight per reward function"):
        gdpo_advantages(REWARD_COLUMNS, K, lengths=LENGTHS, weights=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"gdpo_advantages: lengths has shape \(3,\)"):
        gdpo_advantages(REWARD_COLUMNS, K, lengths=LENGTHS[:3])
    with pytest.raises(ValueError, match="gdpo_advantages: .*not a multiple of group_size=5"):
        gdpo_advantages(REWARD_COLUMNS, 5, lengths=LENGTHS)
    with pytest.raises(ValueError, match="gdpo_advantages: eps must be >= 0"):
        gdpo_advantages(REWARD_COLUMNS, K, lengths=LENGTHS, eps=-1.0)


# ------------------------------------------------------------------------------------------------------------
# sum_pi_squared and the optimal token baseline
# ------------------------------------------------------------------------------------------------------------


def np_softmax(x, temperature=1.0):
    x = np.asarray(x, np.float64) / temperature
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("chunk_size", [None, 3, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sum_pi_squared_against_reference(chunk_size, temperature):
    rng = np.random.default_rng(0)
    x = 2.0 * rng.standard_normal((2, 5, 11))
    want = np.sum(np_softmax(x, temperature) ** 2, -1)
    got = x64(sum_pi_squared, x, temperature=temperature, chunk_size=chunk_size)
    np.testing.assert_allclose(got, want, rtol=1e-13)
    bf16 = sum_pi_squared(jnp.asarray(x, jnp.bfloat16), temperature=temperature, chunk_size=chunk_size)
    assert bf16.dtype == jnp.float32
    np.testing.assert_allclose(bf16, np.sum(np_softmax(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64),
                                                       temperature) ** 2, -1), rtol=1e-5)
    # a statistic of the data, not of the parameters: no gradient flows
    grad = jax.grad(lambda x: jnp.sum(sum_pi_squared(x, chunk_size=chunk_size)))(jnp.asarray(x, jnp.float32))
    np.testing.assert_array_equal(grad, 0.0)


def test_sum_pi_squared_bad_input():
    with pytest.raises(ValueError, match=r"sum_pi_squared: logits must have shape \[B, T, V\]"):
        sum_pi_squared(np.zeros((3, 4)))
    with pytest.raises(ValueError, match="chunk_size must be None or a positive int"):
        sum_pi_squared(np.zeros((1, 3, 4)), chunk_size=0)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        sum_pi_squared(np.zeros((1, 3, 4)), temperature=0.0)


def otb_batch(seed=0, lengths=(3, 5, 1, 4, 2, 6, 6, 1, 2, 3, 4, 5), t=6, v=7):
    """Responses sampled from random logits: log pi(a_t), sum pi^2, the mask, and garbage in the padding."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    x = 1.5 * rng.standard_normal((len(lengths), t, v))
    tokens = rng.integers(0, v, (len(lengths), t)).astype(np.int32)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
    lp = np.where(mask > 0, np_lp(x, tokens), np.nan)
    sp = np.where(mask > 0, np.sum(np_softmax(x) ** 2, -1), -np.inf)
    return x, tokens, lp, sp, mask


def np_otb(rewards, k, lp, sp, mask, is_weights=None, handle_zero_tail=True, eps=1e-8):
    """verl's compute_optimal_token_baseline_advantage for outcome rewards, with per-group loops (its default:
    handle_zero_tail=True)."""
    n, t = mask.shape
    last = mask.sum(1).astype(int) - 1
    token_rewards = np.zeros((n, t))
    token_rewards[np.arange(n), last] = rewards
    returns = np.flip(np.cumsum(np.flip(token_rewards * mask, 1), 1), 1)
    w = 1 - 2 * np.exp(np.nan_to_num(lp)) + np.nan_to_num(sp, neginf=0.0)
    if is_weights is not None:
        w = w * is_weights ** 2
    w_cum = np.cumsum(w * mask, 1)
    baselines = np.zeros((n, t))
    for g in range(n // k):
        rows = np.arange(g * k, (g + 1) * k)
        num = (returns[rows] * w_cum[rows] * mask[rows]).sum(0)
        den = (w_cum[rows] * mask[rows]).sum(0) + eps
        baselines[rows] = num / den
        if handle_zero_tail:
            lengths = mask[rows].sum(1)
            second = int(np.sort(lengths)[-2])
            longest = np.flatnonzero(lengths == lengths.max())
            if len(longest) == 1 and lengths.max() > second:
                baselines[rows[longest[0]], second:] = 0.0
    return (returns - baselines) * mask


@pytest.mark.parametrize("handle_zero_tail", [False, True])
@pytest.mark.parametrize("with_is_weights", [False, True])
def test_optimal_token_baseline_against_reference(handle_zero_tail, with_is_weights):
    _, _, lp, sp, mask = otb_batch()
    rho = np.where(mask > 0, np.random.default_rng(1).uniform(0.5, 2.0, mask.shape), np.nan) if with_is_weights \
        else None
    got = x64(optimal_token_baseline_advantages, REWARDS, K, logprobs=lp, sum_pi_squared=sp, mask=mask,
              is_weights=rho, handle_zero_tail=handle_zero_tail)
    want = np_otb(REWARDS, K, lp, sp, mask, None if rho is None else np.nan_to_num(rho), handle_zero_tail)
    assert np.all(np.isfinite(got))  # NaN / -inf in the padding never reach the cumulative sums
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    # the baseline varies along the response: not a per-response constant
    assert np.ptp(got[1, :5]) > 1e-3


def test_optimal_token_baseline_handles_the_zero_tail_by_default_as_verl():
    """verl's function (and its trainer, which never overrides it) defaults to handle_zero_tail=True: past the
    second-longest response the longest one's baseline is 0, so a longest correct response keeps advantage 1 there
    (it was ~0 with jodc's earlier default)."""
    _, _, lp, sp, mask = otb_batch()
    rewards = np.zeros(len(REWARDS))
    group = mask[:K].sum(1).astype(int)  # the first group's lengths
    longest, second = int(np.argmax(group)), int(np.sort(group)[-2])
    assert group[longest] > second
    rewards[longest] = 1.0
    default = x64(optimal_token_baseline_advantages, rewards, K, logprobs=lp, sum_pi_squared=sp, mask=mask)
    flagged = x64(optimal_token_baseline_advantages, rewards, K, logprobs=lp, sum_pi_squared=sp, mask=mask,
                  handle_zero_tail=True)
    assert np.array_equal(default, flagged)
    np.testing.assert_allclose(default[longest, second:group[longest]], 1.0)
    off = x64(optimal_token_baseline_advantages, rewards, K, logprobs=lp, sum_pi_squared=sp, mask=mask,
              handle_zero_tail=False)
    np.testing.assert_allclose(off[longest, second:group[longest]], 0.0, atol=1e-6)


def test_optimal_token_baseline_from_logits_and_invariants():
    """Fed from `token_logprobs`-style log-probs and `sum_pi_squared` of the same logits; a group whose rewards
    are all equal has advantage 0 (with eps = 0: B_t is then exactly that reward); groups of one get 0."""
    x, tokens, lp, _, mask = otb_batch(3)
    sp = x64(sum_pi_squared, x)
    got = x64(optimal_token_baseline_advantages, REWARDS, K, logprobs=np.nan_to_num(lp), sum_pi_squared=sp,
              mask=mask)
    np.testing.assert_allclose(got, np_otb(REWARDS, K, lp, np.where(mask > 0, sp, 0.0), mask), rtol=1e-12,
                               atol=1e-14)
    flat = np.repeat([0.5, 2.0, -1.0], K)  # (without the zero-tail handling, which gives a lone tail its reward)
    np.testing.assert_allclose(x64(optimal_token_baseline_advantages, flat, K, logprobs=np.nan_to_num(lp),
                                   sum_pi_squared=sp, mask=mask, eps=0.0, handle_zero_tail=False), 0.0, atol=1e-14)
    np.testing.assert_array_equal(optimal_token_baseline_advantages(REWARDS, 1, logprobs=np.nan_to_num(lp),
                                                                    sum_pi_squared=sp, mask=mask), 0.0)


def test_optimal_token_baseline_bad_input():
    _, _, lp, sp, mask = otb_batch()
    kwargs = dict(logprobs=lp, sum_pi_squared=sp, mask=mask)
    with pytest.raises(ValueError, match=r"mask must have shape \[N, T\] with N = 12"):
        optimal_token_baseline_advantages(REWARDS, K, **{**kwargs, "mask": mask[:8]})
    with pytest.raises(ValueError, match=r"sum_pi_squared has shape \(12, 5\) but must be \[N, T\] = \(12, 6\)"):
        optimal_token_baseline_advantages(REWARDS, K, **{**kwargs, "sum_pi_squared": sp[:, :5]})
    with pytest.raises(ValueError, match=r"is_weights has shape \(12,\)"):
        optimal_token_baseline_advantages(REWARDS, K, **kwargs, is_weights=np.ones(12))
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        optimal_token_baseline_advantages(REWARDS, K, **kwargs, eps=-1e-8)
    with pytest.raises(ValueError, match="rewards must have shape \\[N\\]"):
        optimal_token_baseline_advantages(REWARDS[:, None], K, **kwargs)


# ------------------------------------------------------------------------------------------------------------
# Registry
# ------------------------------------------------------------------------------------------------------------


def test_registry_names_and_metadata():
    assert {"opo", "gdpo", "optimal_token_baseline"} <= set(ADVANTAGE_ESTIMATORS)
    opo, gdpo, otb = (get_advantage_estimator(n) for n in ("opo", "gdpo", "optimal_token_baseline"))
    assert opo.inputs == ("lengths",) and not (opo.reward_columns or opo.per_token)
    assert gdpo.reward_columns and gdpo.inputs == ("lengths",) and not gdpo.per_token
    assert otb.per_token and otb.inputs == ("logprobs", "sum_pi_squared", "mask")
    assert otb.optional_inputs == ("is_weights",)
    assert not any(e.reward_columns or e.per_token for n, e in ADVANTAGE_ESTIMATORS.items()
                   if n not in ("gdpo", "optimal_token_baseline", "gae"))
    np.testing.assert_allclose(x64(opo, REWARDS, K, lengths=LENGTHS), np_opo(REWARDS, LENGTHS, K), rtol=1e-14,
                               atol=1e-15)
    np.testing.assert_allclose(x64(gdpo, REWARD_COLUMNS, K, lengths=LENGTHS, weights=[1.0, 0.5, 2.0]),
                               np_gdpo(REWARD_COLUMNS, LENGTHS, K, [1.0, 0.5, 2.0]), rtol=1e-12, atol=1e-14)
    _, _, lp, sp, mask = otb_batch()
    rho = np.ones_like(mask)
    np.testing.assert_allclose(x64(otb, REWARDS, K, logprobs=lp, sum_pi_squared=sp, mask=mask, is_weights=rho),
                               np_otb(REWARDS, K, lp, sp, mask), rtol=1e-12, atol=1e-14)
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) \['lengths'\].*optional \['is_weights'\]"):
        otb(REWARDS, K, logprobs=lp, sum_pi_squared=sp, mask=mask, lengths=LENGTHS)
    # REINFORCE++'s whitening helper was factored out for GDPO: REINFORCE++ itself is unchanged
    np.testing.assert_allclose(x64(reinforce_pp_advantages, REWARDS, K, lengths=LENGTHS),
                               np_masked_whiten(np_grpo_column(REWARDS, K, False, 0.0), LENGTHS), rtol=1e-12,
                               atol=1e-14)
