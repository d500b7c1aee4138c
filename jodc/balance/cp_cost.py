"""Step time of sequences and of context-parallel (CP) pieces, in seconds, for the CP planners and the simulator.

One small model serves both: the planners balance with it, :mod:`jodc.sim.context_parallel` predicts a step with it.
Every quantity is a per-device rate, so a cluster is described by what one device measures (or what a datasheet
says) and nothing else:

* ``seconds_per_token`` -- linear work of one token through the whole model, forward and backward (projections,
  MLP, LM head);
* ``seconds_per_pair`` -- attention work of one causal (query, key) pair through the whole model, forward and
  backward. A sequence of ``s`` tokens has ``s (s + 1) / 2`` pairs; a zigzag piece has the pairs of its queries
  (:mod:`jodc.balance.zigzag`: each of ``k`` members gets about ``1/k`` of them);
* ``exchange_bytes_per_token`` -- bytes one token's K/V moves in one layer's exchanges, all passes together: the
  forward all-gather of K and V, the backward's re-gather (the layer recomputes its forward) and the reduce-scatter
  of dK / dV (fp32, the accumulation dtype). A member receives (sends) ``(k - 1) / k`` of the group's bytes;
* ``exchanges_per_layer`` -- how many of those exchanges a layer does (3: gather, re-gather, reduce-scatter), each
  paying ``link_latency`` plus the group's synchronisation ``layer_sync_seconds``: members wait for the slowest
  member at every exchange, so a CP microbatch lasts as long as its slowest member plus the exchanges;
* ``microbatch_seconds`` -- the fixed cost of running a microbatch at all (the parameter gathers and gradient
  scatters of FSDP: every microbatch gathers every layer once forward, once backward, and scatters its gradient);
* ``link_bandwidth``, ``link_latency`` -- one device's link, bytes/s each way and seconds per transfer;
* ``devices_per_node``, ``inter_node_bandwidth``, ``inter_node_latency`` -- a group whose members span nodes
  (device ``d`` is on node ``d // devices_per_node``) exchanges at the cross-node link's rate instead.

:meth:`ContextParallelCost.from_shape` derives the rates from a :class:`ModelShape` and a device's achieved FLOP/s
(FLOP formulas in :mod:`jodc.balance.model_shape`); its defaults are an A100 SXM 80GB inside an NVSwitch node, the
numbers and sources of :mod:`jodc.sim.hardware` (repeated here so that ``jodc.balance`` needs nothing from
``jodc.sim``). The model is also a :class:`~jodc.balance.cost.CostModel`: called on lengths it gives each
sequence's one-device seconds, so the existing LB-Mini machinery balances short sequences in the same unit.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Sequence

import numpy as np

from jodc.balance.model_shape import ModelShape
from jodc.balance.validation import positive_int, sequence_lengths
from jodc.balance.zigzag import zigzag_layout

#: A100 dense BF16 peak (datasheet) x 0.45 achieved (model FLOPs utilisation of long-sequence training); see
#: jodc/sim/hardware.py for the reasoning.
A100_ACHIEVED_FLOPS = 312e12 * 0.45
#: NVLink 3 through NVSwitch: 600 GB/s per GPU both ways together, 300 GB/s each way (jodc/sim/hardware.py).
NVLINK3_BANDWIDTH = 300e9
#: Small-message latency inside an NVSwitch node: an order of magnitude, not a measurement (jodc/sim/hardware.py).
NVSWITCH_LATENCY = 10e-6
#: Backward FLOPs as a multiple of the forward's: 2 for the gradients + 1 for the per-layer recomputation, so a
#: step costs (1 + 3) x the forward (jodc.sim.step_model.StepConfig.backward_multiplier with recompute).
FORWARD_AND_BACKWARD = 4.0
#: Bytes per K/V element in the forward exchanges (the compute dtype, bf16) and in the dK / dV reduce-scatter
#: (fp32: DESIGN.md section 4, accumulation is fp32).
KV_BYTES, KV_GRAD_BYTES = 2, 4
#: Bytes per parameter of one microbatch's FSDP traffic: gather fp32 masters forward and again backward, scatter an
#: fp32 gradient (the ODC reference implementation's dtypes; jodc.sim.step_model.StepConfig).
PARAM_BYTES_PER_MICROBATCH = 4 + 4 + 4
#: One 400 Gb/s port per GPU across nodes, 50 GB/s each way, 20 us per transfer: jodc.sim.hsdp.A100_NODES_400G.
INTER_NODE_BANDWIDTH, INTER_NODE_LATENCY = 50e9, 20e-6


def _non_negative(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 <= value < math.inf):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def causal_pairs(lengths) -> np.ndarray:
    """Causal (query, key) pairs of sequences of ``lengths`` tokens: ``s (s + 1) / 2`` each, float64."""
    s = np.asarray(lengths, dtype=np.float64)
    return s * (s + 1.0) / 2.0


def piece_pairs(length: int, group_size: int) -> np.ndarray:
    """float64 ``[k]``: the causal pairs of each member's zigzag piece of a sequence of ``length`` tokens.

    A query at global position ``p`` attends to ``p + 1`` keys; member ``i`` holds chunks ``i`` and ``2k - 1 - i``
    (real tokens only: end padding attends to nothing). Sums to ``causal_pairs(length)``.
    """
    layout = zigzag_layout(length, group_size)
    c, k = layout.chunk, layout.group_size

    def chunk_pairs(j: np.ndarray) -> np.ndarray:  # sum of (p + 1) over p in [j c, min((j + 1) c, L))
        lo = np.minimum(j * c, length).astype(np.float64)
        hi = np.minimum((j + 1) * c, length).astype(np.float64)
        return (hi * (hi + 1.0) - lo * (lo + 1.0)) / 2.0

    members = np.arange(k)
    return chunk_pairs(members) + chunk_pairs(2 * k - 1 - members)


@dataclasses.dataclass(frozen=True)
class ContextParallelCost:
    """Seconds of sequences, CP pieces and their exchanges on one device (see the module docstring).

    Attributes:
      num_layers: decoder layers (each does the K/V exchanges once per pass).
      seconds_per_token, seconds_per_pair: linear and attention work, forward + backward, whole model.
      exchange_bytes_per_token: one layer's K/V exchange bytes per token of the split sequence, all passes.
      exchanges_per_layer: exchanges (synchronisation points of the group) per layer.
      link_bandwidth: bytes/s one device sends (and receives) to its peers.
      link_latency: seconds per transfer.
      layer_sync_seconds: extra seconds per exchange for the members to meet (a group barrier), beyond latency.
      microbatch_seconds: fixed seconds of any microbatch (FSDP parameter traffic).
      devices_per_node: devices that share ``link_bandwidth``; 0: one node, every group exchanges at that rate.
      inter_node_bandwidth, inter_node_latency: the link of a group that spans nodes (bytes/s, seconds).
    """

    num_layers: int
    seconds_per_token: float
    seconds_per_pair: float
    exchange_bytes_per_token: float
    exchanges_per_layer: int = 3
    link_bandwidth: float = NVLINK3_BANDWIDTH
    link_latency: float = NVSWITCH_LATENCY
    layer_sync_seconds: float = 0.0
    microbatch_seconds: float = 0.0
    devices_per_node: int = 0
    inter_node_bandwidth: float = INTER_NODE_BANDWIDTH
    inter_node_latency: float = INTER_NODE_LATENCY
    name: str = dataclasses.field(default="context_parallel", init=False)

    def __post_init__(self):
        positive_int(self.num_layers, "num_layers")
        positive_int(self.exchanges_per_layer, "exchanges_per_layer")
        for field in ("seconds_per_token", "seconds_per_pair", "exchange_bytes_per_token", "link_latency",
                      "layer_sync_seconds", "microbatch_seconds", "inter_node_latency"):
            _non_negative(getattr(self, field), f"ContextParallelCost.{field}")
        if isinstance(self.devices_per_node, bool) or not isinstance(self.devices_per_node, int) or \
                self.devices_per_node < 0:
            raise ValueError(f"devices_per_node must be an integer >= 0 (0: one node), got {self.devices_per_node!r}")
        if self.seconds_per_token == 0 and self.seconds_per_pair == 0:
            raise ValueError("ContextParallelCost needs seconds_per_token > 0 or seconds_per_pair > 0")
        for field in ("link_bandwidth", "inter_node_bandwidth"):
            bandwidth = getattr(self, field)
            if isinstance(bandwidth, bool) or not isinstance(bandwidth, numbers.Real) or not bandwidth > 0:
                raise ValueError(f"ContextParallelCost.{field} must be > 0 (inf allowed), got {bandwidth!r}")

    @classmethod
    def from_shape(cls, shape: ModelShape, *, flops_per_second: float = A100_ACHIEVED_FLOPS,
                   link_bandwidth: float = NVLINK3_BANDWIDTH, link_latency: float = NVSWITCH_LATENCY,
                   layer_sync_seconds: float = 0.0, with_parameter_traffic: bool = True, devices_per_node: int = 0,
                   inter_node_bandwidth: float = INTER_NODE_BANDWIDTH,
                   inter_node_latency: float = INTER_NODE_LATENCY) -> "ContextParallelCost":
        """The rates of ``shape`` on a device reaching ``flops_per_second`` (defaults: A100 in an NVSwitch node).

        Per token: ``4 x (2 x matmul params per layer x layers + 2 x vocab x hidden)`` FLOPs; per causal pair:
        ``4 x 4 x width x layers`` (the forward's ``2 width s (s + 1)`` per layer is ``4 width`` per pair); times
        forward + backward (``FORWARD_AND_BACKWARD``). K/V bytes per token and layer:
        ``2 x kv_heads x head_dim x (2 x KV_BYTES + KV_GRAD_BYTES)`` (K and V; gather, re-gather, reduce-scatter).
        """
        rate = float(flops_per_second)
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"flops_per_second must be a finite number > 0, got {flops_per_second!r}")
        per_token = 2.0 * shape.layer_matmul_params * shape.num_layers + 2.0 * shape.vocab * shape.hidden
        per_pair = 4.0 * shape.attention_width * shape.num_layers
        kv_width = 2 * shape.num_kv_heads * shape.head_dim
        params = shape.total_params * PARAM_BYTES_PER_MICROBATCH / link_bandwidth if with_parameter_traffic else 0.0
        return cls(num_layers=shape.num_layers, seconds_per_token=FORWARD_AND_BACKWARD * per_token / rate,
                   seconds_per_pair=FORWARD_AND_BACKWARD * per_pair / rate,
                   exchange_bytes_per_token=float(kv_width * (2 * KV_BYTES + KV_GRAD_BYTES)),
                   link_bandwidth=link_bandwidth, link_latency=link_latency, layer_sync_seconds=layer_sync_seconds,
                   microbatch_seconds=float(params), devices_per_node=devices_per_node,
                   inter_node_bandwidth=inter_node_bandwidth, inter_node_latency=inter_node_latency)

    # ---- one device, whole sequences (the CostModel interface) ------------------------------------------------

    def __call__(self, lengths) -> np.ndarray:
        """Seconds of each whole sequence on one device (no microbatch overhead): the CostModel interface."""
        s = sequence_lengths(lengths, allow_empty=True).astype(np.float64)
        return self.seconds_per_token * s + self.seconds_per_pair * causal_pairs(s)

    def microbatch_time(self, lengths: Sequence[int]) -> float:
        """Seconds of one data-parallel microbatch packing ``lengths`` (0 for an empty one: it is not run)."""
        if len(lengths) == 0:
            return 0.0
        return self.microbatch_seconds + math.fsum(self(np.asarray(lengths)))

    # ---- a context-parallel group ------------------------------------------------------------------------------

    def member_compute(self, split_lengths: Sequence[int], group_size: int) -> np.ndarray:
        """float64 ``[k]``: each member's compute seconds for its zigzag pieces of the split sequences.

        Linear work counts the piece's columns (padding included: it runs through the layers); attention counts
        the real pairs of the member's queries against the whole sequence's keys.
        """
        k = positive_int(group_size, "group_size")
        out = np.zeros(k)
        for length in split_lengths:
            layout = zigzag_layout(int(length), k)
            out += self.seconds_per_token * layout.piece_length + self.seconds_per_pair * piece_pairs(length, k)
        return out

    def spans_nodes(self, members) -> bool:
        """Whether a group with these members (device ids; an int ``k``: devices ``0 .. k-1``) crosses nodes."""
        devices = range(members) if isinstance(members, (int, np.integer)) else members
        return self.devices_per_node > 0 and len({d // self.devices_per_node for d in devices}) > 1

    def exchange_time(self, split_lengths: Sequence[int], members) -> float:
        """Seconds of the K/V exchanges of one CP microbatch (all layers, all passes) for a group of ``members``
        (device ids, or a size ``k`` for devices ``0 .. k-1``).

        Per exchange: ``latency + layer_sync_seconds + (k - 1) / k x bytes / bandwidth`` with bytes the group's
        padded tokens x ``exchange_bytes_per_token / exchanges_per_layer``, at the in-node link's bandwidth and
        latency, or the cross-node link's when the group spans nodes. 0 for a group of one.
        """
        k = _group_size(members)
        if k == 1 or not len(split_lengths):
            return 0.0
        across = self.spans_nodes(members)
        bandwidth = self.inter_node_bandwidth if across else self.link_bandwidth
        latency = self.inter_node_latency if across else self.link_latency
        tokens = sum(zigzag_layout(int(s), k).padded_length for s in split_lengths)
        per_exchange_bytes = tokens * self.exchange_bytes_per_token / self.exchanges_per_layer
        one = latency + self.layer_sync_seconds + (k - 1) / k * per_exchange_bytes / bandwidth
        return self.num_layers * self.exchanges_per_layer * one

    def group_time(self, split_lengths: Sequence[int], members,
                   short_lengths: Sequence[Sequence[int]] | None = None) -> float:
        """Seconds of one CP microbatch: the slowest member's compute (its pieces plus the short sequences packed
        beside them, ``short_lengths[i]`` for member ``i``), the exchanges, and the microbatch's fixed cost. Members
        meet at every exchange, so every member's row lasts this long."""
        compute = self.member_compute(split_lengths, _group_size(members))
        if short_lengths is not None:
            compute = compute + np.array([math.fsum(self(np.asarray(s, dtype=np.int64))) for s in short_lengths])
        return self.microbatch_seconds + float(compute.max()) + self.exchange_time(split_lengths, members)


def _group_size(members) -> int:
    """k from a group's members (device ids) or its size."""
    if isinstance(members, (int, np.integer)) and not isinstance(members, bool):
        return positive_int(int(members), "group_size")
    members = tuple(members)
    if not members:
        raise ValueError("a group needs at least one member")
    return len(members)
