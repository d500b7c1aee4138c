"""The plan a planner hands to an engine: per device, an ordered list of microbatches.

Conventions for filling a microbatch's ``[T]`` buffer (``T = token_cap``):

* the microbatch's sequences are laid out back to back from position 0, in the order of ``seq_indices``;
* ``segment_ids[t]`` is ``j + 1`` for a token of the microbatch's ``j``-th sequence, and ``0`` for padding.
  Segment ids are local to the microbatch (1, 2, ...), not global sequence indices: attention only compares
  them for equality, and a token may attend to another only when both carry the same non-zero id;
* ``positions[t]`` is the token's position within its own sequence (0, 1, ..., s - 1; RoPE restarts per
  sequence), and ``0`` for padding.

An *empty* microbatch (``seq_indices == ()``, ``num_tokens == 0``) is all padding. Planners add empty microbatches
only to give every device the same count for lock-step (collective) engines; an ODC engine may skip them.

Loss normalisers are global: ``total_tokens`` and ``total_sequences`` count the whole minibatch across all devices,
so every device divides by the same numbers (DESIGN.md section 2). A trainer that only counts some tokens (say,
response tokens in SFT) computes its own global count the same way, from the same plan.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from jodc.balance.validation import positive_int


@dataclasses.dataclass(frozen=True)
class Microbatch:
    """One forward + backward on one device: some sequences packed into one buffer.

    Attributes:
      seq_indices: indices of the sequences into the minibatch's input list, in buffer order.
      seq_lengths: their lengths, same order.
      cost: the planner's cost-model cost of the microbatch (sum over its sequences).
    """

    seq_indices: tuple[int, ...]
    seq_lengths: tuple[int, ...]
    cost: float

    def __post_init__(self):
        object.__setattr__(self, "seq_indices", tuple(int(i) for i in self.seq_indices))
        object.__setattr__(self, "seq_lengths", tuple(int(s) for s in self.seq_lengths))
        object.__setattr__(self, "cost", float(self.cost))
        if len(self.seq_indices) != len(self.seq_lengths):
            raise ValueError(
                f"a microbatch needs one length per sequence: {len(self.seq_indices)} indices, "
                f"{len(self.seq_lengths)} lengths"
            )
        if any(i < 0 for i in self.seq_indices):
            raise ValueError(f"sequence indices must be >= 0, got {self.seq_indices}")
        if any(s < 1 for s in self.seq_lengths):
            raise ValueError(f"sequence lengths must be >= 1, got {self.seq_lengths}")
        if not (math.isfinite(self.cost) and self.cost >= 0):
            raise ValueError(f"microbatch cost must be finite and >= 0, got {self.cost}")

    @classmethod
    def empty(cls) -> "Microbatch":
        """A microbatch with no sequences (all padding), used to equalise counts across devices."""
        return cls((), (), 0.0)

    @property
    def num_tokens(self) -> int:
        """Tokens actually used in the buffer (the rest is padding)."""
        return sum(self.seq_lengths)

    @property
    def is_empty(self) -> bool:
        return not self.seq_indices

    def _check_buffer(self, buffer_len: int) -> int:
        buffer_len = positive_int(buffer_len, "buffer_len")
        if buffer_len < self.num_tokens:
            raise ValueError(f"buffer_len={buffer_len} is shorter than the microbatch's {self.num_tokens} tokens")
        return buffer_len

    def segment_ids(self, buffer_len: int) -> np.ndarray:
        """int32 ``[buffer_len]``: ``j + 1`` over the ``j``-th sequence, 0 over padding."""
        out = np.zeros(self._check_buffer(buffer_len), dtype=np.int32)
        start = 0
        for j, length in enumerate(self.seq_lengths):
            out[start : start + length] = j + 1
            start += length
        return out

    def positions(self, buffer_len: int) -> np.ndarray:
        """int32 ``[buffer_len]``: position of each token within its own sequence, 0 over padding."""
        out = np.zeros(self._check_buffer(buffer_len), dtype=np.int32)
        start = 0
        for length in self.seq_lengths:
            out[start : start + length] = np.arange(length, dtype=np.int32)
            start += length
        return out


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per device, the microbatches it runs in order; plus the minibatch-wide facts every device needs.

    Construction checks the invariants: every sequence index ``0 .. total_sequences - 1`` appears exactly once
    across all devices, and no microbatch holds more than ``token_cap`` tokens.

    Attributes:
      devices: ``devices[d]`` is device ``d``'s microbatches, in execution order (heaviest first).
      token_cap: ``T``, the buffer length of every microbatch.
      planner: the planner's name (for reports).
      cost_model: the name of the cost model behind the ``cost`` fields.
    """

    devices: tuple[tuple[Microbatch, ...], ...]
    token_cap: int
    planner: str = ""
    cost_model: str = ""

    def __post_init__(self):
        object.__setattr__(self, "devices", tuple(tuple(device) for device in self.devices))
        positive_int(self.token_cap, "token_cap")
        if not self.devices:
            raise ValueError("a plan needs at least one device")
        seen = sorted(i for device in self.devices for mb in device for i in mb.seq_indices)
        if seen != list(range(len(seen))):
            duplicates = sorted({i for i in seen if seen.count(i) > 1})
            missing = sorted(set(range(max(seen, default=-1) + 1)) - set(seen))
            raise ValueError(
                "every sequence must appear exactly once: "
                + (f"duplicated {duplicates[:5]} " if duplicates else "")
                + (f"missing {missing[:5]}" if missing else "")
            )
        for d, device in enumerate(self.devices):
            for m, mb in enumerate(device):
                if not isinstance(mb, Microbatch):
                    raise ValueError(f"device {d} item {m} is a {type(mb).__name__}, not a Microbatch")
                if mb.num_tokens > self.token_cap:
                    raise ValueError(
                        f"device {d} microbatch {m} holds {mb.num_tokens} tokens, over token_cap={self.token_cap}"
                    )

    def without_empty_microbatches(self) -> "Plan":
        """This plan minus its empty microbatches (an ODC engine need not run the padding lock-step planners add)."""
        return dataclasses.replace(self, devices=tuple(tuple(mb for mb in device if not mb.is_empty)
                                                       for device in self.devices))

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def total_sequences(self) -> int:
        """Sequences in the whole minibatch (the global sequence-count normaliser)."""
        return sum(len(mb.seq_indices) for device in self.devices for mb in device)

    @property
    def total_tokens(self) -> int:
        """Tokens in the whole minibatch (the global token-count normaliser)."""
        return sum(mb.num_tokens for device in self.devices for mb in device)

    def microbatch_counts(self) -> tuple[int, ...]:
        """Microbatches per device, empty ones included."""
        return tuple(len(device) for device in self.devices)

    @property
    def is_lockstep(self) -> bool:
        """Whether every device has the same number of microbatches (what a collective engine needs)."""
        return len(set(self.microbatch_counts())) == 1

    def device_costs(self) -> np.ndarray:
        """Sum of microbatch costs per device, float64 ``[num_devices]``."""
        return np.array([sum(mb.cost for mb in device) for device in self.devices], dtype=np.float64)

    def device_tokens(self) -> np.ndarray:
        """Tokens per device, int64 ``[num_devices]``."""
        return np.array([sum(mb.num_tokens for mb in device) for device in self.devices], dtype=np.int64)

    def sequence_lengths(self) -> np.ndarray:
        """The minibatch's lengths in input order, int64 ``[total_sequences]`` (recovered from the plan)."""
        out = np.zeros(self.total_sequences, dtype=np.int64)
        for device in self.devices:
            for mb in device:
                out[list(mb.seq_indices)] = mb.seq_lengths
        return out

    def sequence_devices(self) -> np.ndarray:
        """The device each sequence is assigned to, int64 ``[total_sequences]``."""
        out = np.zeros(self.total_sequences, dtype=np.int64)
        for d, device in enumerate(self.devices):
            for mb in device:
                out[list(mb.seq_indices)] = d
        return out

    def padded_to_equal_counts(self) -> "Plan":
        """The same plan with empty microbatches appended so every device has the largest count."""
        most = max(self.microbatch_counts())
        devices = tuple(device + (Microbatch.empty(),) * (most - len(device)) for device in self.devices)
        return dataclasses.replace(self, devices=devices)
