"""The zigzag layout of one sequence split over a context-parallel group (host side, numpy only).

A sequence of ``L`` tokens split over a group of ``k`` devices is cut into ``2k`` equal chunks of ``c`` tokens;
device ``i`` of the group holds chunks ``i`` and ``2k - 1 - i``, in that order, as one piece of ``2c`` tokens.
Under causal attention a chunk's cost grows with its index, so pairing an early chunk with a late one gives every
member the same attention work (the load-balanced order of Megatron's context parallelism and of ring / striped
attention papers): chunk ``j`` has about ``(j + 1/2) c^2`` query-key pairs, and ``j + (2k - 1 - j)`` is the same
for every device.

Lengths that do not divide into ``2k`` chunks are padded at the end of the sequence: ``c = ceil(L / 2k)``, and the
``2kc - L`` padding tokens (segment id 0, position 0: the packing convention of :mod:`jodc.balance.plan`) fall into
the last chunks, which sit on the first devices (chunk ``2k - 1`` is device 0's second). A sequence shorter than
``2k`` (more chunks than tokens) is legal and handled the same way: ``c = 1`` and the chunks past the sequence's end
are all padding, so some devices hold padding only. Padding costs memory, not correctness; planners should give a
sequence a group small enough that ``L >= 2k``.

A device's piece keeps the sequence's *global* positions (``0 .. L-1`` over the whole group), which both RoPE and the
context-parallel attention's causal mask read (``jodc.models.context_parallel``). :func:`zigzag_split` cuts any
per-token field (tokens, loss masks, activations) into the ``k`` pieces (:func:`zigzag_piece`: one member's),
:func:`zigzag_merge` puts pieces back in sequence order, and :func:`zigzag_row` lays out one device's packed row:
its pieces of the row's split sequences first (one, or several as the fixed layout packs them; segment ids 1..n),
then short sequences of its own, then padding.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jodc.balance.validation import positive_int, sequence_lengths


@dataclasses.dataclass(frozen=True)
class ZigzagLayout:
    """Where every token of one sequence of ``length`` tokens goes in a group of ``group_size`` devices."""

    length: int  # L, the sequence's tokens
    group_size: int  # k, devices in the group
    chunk: int  # c = ceil(L / 2k), tokens per chunk (the last chunks may be partly or wholly padding)

    @property
    def num_chunks(self) -> int:
        """2k: two chunks per device."""
        return 2 * self.group_size

    @property
    def padded_length(self) -> int:
        """2kc >= L: the sequence with its end padding."""
        return self.num_chunks * self.chunk

    @property
    def piece_length(self) -> int:
        """2c: tokens (padding included) each device holds."""
        return 2 * self.chunk

    def chunks_of(self, device: int) -> tuple[int, int]:
        """The two chunk indices device ``device`` of the group holds, in the order it holds them."""
        d = _check_member(self, device)
        return d, self.num_chunks - 1 - d

    def sequence_indices(self, device: int) -> np.ndarray:
        """int64 [2c]: for each slot of the device's piece, the index in the padded sequence it holds (indices
        >= ``length`` are padding)."""
        first, second = self.chunks_of(device)
        slots = np.arange(self.chunk, dtype=np.int64)
        return np.concatenate([first * self.chunk + slots, second * self.chunk + slots])

    def valid(self, device: int) -> np.ndarray:
        """bool [2c]: which slots of the device's piece hold a real token (not end padding)."""
        return self.sequence_indices(device) < self.length

    def positions(self, device: int) -> np.ndarray:
        """int32 [2c]: the global positions of the device's piece (0 over padding, the packing convention)."""
        index = self.sequence_indices(device)
        return np.where(index < self.length, index, 0).astype(np.int32)

    def tokens_of(self, device: int) -> int:
        """How many real tokens device ``device`` holds."""
        return int(self.valid(device).sum())


def _check_member(layout: ZigzagLayout, device) -> int:
    if isinstance(device, bool) or not isinstance(device, (int, np.integer)) or not 0 <= device < layout.group_size:
        raise ValueError(f"device must be an integer in [0, {layout.group_size}) (the group's members), got {device!r}")
    return int(device)


def zigzag_layout(length: int, group_size: int) -> ZigzagLayout:
    """The layout of a sequence of ``length`` tokens over ``group_size`` devices (both positive integers).

    ``length`` need not divide by ``2 * group_size``: the sequence is padded at its end (see the module docstring).
    """
    length = positive_int(length, "length")
    group_size = positive_int(group_size, "group_size")
    return ZigzagLayout(length=length, group_size=group_size, chunk=-(-length // (2 * group_size)))


def zigzag_split(layout: ZigzagLayout, values, *, pad_value=0) -> np.ndarray:
    """Cut a per-token field ``[L, *trailing]`` into the group's pieces ``[k, 2c, *trailing]``.

    Row ``i`` is device ``i``'s piece (chunks ``i`` and ``2k-1-i``); slots past the sequence's end hold ``pad_value``.
    """
    array = np.asarray(values)
    if array.ndim == 0 or array.shape[0] != layout.length:
        raise ValueError(f"the layout is for a sequence of {layout.length} tokens; got an array of shape "
                         f"{array.shape} (its first axis must be the sequence)")
    padded = np.full((layout.padded_length,) + array.shape[1:], pad_value, dtype=array.dtype)
    padded[: layout.length] = array
    return np.stack([padded[layout.sequence_indices(d)] for d in range(layout.group_size)])


def zigzag_merge(layout: ZigzagLayout, pieces) -> np.ndarray:
    """Put the pieces ``[k, 2c, *trailing]`` back in sequence order: ``[L, *trailing]`` (padding dropped).

    The inverse of :func:`zigzag_split`: ``zigzag_merge(layout, zigzag_split(layout, x)) == x``.
    """
    array = np.asarray(pieces)
    expected = (layout.group_size, layout.piece_length)
    if array.ndim < 2 or array.shape[:2] != expected:
        raise ValueError(f"pieces must have shape [group_size, piece_length, ...] = {list(expected)} + [...], "
                         f"got {array.shape}")
    padded = np.empty((layout.padded_length,) + array.shape[2:], dtype=array.dtype)
    for d in range(layout.group_size):
        padded[layout.sequence_indices(d)] = array[d]
    return padded[: layout.length]


def zigzag_piece(layout: ZigzagLayout, device: int, values, *, pad_value=0) -> np.ndarray:
    """Member ``device``'s piece ``[2c, *trailing]`` of a per-token field ``[L, *trailing]``: row ``device`` of
    :func:`zigzag_split`, cut without building the other members' pieces (a member packing its rows of a plan that
    splits every sequence over the whole world reads only its own ``2c`` tokens of each)."""
    d = _check_member(layout, device)
    array = np.asarray(values)
    if array.ndim == 0 or array.shape[0] != layout.length:
        raise ValueError(f"the layout is for a sequence of {layout.length} tokens; got an array of shape "
                         f"{array.shape} (its first axis must be the sequence)")
    index = layout.sequence_indices(d)
    valid = index < layout.length
    piece = np.full((layout.piece_length,) + array.shape[1:], pad_value, dtype=array.dtype)
    piece[valid] = array[index[valid]]
    return piece


@dataclasses.dataclass(frozen=True)
class ZigzagRow:
    """One group member's packed row: its piece of each split sequence, then its own short sequences, then padding.

    Split sequence ``j`` (of ``split_segments``) has segment id ``j + 1`` on every member, so the context-parallel
    attention can tell which tokens attend across the group (`jodc.models.context_parallel.group_keys` takes the
    count); the row's own short sequences are numbered ``split_segments + 1, ...`` and attend within the row.
    """

    segment_ids: np.ndarray  # int32 [T]: 0 padding, 1..n the split sequences' pieces, n+1.. the row's own sequences
    positions: np.ndarray  # int32 [T]: global positions over each piece, restarting at 0 for each short sequence
    split_segments: int  # n: segments 1..n of this row are pieces of split sequences (the same ones on every member)
    piece_starts: tuple[int, ...]  # column where each split sequence's piece starts
    short_starts: tuple[int, ...]  # column where each short sequence starts


def _row_layouts(layouts) -> tuple[ZigzagLayout, ...]:
    """`layouts` as a non-empty tuple of layouts over one group size (a single layout is a tuple of one)."""
    if isinstance(layouts, ZigzagLayout):
        return (layouts,)
    layouts = tuple(layouts) if isinstance(layouts, (list, tuple)) else None
    if not layouts or not all(isinstance(x, ZigzagLayout) for x in layouts):
        raise ValueError("zigzag_row needs a ZigzagLayout or a non-empty list of them (one per split sequence)")
    sizes = sorted({x.group_size for x in layouts})
    if len(sizes) != 1:
        raise ValueError(f"the split sequences of one row must be laid out over one group; got group sizes {sizes}")
    return layouts


def zigzag_row(layouts, device: int, token_cap: int, short_lengths: Sequence[int] = ()) -> ZigzagRow:
    """Segment ids and positions of member ``device``'s row of ``token_cap`` columns.

    ``layouts``: the zigzag layout of the row's split sequence, or a list of them (several split sequences in one
    row, as `fixed_cp` packs them; all over the same group). The pieces come first, one after another (piece ``j``
    with segment id ``j + 1`` and its sequence's global positions, its end padding as segment 0), then the short
    sequences of ``short_lengths`` (ids ``n + 1, n + 2, ...``, positions from 0), then padding. With one layout this
    is the row of one split sequence (segment 1, short sequences 2, 3, ...). Raises ValueError when they do not fit
    in ``token_cap``.
    """
    layouts = _row_layouts(layouts)
    d = _check_member(layouts[0], device)
    token_cap = positive_int(token_cap, "token_cap")
    shorts = sequence_lengths(short_lengths, allow_empty=True)
    piece_columns = sum(x.piece_length for x in layouts)
    needed = piece_columns + int(shorts.sum())
    if needed > token_cap:
        raise ValueError(f"device {d}'s row needs {piece_columns} columns for its pieces of {len(layouts)} split "
                         f"sequence(s) and {int(shorts.sum())} for {len(shorts)} short sequences ({needed} in all), "
                         f"more than token_cap={token_cap}")
    segment_ids = np.zeros(token_cap, np.int32)
    positions = np.zeros(token_cap, np.int32)
    piece_starts, column = [], 0
    for j, layout in enumerate(layouts):
        piece_starts.append(column)
        segment_ids[column : column + layout.piece_length] = np.where(layout.valid(d), j + 1, 0)
        positions[column : column + layout.piece_length] = layout.positions(d)
        column += layout.piece_length
    short_starts = []
    for i, n in enumerate(shorts.tolist()):
        short_starts.append(column)
        segment_ids[column : column + n] = len(layouts) + 1 + i
        positions[column : column + n] = np.arange(n, dtype=np.int32)
        column += n
    return ZigzagRow(segment_ids=segment_ids, positions=positions, split_segments=len(layouts),
                     piece_starts=tuple(piece_starts), short_starts=tuple(short_starts))


def segment_id_limit(token_cap: int, group_size: int) -> int:
    """The largest segment id a row of ``token_cap`` columns may hold in a group of ``group_size``: the attention's
    group-wide key of a row's own sequence ``s`` on member ``m`` is ``T + 1 + (s - 1) k + m``
    (`jodc.models.context_parallel.group_keys`), at most ``T + s k``, which must fit int32."""
    return (2**31 - 1 - int(token_cap)) // int(group_size)


def check_group_rows(segment_ids, positions, split_segments) -> None:
    """Host-side check of a context-parallel group's rows before they run; ValueError naming the first problem.

    segment_ids, positions: int [k, B, T] (member, row, column); split_segments: int [k, B], how many leading
    segments of each row are split sequences (segments 1..n; 0: none). Checks what the attention cannot check on
    device: a row's split sequences are the same ones on every member (every member's row ``b`` has the same count),
    the count is at most T, each split sequence's global positions are distinct over the whole group (a duplicate
    would let two tokens see each other), and segment ids are non-negative and small enough for the group-wide keys
    (`segment_id_limit`).
    """
    seg, pos, split = np.asarray(segment_ids), np.asarray(positions), np.asarray(split_segments)
    if seg.ndim != 3 or pos.shape != seg.shape or split.shape != seg.shape[:2]:
        raise ValueError(f"segment_ids and positions must be [k, B, T] and split_segments [k, B]; got "
                         f"{seg.shape}, {pos.shape}, {split.shape}")
    for name, array in (("segment_ids", seg), ("positions", pos), ("split_segments", split)):
        if array.dtype.kind not in "iu":
            raise ValueError(f"{name} must be integers, got dtype {array.dtype}")
    k, _, t = seg.shape
    if seg.min(initial=0) < 0 or split.min(initial=0) < 0:
        raise ValueError("segment ids and split_segments must be >= 0 (segment 0 is padding)")
    if split.max(initial=0) > t:
        raise ValueError(f"split_segments {int(split.max())} is more than the row's {t} columns")
    limit = segment_id_limit(t, k)
    if seg.max(initial=0) > limit:
        raise ValueError(f"segment id {int(seg.max())} is too large for rows of {t} in a group of {k} (ids must be "
                         f"<= {limit})")
    for b in range(seg.shape[1]):
        counts = split[:, b]
        if (counts != counts[0]).any():
            first = np.flatnonzero(counts == counts[0]).tolist()
            others = np.flatnonzero(counts != counts[0]).tolist()
            raise ValueError(f"row {b}: members {first} hold {int(counts[0])} split sequence(s) and members {others} "
                             f"hold {counts[others].tolist()}; every member's row {b} must hold a piece of each of "
                             "the same split sequences")
        for s in range(1, int(counts[0]) + 1):
            values, repeats = np.unique(pos[:, b][seg[:, b] == s], return_counts=True)
            if (repeats > 1).any():
                raise ValueError(f"row {b}: split sequence {s} has position {int(values[repeats > 1][0])} on more "
                                 "than one token of the group; its positions must be its global positions "
                                 "(zigzag_layout)")
