"""Exact minimum-makespan partition by mixed-integer programming (HiGHS through ``scipy.optimize.milp``).

For validation and small instances: the planners' own search is deterministic and cheap; this one is slow but, when
it finishes within its node limit, provably optimal. Formulation, for ``n`` items with costs ``c`` and ``k`` parts::

    minimise    C
    subject to  sum_p x[i, p] = 1              for every item i
                sum_i c[i] x[i, p] - C <= 0    for every part p
                x[i, p] = 0  for p > i (items sorted heaviest first)   -- breaks the symmetry between parts
                x binary

The solve is bounded by a node count (``node_limit``), never by time, so its answer does not depend on the host's
speed. scipy is imported only here, and only when called (the planners do not need it).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from jodc.balance.validation import costs_array, positive_int

DEFAULT_NODE_LIMIT = 20_000


@dataclasses.dataclass(frozen=True)
class ExactResult:
    """The best partition the MILP found: parts (indices, ascending), its heaviest part, and whether it is proven
    optimal (``optimal``; else the node limit stopped the solve, and ``lower_bound`` is the solver's best bound)."""

    parts: list[list[int]]
    makespan: float
    optimal: bool
    lower_bound: float


def exact_partition(costs, num_parts: int, *, node_limit: int = DEFAULT_NODE_LIMIT,
                    incumbent: list[list[int]] | None = None) -> ExactResult:
    """Minimum-makespan partition of ``costs`` into ``num_parts`` parts by MILP (see the module docstring).

    ``incumbent`` (a partition) is returned if the solver finds nothing better within ``node_limit`` nodes.
    Raises ImportError with a hint when scipy is missing.
    """
    cost = costs_array(costs)
    k = positive_int(num_parts, "num_parts")
    if isinstance(node_limit, bool) or not isinstance(node_limit, int) or node_limit < 1:
        raise ValueError(f"node_limit must be a positive integer, got {node_limit!r}")
    n = cost.size
    total = math.fsum(cost)
    bound = max(float(cost.max(initial=0.0)), total / k)
    incumbent_span = math.inf
    if incumbent is not None:
        incumbent_span = max((math.fsum(cost[p]) for p in incumbent), default=0.0)
    if n <= k:
        return ExactResult([[i] for i in range(n)] + [[] for _ in range(k - n)], bound, True, bound)
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix
    except ImportError as error:  # pragma: no cover - scipy ships with jax
        raise ImportError("the exact planner needs scipy (pip install scipy)") from error

    order = sorted(range(n), key=lambda i: (-cost[i], i))
    scale = total if total > 0 else 1.0
    c = cost[order] / scale  # well-scaled for the solver
    allowed = [(r, p) for r in range(n) for p in range(min(r + 1, k))]
    m = len(allowed)
    var = {rp: v for v, rp in enumerate(allowed)}
    rows, cols, vals = [], [], []
    for (r, p), v in var.items():  # assignment rows 0..n-1
        rows.append(r), cols.append(v), vals.append(1.0)
    for (r, p), v in var.items():  # load rows n..n+k-1
        rows.append(n + p), cols.append(v), vals.append(c[r])
    for p in range(k):
        rows.append(n + p), cols.append(m), vals.append(-1.0)
    matrix = coo_matrix((vals, (rows, cols)), shape=(n + k, m + 1)).tocsr()
    lower = np.concatenate([np.ones(n), np.full(k, -np.inf)])
    upper = np.concatenate([np.ones(n), np.zeros(k)])
    objective = np.zeros(m + 1)
    objective[m] = 1.0
    integrality = np.concatenate([np.ones(m), [0]])
    var_bounds = Bounds(np.concatenate([np.zeros(m), [bound / scale]]), np.concatenate([np.ones(m), [np.inf]]))
    result = milp(objective, constraints=LinearConstraint(matrix, lower, upper), integrality=integrality,
                  bounds=var_bounds, options={"node_limit": int(node_limit), "mip_rel_gap": 1e-6,
                                              "presolve": True})
    solver_bound = bound
    if getattr(result, "mip_dual_bound", None) is not None and np.isfinite(result.mip_dual_bound):
        solver_bound = max(bound, float(result.mip_dual_bound) * scale)
    if result.x is None:
        if incumbent is None:
            raise RuntimeError(f"the MILP found no partition within {node_limit} nodes: {result.message}")
        return ExactResult([sorted(p) for p in incumbent], incumbent_span, False, solver_bound)
    x = np.asarray(result.x)
    parts: list[list[int]] = [[] for _ in range(k)]
    for (r, p), v in var.items():
        if x[v] > 0.5:
            parts[p].append(order[r])
    parts = [sorted(p) for p in parts]
    span = max(math.fsum(cost[p]) for p in parts)
    optimal = result.status == 0
    if incumbent is not None and incumbent_span <= span:
        return ExactResult([sorted(p) for p in incumbent], incumbent_span, optimal, solver_bound)
    return ExactResult(parts, span, optimal, span if optimal else solver_bound)
