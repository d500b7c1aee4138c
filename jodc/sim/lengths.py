"""Synthetic sequence-length generators shaped like published post-training data.

Every generator is a log-normal distribution restricted to ``[min_len, max_len]`` whose location is solved so
that the restricted distribution has the published (or assumed) mean exactly; ``sigma`` sets the tail. Two ways
to restrict it:

* ``truncate`` -- lengths outside the range are redrawn (a data set filtered by length);
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
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import numpy as np

from jodc.balance.validation import positive_int

TAILS = ("truncate", "clip")


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


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
        if self.sigma <= 0:
            raise ValueError(f"sigma must be > 0, got {self.sigma}")
        if self.tail not in TAILS:
            raise ValueError(f"tail must be one of {TAILS}, got {self.tail!r}")

    def mean_for(self, mu: float) -> float:
        """The restricted distribution's mean when the log-length has location ``mu``."""
        s = self.sigma
        a, b = math.log(self.min_len), math.log(self.max_len)
        partial = math.exp(mu + s * s / 2) * (_normal_cdf((b - mu - s * s) / s) - _normal_cdf((a - mu - s * s) / s))
        below, above = _normal_cdf((a - mu) / s), 1.0 - _normal_cdf((b - mu) / s)
        if self.tail == "clip":
            return self.min_len * below + partial + self.max_len * above
        inside = 1.0 - below - above
        return partial / inside if inside > 0 else (self.min_len if mu < a else self.max_len)

    @functools.cached_property
    def mu(self) -> float:
        """The log-location that gives the target mean (bisection; the mean grows with ``mu``)."""
        low = math.log(self.min_len) - 10 * self.sigma
        high = math.log(self.max_len) + 10 * self.sigma
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
        kept = np.zeros(0)
        while kept.size < n:
            raw = np.exp(rng.normal(self.mu, self.sigma, max(2 * (n - kept.size), 64)))
            kept = np.concatenate([kept, raw[(raw >= self.min_len) & (raw <= self.max_len)]])
        return np.clip(np.rint(kept[:n]), self.min_len, self.max_len).astype(np.int64)


LONGALIGN_SFT = LengthDistribution(
    name="longalign_sft",
    min_len=8192,
    max_len=65536,
    mean=16500.0,
    sigma=0.8,
    tail="truncate",
    source="LongAlign-10k: 8K-64K tokens (dataset card); mean ~16.5K (ODC paper); sigma assumed",
)

AGENT_TRAJECTORIES = LengthDistribution(
    name="agent_trajectories",
    min_len=2048,
    max_len=131072,
    mean=34700.0,
    sigma=0.8,
    tail="truncate",
    source="SWE-Smith-like trajectories: mean ~34.7K (ODC paper); range (2K-128K) and sigma assumed",
)

RL_RESPONSES = LengthDistribution(
    name="rl_responses",
    min_len=256,
    max_len=16384,
    mean=4096.0,
    sigma=0.8,
    tail="clip",
    source="RL rollouts (prompt + response) capped at 16K: all constants assumed",
)

LENGTH_DISTRIBUTIONS = {d.name: d for d in (LONGALIGN_SFT, AGENT_TRAJECTORIES, RL_RESPONSES)}


def get_length_distribution(name: str) -> LengthDistribution:
    """A preset by name: ``longalign_sft``, ``agent_trajectories`` or ``rl_responses``."""
    if name not in LENGTH_DISTRIBUTIONS:
        raise ValueError(f"unknown length distribution {name!r}; choose one of {', '.join(LENGTH_DISTRIBUTIONS)}")
    return LENGTH_DISTRIBUTIONS[name]
