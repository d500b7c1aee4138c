"""Turning one device's share of a plan into dense ``[num_microbatches, T]`` numpy arrays an engine can feed.

:func:`materialize` packs token ids and returns them with the ``segment_ids`` and ``positions`` that go with them
(conventions in :mod:`jodc.balance.plan`). :func:`pack_arrays` packs any other per-token field the same way
(loss masks, old log-probs, a top-K table with trailing dimensions), so every field lines up token for token.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jodc.balance.plan import Plan


@dataclasses.dataclass(frozen=True)
class PackedMicrobatches:
    """One device's microbatches as dense arrays; row ``m`` is microbatch ``m`` of the plan's device."""

    tokens: np.ndarray  # [M, T] token ids, pad_token over padding
    segment_ids: np.ndarray  # int32 [M, T], 0 over padding
    positions: np.ndarray  # int32 [M, T], 0 over padding


def _check_device(plan: Plan, device: int) -> int:
    if isinstance(device, bool) or not isinstance(device, (int, np.integer)) or not 0 <= device < plan.num_devices:
        raise ValueError(f"device must be an integer in [0, {plan.num_devices}), got {device!r}")
    return int(device)


def layout(plan: Plan, device: int) -> tuple[np.ndarray, np.ndarray]:
    """``(segment_ids, positions)`` of a device's microbatches, each int32 ``[M, T]``."""
    d = _check_device(plan, device)
    microbatches = plan.devices[d]
    segment_ids = np.zeros((len(microbatches), plan.token_cap), dtype=np.int32)
    positions = np.zeros_like(segment_ids)
    for m, mb in enumerate(microbatches):
        segment_ids[m] = mb.segment_ids(plan.token_cap)
        positions[m] = mb.positions(plan.token_cap)
    return segment_ids, positions


def pack_arrays(plan: Plan, device: int, per_sequence: Sequence[np.ndarray], *, pad_value=0) -> np.ndarray:
    """Pack a per-token field for one device: ``[M, T, *trailing]``.

    Args:
      plan: the plan.
      device: which device's microbatches.
      per_sequence: one array per sequence of the minibatch (input order), each ``[s_i, *trailing]`` with
        ``s_i`` the sequence's length; all with the same trailing shape and dtype kind.
      pad_value: the value written over padding.
    """
    d = _check_device(plan, device)
    if len(per_sequence) != plan.total_sequences:
        raise ValueError(f"per_sequence has {len(per_sequence)} arrays for {plan.total_sequences} sequences")
    lengths = plan.sequence_lengths()
    arrays = [np.asarray(a) for a in per_sequence]
    for i, a in enumerate(arrays):
        if a.ndim == 0 or a.shape[0] != lengths[i]:
            raise ValueError(f"sequence {i} has length {lengths[i]} in the plan but its array has shape {a.shape}")
    trailing = arrays[0].shape[1:] if arrays else ()
    for i, a in enumerate(arrays):
        if a.shape[1:] != trailing:
            raise ValueError(f"sequence {i}'s array has trailing shape {a.shape[1:]}, sequence 0's has {trailing}")
    dtype = np.result_type(*arrays) if arrays else np.int32
    microbatches = plan.devices[d]
    out = np.full((len(microbatches), plan.token_cap) + trailing, pad_value, dtype=dtype)
    for m, mb in enumerate(microbatches):
        start = 0
        for i, length in zip(mb.seq_indices, mb.seq_lengths):
            out[m, start : start + length] = arrays[i]
            start += length
    return out


def materialize(plan: Plan, device: int, token_arrays: Sequence[np.ndarray], *, pad_token: int = 0) -> PackedMicrobatches:
    """Token ids, segment ids and positions of a device's microbatches (see :mod:`jodc.balance.plan`)."""
    tokens = pack_arrays(plan, device, token_arrays, pad_value=pad_token)
    if tokens.ndim != 2 or tokens.dtype.kind not in "iu":
        raise ValueError(f"token arrays must be 1-D integer arrays, got packed shape {tokens.shape} dtype {tokens.dtype}")
    segment_ids, positions = layout(plan, device)
    return PackedMicrobatches(tokens=tokens, segment_ids=segment_ids, positions=positions)
