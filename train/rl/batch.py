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
from typing import Callable, Sequence

import numpy as np

from jodc.fsdp import MinibatchArrays
from jodc.fsdp.batch import minibatch_from_plan

from .rollout import Rollout

_SPLIT_STREAM = 4  # random stream of the minibatch split (see rl_tasks for the others)


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
    return sequences_from_arrays(rollout.prompt_ids, rollout.response_ids, rollout.logprobs, advantages,
                                 topk_ids=rollout.topk_ids if with_topk else None,
                                 topk_logprobs=rollout.topk_logprobs if with_topk else None,
                                 ref_logprobs=ref_logprobs, trainer_logprobs=trainer_logprobs, returns=returns,
                                 old_values=old_values)


def sequences_from_arrays(prompt_ids: Sequence[np.ndarray], response_ids: Sequence[np.ndarray],
                          logprobs: Sequence[np.ndarray], advantages, *, topk_ids=None, topk_logprobs=None,
                          ref_logprobs=None, trainer_logprobs=None, returns=None, old_values=None
                          ) -> TrainingSequences:
    """`training_sequences` from per response arrays (any subset of a rollout: the sequences a process of a
    multi-process run trains on, `assembly.py`); the per-token extras that are None are left out."""
    n = len(response_ids)
    responses = response_ids
    if isinstance(advantages, (list, tuple)):
        if [len(a) for a in advantages] != [len(r) for r in responses]:
            raise ValueError("per-token advantages must hold one value per response token")
        per_token_advantages = [np.asarray(a, np.float32) for a in advantages]
    else:
        advantages = np.asarray(advantages, np.float32)
        if advantages.shape != (n,):
            raise ValueError(f"advantages must have shape ({n},), got {advantages.shape}")
        per_token_advantages = [np.full(len(r), a) for r, a in zip(responses, advantages)]
    per_token = {"behaviour_logprobs": logprobs,  # each extra's values at the response tokens
                 "advantages": per_token_advantages, "returns": returns, "old_values": old_values,
                 "topk_ids": topk_ids, "topk_logprobs": topk_logprobs,
                 "ref_logprobs": ref_logprobs, "trainer_logprobs": trainer_logprobs}
    tokens = [np.concatenate([p, r]).astype(np.int32) for p, r in zip(prompt_ids, responses)]

    def placed(values, dtype=np.float32) -> list[np.ndarray]:
        """Per sequence, the response tokens' `values` at their predicting positions (len(prompt) - 1 ...), zeros
        before."""
        arrays = [np.asarray(v, dtype) for v in values]
        return [np.concatenate([np.zeros((len(p) - 1,) + v.shape[1:], dtype), v])
                for p, v in zip(prompt_ids, arrays)]

    return TrainingSequences(
        inputs=[t[:-1] for t in tokens], targets=[t[1:] for t in tokens],
        loss_masks=placed([np.ones(len(r)) for r in responses]),
        extras={name: placed(v, np.int32 if name == "topk_ids" else np.float32) for name, v in per_token.items()
                if v is not None})


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
    if max(lengths) > token_cap:
        raise ValueError(f"a prompt + response of {max(lengths)} tokens exceeds engine.token_cap={token_cap}; "
                         "raise engine.token_cap or lower rollout.max_new_tokens")
    plan = planner(lengths, num_devices, token_cap, cost_model=cost_model)
    return plan.without_empty_microbatches() if skip_empty_microbatches else plan


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
