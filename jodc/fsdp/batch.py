"""A minibatch as the engines consume it: per device, a stack of packed microbatches of T tokens.

Arrays have shape [devices, max_microbatches, T]; device d uses its first `counts[d]` microbatches (the rest are
padding that the ODC engine never touches and the collective engine runs as empty, loss-free work). `normalizer`
is the global number of loss tokens of the minibatch, so per-microbatch losses add up to the minibatch mean.

Across processes (jax.distributed) each process's engine reads only the rows of its own devices (the engines place
a batch with `sharding.put_per_device`, which takes each addressable device's row and nothing else), so a process
may leave the other processes' rows as zero placeholders (`minibatch_from_plan(..., devices=...)`); what every
device must know about the others (the counts, the tokens of every microbatch for the length buckets of lock-step
engines, the normaliser) is then in `counts`, `microbatch_tokens` and `normalizer`, computed from the plan.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jodc.balance import layout, pack_arrays

RESERVED = ("normalizer",)

FIELDS = ("tokens", "targets", "loss_mask", "positions", "segment_ids")


@dataclasses.dataclass
class MinibatchArrays:
    tokens: np.ndarray       # int32 [D, M, T] input ids
    targets: np.ndarray      # int32 [D, M, T] next-token ids (anything where loss_mask is 0)
    loss_mask: np.ndarray    # float32 [D, M, T] 1 where a token's prediction is trained
    positions: np.ndarray    # int32 [D, M, T] position within its sequence
    segment_ids: np.ndarray  # int32 [D, M, T] 0 = padding, 1.. = sequence within the row
    counts: np.ndarray       # int32 [D] real microbatches per device
    normalizer: float        # global loss-token count
    num_sequences: int = 0
    # int [D, M]: tokens of every device's microbatches, all devices' (from the plan), also where the rows are
    # placeholders; None: read from `segment_ids`
    microbatch_tokens: np.ndarray | None = None
    # more per-token fields for the loss ([D, M, T, ...] each), e.g. behaviour log-probs and advantages for RL
    extras: dict = dataclasses.field(default_factory=dict)
    # context parallelism (a `jodc.balance.CPPlan`, `jodc.fsdp.cp_batch`): per microbatch the size of its group
    # (int32 [D, M], 0: a plain microbatch), the group's members (int32 [D, M, D], heap positions in member order,
    # zero-padded past the size) and this device's member index (int32 [D, M]); None: no CP microbatch.
    # cp_split_segments (int32 [D, M]): how many split sequences the row holds (segments 1..n, the same on every
    # member; 0 on plain microbatches); None with the others given: one per CP row
    cp_size: np.ndarray | None = None
    cp_members: np.ndarray | None = None
    cp_member: np.ndarray | None = None
    cp_split_segments: np.ndarray | None = None
    num_cp_sequences: int = 0  # sequences split over CP groups

    def __post_init__(self):
        shape = self.tokens.shape
        if len(shape) != 3:
            raise ValueError(f"minibatch arrays must be [devices, microbatches, T], got tokens of shape {shape}")
        for f in FIELDS:
            arr = getattr(self, f)
            if arr.shape != shape:
                raise ValueError(f"minibatch field {f!r} has shape {arr.shape}, tokens have {shape}")
        for name, arr in self.extras.items():
            if name in FIELDS or name in RESERVED:
                raise ValueError(f"extra field {name!r} clashes with a built-in minibatch field")
            if tuple(np.shape(arr)[:3]) != shape:
                raise ValueError(f"extra field {name!r} has shape {np.shape(arr)}, it must start with {shape}")
        self.counts = np.asarray(self.counts, np.int32)
        if self.counts.shape != (shape[0],) or (self.counts < 0).any() or (self.counts > shape[1]).any():
            raise ValueError(f"counts {self.counts.tolist()} do not fit {shape[0]} devices x {shape[1]} microbatches")
        if self.microbatch_tokens is not None:
            self.microbatch_tokens = np.asarray(self.microbatch_tokens, np.int64)
            if self.microbatch_tokens.shape != shape[:2]:
                raise ValueError(f"microbatch_tokens has shape {self.microbatch_tokens.shape}, expected {shape[:2]}")
        cp = (self.cp_size, self.cp_members, self.cp_member)
        if any(x is not None for x in cp):
            if any(x is None for x in cp):
                raise ValueError("cp_size, cp_members and cp_member come together (all or none)")
            self.cp_size, self.cp_members, self.cp_member = (np.asarray(x, np.int32) for x in cp)
            if (self.cp_size.shape != shape[:2] or self.cp_member.shape != shape[:2]
                    or self.cp_members.shape != shape[:2] + (shape[0],)):
                raise ValueError(f"cp_size / cp_member must be {list(shape[:2])} and cp_members "
                                 f"{list(shape[:2]) + [shape[0]]}, got {self.cp_size.shape}, {self.cp_member.shape}, "
                                 f"{self.cp_members.shape}")
            self.cp_split_segments = _split_segments(self.cp_split_segments, self.cp_size, shape[2])
        elif self.cp_split_segments is not None:
            raise ValueError("cp_split_segments needs cp_size, cp_members and cp_member")
        if not self.normalizer > 0:
            raise ValueError(f"normalizer must be > 0 (the global loss-token count), got {self.normalizer}")

    @property
    def num_devices(self) -> int:
        return self.tokens.shape[0]

    @property
    def token_cap(self) -> int:
        return self.tokens.shape[2]

    @property
    def num_tokens(self) -> int:
        """Tokens of the whole minibatch (every device's, also those of placeholder rows)."""
        return int(self.tokens_per_microbatch().sum())

    def tokens_per_microbatch(self) -> np.ndarray:
        """int [D, M]: the tokens each device's microbatches hold (`microbatch_tokens`, else counted)."""
        if self.microbatch_tokens is not None:
            return self.microbatch_tokens
        return (np.asarray(self.segment_ids) > 0).sum(-1)

    @property
    def has_context_parallel(self) -> bool:
        """Whether some microbatch is a device's row of a context-parallel group."""
        return self.cp_size is not None and bool((self.cp_size > 0).any())

    def as_dict(self) -> dict[str, np.ndarray]:
        """Every per-token field (built-in and extras), as the engines hand them to the model's stages."""
        return {**{f: getattr(self, f) for f in FIELDS}, **self.extras}


def _split_segments(split_segments, cp_size: np.ndarray, token_cap: int) -> np.ndarray:
    """The per-microbatch counts of split sequences, checked: int32 [D, M] like `cp_size`, 1..T on CP rows (a CP
    row holds at least one split sequence, at most T / 2 pieces), 0 on plain ones. None: one per CP row."""
    if split_segments is None:
        return (cp_size > 0).astype(np.int32)
    split_segments = np.asarray(split_segments)
    if split_segments.shape != cp_size.shape or split_segments.dtype.kind not in "iu":
        raise ValueError(f"cp_split_segments must be integers of shape {list(cp_size.shape)} (like cp_size), got "
                         f"{split_segments.dtype}{list(split_segments.shape)}")
    cp_rows = cp_size > 0
    bad = np.argwhere(np.where(cp_rows, (split_segments < 1) | (split_segments > token_cap), split_segments != 0))
    if bad.size:
        d, j = (int(x) for x in bad[0])
        want = f"1..{token_cap} on a CP row" if cp_rows[d, j] else "0 on a plain microbatch"
        raise ValueError(f"cp_split_segments[{d}, {j}] is {int(split_segments[d, j])}; it must be {want}")
    return split_segments.astype(np.int32)


def minibatch_from_plan(plan, inputs, targets, loss_masks, extras: dict | None = None,
                        normalizer: float | None = None, devices=None) -> MinibatchArrays:
    """Packs a minibatch by a `jodc.balance.Plan`.

    Args:
      plan: the planner's output for these sequences (their lengths, in this order).
      inputs, targets: per sequence, int token arrays of its planned length (targets[t] is the token after
        inputs[t]).
      loss_masks: per sequence, 1 where the prediction of targets[t] is trained (e.g. completion tokens).
      extras: more per-token fields by name, each a list with one array per sequence ([s_i, ...]).
      normalizer: the global denominator the loss divides by (default: the total of `loss_masks`).
      devices: pack only these devices' rows (a process's own, across processes); the others stay zero
        placeholders, which the engines never read there (see the module docstring), and the arrays of the
        sequences on them are not read (any array of the right length, shape and dtype will do, e.g. a
        `np.broadcast_to` view). Default: every device.

    Device d gets all of its planned microbatches (empty ones from lock-step planners included); the microbatch
    axis is padded to the largest count with empty microbatches. The normaliser is the minibatch's total of
    `loss_masks`, the same on every device. A `jodc.balance.CPPlan` (sequences split over context-parallel
    groups) is packed by `jodc.fsdp.cp_batch.minibatch_from_cp_plan`.
    """
    from jodc.balance.cp_plan import CPPlan

    if isinstance(plan, CPPlan):
        from jodc.fsdp.cp_batch import minibatch_from_cp_plan

        return minibatch_from_cp_plan(plan, inputs, targets, loss_masks, extras=extras, normalizer=normalizer,
                                      devices=devices)
    num_devices = len(plan.devices)
    m = max(1, max(len(mbs) for mbs in plan.devices))
    t = plan.token_cap
    shape = (num_devices, m, t)
    fields = {"tokens": np.zeros(shape, np.int32), "targets": np.zeros(shape, np.int32),
              "loss_mask": np.zeros(shape, np.float32), "positions": np.zeros(shape, np.int32),
              "segment_ids": np.zeros(shape, np.int32)}
    packed = range(num_devices) if devices is None else sorted(set(devices))
    for d in packed:
        n = len(plan.devices[d])
        if n == 0:
            continue
        segment_ids, positions = layout(plan, d)
        fields["segment_ids"][d, :n] = segment_ids
        fields["positions"][d, :n] = positions
        fields["tokens"][d, :n] = pack_arrays(plan, d, [np.asarray(x, np.int32) for x in inputs])
        fields["targets"][d, :n] = pack_arrays(plan, d, [np.asarray(x, np.int32) for x in targets])
        fields["loss_mask"][d, :n] = pack_arrays(plan, d, [np.asarray(x, np.float32) for x in loss_masks])
    packed_extras = {}
    for name, per_sequence in (extras or {}).items():
        per_sequence = [np.asarray(x) for x in per_sequence]
        trailing = per_sequence[0].shape[1:] if per_sequence else ()
        dtype = np.result_type(*per_sequence) if per_sequence else np.float32
        out = np.zeros(shape + trailing, dtype)
        for d in packed:
            n = len(plan.devices[d])
            if n:
                out[d, :n] = pack_arrays(plan, d, per_sequence)
        packed_extras[name] = out
    if normalizer is None:
        normalizer = float(sum(float(np.sum(x)) for x in loss_masks))
    counts = np.array([len(mbs) for mbs in plan.devices], np.int32)
    microbatch_tokens = np.zeros((num_devices, m), np.int64)
    for d, mbs in enumerate(plan.devices):
        microbatch_tokens[d, :len(mbs)] = [sum(mb.seq_lengths) for mb in mbs]
    return MinibatchArrays(counts=counts, normalizer=max(float(normalizer), 1.0), num_sequences=len(inputs),
                           microbatch_tokens=microbatch_tokens, extras=packed_extras, **fields)
