"""Synthetic sequence-length generators shaped like published post-training data.

Every generator is a log-normal distribution restricted to ``[min_len, max_len]`` whose location is solved so
that the restricted distribution has the published (or assumed) mean exactly; ``sigma`` sets the tail. Two ways
to restrict it:

* ``truncate`` -- the distribution conditioned on the range (a data set filtered by length);
* ``clip`` -- lengths above ``max_len`` become ``max_len`` (generation stopped at a length cap, as in RL rollouts,
  which piles a spike of truncated responses at the cap), and below ``min_len`` become ``min_len``.

Presets, and where each constant comes from:

* ``LONGALIGN_SFT`` (long-context SFT): LongAlign-10k holds 10,000 instruction samples of 8K to 64K tokens
  (dataset card, Bai et al. 2024, arXiv 2401.18058), hence ``min_len = 8192``, ``max_len = 65536``; the ODC
  paper (arXiv 2601.19362) reports a mean of about 16.5K tokens, hence ``mean = 16500``. ``sigma = 0.8`` is our
  choice of tail: it gives a median near 13.5K, a 90th percentile near 28K and a 99th near 52K, i.e. most
  samples close to the lower end with a thin tail out to 64K.
* ``AGENT_TRAJECTORIES`` (agentic SFT, SWE-Smith-like): the ODC paper reports a mean of about 34.7K tokens,
  hence ``mean = 34700``. The range is assumed: ``max_len = 131072`` is the context length of the
  DeepSeek-R1-Distill-Qwen models (``max_position_embeddings``), ``min_len = 2048`` a short trajectory (system
  prompt, issue, a few tool calls); ``sigma = 0.8`` as above.
* ``RL_RESPONSES`` (RL rollouts, prompt + response): assumed, no single published histogram. ``max_len = 16384``
  is a common response cap for reasoning RL at this model size, ``mean = 4096`` and ``sigma = 0.8`` give a
  shorter tail than the SFT sets and about 2% of rollouts truncated at the cap; ``min_len = 256`` is a short
  prompt with a short answer.
* ``LONGALIGN_LONG_TAIL`` (:class:`LongTailLengths`, for context parallelism): ``LONGALIGN_SFT`` with 1.5% of
  sequences drawn log-uniformly from 4-8x a 64K token cap (256K-512K tokens). Assumed: long documents or agent
  trajectories beyond one device's memory, rare enough that splitting every sequence (fixed CP) wastes the rest.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import numpy as np

from jodc.balance.validation import positive_int

TAILS = ("truncate", "clip")


GRID_POINTS = 16385  # resolution of the grid on which truncated distributions are integrated and sampled
LOG_REACH = 40.0  # the grid covers where the integrand is within e^-40 of its peak (the rest is negligible)
MAX_SIGMA = 5.0  # beyond this a log-normal spans >10^10 in length within two sigmas: not a length distribution


def _normal_mass(low: float, high: float) -> float:
    """P(low < Z < high) for a standard normal Z, accurate in either tail (no 1 - 1 cancellation)."""
    root2 = math.sqrt(2.0)
    if low > 0:
        return 0.5 * (math.erfc(low / root2) - math.erfc(high / root2))
    if high < 0:
        return 0.5 * (math.erfc(-high / root2) - math.erfc(-low / root2))
    return 0.5 * (math.erf(high / root2) - math.erf(low / root2))


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """A log-normal length distribution restricted to ``[min_len, max_len]`` with a given mean.

    Attributes:
      name: a label.
      min_len, max_len: the range of lengths (tokens), ``1 <= min_len < max_len``.
      mean: the mean of the restricted distribution, strictly inside the range.
      sigma: standard deviation of the log-length before restriction (> 0): larger means a heavier tail.
      tail: ``truncate`` or ``clip`` (see the module docstring).
      source: where the numbers come from.
    """

    name: str
    min_len: int
    max_len: int
    mean: float
    sigma: float
    tail: str = "truncate"
    source: str = ""

    def __post_init__(self):
        positive_int(self.min_len, "min_len")
        positive_int(self.max_len, "max_len")
        if self.min_len >= self.max_len:
            raise ValueError(f"min_len={self.min_len} must be below max_len={self.max_len}")
        for field in ("mean", "sigma"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{field} must be a finite number, got {value!r}")
        if not self.min_len < self.mean < self.max_len:
            raise ValueError(f"mean={self.mean} must lie strictly between min_len and max_len")
        if not 0 < self.sigma <= MAX_SIGMA:
            raise ValueError(f"sigma must be in (0, {MAX_SIGMA}], got {self.sigma}")
        if self.tail not in TAILS:
            raise ValueError(f"tail must be one of {TAILS}, got {self.tail!r}")

    def _truncated_grid(self, mu: float) -> tuple[np.ndarray, np.ndarray]:
        """Grid ``z`` of standardised log-lengths on the truncated range, and the log-density there (max 0).

        The grid spans only where the density, or the density tilted by ``exp(sigma z)`` (the integrand of the
        mean), is within ``e^-LOG_REACH`` of its peak, so a steep density far in a tail is still resolved.
        """
        a = (math.log(self.min_len) - mu) / self.sigma
        b = (math.log(self.max_len) - mu) / self.sigma
        low, high = b, a
        for centre in (0.0, self.sigma):
            peak = min(max(centre, a), b)
            reach = math.sqrt((peak - centre) ** 2 + 2.0 * LOG_REACH)
            low, high = min(low, max(a, centre - reach)), max(high, min(b, centre + reach))
        z = np.linspace(low, high, GRID_POINTS)
        peak = min(max(0.0, a), b)
        return z, -(z * z - peak * peak) / 2.0

    def mean_for(self, mu: float) -> float:
        """The restricted distribution's mean when the log-length has location ``mu``."""
        s = self.sigma
        a, b = (math.log(self.min_len) - mu) / s, (math.log(self.max_len) - mu) / s
        if self.tail == "clip":
            # E[X; inside] = exp(mu + s^2 / 2) * P(a - s < Z < b - s), in log space so it cannot overflow
            mass = _normal_mass(a - s, b - s)
            inside = math.exp(mu + s * s / 2 + math.log(mass)) if mass > 0 else 0.0
            return self.min_len * _normal_mass(-math.inf, a) + inside + self.max_len * _normal_mass(b, math.inf)
        z, log_density = self._truncated_grid(mu)
        log_tilted = log_density + s * z
        top = float(log_tilted.max())
        ratio = _trapezoid(np.exp(log_tilted - top), z) / _trapezoid(np.exp(log_density), z)
        return min(max(math.exp(mu + top) * ratio, float(self.min_len)), float(self.max_len))

    @functools.cached_property
    def mu(self) -> float:
        """The log-location that gives the target mean (bisection; the mean grows with ``mu``)."""
        low = math.log(self.min_len) - 10 * self.sigma
        high = math.log(self.max_len) + 10 * self.sigma
        step = 10 * self.sigma
        while self.mean_for(high) < self.mean:  # widen the bracket for means close to an end of the range
            high += step
            step *= 2
        step = 10 * self.sigma
        while self.mean_for(low) > self.mean:
            low -= step
            step *= 2
        for _ in range(200):
            mid = 0.5 * (low + high)
            if self.mean_for(mid) < self.mean:
                low = mid
            else:
                high = mid
        return 0.5 * (low + high)

    def sample(self, n: int, seed: int = 0) -> np.ndarray:
        """``n`` integer lengths (int64), reproducible from ``seed``."""
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        rng = np.random.default_rng(seed)
        if self.tail == "clip":
            raw = np.exp(rng.normal(self.mu, self.sigma, n))
            return np.clip(np.rint(raw), self.min_len, self.max_len).astype(np.int64)
        # Truncated: invert the CDF of the standardised log-length, tabulated on the grid (no rejection loop, so
        # the cost does not depend on how much of the log-normal the range cuts away).
        z, log_density = self._truncated_grid(self.mu)
        density = np.exp(log_density)
        cdf = np.concatenate([[0.0], np.cumsum((density[1:] + density[:-1]) / 2.0 * np.diff(z))])
        draws = np.interp(rng.random(n) * cdf[-1], cdf, z)
        raw = np.exp(self.mu + self.sigma * draws)
        return np.clip(np.rint(raw), self.min_len, self.max_len).astype(np.int64)


def _trapezoid(values: np.ndarray, z: np.ndarray) -> float:
    return float(np.sum((values[1:] + values[:-1]) / 2.0 * np.diff(z)))


LONGALIGN_SFT = LengthDistribution(
    name="longalign_sft", min_len=8192, max_len=65536, mean=16500.0, sigma=0.8, tail="truncate",
    source="LongAlign-10k: 8K-64K tokens (dataset card); mean ~16.5K (ODC paper); sigma assumed")

AGENT_TRAJECTORIES = LengthDistribution(
    name="agent_trajectories", min_len=2048, max_len=131072, mean=34700.0, sigma=0.8, tail="truncate",
    source="SWE-Smith-like trajectories: mean ~34.7K (ODC paper); range (2K-128K) and sigma assumed")

RL_RESPONSES = LengthDistribution(
    name="rl_responses", min_len=256, max_len=16384, mean=4096.0, sigma=0.8, tail="clip",
    source="RL rollouts (prompt + response) capped at 16K: all constants assumed")

LENGTH_DISTRIBUTIONS = {d.name: d for d in (LONGALIGN_SFT, AGENT_TRAJECTORIES, RL_RESPONSES)}


@dataclasses.dataclass(frozen=True)
class LongTailLengths:
    """A body distribution plus a rare tail of much longer sequences (what context parallelism is for).

    Each sequence is, with probability ``tail_fraction``, drawn log-uniformly from ``[tail_min, tail_max]``, else
    from ``body``. Sampling is reproducible from the seed.
    """

    name: str
    body: LengthDistribution
    tail_min: int
    tail_max: int
    tail_fraction: float
    source: str = ""

    def __post_init__(self):
        positive_int(self.tail_min, "tail_min")
        positive_int(self.tail_max, "tail_max")
        if not self.tail_min <= self.tail_max:
            raise ValueError(f"tail_min={self.tail_min} must be at most tail_max={self.tail_max}")
        if isinstance(self.tail_fraction, bool) or not 0 <= self.tail_fraction <= 1:
            raise ValueError(f"tail_fraction must be in [0, 1], got {self.tail_fraction!r}")

    @property
    def min_len(self) -> int:
        return min(self.body.min_len, self.tail_min)

    @property
    def max_len(self) -> int:
        return max(self.body.max_len, self.tail_max)

    def sample(self, n: int, seed: int = 0) -> np.ndarray:
        """``n`` integer lengths (int64), reproducible from ``seed``."""
        lengths = self.body.sample(n, seed=seed)
        rng = np.random.default_rng([seed, 1])
        tail = rng.random(lengths.size) < self.tail_fraction
        log_lengths = rng.uniform(math.log(self.tail_min), math.log(self.tail_max), int(tail.sum()))
        lengths[tail] = np.clip(np.rint(np.exp(log_lengths)), self.tail_min, self.tail_max).astype(np.int64)
        return lengths


LONGALIGN_LONG_TAIL = LongTailLengths(
    name="longalign_long_tail", body=LONGALIGN_SFT, tail_min=4 * 65536, tail_max=8 * 65536, tail_fraction=0.015,
    source="LONGALIGN_SFT with 1.5% of sequences 4-8x a 64K token cap (256K-512K): assumed, the case context "
           "parallelism serves (long documents or agent trajectories beyond one device's memory)")

#: Mixtures with a long tail, for the context-parallel what-ifs (jodc.sim.context_parallel).
LONG_TAIL_DISTRIBUTIONS = {d.name: d for d in (LONGALIGN_LONG_TAIL,)}


def get_length_distribution(name: str) -> LengthDistribution | LongTailLengths:
    """A preset by name: ``longalign_sft``, ``agent_trajectories``, ``rl_responses`` or ``longalign_long_tail``."""
    presets = {**LENGTH_DISTRIBUTIONS, **LONG_TAIL_DISTRIBUTIONS}
    if name not in presets:
        raise ValueError(f"unknown length distribution {name!r}; choose one of {', '.join(presets)}")
    return presets[name]
