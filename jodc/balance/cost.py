"""Cost models: how much compute one sequence of ``s`` tokens costs, in arbitrary but consistent units.

The planners only compare and add costs, so a model needs to be proportional to the real time, not equal to it.
A packed microbatch costs the sum of its sequences' costs (segment-aware attention, DESIGN.md section 5).

* ``linear`` -- ``c = s``: token count. Right when linear layers dominate (short sequences, big models).
* ``quadratic`` -- ``c = a * x^2 + b * x`` with ``x = s / scale``: attention grows with ``s^2``. The coefficients
  can be given, fitted to measured step times with :meth:`QuadraticCost.fit`, or taken from the ODC paper's fit for
  a 7B model (:meth:`QuadraticCost.paper_7b`: ``a = 4.348357``, ``b = 8.768377``, ``scale = 32000``).
* ``flops`` -- forward FLOPs of the whole model on the sequence, from a :class:`ModelShape` (linear layers ~ 2 x
  matmul parameters per token, causal attention ~ ``2 * width * s * (s + 1)`` per layer). This is a quadratic with
  coefficients fixed by the shape; :meth:`FlopsCost.as_quadratic` gives them.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Protocol, runtime_checkable

import numpy as np

from jodc.balance.model_shape import ModelShape
from jodc.balance.validation import costs_array, sequence_lengths


@runtime_checkable
class CostModel(Protocol):
    """Anything with a ``name`` that maps an array of sequence lengths to an array of non-negative costs."""

    name: str

    def __call__(self, lengths) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class LinearCost:
    """``c = s``: the token count."""

    name: str = dataclasses.field(default="linear", init=False)

    def __call__(self, lengths) -> np.ndarray:
        return sequence_lengths(lengths, allow_empty=True).astype(np.float64)


@dataclasses.dataclass(frozen=True)
class QuadraticCost:
    """``c = a * x^2 + b * x`` with ``x = s / scale``; ``a, b >= 0``, not both zero, ``scale > 0``."""

    a: float
    b: float
    scale: float = 1.0
    name: str = dataclasses.field(default="quadratic", init=False)

    def __post_init__(self):
        for field in ("a", "b", "scale"):
            value = getattr(self, field)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"QuadraticCost.{field} must be a finite number, got {value!r}")
        if self.a < 0 or self.b < 0:
            raise ValueError(f"QuadraticCost coefficients must be >= 0, got a={self.a}, b={self.b}")
        if self.a == 0 and self.b == 0:
            raise ValueError("QuadraticCost needs a > 0 or b > 0: with both zero every sequence would cost nothing")
        if self.scale <= 0:
            raise ValueError(f"QuadraticCost.scale must be > 0, got {self.scale}")

    def __call__(self, lengths) -> np.ndarray:
        x = sequence_lengths(lengths, allow_empty=True).astype(np.float64) / self.scale
        return self.a * x * x + self.b * x

    @classmethod
    def paper_7b(cls) -> "QuadraticCost":
        """The ODC paper's fit for a 7B model: ``4.348357 x^2 + 8.768377 x`` with ``x = s / 32000``."""
        return cls(a=4.348357, b=8.768377, scale=32000.0)

    @classmethod
    def fit(cls, lengths, costs, *, scale: float = 1.0) -> "QuadraticCost":
        """Least-squares fit of ``a, b >= 0`` to measured ``costs`` (e.g. step seconds) of sequences ``lengths``.

        The fit has no intercept (an empty sequence costs nothing). Non-negativity is enforced by comparing the
        unconstrained solution with the two one-coefficient fits and keeping the best feasible one.
        """
        s = sequence_lengths(lengths).astype(np.float64)
        c = costs_array(costs, "costs")
        if c.shape != s.shape:
            raise ValueError(f"lengths and costs differ in size: {s.size} vs {c.size}")
        if np.unique(s).size < 2:
            raise ValueError("fitting a quadratic needs at least two distinct sequence lengths")
        if not np.any(c > 0):
            raise ValueError("every cost is zero: nothing to fit")
        if not (isinstance(scale, numbers.Real) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
        x = s / scale
        design = np.stack([x * x, x], axis=1)
        candidates = []
        solution, *_ = np.linalg.lstsq(design, c, rcond=None)
        if np.all(solution >= 0):
            candidates.append((float(solution[0]), float(solution[1])))
        for column in (0, 1):  # one coefficient alone: closed form, always >= 0 since costs and x are
            only = design[:, column]
            coef = float(only @ c / (only @ only))
            candidates.append((coef, 0.0) if column == 0 else (0.0, coef))

        def residual(ab):
            return float(np.sum((design @ np.asarray(ab) - c) ** 2))

        a, b = min(candidates, key=residual)
        return cls(a=a, b=b, scale=float(scale))


@dataclasses.dataclass(frozen=True)
class FlopsCost:
    """Forward FLOPs of the whole model on each sequence (see :mod:`jodc.balance.model_shape` for the formulas)."""

    shape: ModelShape
    name: str = dataclasses.field(default="flops", init=False)

    def __post_init__(self):
        if not isinstance(self.shape, ModelShape):
            raise ValueError(f"FlopsCost needs a ModelShape, got {type(self.shape).__name__}")

    def __call__(self, lengths) -> np.ndarray:
        return self.shape.sequence_forward_flops(sequence_lengths(lengths, allow_empty=True))

    def as_quadratic(self) -> QuadraticCost:
        """The same cost as ``a * s^2 + b * s`` (unit scale)."""
        shape = self.shape
        a = 2.0 * shape.attention_width * shape.num_layers
        b = a + 2.0 * shape.layer_matmul_params * shape.num_layers + 2.0 * shape.vocab * shape.hidden
        return QuadraticCost(a=a, b=b)


COST_MODEL_NAMES = ("linear", "quadratic", "flops")


def make_cost_model(name: str, **params) -> CostModel:
    """Build a cost model by name: ``linear``; ``quadratic`` (``a``, ``b``, optional ``scale``; with no
    parameters, the paper's 7B fit); ``flops`` (``shape=ModelShape``)."""
    if name == "linear":
        if params:
            raise ValueError(f"the linear cost model takes no parameters, got {sorted(params)}")
        return LinearCost()
    if name == "quadratic":
        return QuadraticCost(**params) if params else QuadraticCost.paper_7b()
    if name == "flops":
        if set(params) != {"shape"}:
            raise ValueError(f"the flops cost model takes exactly one parameter, shape=ModelShape; got {sorted(params)}")
        return FlopsCost(params["shape"])
    raise ValueError(f"unknown cost model {name!r}; choose one of {', '.join(COST_MODEL_NAMES)}")


def sequence_costs(cost_model: CostModel, lengths: np.ndarray) -> np.ndarray:
    """Apply ``cost_model`` and check it returned one finite, non-negative cost per sequence."""
    if not callable(cost_model):
        raise ValueError(f"cost_model must be callable (e.g. LinearCost()), got {cost_model!r}")
    costs = np.asarray(cost_model(lengths), dtype=np.float64)
    if costs.shape != np.shape(lengths):
        raise ValueError(f"cost_model returned shape {costs.shape} for {np.shape(lengths)} lengths")
    return costs_array(costs, "cost_model(lengths)")
