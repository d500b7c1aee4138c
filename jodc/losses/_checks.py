"""Argument checks shared by the loss functions.

Every check runs at trace time on static shapes, so it costs nothing under ``jit`` and a mistake is reported
with the offending names and shapes before any numerics run.
"""
from __future__ import annotations

from typing import Any, Iterable

import jax.numpy as jnp
import numpy as np


def shape_of(x: Any) -> tuple[int, ...]:
    """The shape of an array-like (``()`` for Python scalars)."""
    return tuple(np.shape(x))


def dtype_of(x: Any) -> np.dtype:
    """The dtype of an array-like, without copying it (tracers, jax and numpy arrays carry one)."""
    return np.dtype(x.dtype) if hasattr(x, "dtype") else jnp.asarray(x).dtype


def check_choice(fn: str, name: str, value: Any, choices: Iterable[str]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{fn}: unknown {name} {value!r}; expected one of {list(choices)}")


def check_logits(fn: str, logits: Any) -> tuple[int, int, int]:
    """Logits must be a floating [B, T, V] array; returns (B, T, V)."""
    shape = shape_of(logits)
    if len(shape) != 3:
        raise ValueError(f"{fn}: logits must have shape [B, T, V], got shape {shape}")
    if not jnp.issubdtype(dtype_of(logits), jnp.floating):
        raise ValueError(f"{fn}: logits must be a floating dtype, got {dtype_of(logits)}")
    return shape  # type: ignore[return-value]


def check_bt(fn: str, name: str, x: Any, bt: tuple[int, int], *, integer: bool = False) -> None:
    """A per-token field must have shape [B, T] (the leading two dims of logits)."""
    shape = shape_of(x)
    if shape != tuple(bt):
        raise ValueError(
            f"{fn}: {name} has shape {shape} but logits imply [B, T] = {tuple(bt)}"
        )
    if integer and not jnp.issubdtype(dtype_of(x), jnp.integer):
        raise ValueError(f"{fn}: {name} must be an integer array, got dtype {dtype_of(x)}")


def check_per_token(fn: str, name: str, values: Any, mask: Any, segment_ids: Any = None,
                    others: tuple[tuple[str, Any], ...] = ()) -> tuple[int, int]:
    """Per-token inputs without logits: ``values`` [B, T] sets the shape; ``mask``, ``segment_ids`` (integer, when
    given) and each ``(name, array)`` of ``others`` must match it. Returns [B, T]."""
    bt = shape_of(values)
    if len(bt) != 2:
        raise ValueError(f"{fn}: {name} must have shape [B, T], got shape {bt}")
    for other_name, other in others:
        check_bt(fn, other_name, other, bt)
    check_bt(fn, "mask", mask, bt)
    if segment_ids is not None:
        check_bt(fn, "segment_ids", segment_ids, bt, integer=True)
    return bt


def check_btk(fn: str, name: str, x: Any, bt: tuple[int, int], *, integer: bool = False) -> int:
    """A per-token top-k field must have shape [B, T, K]; returns K."""
    shape = shape_of(x)
    if len(shape) != 3 or shape[:2] != tuple(bt) or shape[2] < 1:
        raise ValueError(
            f"{fn}: {name} has shape {shape} but must be [B, T, K] with [B, T] = {tuple(bt)} and K >= 1"
        )
    if integer and not jnp.issubdtype(dtype_of(x), jnp.integer):
        raise ValueError(f"{fn}: {name} must be an integer array, got dtype {dtype_of(x)}")
    return shape[2]


def check_nonnegative(fn: str, name: str, value: float) -> None:
    """A hyper-parameter that must be a non-negative number."""
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"{fn}: {name} must be a finite number >= 0, got {value!r}")


def check_positive(fn: str, name: str, value: float) -> None:
    """A hyper-parameter that must be a positive number."""
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{fn}: {name} must be a finite number > 0, got {value!r}")


def check_chunk_size(fn: str, chunk_size: int | None) -> None:
    """``chunk_size`` is None (no chunking) or a positive int."""
    if chunk_size is not None and (not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1):
        raise ValueError(f"{fn}: chunk_size must be None or a positive int, got {chunk_size!r}")
