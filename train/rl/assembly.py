"""An RL step's minibatches across processes without replicating the rollout (`rollout.assembly: sharded`, the
default under `mpirun`); `layout.py` calls these pieces, and in one process (or replicated) the trainer's path is
the same with nothing exchanged.

Each process samples and scores only its share of a step's prompts (`RolloutSampler`). Instead of all-gathering
the scored shares (`rollout.assembly: replicated`: every process then holds, scores the passes of, and packs the
whole rollout), the processes exchange three things:

1. `exchange_rollout`, where the shares were exchanged (the sampler's thread, so the asynchronous sampler works
   across processes as before): per response only what is needed globally, `ShareMeta` (prompt and response
   lengths, finished flags, rewards, policy versions, the partial sums of the mismatch metrics). Every process gets
   a `StepRollout` (scored.py): its own share's arrays and the whole rollout's metadata.
2. `exchange_step_inputs`, in the trainer after the per-sequence forward passes (reference log-probs, recomputed
   trainer log-probs, critic values), which each process runs on its own share only: what the batch-level
   quantities read, per response token, only when the objective has them: the log-probs and reference log-probs of
   the KL in the reward (its batch KL drives the controller) and the critic's values (GAE whitens the advantages
   over the whole rollout). Every process then computes the advantages (and returns) of the whole rollout from the
   same numbers as one process does, bit for bit.
3. `send_sequences`, after the minibatch plans, which every process computes identically from the global metadata
   (`split_minibatches`, then the planner over the lengths): each sequence's arrays (tokens, behaviour log-probs
   and top-k, reference / recomputed log-probs) go point-to-point to the one process whose device the plan puts it
   on; a process builds the training sequences of its devices only and packs only its devices' rows of each
   minibatch (`pack_local_minibatch`: the others' rows are zero placeholders, which the engines never read:
   `jodc.fsdp.batch`, `sharding.put_per_device`).

Every exchange has `rollout_exchange`'s semantics (MPI point-to-point, non-blocking, polled: a process that fails
sends its error, one that sends nothing within the timeout is named; every process raises `RolloutShareError`).
Before the first update the processes compare a digest of what they computed from the exchanged metadata
(rewards, lengths, advantages, plans): `assembly_digest`.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import numpy as np

from jodc.fsdp import MinibatchArrays
from jodc.fsdp.batch import minibatch_from_plan

from ..core.distributed import digest
from .batch import TrainingSequences, minibatch_normalizer, sequences_from_arrays
from .rollout_exchange import ASSEMBLY_TAGS, exchange, gather_shares
from .scored import ScoredRollout, ShareMeta, StepRollout


def exchange_rollout(step: int, share: Callable[[], ScoredRollout], *, process: int,
                     timeout_s: float | None) -> StepRollout:
    """Step `step`'s rollout across processes: this process's `share()` (kept here) and every process's
    `ShareMeta` (exchanged; a share that fails or does not come fails every process, `gather_shares`)."""
    started = time.perf_counter()
    kept: list[ScoredRollout] = []

    def produce() -> ShareMeta:
        kept.append(share())
        return ShareMeta.of(kept[0])

    metas = gather_shares(produce, what=f"step {step + 1}'s rollout", timeout_s=timeout_s)
    own = kept[0]
    waited = max(0.0, time.perf_counter() - started - own.seconds)
    return StepRollout.from_metas(own, metas, process, exchange_seconds=waited)


@dataclasses.dataclass
class StepInputs:
    """The per-sequence forward passes of one process's share (per response lists, None where not run) and what
    the batch-level quantities need of every process's (per response over the whole rollout, None where not
    needed)."""

    ref_logprobs: list[np.ndarray] | None
    old_logprobs: list[np.ndarray] | None
    values: list[np.ndarray] | None
    kl_logprobs_all: list[np.ndarray] | None = None  # the log-probs the KL in the reward is taken from
    ref_logprobs_all: list[np.ndarray] | None = None
    values_all: list[np.ndarray] | None = None


def exchange_step_inputs(step: int, passes: Callable[[], StepInputs], *, kl_in_reward: bool, critic: bool,
                         behaviour_logprobs: Sequence[np.ndarray], timeout_s: float | None) -> StepInputs:
    """Runs `passes()` (this process's share's forward passes) and exchanges with every process what the KL in the
    reward (`kl_in_reward`: the log-probs it is taken from, the recomputed ones where `passes` gave them, else
    `behaviour_logprobs`, and the reference's) and GAE (`critic`: the values) read over the whole rollout. A pass
    that fails in any process fails every process (`rollout_exchange.exchange`), naming it."""
    kept: list[StepInputs] = []

    def produce():
        own = passes()
        kept.append(own)
        kl = own.old_logprobs if own.old_logprobs is not None else list(behaviour_logprobs)
        return ((kl, own.ref_logprobs) if kl_in_reward else None, own.values if critic else None)

    parts = gather_shares(produce, what=f"step {step + 1}'s forward passes", timeout_s=timeout_s,
                          tags=ASSEMBLY_TAGS)
    own = kept[0]
    if kl_in_reward:
        own.kl_logprobs_all = [x for kl, _ in (p[0] for p in parts) for x in kl]
        own.ref_logprobs_all = [x for _, ref in (p[0] for p in parts) for x in ref]
    if critic:
        own.values_all = [x for p in parts for x in p[1]]
    return own


def sequence_destinations(plans: Sequence, minibatches: Sequence[np.ndarray], device_processes: Sequence[int],
                          num_sequences: int) -> np.ndarray:
    """int [N]: for every response of the step, the process whose device its minibatch's plan puts it on."""
    out = np.full(num_sequences, -1, np.int64)
    for plan, indices in zip(plans, minibatches):
        for d, microbatches in enumerate(plan.devices):
            for mb in microbatches:
                out[np.asarray(indices)[list(mb.seq_indices)]] = device_processes[d]
    if (out < 0).any():
        raise ValueError(f"the plans place no device for responses {np.flatnonzero(out < 0)[:5].tolist()}")
    return out


def _travelling_fields(with_topk: bool, with_ref: bool, with_old: bool) -> tuple[str, ...]:
    """The per response arrays a sequence travels with: those the objective reads (advantages, returns and old
    values are computed in every process from the exchanged inputs and never travel)."""
    return (("prompt_ids", "response_ids", "logprobs") + (("topk_ids", "topk_logprobs") if with_topk else ())
            + (("ref_logprobs",) if with_ref else ()) + (("trainer_logprobs",) if with_old else ()))


def send_sequences(step: int, scored: StepRollout, destinations: np.ndarray, inputs: StepInputs, *, process: int,
                   processes: int, with_topk: bool, with_ref: bool, with_old: bool, timeout_s: float | None
                   ) -> dict[int, dict[str, np.ndarray]]:
    """{response index: its arrays} of every response the plans put on process `process`'s devices (`destinations`:
    each response's process): those it holds without a copy; unless it holds them all (one process, or
    replicated), it sends each of its responses to the process `destinations` names (point-to-point, nothing to a
    process that trains none of them) and receives the others'. `with_*`: the behaviour top-k, the reference's and
    the recomputed log-probs travel too."""
    fields = _travelling_fields(with_topk, with_ref, with_old)
    held = scored.held
    r = scored.own.rollout
    per_field = {"prompt_ids": r.prompt_ids, "response_ids": r.response_ids, "logprobs": r.logprobs,
                 "topk_ids": r.topk_ids, "topk_logprobs": r.topk_logprobs, "ref_logprobs": inputs.ref_logprobs,
                 "trainer_logprobs": inputs.old_logprobs}

    def arrays(k: int) -> dict[str, np.ndarray]:
        return {f: per_field[f][k] for f in fields}

    local = {i: arrays(k) for k, i in enumerate(held) if destinations[i] == process}
    if scored.holds_all:
        return local

    def produce():
        out: list[Any] = [None] * processes  # nothing to a process that trains none of them
        for p in set(int(destinations[i]) for i in held) - {process}:  # this process's own stay here
            out[p] = _packed([(i, arrays(k)) for k, i in enumerate(held) if destinations[i] == p], fields)
        return out

    parts = exchange(produce, what=f"step {step + 1}'s training sequences", timeout_s=timeout_s, tags=ASSEMBLY_TAGS)
    received = {i: a for part in parts if part is not None for i, a in _unpacked(part).items()}
    received.update(local)
    return received


def _packed(sequences: list[tuple[int, dict[str, np.ndarray]]], fields: Sequence[str]) -> dict[str, np.ndarray]:
    """Sequences' arrays as one message: per field the arrays concatenated, with every sequence's length (a
    pickled array per sequence and field would cost more in pickle framing than the tokens themselves)."""
    out = {"ids": np.array([i for i, _ in sequences], np.int64)}
    for f in fields:
        values = [a[f] for _, a in sequences]
        out[f] = np.concatenate(values)
        out[f"{f}/lengths"] = np.array([len(v) for v in values], np.int64)
    return out


def _unpacked(message: dict[str, np.ndarray]) -> dict[int, dict[str, np.ndarray]]:
    """{sequence: {field: array}} of a `_packed` message (the same values, bit for bit)."""
    fields = [f for f in message if f != "ids" and not f.endswith("/lengths")]
    split = {f: np.split(message[f], np.cumsum(message[f"{f}/lengths"])[:-1]) for f in fields}
    return {int(i): {f: split[f][n] for f in fields} for n, i in enumerate(message["ids"])}


def local_sequences(received: dict[int, dict[str, np.ndarray]], advantages, *, returns=None, old_values=None
                    ) -> tuple[list[int], TrainingSequences]:
    """(the response indices, ascending; their training sequences) of the responses this process trains on.
    `advantages` [N] (or per response token arrays), `returns` and `old_values` (per response, critic PPO) are the
    whole rollout's."""
    ids = sorted(received)
    if not ids:
        return ids, sequences_from_arrays([], [], [], np.zeros(0, np.float32))

    def field(name):
        return [received[i][name] for i in ids] if name in received[ids[0]] else None

    def of_all(values):
        return None if values is None else [values[i] for i in ids]

    adv = [advantages[i] for i in ids] if isinstance(advantages, (list, tuple)) else np.asarray(advantages)[ids]
    return ids, sequences_from_arrays(field("prompt_ids"), field("response_ids"), field("logprobs"), adv,
                                      topk_ids=field("topk_ids"), topk_logprobs=field("topk_logprobs"),
                                      ref_logprobs=field("ref_logprobs"), trainer_logprobs=field("trainer_logprobs"),
                                      returns=of_all(returns), old_values=of_all(old_values))


def extra_specs(*, with_topk: bool, top_k: int, with_ref: bool, with_old: bool, critic: bool
                ) -> dict[str, tuple[Any, tuple[int, ...]]]:
    """{extra: (dtype, trailing shape)} of the minibatch extras `training_sequences` makes for this objective (the
    placeholders of sequences packed elsewhere take them)."""
    names = ["behaviour_logprobs", "advantages"] + (["returns", "old_values"] if critic else [])
    specs = {n: (np.float32, ()) for n in names}
    if with_topk:
        specs.update(topk_ids=(np.int32, (top_k,)), topk_logprobs=(np.float32, (top_k,)))
    if with_ref:
        specs["ref_logprobs"] = (np.float32, ())
    if with_old:
        specs["trainer_logprobs"] = (np.float32, ())
    return specs


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


def assembly_digest(scored: StepRollout, advantages, minibatches: Sequence[np.ndarray], plans: Sequence
                    ) -> np.ndarray:
    """A digest of what every process computes from the exchanged metadata (rewards, lengths, versions, advantages,
    the minibatch split and the plans' placement): the agreement check of a sharded step."""
    adv = list(advantages) if isinstance(advantages, (list, tuple)) else [np.asarray(advantages)]
    placement = [np.array([(d, m, i) for d, device in enumerate(plan.devices) for m, mb in enumerate(device)
                           for i in mb.seq_indices], np.int64) for plan in plans]
    return digest([scored.rewards, scored.prompt_lengths, scored.response_lengths, scored.versions, *adv,
                   *minibatches, *placement])
