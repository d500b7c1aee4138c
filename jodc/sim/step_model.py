"""Per-bucket compute and communication times of one training step, the raw material of both schedules.

A step runs every microbatch through the model's buckets (DESIGN.md: embedding, one bucket per decoder layer,
final norm + LM head) forward in order, then backward in reverse. For every bucket visit:

* forward: gather the bucket's full parameters, then compute the bucket's forward on the microbatch;
* backward: gather again (parameters are not kept between forward and backward: that is what makes it FSDP),
  recompute the forward from the saved input (``recompute=True``, the design's ``custom_vjp``), run the backward
  (about twice the forward's FLOPs), and scatter the gradient slices to their owners.

Compute time = FLOPs / achieved FLOP/s (FLOP formulas in :mod:`jodc.balance.model_shape`; the embedding lookup
counts as free). Communication time of moving a bucket of ``B`` bytes among ``D`` devices, each device sending or
receiving ``(D - 1) / D`` of it: ``latency + (D - 1) / D * B / bandwidth`` for both an all-gather / reduce-scatter
(collective) and ODC's point-to-point pulls / pushes (at ``p2p_efficiency`` of the bandwidth); zero when ``D = 1``.
Communication is not overlapped with compute here, a conservative choice that both schedules share.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jodc.balance.model_shape import ModelShape
from jodc.balance.plan import Plan
from jodc.balance.validation import positive_int
from jodc.sim.hardware import HardwareSpec


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What a training step moves and recomputes.

    Attributes:
      gather_bytes_per_param: bytes per parameter that a gather moves. 4: the ODC reference implementation
        gathers fp32 master shards and casts after the transfer.
      grad_bytes_per_param: bytes per parameter that a gradient scatter moves. 4: accumulation is fp32.
      recompute: whether the backward recomputes each bucket's forward (activation checkpointing per layer).
    """

    gather_bytes_per_param: int = 4
    grad_bytes_per_param: int = 4
    recompute: bool = True

    def __post_init__(self):
        positive_int(self.gather_bytes_per_param, "gather_bytes_per_param")
        positive_int(self.grad_bytes_per_param, "grad_bytes_per_param")
        if not isinstance(self.recompute, bool):
            raise ValueError(f"recompute must be a bool, got {self.recompute!r}")

    @property
    def backward_multiplier(self) -> float:
        """Backward-pass FLOPs as a multiple of the forward's: 2 (gradients), plus 1 when recomputing."""
        return 3.0 if self.recompute else 2.0


@dataclasses.dataclass(frozen=True)
class BucketSteps:
    """The ordered bucket visits of one microbatch (forward, then backward in reverse), as parallel arrays.

    Compute of visit ``l`` on a microbatch = ``tokens * flops_per_token[l] + pair_sum * flops_per_pair[l]``
    where ``pair_sum = sum_i s_i * (s_i + 1)`` over its sequences.
    """

    names: tuple[str, ...]
    flops_per_token: np.ndarray
    flops_per_pair: np.ndarray
    gather_bytes: np.ndarray
    scatter_bytes: np.ndarray


def bucket_steps(shape: ModelShape, config: StepConfig) -> BucketSteps:
    """The forward and backward bucket visits of ``shape`` under ``config``."""
    names = ["embedding"] + [f"layer{i}" for i in range(shape.num_layers)] + ["head"]
    params = np.array([shape.embedding_params] + [shape.layer_params] * shape.num_layers + [shape.head_params],
                      dtype=np.float64)
    per_token = np.array(
        [0.0] + [2.0 * shape.layer_matmul_params] * shape.num_layers + [2.0 * shape.vocab * shape.hidden]
    )
    per_pair = np.array([0.0] + [2.0 * shape.attention_width] * shape.num_layers + [0.0])
    back = config.backward_multiplier
    return BucketSteps(
        names=tuple(f"fwd:{n}" for n in names) + tuple(f"bwd:{n}" for n in reversed(names)),
        flops_per_token=np.concatenate([per_token, back * per_token[::-1]]),
        flops_per_pair=np.concatenate([per_pair, back * per_pair[::-1]]),
        gather_bytes=np.concatenate([params, params[::-1]]) * config.gather_bytes_per_param,
        scatter_bytes=np.concatenate([np.zeros_like(params), params[::-1]]) * config.grad_bytes_per_param,
    )


def transfer_time(num_bytes: np.ndarray, num_devices: int, bandwidth: float, latency: float) -> np.ndarray:
    """Seconds to gather or scatter buckets of ``num_bytes`` among ``num_devices`` (0 where nothing moves)."""
    num_bytes = np.asarray(num_bytes, dtype=np.float64)
    if num_devices == 1:
        return np.zeros_like(num_bytes)
    moved = (num_devices - 1) / num_devices * num_bytes / bandwidth
    return np.where(num_bytes > 0, latency + moved, 0.0)


def communication_times(steps: BucketSteps, num_devices: int, hardware: HardwareSpec, *, p2p: bool) -> np.ndarray:
    """Seconds of communication per bucket visit: gather plus (in the backward) gradient scatter."""
    bandwidth = hardware.link_bandwidth * (hardware.p2p_efficiency if p2p else 1.0)
    gather = transfer_time(steps.gather_bytes, num_devices, bandwidth, hardware.link_latency)
    scatter = transfer_time(steps.scatter_bytes, num_devices, bandwidth, hardware.link_latency)
    return gather + scatter


def microbatch_shapes(plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens, pair_sums, nonempty)`` per (device, microbatch slot), each ``[D, max count]``; 0 / False where a
    device has no microbatch in that slot."""
    most = max(plan.microbatch_counts(), default=0)
    tokens = np.zeros((plan.num_devices, most))
    pair_sums = np.zeros((plan.num_devices, most))
    nonempty = np.zeros((plan.num_devices, most), dtype=bool)
    for d, device in enumerate(plan.devices):
        for m, mb in enumerate(device):
            s = np.asarray(mb.seq_lengths, dtype=np.float64)
            tokens[d, m] = s.sum()
            pair_sums[d, m] = (s * (s + 1.0)).sum()
            nonempty[d, m] = not mb.is_empty
    return tokens, pair_sums, nonempty


def compute_times(plan: Plan, shape: ModelShape, hardware: HardwareSpec, config: StepConfig) -> np.ndarray:
    """Seconds of compute per (device, microbatch slot, bucket visit): ``[D, max count, visits]``."""
    steps = bucket_steps(shape, config)
    tokens, pair_sums, _ = microbatch_shapes(plan)
    flops = tokens[..., None] * steps.flops_per_token + pair_sums[..., None] * steps.flops_per_pair
    return flops / hardware.achieved_flops
