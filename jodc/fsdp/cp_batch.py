"""Packing a plan with context-parallel groups (`jodc.balance.CPPlan`) into the engines' arrays.

A plain microbatch is packed as `minibatch_from_plan` packs it. A CP microbatch on member i of its group holds, in
the columns `CPMicrobatch.row(T)` gives, member i's zigzag piece of each of the group's split sequences, one after
another (every per-token field cut by `jodc.balance.zigzag.zigzag_piece`: tokens, targets, loss mask, extras;
padding 0), with the sequences' global positions and segment ids 1..n, then its own short sequences (segment ids
n + 1, ...; positions from 0). The members' rows together hold exactly the one-device sequences' fields,
redistributed. Per microbatch the batch also records its group's size (0: plain), its members (heap positions in
member order, zero-padded to the number of devices), this device's member index and the row's number of split
sequences n: run-time operands of the engines' compiled steps.
"""
from __future__ import annotations

import numpy as np

from jodc.balance.cp_plan import CPMicrobatch, CPPlan
from jodc.balance.zigzag import ZigzagRow, zigzag_piece
from jodc.fsdp.batch import MinibatchArrays


def _row_fields(item, token_cap: int, row: ZigzagRow | None) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids and positions of one microbatch's row (`row`: a CP microbatch's laid-out row)."""
    if isinstance(item, CPMicrobatch):
        return row.segment_ids, row.positions
    return item.segment_ids(token_cap), item.positions(token_cap)


def _pack_row(out: np.ndarray, item, row: ZigzagRow | None, per_sequence) -> None:
    """Writes one microbatch's row of a per-token field into `out` ([T, ...], zeros). A CP microbatch's `row` says
    where its pieces and short sequences start."""
    if isinstance(item, CPMicrobatch):
        for layout, seq, start in zip(item.group.layouts(), item.group.seq_indices, row.piece_starts):
            out[start : start + layout.piece_length] = zigzag_piece(layout, item.member, per_sequence[seq])
        for start, i, n in zip(row.short_starts, item.short.seq_indices, item.short.seq_lengths):
            out[start : start + n] = per_sequence[i]
        return
    start = 0
    for i, n in zip(item.seq_indices, item.seq_lengths):
        out[start : start + n] = per_sequence[i]
        start += n


def minibatch_from_cp_plan(plan: CPPlan, inputs, targets, loss_masks, extras: dict | None = None,
                           normalizer: float | None = None, devices=None) -> MinibatchArrays:
    """Packs a minibatch by a `CPPlan` (arguments as `jodc.fsdp.batch.minibatch_from_plan`'s). Each device's
    microbatches keep the plan's order (its CP rows in increasing group id: the deadlock-free order)."""
    if not isinstance(plan, CPPlan):
        raise ValueError(f"minibatch_from_cp_plan needs a CPPlan, got {type(plan).__name__}")
    lengths = plan.sequence_lengths()
    if len(inputs) != len(lengths):
        raise ValueError(f"the plan holds {len(lengths)} sequences, got {len(inputs)} inputs")
    for name, per_sequence in (("inputs", inputs), ("targets", targets), ("loss_masks", loss_masks),
                               *((f"extras[{k!r}]", v) for k, v in (extras or {}).items())):
        for i, x in enumerate(per_sequence):
            if np.shape(x)[:1] != (lengths[i],):
                raise ValueError(f"{name}[{i}] has shape {np.shape(x)}, the plan gives sequence {i} {lengths[i]} "
                                 "tokens")
    num_devices, t = plan.num_devices, plan.token_cap
    m = max(1, max(len(items) for items in plan.devices))
    shape = (num_devices, m, t)
    fields = {"tokens": (inputs, np.int32), "targets": (targets, np.int32), "loss_mask": (loss_masks, np.float32)}
    out = {k: np.zeros(shape, dtype) for k, (_, dtype) in fields.items()}
    out["positions"] = np.zeros(shape, np.int32)
    out["segment_ids"] = np.zeros(shape, np.int32)
    per_field = {k: [np.asarray(x, dtype) for x in seqs] for k, (seqs, dtype) in fields.items()}
    packed_extras = {}
    for name, per_sequence in (extras or {}).items():
        per_sequence = [np.asarray(x) for x in per_sequence]
        trailing = per_sequence[0].shape[1:] if per_sequence else ()
        dtype = np.result_type(*per_sequence) if per_sequence else np.float32
        packed_extras[name] = np.zeros(shape + trailing, dtype)
        per_field[name] = per_sequence
    cp_size = np.zeros((num_devices, m), np.int32)
    cp_member = np.zeros((num_devices, m), np.int32)
    cp_members = np.zeros((num_devices, m, num_devices), np.int32)
    cp_split_segments = np.zeros((num_devices, m), np.int32)
    microbatch_tokens = np.zeros((num_devices, m), np.int64)
    packed = range(num_devices) if devices is None else sorted(set(devices))
    for d, items in enumerate(plan.devices):
        for j, item in enumerate(items):
            row = item.row(t) if isinstance(item, CPMicrobatch) else None
            segment_ids, positions = _row_fields(item, t, row)
            microbatch_tokens[d, j] = int((segment_ids > 0).sum())
            if row is not None:
                cp_size[d, j] = item.group.size
                cp_member[d, j] = item.member
                cp_members[d, j, : item.group.size] = item.group.members
                cp_split_segments[d, j] = row.split_segments
            if d not in packed:
                continue
            out["segment_ids"][d, j] = segment_ids
            out["positions"][d, j] = positions
            for name, per_sequence in per_field.items():
                target = out[name] if name in out else packed_extras[name]
                _pack_row(target[d, j], item, row, per_sequence)
    if normalizer is None:
        normalizer = float(sum(float(np.sum(x)) for x in loss_masks))
    counts = np.array([len(items) for items in plan.devices], np.int32)
    cp = (cp_size, cp_members, cp_member, cp_split_segments) if plan.groups else (None,) * 4
    return MinibatchArrays(counts=counts, normalizer=max(float(normalizer), 1.0), num_sequences=len(inputs),
                           microbatch_tokens=microbatch_tokens, extras=packed_extras, cp_size=cp[0],
                           cp_members=cp[1], cp_member=cp[2], cp_split_segments=cp[3],
                           num_cp_sequences=plan.num_cp_sequences, **out)


__all__ = ["minibatch_from_cp_plan"]
