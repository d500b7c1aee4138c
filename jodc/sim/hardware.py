"""Hardware descriptions for the schedule simulator: compute rate, link bandwidth and latency of one device.

Sources of the preset's numbers:

* ``peak_flops = 312e12``: NVIDIA A100 dense BF16 tensor-core peak (A100 datasheet; 624 TFLOP/s is the
  2:4-sparse figure, not used here).
* ``achieved_fraction = 0.45``: the share of peak that long-sequence training reaches (model FLOPs
  utilisation). Well-tuned dense training on A100 typically reports 40-55%; a 1.5B model has small matmuls, so
  we take the middle of the lower half. It scales every compute time alike, so it moves step times but barely
  the ODC / collective ratio (only through the compute : communication balance).
* ``link_bandwidth = 300e9`` bytes/s per direction: third-generation NVLink through NVSwitch on A100 SXM
  gives 600 GB/s per GPU in both directions together, i.e. 300 GB/s each way.
* ``link_latency = 10e-6`` s per collective or point-to-point transfer: the order of magnitude of
  small-message latency inside an NVSwitch node (nccl-tests report a few to a few tens of microseconds). It is
  a round number, not a measurement; it matters only for tiny buckets.
* ``p2p_efficiency = 1.0``: the ODC paper reports its one-sided gather / scatter primitives reach about NCCL's
  bandwidth inside a node; across nodes they are clearly slower, so lower this for multi-node what-ifs.
"""
from __future__ import annotations

import dataclasses
import math
import numbers


def _positive(value, name: str, *, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value) or value <= 0 or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be > 0{' (inf allowed)' if allow_inf else ' and finite'}, got {value}")
    return value


def _fraction(value, name: str) -> float:
    """`value` as a float in (0, 1]; ValueError naming `name` otherwise."""
    value = _positive(value, name)
    if value > 1:
        raise ValueError(f"{name} must be at most 1, got {value}")
    return value


def _latency(value, name: str) -> float:
    """`value` as a finite float >= 0 (seconds); ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 <= value < math.inf):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    """One accelerator and its links, as the simulator sees them.

    Attributes:
      name: a label for reports.
      peak_flops: dense peak FLOP/s of one device at the compute dtype.
      achieved_fraction: the fraction of peak that training kernels reach (0 < f <= 1).
      link_bandwidth: bytes/s one device can send (and, at the same time, receive) to its peers; ``inf`` for
        free communication.
      link_latency: seconds of fixed cost per collective or point-to-point transfer (>= 0).
      p2p_efficiency: the fraction of ``link_bandwidth`` that ODC's point-to-point gathers and scatters reach,
        relative to collectives (0 < e <= 1).
    """

    name: str
    peak_flops: float
    achieved_fraction: float
    link_bandwidth: float
    link_latency: float
    p2p_efficiency: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "peak_flops", _positive(self.peak_flops, "peak_flops"))
        object.__setattr__(self, "achieved_fraction", _fraction(self.achieved_fraction, "achieved_fraction"))
        object.__setattr__(self, "link_bandwidth", _positive(self.link_bandwidth, "link_bandwidth", allow_inf=True))
        object.__setattr__(self, "link_latency", _latency(self.link_latency, "link_latency"))
        object.__setattr__(self, "p2p_efficiency", _fraction(self.p2p_efficiency, "p2p_efficiency"))

    @property
    def achieved_flops(self) -> float:
        """FLOP/s that training actually gets: ``peak_flops * achieved_fraction``."""
        return self.peak_flops * self.achieved_fraction

    def with_free_communication(self) -> "HardwareSpec":
        """The same device with infinite bandwidth and zero latency (isolates the effect of scheduling)."""
        return dataclasses.replace(self, name=f"{self.name} (free comm)", link_bandwidth=math.inf, link_latency=0.0)


A100_SXM_80GB = HardwareSpec(
    name="A100-SXM-80GB",
    peak_flops=312e12,
    achieved_fraction=0.45,
    link_bandwidth=300e9,
    link_latency=10e-6,
    p2p_efficiency=1.0,
)
