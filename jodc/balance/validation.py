"""Checks on planner inputs, shared by every planner so that bad input fails the same way everywhere.

Each function returns the value in the form the planners use (an int64 array, a plain int) or raises
``ValueError`` with a message that names the offending argument and, for lengths, the first bad index.
"""
from __future__ import annotations

import numbers
from typing import Sequence

import numpy as np


def positive_int(value, name: str) -> int:
    """``value`` as an ``int`` if it is an integer >= 1 (bools are rejected), else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return int(value)


def sequence_lengths(lengths: Sequence[int] | np.ndarray, *, allow_empty: bool = False) -> np.ndarray:
    """The minibatch's sequence lengths as a 1-D int64 array.

    Every length must be an integer >= 1: a negative length is meaningless and a zero-length sequence has no
    tokens to train on (and would give an empty segment), so both are rejected. An empty minibatch is rejected
    unless ``allow_empty`` (helpers that work on one device's share, which may be empty, pass it).
    """
    array = np.asarray(lengths)
    if array.ndim != 1:
        raise ValueError(f"lengths must be a 1-D sequence of integers, got an array of shape {array.shape}")
    if array.size == 0:
        if allow_empty:
            return np.zeros(0, dtype=np.int64)
        raise ValueError("the minibatch is empty: lengths has no sequences")
    if array.dtype.kind == "b" or array.dtype.kind not in "iuf":
        raise ValueError(f"lengths must be integers, got dtype {array.dtype}")
    if array.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(array) | (array != np.round(array)))
        if bad.size:
            raise ValueError(f"lengths must be integers; lengths[{bad[0]}] = {array[bad[0]]!r}")
    as_int = array.astype(np.int64)
    nonpositive = np.flatnonzero(as_int < 1)
    if nonpositive.size:
        i = int(nonpositive[0])
        what = "negative" if as_int[i] < 0 else "zero"
        raise ValueError(f"sequence lengths must be >= 1; lengths[{i}] = {as_int[i]} is {what}")
    return as_int


def lengths_within_cap(lengths: np.ndarray, token_cap: int) -> None:
    """``ValueError`` naming the first sequence longer than the per-microbatch token cap."""
    too_long = np.flatnonzero(lengths > token_cap)
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(
            f"sequence {i} has {int(lengths[i])} tokens, more than token_cap={token_cap}: it cannot fit in any "
            f"microbatch ({too_long.size} sequence(s) too long; raise token_cap or truncate them)"
        )


def min_group_size(length: int, token_cap: int) -> int | None:
    """The fewest devices whose zigzag pieces of a sequence of ``length`` tokens fit in ``token_cap`` columns each
    (a piece is ``2 ceil(L / 2k)`` columns, so ``ceil(L / cap)`` may need one more); 1 when the sequence fits
    whole; None when no group can hold it (a cap of one column holds no two-chunk piece)."""
    if length <= token_cap:
        return 1
    if token_cap < 2:
        return None
    k = -(-length // token_cap)
    while 2 * -(-length // (2 * k)) > token_cap:
        k += 1
    return k


def lengths_within_world(lengths: np.ndarray, num_devices: int, token_cap: int) -> None:
    """``ValueError`` naming the first sequence that no context-parallel group of the ``num_devices`` devices can
    hold (its zigzag piece over all of them would exceed ``token_cap``): refused before anything runs."""
    capacity = num_devices * token_cap
    too_long = [i for i, n in enumerate(lengths.tolist())
                if n > token_cap and (min_group_size(n, token_cap) or num_devices + 1) > num_devices]
    if too_long:
        i = too_long[0]
        raise ValueError(
            f"sequence {i} has {int(lengths[i])} tokens, more than the world's capacity of {num_devices} devices x "
            f"token_cap={token_cap} = {capacity} tokens can hold (its zigzag piece over every device would not "
            f"fit in a row); {len(too_long)} sequence(s) too long: truncate or drop them (data.max_length <= {capacity}) or "
            f"add devices"
        )


def planner_inputs(lengths, num_devices, token_cap) -> tuple[np.ndarray, int, int]:
    """Validate a planner's three positional arguments together; returns (lengths, num_devices, token_cap)."""
    devices = positive_int(num_devices, "num_devices")
    cap = positive_int(token_cap, "token_cap")
    array = sequence_lengths(lengths)
    lengths_within_cap(array, cap)
    return array, devices, cap


def costs_array(costs, name: str = "costs", *, allow_empty: bool = True) -> np.ndarray:
    """Per-item costs as a 1-D float64 array of finite, non-negative values."""
    array = np.asarray(costs, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size == 0 and not allow_empty:
        raise ValueError(f"{name} is empty")
    bad = np.flatnonzero(~np.isfinite(array) | (array < 0))
    if bad.size:
        raise ValueError(f"{name} must be finite and >= 0; {name}[{bad[0]}] = {array[bad[0]]!r}")
    return array


def check_partition(parts, num_items: int) -> None:
    """``ValueError`` unless ``parts`` (lists of item indices) holds each of ``range(num_items)`` exactly once."""
    seen = np.zeros(num_items, dtype=np.int64)
    for part in parts:
        for i in part:
            if not (0 <= int(i) < num_items):
                raise ValueError(f"partition refers to item {i}, outside range({num_items})")
            seen[int(i)] += 1
    if np.any(seen != 1):
        bad = int(np.flatnonzero(seen != 1)[0])
        raise ValueError(f"partition must hold every item exactly once; item {bad} appears {seen[bad]} times")
