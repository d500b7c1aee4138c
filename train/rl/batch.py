"""A scored rollout -> training sequences -> the minibatches of one RL step, packed for the engines.

Sequence i is `prompt_i + response_i`; the model reads tokens[:-1] and predicts tokens[1:], and the loss covers
the predictions of response tokens. Per predicted position the sequence carries the extras the objective reads:
the behaviour log-prob of the sampled token, the response's advantage, and when used the behaviour top-k and the
reference log-prob (prompt positions hold zeros and are masked out).

The rollout is shuffled (a pure function of the seed and the step) and cut into `updates_per_step` minibatches
of near-equal size (`split_minibatches`); each is balanced over the devices by the planner (LB-Mini for ODC: by
compute cost, so devices may run different numbers of microbatches; `plan_minibatch`, a pure function of the
lengths, so processes that hold only some of the sequences plan alike: `assembly.py`) and packed. Every update
after the first sees a policy the rollout did not come from: the off-policy regime the trust region is for. The
loss normaliser is the minibatch's total number of response tokens (token-mean) or of responses (sequence-level
aggregations).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import numpy as np

from jodc.fsdp import MinibatchArrays
from jodc.balance import CP_PLANNERS
from jodc.balance.cp_plan import CPMicrobatch
from jodc.fsdp.batch import minibatch_from_plan

from ..core.distributed import check_agreement, digest
from .rollout import Rollout

_SPLIT_STREAM = 4  # random stream of the minibatch split (see rl_tasks for the others)


@dataclasses.dataclass(frozen=True)
class ExtraField:
    """A per-token minibatch extra the RL head may read: its dtype, whether it has a trailing axis of the behaviour
    top-k's K, and whether it travels with its sequence between processes (the rollout's arrays and the forward
    passes' log-probs) or is computed in every process from what the layout exchanged (advantages, returns, old
    values)."""

    dtype: type
    top_k_axis: bool = False
    travels: bool = True


#: Every per-token extra, the one place that describes them; the objective chooses which it reads
#: (`PolicyObjective.extras`), and the training sequences, the placeholders of rows packed elsewhere and the
#: sequences sent between processes all follow that choice.
EXTRA_FIELDS = {
    "behaviour_logprobs": ExtraField(np.float32),
    "advantages": ExtraField(np.float32, travels=False),
    "topk_ids": ExtraField(np.int32, top_k_axis=True),
    "topk_logprobs": ExtraField(np.float32, top_k_axis=True),
    "ref_logprobs": ExtraField(np.float32),
    "trainer_logprobs": ExtraField(np.float32),
    "returns": ExtraField(np.float32, travels=False),
    "old_values": ExtraField(np.float32, travels=False),
}


def extra_specs(names: Sequence[str], top_k: int) -> dict[str, tuple[type, tuple[int, ...]]]:
    """{extra: (dtype, trailing shape)} of the extras `names` (the objective's), as the training sequences hold
    them (the placeholders of sequences packed elsewhere take them)."""
    return {n: (EXTRA_FIELDS[n].dtype, (top_k,) if EXTRA_FIELDS[n].top_k_axis else ()) for n in names}


def travelling_fields(names: Sequence[str]) -> tuple[str, ...]:
    """The per response arrays a sequence travels with when the objective reads the extras `names`: its tokens and
    the extras that are not computed in every process."""
    return ("prompt_ids", "response_ids") + tuple(n for n in names if EXTRA_FIELDS[n].travels)


@dataclasses.dataclass
class TrainingSequences:
    """Per sequence arrays of length s_i = len(prompt) + len(response) - 1 (extras [s_i, K] for top-k)."""

    inputs: list[np.ndarray]
    targets: list[np.ndarray]
    loss_masks: list[np.ndarray]
    extras: dict[str, list[np.ndarray]]

    def __len__(self) -> int:
        return len(self.inputs)

    @property
    def lengths(self) -> list[int]:
        return [len(x) for x in self.inputs]


def training_sequences(rollout: Rollout, advantages, *, with_topk: bool = False,
                       ref_logprobs: Sequence[np.ndarray] | None = None,
                       trainer_logprobs: Sequence[np.ndarray] | None = None,
                       returns: Sequence[np.ndarray] | None = None,
                       old_values: Sequence[np.ndarray] | None = None) -> TrainingSequences:
    """The rollout's training sequences; `advantages` [N] per response, or (critic PPO) a list of per response
    token arrays; `ref_logprobs` (reference policy), `trainer_logprobs` (the trainer's recomputed old / proximal
    log-probs), and for critic PPO `returns` and `old_values` (the value targets and the rollout's values) per
    response token."""
    if with_topk and rollout.topk_ids is None:
        raise ValueError("the objective needs the behaviour top-k, but the rollout did not store it")
    extras = {"behaviour_logprobs": rollout.logprobs, "ref_logprobs": ref_logprobs,
              "trainer_logprobs": trainer_logprobs, "returns": returns, "old_values": old_values}
    if with_topk:
        extras.update(topk_ids=rollout.topk_ids, topk_logprobs=rollout.topk_logprobs)
    return sequences_from_arrays(rollout.prompt_ids, rollout.response_ids, advantages, extras)


def sequences_from_arrays(prompt_ids: Sequence[np.ndarray], response_ids: Sequence[np.ndarray], advantages,
                          extras: dict[str, Sequence[np.ndarray] | None]) -> TrainingSequences:
    """The training sequences of per response arrays (any subset of a rollout: the sequences a process of a
    multi-process run trains on, `local_sequences`): `advantages` [N] or per response token arrays, and per
    response token the `extras` (names of `EXTRA_FIELDS`; those that are None are left out)."""
    unknown = set(extras) - set(EXTRA_FIELDS)
    if unknown:
        raise ValueError(f"unknown minibatch extras {sorted(unknown)} (known: {list(EXTRA_FIELDS)})")
    n = len(response_ids)
    if isinstance(advantages, (list, tuple)):
        if [len(a) for a in advantages] != [len(r) for r in response_ids]:
            raise ValueError("per-token advantages must hold one value per response token")
        per_token_advantages = [np.asarray(a, np.float32) for a in advantages]
    else:
        advantages = np.asarray(advantages, np.float32)
        if advantages.shape != (n,):
            raise ValueError(f"advantages must have shape ({n},), got {advantages.shape}")
        per_token_advantages = [np.full(len(r), a) for r, a in zip(response_ids, advantages)]
    per_token = {**extras, "advantages": per_token_advantages}  # each extra's values at the response tokens
    tokens = [np.concatenate([p, r]).astype(np.int32) for p, r in zip(prompt_ids, response_ids)]

    def placed(values, dtype=np.float32) -> list[np.ndarray]:
        """Per sequence, the response tokens' `values` at their predicting positions (len(prompt) - 1 ...), zeros
        before."""
        arrays = [np.asarray(v, dtype) for v in values]
        return [np.concatenate([np.zeros((len(p) - 1,) + v.shape[1:], dtype), v])
                for p, v in zip(prompt_ids, arrays)]

    return TrainingSequences(
        inputs=[t[:-1] for t in tokens], targets=[t[1:] for t in tokens],
        loss_masks=placed([np.ones(len(r)) for r in response_ids]),
        extras={name: placed(per_token[name], EXTRA_FIELDS[name].dtype) for name in EXTRA_FIELDS
                if per_token.get(name) is not None})


def local_sequences(received: dict[int, dict[str, np.ndarray]], advantages, *, returns=None, old_values=None
                    ) -> tuple[list[int], TrainingSequences]:
    """(the response indices, ascending; their training sequences) of the responses this process trains on:
    `received` {response: its travelling arrays} (`assembly.send_sequences`); `advantages` [N] (or per response
    token arrays), `returns` and `old_values` (per response, critic PPO) are the whole rollout's."""
    ids = sorted(received)
    if not ids:
        return ids, sequences_from_arrays([], [], np.zeros(0, np.float32), {})

    def of_all(values):
        return None if values is None else [values[i] for i in ids]

    adv = [advantages[i] for i in ids] if isinstance(advantages, (list, tuple)) else np.asarray(advantages)[ids]
    extras = {name: [received[i][name] for i in ids] for name in received[ids[0]] if name in EXTRA_FIELDS}
    return ids, sequences_from_arrays([received[i]["prompt_ids"] for i in ids],
                                      [received[i]["response_ids"] for i in ids], adv,
                                      {**extras, "returns": of_all(returns), "old_values": of_all(old_values)})


def split_minibatches(num_sequences: int, updates: int, *, seed: int, step: int) -> list[np.ndarray]:
    """`updates` disjoint index sets covering 0..num_sequences-1 in a seeded random order (sizes differ by at
    most one)."""
    if not 1 <= updates <= num_sequences:
        raise ValueError(f"cannot split {num_sequences} sequences into {updates} minibatches")
    order = np.random.default_rng([seed, _SPLIT_STREAM, step]).permutation(num_sequences)
    return [np.sort(part) for part in np.array_split(order, updates)]


def minibatch_normalizer(response_lengths: Sequence[int], aggregation: str) -> float:
    """The minibatch's global denominator from its responses' token counts: response tokens (token-mean) or
    responses with at least one token (seq-* aggregations)."""
    if aggregation == "token-mean":
        return float(sum(int(n) for n in response_lengths))
    return float(sum(1 for n in response_lengths if n > 0))


def plan_minibatch(lengths: Sequence[int], *, planner: Callable, num_devices: int, token_cap: int, cost_model,
                   skip_empty_microbatches: bool = True):
    """The plan of a minibatch of sequences of `lengths` (a pure function of them: every process of a run computes
    the same). ValueError when a sequence exceeds `token_cap`."""
    lengths = [int(n) for n in lengths]
    # a CP planner (possibly wrapped, e.g. timed) splits longer sequences over groups, up to the world's capacity
    context_parallel = getattr(planner, "__wrapped__", planner) in CP_PLANNERS.values()
    if max(lengths) > token_cap and not context_parallel:
        raise ValueError(f"a prompt + response of {max(lengths)} tokens exceeds engine.token_cap={token_cap}; "
                         "raise engine.token_cap or lower rollout.max_new_tokens (or set engine.context_parallel)")
    plan = planner(lengths, num_devices, token_cap, cost_model=cost_model)
    return plan.without_empty_microbatches() if skip_empty_microbatches and not context_parallel else plan


def pack_minibatch(sequences: TrainingSequences, indices: np.ndarray, *, planner: Callable, num_devices: int,
                   token_cap: int, cost_model, aggregation: str, skip_empty_microbatches: bool = True
                   ) -> tuple[object, MinibatchArrays]:
    """(plan, engine arrays) of the sequences at `indices`. ValueError when a sequence exceeds `token_cap`."""
    plan = plan_minibatch([sequences.lengths[i] for i in indices], planner=planner, num_devices=num_devices,
                          token_cap=token_cap, cost_model=cost_model, skip_empty_microbatches=skip_empty_microbatches)
    masks = [sequences.loss_masks[i] for i in indices]
    arrays = minibatch_from_plan(plan, [sequences.inputs[i] for i in indices], [sequences.targets[i] for i in indices],
                                 masks, extras={k: [v[i] for i in indices] for k, v in sequences.extras.items()},
                                 normalizer=minibatch_normalizer([int(m.sum()) for m in masks], aggregation))
    return plan, arrays


def plan_step(scored, advantages, *, updates: int, seed: int, step: int, planner: Callable, num_devices: int,
              token_cap: int, cost_model, skip_empty_microbatches: bool) -> tuple[list[np.ndarray], list]:
    """(the step's minibatches as response index sets, their plans): the seeded split (`split_minibatches`) and each
    minibatch's plan over the global lengths (`plan_minibatch`), which every process computes alike from the
    exchanged metadata; across processes checked to agree, with the rewards and advantages they came from, before
    anything is sent (`core.distributed.check_agreement`)."""
    splits = split_minibatches(len(scored), updates, seed=seed, step=step)
    plans = [plan_minibatch(scored.sequence_lengths[indices], planner=planner, num_devices=num_devices,
                            token_cap=token_cap, cost_model=cost_model,
                            skip_empty_microbatches=skip_empty_microbatches) for indices in splits]
    computed_here = functools.partial(step_digest, scored, advantages, splits, plans)  # only across processes
    check_agreement(f"step {step + 1}'s rewards, lengths, advantages and plans", computed_here)
    return splits, plans


def placed_sequences(item) -> tuple[int, ...]:
    """The sequences a plan's microbatch holds on its device: a plain microbatch's, or a CP row's split sequences
    (a piece of each) and its own short ones."""
    if isinstance(item, CPMicrobatch):
        return item.group.seq_indices + item.short.seq_indices
    return item.seq_indices


def step_digest(scored, advantages, minibatches: Sequence[np.ndarray], plans: Sequence) -> np.ndarray:
    """A digest of what every process computes from the exchanged metadata (`scored`'s rewards, lengths and
    versions, the advantages, the minibatch split and the plans' placement): what `plan_step` compares."""
    adv = list(advantages) if isinstance(advantages, (list, tuple)) else [np.asarray(advantages)]
    placement = [np.array([(d, m, i) for d, device in enumerate(plan.devices) for m, mb in enumerate(device)
                           for i in placed_sequences(mb)], np.int64) for plan in plans]
    return digest([scored.rewards, scored.prompt_lengths, scored.response_lengths, scored.versions, *adv,
                   *minibatches, *placement])


def pack_local_minibatch(plan, indices: np.ndarray, ids: list[int], sequences: TrainingSequences, *,
                         sequence_lengths: np.ndarray, response_lengths: np.ndarray, local_devices: Sequence[int],
                         specs: dict[str, tuple[Any, tuple[int, ...]]], aggregation: str) -> MinibatchArrays:
    """The minibatch of responses `indices` (global) packed by `plan`, only the rows of `local_devices` filled from
    `sequences` (responses `ids`); the normaliser from the global response lengths (`minibatch_normalizer`)."""
    where = {i: k for k, i in enumerate(ids)}
    lengths = [int(sequence_lengths[i]) for i in indices]

    def per_position(values, dtype, trailing=()):
        return [values[where[i]] if i in where else np.broadcast_to(np.zeros((), dtype), (n,) + trailing)
                for i, n in zip(indices, lengths)]

    masks_total = minibatch_normalizer([response_lengths[i] for i in indices], aggregation)
    extras = {name: per_position(sequences.extras.get(name, {}), dtype, trailing)
              for name, (dtype, trailing) in specs.items()}
    return minibatch_from_plan(plan, per_position(sequences.inputs, np.int32),
                               per_position(sequences.targets, np.int32),
                               per_position(sequences.loss_masks, np.float32),
                               extras=extras, normalizer=masks_total, devices=local_devices)
