"""Planning for engines that run each microbatch at a padded length (length buckets).

With length buckets (``jodc.fsdp`` engines' ``length_buckets``) a microbatch runs at the smallest bucket that holds
its tokens. Segment-aware attention still costs per sequence, but the token-linear work (projections, MLP, head)
runs over the padded length. A device's cost then depends on how its share packs, not only on which sequences it
holds: 1030 tokens need a 1024 and a 256 microbatch, 990 tokens one of 1024; 600 tokens cost a 1024 microbatch in
one piece, 768 tokens' worth in two (256 + 512). Balancing sequence costs alone cannot see this, and measured on the
end-to-end benchmark, LB-Mini plans balanced that way lost up to 10% to LB-Micro's in compute time.

:class:`PaddedMicrobatchCost` prices a packed microbatch at its run length; :func:`rebalance_for_buckets` moves and
swaps sequences between devices (each device repacked on its own, as LB-Mini does) until the costliest device
cannot be made cheaper by one move or swap.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from jodc.balance.cost import CostModel, FlopsCost, LinearCost, QuadraticCost, sequence_costs
from jodc.balance.packing import pack_microbatches
from jodc.balance.validation import positive_int


def run_lengths(length_buckets, token_cap: int) -> tuple[int, ...]:
    """The lengths a microbatch may run at: the buckets below ``token_cap`` (ascending, deduplicated), then
    ``token_cap`` itself (the engines' rule)."""
    cap = positive_int(token_cap, "token_cap")
    buckets = [] if length_buckets is None else list(length_buckets)
    for b in buckets:
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b <= 0:
            raise ValueError(f"length buckets must be positive integers, got {list(buckets)!r}")
    return tuple(sorted({int(b) for b in buckets if b < cap})) + (cap,)


def padding_rate(cost_model: CostModel) -> float:
    """Cost of one padding token: the token-linear part of ``cost_model`` per token (a padding token goes through
    every projection but attends to nothing)."""
    if isinstance(cost_model, LinearCost):
        return 1.0
    if isinstance(cost_model, FlopsCost):
        cost_model = cost_model.as_quadratic()
    if isinstance(cost_model, QuadraticCost):
        return cost_model.b / cost_model.scale
    raise ValueError(f"no padding rate known for cost model {cost_model!r}: pass padding_rate= explicitly "
                     "(the cost of one token of the model's linear layers, in the cost model's units)")


@dataclasses.dataclass(frozen=True)
class PaddedMicrobatchCost:
    """Cost of a packed microbatch run at the smallest of ``lengths`` that holds it: its sequences' costs plus
    ``rate`` per padding token up to that length, plus ``overhead`` for being a microbatch at all. Without buckets
    and overhead (run length = token count) it is the plain sum of sequence costs the planners balance."""

    sequence_cost: CostModel
    lengths: tuple[int, ...]  # ascending run lengths; the last is the token cap
    rate: float
    overhead: float = 0.0  # per non-empty microbatch: work it brings whatever it holds (per-layer gathers, pushes)

    @classmethod
    def for_buckets(cls, sequence_cost: CostModel, length_buckets, token_cap: int, *,
                    rate: float | None = None, overhead: float = 0.0) -> "PaddedMicrobatchCost":
        """The cost of microbatches under an engine with these ``length_buckets`` and ``token_cap``; ``overhead``
        is what one more microbatch costs beyond its tokens, in the cost model's units."""
        rate = padding_rate(sequence_cost) if rate is None else rate
        for name, value in (("padding rate", rate), ("microbatch overhead", overhead)):
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                    and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        return cls(sequence_cost, run_lengths(length_buckets, token_cap), float(rate), float(overhead))

    def run_length(self, tokens: int) -> int:
        """The length a microbatch of ``tokens`` tokens runs at (0 for an empty one, which is skipped)."""
        if tokens <= 0:
            return 0
        i = int(np.searchsorted(self.lengths, tokens, side="left"))
        if i == len(self.lengths):
            raise ValueError(f"a microbatch of {tokens} tokens exceeds the token cap {self.lengths[-1]}")
        return self.lengths[i]

    def __call__(self, microbatch_lengths) -> float:
        lengths = np.asarray(microbatch_lengths, dtype=np.int64).reshape(-1)
        tokens = int(lengths.sum())
        if tokens == 0:
            return 0.0
        padding = self.run_length(tokens) - tokens
        return math.fsum(sequence_costs(self.sequence_cost, lengths)) + self.rate * padding + self.overhead


def pack_device(lengths: np.ndarray, costs: np.ndarray, token_cap: int,
                microbatch_cost: PaddedMicrobatchCost) -> tuple[list[list[int]], float]:
    """Pack one device's share for the least cost: longest sequence first, each into the microbatch whose run
    length grows least, or into a new one when that (its padding plus the microbatch overhead) is cheaper. Cost
    balance between a device's own
    microbatches does not matter to ODC (they run one after another), their padding does. Returns the packing
    (positions into ``lengths``, costliest microbatch first) and its cost."""
    n = int(lengths.size)
    if n == 0:
        return [], 0.0
    run = microbatch_cost.run_length
    parts: list[list[int]] = []
    tokens: list[int] = []
    for i in sorted(range(n), key=lambda k: (-int(lengths[k]), k)):
        s = int(lengths[i])
        if s > token_cap:
            raise ValueError(f"a sequence of {s} tokens exceeds the token cap {token_cap}")
        best = None
        for b, t in enumerate(tokens):
            if t + s <= token_cap:
                growth = run(t + s) - run(t)
                if best is None or growth < best[0]:
                    best = (growth, b)
        # joining pays the growth of the run length; a new microbatch its own padding and the overhead
        if best is None or microbatch_cost.rate * best[0] > (microbatch_cost.rate * run(s)
                                                              + microbatch_cost.overhead):
            parts.append([i])
            tokens.append(s)
        else:
            parts[best[1]].append(i)
            tokens[best[1]] += s
    part_costs = [microbatch_cost(lengths[part]) for part in parts]
    order = sorted(range(len(parts)), key=lambda b: (-part_costs[b], min(parts[b])))
    return [sorted(parts[b]) for b in order], math.fsum(part_costs)


def rebalance_for_buckets(lengths: np.ndarray, costs: np.ndarray, shares: list[list[int]], token_cap: int,
                          microbatch_cost: PaddedMicrobatchCost, *, max_evaluations: int = 2_000,
                          ) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Improve a partition (``shares``: global sequence indices per device) for padded microbatch costs.

    Repeatedly takes the costliest device and looks, device by device from the cheapest, for the first move of one
    of its sequences, or swap with one of the other device's, after which both devices (each repacked) cost less than
    it did; stops when none exists or after ``max_evaluations`` repackings. Deterministic. Returns the new shares and
    each device's packing (positions into its share)."""
    shares = [list(s) for s in shares]
    cache: dict[tuple[int, ...], tuple[list[list[int]], float]] = {}

    def evaluate(share):  # packings are positions into the share as given, so key on its exact order
        key = tuple(share)
        if key not in cache:
            cache[key] = pack_device(lengths[share], costs[share], token_cap, microbatch_cost)
        return cache[key]

    def start(share):  # the plain LB-Mini packing competes too, so rebalancing never ends worse than it
        greedy = evaluate(share)
        if not share:
            return greedy
        plain = pack_microbatches(lengths[share], costs[share], token_cap, search_nodes=0)  # as lb_mini packs
        plain_cost = math.fsum(microbatch_cost(lengths[share][part]) for part in plain)
        return (plain, plain_cost) if plain_cost < greedy[1] else greedy

    packed = [start(s) for s in shares]
    evaluations = len(shares)
    while evaluations < max_evaluations and len(shares) > 1:
        device_costs = [p[1] for p in packed]
        worst = int(np.argmax(device_costs))
        target = device_costs[worst]
        tolerance = 1e-9 * max(target, 1.0)
        improved = False
        heavy = sorted(shares[worst], key=lambda i: (-costs[i], i))
        for other in sorted((d for d in range(len(shares)) if d != worst), key=lambda d: (device_costs[d], d)):
            candidates = [(i, None) for i in heavy]
            candidates += [(i, j) for i in heavy for j in sorted(shares[other], key=lambda j: (costs[j], j))
                           if costs[j] < costs[i] or lengths[j] != lengths[i]]
            other_sum = math.fsum(costs[shares[other]])
            worst_sum = math.fsum(costs[shares[worst]])
            for i, j in candidates:
                moved_in = costs[j] if j is not None else 0.0
                # padding only adds cost: a side whose sequence costs alone reach the target cannot help
                if (other_sum + costs[i] - moved_in >= target - tolerance
                        or worst_sum - costs[i] + moved_in >= target - tolerance):
                    continue
                new_worst = [k for k in shares[worst] if k != i] + ([j] if j is not None else [])
                new_other = [k for k in shares[other] if k != j] + [i]
                a, b = evaluate(new_worst), evaluate(new_other)
                evaluations += 2
                if max(a[1], b[1]) < target - tolerance:
                    shares[worst], shares[other] = new_worst, new_other
                    packed[worst], packed[other] = a, b
                    improved = True
                    break
                if evaluations >= max_evaluations:
                    break
            if improved or evaluations >= max_evaluations:
                break
        if not improved:
            break
    return shares, [p[0] for p in packed]
