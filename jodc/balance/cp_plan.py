"""A plan with context-parallel (CP) groups: sequences longer than the token cap split over groups of devices.

A :class:`CPPlan` is, per device, an ordered list of microbatches of two kinds:

* :class:`~jodc.balance.plan.Microbatch` -- data-parallel, as in every other plan (short sequences packed whole);
* :class:`CPMicrobatch` -- this device's row of a CP group's microbatch: its zigzag piece of each split sequence
  (:mod:`jodc.balance.zigzag`), then short sequences of its own in the rest of the row, then padding.

A :class:`CPGroup` is one group microbatch: its id, its ordered member list (global device ids; member ``i`` holds
zigzag piece ``i``) and its split sequences. Every member runs the group's :class:`CPMicrobatch` in lock-step with
the other members (they exchange K/V at every layer), and with nobody else.

**Ordering rule (deadlock freedom).** Group ids are a global order, and every device runs its CP microbatches in
increasing group id. A member blocks only inside a group microbatch, waiting for that group's other members; the
group with the smallest id not yet finished has every member either in it or running data-parallel microbatches
(which never block) on the way to it, since each member's earlier CP microbatches have smaller ids and are done.
So that group always completes, and by induction every group does. :meth:`CPPlan.check` verifies the rule; a
lock-step plan (:attr:`CPPlan.is_lockstep`) also puts each group at the same position on all its members.

Construction checks: every sequence exactly once (split in one group, or whole in one row), every member row within
the cap (pieces ``2 ceil(L / 2k)`` columns each, plus its short sequences), groups consistent with the rows that
name them, and the ordering rule.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from jodc.balance.plan import Microbatch
from jodc.balance.validation import positive_int
from jodc.balance.zigzag import ZigzagLayout, ZigzagRow, zigzag_layout, zigzag_row


@dataclasses.dataclass(frozen=True)
class CPGroup:
    """One CP group microbatch.

    Attributes:
      group_id: its place in the global order of groups (0, 1, ...: members run groups in increasing id).
      members: the devices of the group, in member order (member ``i`` holds zigzag piece ``i``).
      seq_indices: the split sequences (indices into the minibatch), in row order.
      seq_lengths: their lengths.
      cost: the planner's estimate of the group microbatch's time (its slowest member plus the exchanges).
    """

    group_id: int
    members: tuple[int, ...]
    seq_indices: tuple[int, ...]
    seq_lengths: tuple[int, ...]
    cost: float

    def __post_init__(self):
        object.__setattr__(self, "members", tuple(int(d) for d in self.members))
        object.__setattr__(self, "seq_indices", tuple(int(i) for i in self.seq_indices))
        object.__setattr__(self, "seq_lengths", tuple(int(s) for s in self.seq_lengths))
        object.__setattr__(self, "cost", float(self.cost))
        if not self.members or len(set(self.members)) != len(self.members) or min(self.members) < 0:
            raise ValueError(f"group {self.group_id}: members must be distinct devices >= 0, got {self.members}")
        if not self.seq_indices or len(self.seq_indices) != len(self.seq_lengths):
            raise ValueError(f"group {self.group_id}: needs one length per split sequence (and at least one), got "
                             f"{self.seq_indices} / {self.seq_lengths}")
        if any(s < 1 for s in self.seq_lengths):
            raise ValueError(f"group {self.group_id}: sequence lengths must be >= 1, got {self.seq_lengths}")

    @property
    def size(self) -> int:
        """k, the number of members."""
        return len(self.members)

    def layouts(self) -> tuple[ZigzagLayout, ...]:
        """The zigzag layout of each split sequence over the group."""
        return tuple(zigzag_layout(s, self.size) for s in self.seq_lengths)

    @property
    def piece_columns(self) -> int:
        """Columns of a member's row taken by its pieces (``2 ceil(L / 2k)`` per split sequence)."""
        return sum(layout.piece_length for layout in self.layouts())

    def member_index(self, device: int) -> int:
        """The member position of ``device`` (ValueError if it is not a member)."""
        if device not in self.members:
            raise ValueError(f"device {device} is not a member of group {self.group_id} {self.members}")
        return self.members.index(device)


@dataclasses.dataclass(frozen=True)
class CPMicrobatch:
    """A device's row of a CP group microbatch: what an engine needs to lay out and run it.

    Attributes:
      group: the :class:`CPGroup` (id, members, split sequences).
      member: this device's member index in ``group.members`` (which zigzag piece it holds).
      short: the short sequences packed after the pieces (a data-parallel microbatch's fields; may be empty).
    """

    group: CPGroup
    member: int
    short: Microbatch = dataclasses.field(default_factory=Microbatch.empty)

    def __post_init__(self):
        if not 0 <= self.member < self.group.size:
            raise ValueError(f"member {self.member} is outside group {self.group.group_id} of {self.group.size}")

    @property
    def device(self) -> int:
        return self.group.members[self.member]

    @property
    def num_columns(self) -> int:
        """Columns used: the pieces (end padding included) plus the short sequences."""
        return self.group.piece_columns + self.short.num_tokens

    @property
    def is_empty(self) -> bool:
        return False

    def row(self, token_cap: int) -> ZigzagRow:
        """Segment ids and positions of this row (:func:`~jodc.balance.zigzag.zigzag_row`): its piece of each split
        sequence in ``group.seq_indices`` order (segment ids 1..n), then its short sequences, then padding."""
        return zigzag_row(self.group.layouts(), self.member, token_cap, self.short.seq_lengths)


Item = Microbatch | CPMicrobatch


@dataclasses.dataclass(frozen=True)
class CPPlan:
    """Per device, the microbatches it runs in order (data-parallel and CP rows); the groups; minibatch facts.

    Attributes:
      devices: ``devices[d]`` is device ``d``'s microbatches in execution order.
      groups: every CP group, ``groups[g].group_id == g``.
      token_cap: ``T``, the columns of every row.
      planner, cost_model: names, for reports.
    """

    devices: tuple[tuple[Item, ...], ...]
    groups: tuple[CPGroup, ...]
    token_cap: int
    planner: str = ""
    cost_model: str = ""

    def __post_init__(self):
        object.__setattr__(self, "devices", tuple(tuple(device) for device in self.devices))
        object.__setattr__(self, "groups", tuple(self.groups))
        self.check()

    def check(self) -> None:
        """ValueError naming the first broken invariant (see the module docstring)."""
        cap = positive_int(self.token_cap, "token_cap")
        if not self.devices:
            raise ValueError("a plan needs at least one device")
        world = len(self.devices)
        for g, group in enumerate(self.groups):
            if group.group_id != g:
                raise ValueError(f"groups[{g}] has group_id {group.group_id}: groups must be listed by id")
            if max(group.members) >= world:
                raise ValueError(f"group {g} names device {max(group.members)}, outside the plan's {world} devices")
        rows_seen = {g: set() for g in range(len(self.groups))}
        seen: list[int] = []
        for d, device in enumerate(self.devices):
            last_group = -1
            for m, item in enumerate(device):
                where = f"device {d} microbatch {m}"
                if isinstance(item, CPMicrobatch):
                    g = item.group.group_id
                    if g >= len(self.groups) or self.groups[g] != item.group:
                        raise ValueError(f"{where} names group {g}, which is not the plan's group {g}")
                    if item.device != d:
                        raise ValueError(f"{where} is member {item.member} of group {g}, i.e. device {item.device}")
                    if g <= last_group:
                        raise ValueError(f"{where}: group {g} comes after group {last_group}; every device must run "
                                         "its CP microbatches in increasing group id (the deadlock-free order)")
                    last_group = g
                    rows_seen[g].add(item.member)
                    seen.extend(item.short.seq_indices)
                    if item.num_columns > cap:
                        raise ValueError(f"{where} needs {item.num_columns} columns ({item.group.piece_columns} for "
                                         f"its pieces, {item.short.num_tokens} short), over token_cap={cap}")
                elif isinstance(item, Microbatch):
                    seen.extend(item.seq_indices)
                    if item.num_tokens > cap:
                        raise ValueError(f"{where} holds {item.num_tokens} tokens, over token_cap={cap}")
                else:
                    raise ValueError(f"{where} is a {type(item).__name__}, not a Microbatch or CPMicrobatch")
        for g, members in rows_seen.items():
            if len(members) != self.groups[g].size:
                missing = sorted(set(range(self.groups[g].size)) - members)
                raise ValueError(f"group {g}: members {missing} have no row for it; every member runs the group")
            seen.extend(self.groups[g].seq_indices)
        counts = np.bincount(np.asarray(seen, dtype=np.int64), minlength=1) if seen else np.zeros(0, np.int64)
        if np.any(counts != 1):
            bad = np.flatnonzero(counts != 1)
            raise ValueError(f"every sequence must appear exactly once; sequence {int(bad[0])} appears "
                             f"{int(counts[bad[0]])} times")

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def total_sequences(self) -> int:
        return sum(len(g.seq_indices) for g in self.groups) + sum(
            len(item.short.seq_indices if isinstance(item, CPMicrobatch) else item.seq_indices)
            for device in self.devices for item in device)

    @property
    def num_cp_sequences(self) -> int:
        """Sequences split over a CP group (the loader's and the trainer's count)."""
        return sum(len(g.seq_indices) for g in self.groups)

    @property
    def total_tokens(self) -> int:
        return int(self.sequence_lengths().sum())

    def sequence_lengths(self) -> np.ndarray:
        """The minibatch's lengths in input order, int64."""
        out = np.zeros(self.total_sequences, dtype=np.int64)
        for g in self.groups:
            out[list(g.seq_indices)] = g.seq_lengths
        for device in self.devices:
            for item in device:
                mb = item.short if isinstance(item, CPMicrobatch) else item
                out[list(mb.seq_indices)] = mb.seq_lengths
        return out

    def microbatch_counts(self) -> tuple[int, ...]:
        return tuple(len(device) for device in self.devices)

    @property
    def is_lockstep(self) -> bool:
        """Equal counts on every device and every group at the same position on all its members (what a
        lock-step engine needs: step ``i`` of every device runs together)."""
        if len(set(self.microbatch_counts())) != 1:
            return False
        position = {}
        for device in self.devices:
            for m, item in enumerate(device):
                if isinstance(item, CPMicrobatch) and position.setdefault(item.group.group_id, m) != m:
                    return False
        return True

    def device_loads(self) -> np.ndarray:
        """The planner's cost per device: its data-parallel microbatches plus its groups' costs, float64."""
        return np.array([math.fsum(item.group.cost if isinstance(item, CPMicrobatch) else item.cost
                                   for item in device) for device in self.devices])
