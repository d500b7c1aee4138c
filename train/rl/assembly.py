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
   (`batch.plan_step`): each sequence's arrays (tokens, behaviour log-probs and top-k, reference / recomputed
   log-probs: `batch.travelling_fields`) go point-to-point to the processes whose devices the plan puts it on (one,
   or several for a sequence split over a context-parallel group whose members sit in several processes:
   `sequence_destinations`); a process builds the training sequences of its devices only and packs only its
   devices' rows of each minibatch (`batch.pack_local_minibatch`: the others' rows are zero placeholders, which the
   engines never read: `jodc.fsdp.batch`, `sharding.put_per_device`).

Every exchange has `rollout_exchange`'s semantics (MPI point-to-point, non-blocking, polled: a process that fails
sends its error, one that sends nothing within the timeout is named; every process raises `RolloutShareError`).
Before the first update the processes compare a digest of what they computed from the exchanged metadata
(rewards, lengths, advantages, plans): `batch.plan_step`.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import numpy as np

from .batch import placed_sequences
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
    """bool [N, P]: for every response of the step, the processes whose devices its minibatch's plan puts it on: one
    process, or each process holding a member of the context-parallel group it is split over (each packs its members'
    pieces of it, so each needs the whole response)."""
    processes = max(int(p) for p in device_processes) + 1
    out = np.zeros((num_sequences, processes), bool)
    for plan, indices in zip(plans, minibatches):
        for d, microbatches in enumerate(plan.devices):
            for mb in microbatches:
                out[np.asarray(indices)[list(placed_sequences(mb))], int(device_processes[d])] = True
    unplaced = np.flatnonzero(~out.any(axis=1))
    if unplaced.size:
        raise ValueError(f"the plans place no device for responses {unplaced[:5].tolist()}")
    return out


def send_sequences(step: int, scored: StepRollout, destinations: np.ndarray, inputs: StepInputs, *, process: int,
                   processes: int, fields: Sequence[str], timeout_s: float | None) -> dict[int, dict[str, np.ndarray]]:
    """{response index: its arrays `fields`} of every response the plans put on process `process`'s devices
    (`destinations`: bool [N, P], the processes each response goes to, `sequence_destinations`): those it holds
    without a copy; unless it holds them all (one process, or replicated), it sends each of its responses to every
    other process `destinations` names (point-to-point, nothing to a process that trains none of them) and receives
    the others'. `fields`: the tokens and the extras the objective reads that travel (`batch.travelling_fields`)."""
    held = scored.held
    r = scored.own.rollout
    per_field = {"prompt_ids": r.prompt_ids, "response_ids": r.response_ids, "behaviour_logprobs": r.logprobs,
                 "topk_ids": r.topk_ids, "topk_logprobs": r.topk_logprobs, "ref_logprobs": inputs.ref_logprobs,
                 "trainer_logprobs": inputs.old_logprobs}

    def arrays(k: int) -> dict[str, np.ndarray]:
        return {f: per_field[f][k] for f in fields}

    local = {i: arrays(k) for k, i in enumerate(held) if destinations[i, process]}
    if scored.holds_all:
        return local

    def produce():
        out: list[Any] = [None] * processes  # nothing to a process that trains none of them
        for p in range(destinations.shape[1]):
            chosen = [(i, arrays(k)) for k, i in enumerate(held) if p != process and destinations[i, p]]
            if chosen:  # this process's own stay here
                out[p] = _packed(chosen, fields)
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
