"""A planner's plan + the minibatch's examples -> the `MinibatchArrays` an engine steps on.

The packing itself is `jodc.fsdp.batch.minibatch_from_plan` (sequences back to back per row, segment ids 1, 2, ...
per sequence and 0 over padding, positions restarting at 0, rows padded to the largest per-device count with
empty microbatches). This module supplies what SFT adds: targets are the next token within the same sequence and
the loss mask is the example's completion mask shifted onto its targets, so the last token of every sequence
(which has no next token) is never trained; the normalizer is the whole minibatch's number of trained tokens,
so the loss is a global per-token mean; and for ODC the lock-step planners' empty microbatches are dropped.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from jodc.balance import Plan
from jodc.balance.cp_plan import CPPlan
from jodc.fsdp import MinibatchArrays
from jodc.fsdp.batch import minibatch_from_plan

from .data import Example


def shifted_targets(example: Example) -> tuple[np.ndarray, np.ndarray]:
    """(targets, loss mask) of one sequence: targets[i] = tokens[i + 1] (0 at the end, untrained), mask likewise."""
    targets = np.append(example.tokens[1:], np.int32(0)).astype(np.int32)
    mask = np.append(example.loss_mask[1:], False).astype(np.float32)
    return targets, mask


def minibatch_arrays(plan: Plan | CPPlan, examples: Sequence[Example], *, skip_empty_microbatches: bool = False
                     ) -> MinibatchArrays:
    """Packs `examples` (the minibatch, in the plan's sequence-index order) as `plan` says.

    skip_empty_microbatches: drop the plan's empty microbatches (right for ODC; a lock-step collective engine
    runs max(counts) microbatches on every device anyway).
    """
    if plan.total_sequences != len(examples):
        raise ValueError(f"the plan covers {plan.total_sequences} sequences, the minibatch has {len(examples)}")
    lengths = plan.sequence_lengths()
    for i, example in enumerate(examples):
        if example.length != lengths[i]:
            raise ValueError(f"sequence {i} has {example.length} tokens, the plan was made for {lengths[i]}")
    shifted = [shifted_targets(e) for e in examples]
    if not any(mask.any() for _, mask in shifted):
        raise ValueError("the minibatch has no trained token (every example's loss mask is empty)")
    if skip_empty_microbatches and isinstance(plan, Plan):  # a CPPlan (context parallelism) has none
        plan = plan.without_empty_microbatches()
    return minibatch_from_plan(plan, [e.tokens for e in examples], [t for t, _ in shifted],
                               [m for _, m in shifted])
