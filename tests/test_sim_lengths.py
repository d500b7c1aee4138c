"""Synthetic length generators: range, mean, tail behaviour, reproducibility, bad parameters."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jodc.sim import AGENT_TRAJECTORIES, LENGTH_DISTRIBUTIONS, LONGALIGN_SFT, RL_RESPONSES
from jodc.sim import LengthDistribution, get_length_distribution


@pytest.mark.parametrize("dist", list(LENGTH_DISTRIBUTIONS.values()), ids=list(LENGTH_DISTRIBUTIONS))
def test_presets_hit_their_range_and_mean(dist):
    x = dist.sample(200_000, seed=1)
    assert x.dtype == np.int64
    assert x.min() >= dist.min_len and x.max() <= dist.max_len
    assert abs(x.mean() - dist.mean) / dist.mean < 0.01
    assert dist.mean_for(dist.mu) == pytest.approx(dist.mean, rel=1e-9)


def test_published_statistics_of_the_presets():
    assert (LONGALIGN_SFT.min_len, LONGALIGN_SFT.max_len, LONGALIGN_SFT.mean) == (8192, 65536, 16500)
    assert AGENT_TRAJECTORIES.mean == 34700
    x = LONGALIGN_SFT.sample(100_000, seed=0)
    assert np.median(x) < LONGALIGN_SFT.mean < np.percentile(x, 75)  # long-tailed: mean well above the median
    assert np.percentile(x, 99) > 3 * LONGALIGN_SFT.min_len


def test_clip_piles_truncated_rollouts_at_the_cap_and_truncate_does_not():
    rl = RL_RESPONSES.sample(100_000, seed=0)
    assert 0.005 < np.mean(rl == RL_RESPONSES.max_len) < 0.05
    sft = LONGALIGN_SFT.sample(100_000, seed=0)
    assert np.mean(sft == LONGALIGN_SFT.max_len) < 1e-3
    assert RL_RESPONSES.max_len < LONGALIGN_SFT.max_len  # the RL tail is the shorter one


def test_sampling_is_reproducible_by_seed():
    np.testing.assert_array_equal(LONGALIGN_SFT.sample(64, seed=3), LONGALIGN_SFT.sample(64, seed=3))
    assert not np.array_equal(LONGALIGN_SFT.sample(64, seed=3), LONGALIGN_SFT.sample(64, seed=4))
    assert LONGALIGN_SFT.sample(0).shape == (0,)


@given(
    st.integers(1, 10_000),
    st.integers(2, 1000),
    st.floats(0.02, 0.98),
    st.floats(0.05, 5.0),
    st.sampled_from(["truncate", "clip"]),
)
@settings(max_examples=60, deadline=None)
def test_any_valid_distribution_solves_its_mean_and_stays_in_range(low, ratio, where, sigma, tail):
    high = low * ratio
    mean = low + where * (high - low)
    dist = LengthDistribution("x", low, high, mean, sigma, tail)
    assert dist.mean_for(dist.mu) == pytest.approx(mean, rel=1e-6)
    x = dist.sample(20_000, seed=0)
    assert x.min() >= low and x.max() <= high
    # the samples' mean matches, up to rounding to integers (at most 0.5) and sampling noise
    noise = 4 * x.std() / np.sqrt(x.size) + 0.5
    assert abs(x.mean() - mean) <= noise


@pytest.mark.parametrize("make, match", [
    (lambda: LengthDistribution("x", 100, 100, 100.0, 1.0), "below max_len"),
    (lambda: LengthDistribution("x", 100, 200, 250.0, 1.0), "strictly between"),
    (lambda: LengthDistribution("x", 100, 200, 150.0, 0.0), "sigma"),
    (lambda: LengthDistribution("x", 100, 200, 150.0, 6.0), "sigma"),
    (lambda: LengthDistribution("x", 100, 200, 150.0, 1.0, tail="reflect"), "tail"),
    (lambda: LengthDistribution("x", 0, 200, 150.0, 1.0), "min_len"),
    (lambda: LONGALIGN_SFT.sample(-1), "n must be"),
    (lambda: get_length_distribution("sharegpt"), "unknown length distribution"),
])
def test_bad_parameters_are_rejected(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_presets_by_name():
    assert get_length_distribution("rl_responses") is RL_RESPONSES
