"""The records of a step's rollout once sampled and scored.

- `ScoredRollout`: a rollout (all of a step's responses, or one process's share of them) with its rewards, the
  policy version of every response and, where the sampler's numerics differ from the trainer's, the trainer's
  log-probs of the same tokens at the sampling weights. It serialises to JSON exactly (float32 values survive the
  float64 round trip), so rollouts sampled ahead of the trainer go into checkpoints.
- `StepRollout`: what the trainer gets for a step: the `ScoredRollout` this process holds (`own`, responses
  `held` of the step: all of them in one process or with `rollout.assembly: replicated`, the process's share
  otherwise) and every response's metadata over the whole rollout (lengths, rewards, versions, the mismatch).
  `layout.py` makes it, in one process without any exchange.
- `ShareMeta`: what a process tells the others about its share (`StepRollout.from_metas` joins them).

The rollout/trainer mismatch is kept as partial sums (`MismatchSums`), so shares held apart combine into the whole
rollout's numbers without their tokens (`mismatch_metrics` turns sums into the step's metrics: one place).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import numpy as np

from .rollout import Rollout


class MismatchSums(NamedTuple):
    """Partial sums of the per-token mismatch between the sampler's (behaviour) and the trainer's log-probs."""
    abs_sum: float  # sum |trainer - behaviour|
    abs_max: float  # max |trainer - behaviour|
    k3_sum: float   # sum of r - 1 - log r, r = pi_trainer / mu_behaviour (log r clipped to +-20)
    tokens: int

    @classmethod
    def of(cls, behaviour: Sequence[np.ndarray], trainer: Sequence[np.ndarray]) -> "MismatchSums":
        b = np.concatenate([np.asarray(x, np.float64) for x in behaviour] + [np.zeros(0)])
        t = np.concatenate([np.asarray(x, np.float64) for x in trainer] + [np.zeros(0)])
        log_ratio = np.clip(t - b, -20.0, 20.0)
        return cls(float(np.abs(t - b).sum()), float(np.abs(t - b).max(initial=0.0)),
                   float((np.exp(log_ratio) - 1.0 - log_ratio).sum()), int(b.size))

    @classmethod
    def combined(cls, parts: Sequence["MismatchSums"]) -> "MismatchSums":
        return cls(sum(p.abs_sum for p in parts), max(p.abs_max for p in parts), sum(p.k3_sum for p in parts),
                   sum(p.tokens for p in parts))


def mismatch_metrics(sums: MismatchSums | None) -> dict[str, float]:
    """The step's mismatch metrics from partial sums (none when the mismatch was not measured): `logprob_mismatch`
    (mean |behaviour - trainer| per response token), `logprob_mismatch_max`, and `mismatch_kl` (k3 estimate of
    KL(behaviour || trainer) from the rollout's tokens)."""
    if sums is None:
        return {}
    if not sums.tokens:
        return {"logprob_mismatch": 0.0, "logprob_mismatch_max": 0.0, "mismatch_kl": 0.0}
    return {"logprob_mismatch": sums.abs_sum / sums.tokens, "logprob_mismatch_max": sums.abs_max,
            "mismatch_kl": sums.k3_sum / sums.tokens}


def logprob_mismatch(behaviour: Sequence[np.ndarray], trainer: Sequence[np.ndarray]) -> dict[str, float]:
    """Per-token mismatch between the sampler's and the trainer's log-probs of the same tokens at the same weights
    (`mismatch_metrics` of their sums)."""
    return mismatch_metrics(MismatchSums.of(behaviour, trainer))


def _check_shares(where: str, steps: Sequence[int], measured: Sequence[bool]) -> bool:
    """Whether the shares of one step measured the mismatch; ValueError when they are of several steps or only some
    measured it."""
    if len(set(steps)) != 1:
        raise ValueError(f"{where}: shares of steps {sorted(set(steps))}")
    if len(set(measured)) != 1:
        raise ValueError(f"{where}: some shares measured the mismatch and some did not")
    return measured[0]


@dataclasses.dataclass
class ScoredRollout:
    """A step's rollout (or one process's share of it), its rewards and the policy version of each response.

    trainer_logprobs: per response, fp32 [n_i]: the trainer's forward pass at the sampling weights (the reference
      of the mismatch; at version == step it is also the trainer's "old" / proximal log-probs); None when the
      mismatch is not measured (an fp32 sampler: the trainer's own numerics).
    """

    step: int
    rollout: Rollout
    rewards: np.ndarray
    versions: np.ndarray
    trainer_logprobs: list[np.ndarray] | None
    reward_seconds: float = 0.0
    mismatch_seconds: float = 0.0
    exchange_seconds: float = 0.0  # across processes: waiting for and receiving the other processes' shares

    @property
    def newest_versions(self) -> np.ndarray | None:
        """Per response, the policy version of its newest token: above `versions` (its oldest token's) for a
        response that a weight update reached under way; None without per-token versions (not partial rollouts)."""
        if self.rollout.token_versions is None:
            return None
        return np.array([int(t.max()) if len(t) else int(v) for t, v in zip(self.rollout.token_versions,
                                                                              self.versions)], np.int64)

    @property
    def mismatch_sums(self) -> MismatchSums | None:
        if self.trainer_logprobs is None:
            return None
        return MismatchSums.of(self.rollout.logprobs, self.trainer_logprobs)

    @property
    def mismatch(self) -> dict[str, float]:
        """The mismatch metrics (`mismatch_metrics`; empty when not measured)."""
        return mismatch_metrics(self.mismatch_sums)

    @property
    def response_lengths(self) -> np.ndarray:
        return self.rollout.response_lengths

    @property
    def finished(self) -> np.ndarray:
        return self.rollout.finished

    @property
    def rollout_seconds(self) -> float:
        return self.rollout.seconds

    @property
    def seconds(self) -> float:
        """The sampler's wall time for this rollout: sampling, scoring, the mismatch forward and (across
        processes) the exchange of the shares."""
        return self.rollout.seconds + self.reward_seconds + self.mismatch_seconds + self.exchange_seconds

    def __len__(self) -> int:
        return len(self.rewards)

    def select(self, held: range) -> "ScoredRollout":
        """Responses `held` (a range) of this rollout."""
        def part(values):
            return None if values is None else values[held.start:held.stop]

        return dataclasses.replace(self, rollout=self.rollout.select(held), rewards=part(self.rewards),
                                   versions=part(self.versions), trainer_logprobs=part(self.trainer_logprobs))

    @classmethod
    def concat(cls, parts: Sequence["ScoredRollout"], exchange_seconds: float = 0.0) -> "ScoredRollout":
        """One step's rollout from its shares (in prompt order); times are the slowest share's."""
        measured = _check_shares("ScoredRollout.concat", [p.step for p in parts],
                                 [p.trainer_logprobs is not None for p in parts])
        trainer = [x for p in parts for x in p.trainer_logprobs] if measured else None
        return cls(step=parts[0].step, rollout=Rollout.concat([p.rollout for p in parts]),
                   rewards=np.concatenate([p.rewards for p in parts]),
                   versions=np.concatenate([p.versions for p in parts]), trainer_logprobs=trainer,
                   reward_seconds=max(p.reward_seconds for p in parts),
                   mismatch_seconds=max(p.mismatch_seconds for p in parts), exchange_seconds=exchange_seconds)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field (`from_json` restores it bit for bit)."""
        def plain(value):
            """Arrays, also in lists, as nested lists."""
            if isinstance(value, list):
                return [plain(v) for v in value]
            return value.tolist() if isinstance(value, np.ndarray) else value

        return {**{f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)},
                "rollout": {f.name: plain(getattr(self.rollout, f.name)) for f in dataclasses.fields(Rollout)}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ScoredRollout":
        """The record `to_json` wrote (checkpoints written before the mismatch was derived from the log-probs also
        hold it as `mismatch`: it is derived again, the same)."""
        r = data["rollout"]
        k = len(r["topk_ids"][0][0]) if r["topk_ids"] and r["topk_ids"][0] else 0

        def arrays(xs, dtype, shape_tail=()):
            return None if xs is None else [np.asarray(x, dtype).reshape((-1,) + shape_tail) for x in xs]

        tail = (k,) if k else ()
        rollout = Rollout(**{**r, "prompt_ids": arrays(r["prompt_ids"], np.int32),
                             "response_ids": arrays(r["response_ids"], np.int32),
                             "logprobs": arrays(r["logprobs"], np.float32),
                             "topk_ids": arrays(r["topk_ids"], np.int32, tail),
                             "topk_logprobs": arrays(r["topk_logprobs"], np.float32, tail),
                             "finished": np.asarray(r["finished"], bool),
                             "token_versions": arrays(r.get("token_versions"), np.int32)})
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in data.items() if k in fields}, "rollout": rollout,
                      "rewards": np.asarray(data["rewards"], np.float64),
                      "versions": np.asarray(data["versions"], np.int64),
                      "trainer_logprobs": arrays(data["trainer_logprobs"], np.float32)})


@dataclasses.dataclass
class ShareMeta:
    """What a process tells the others about its share of a rollout: per response [n] arrays, and the partial sums
    of the mismatch (None when it is not measured)."""

    step: int
    prompt_lengths: np.ndarray
    response_lengths: np.ndarray
    finished: np.ndarray
    rewards: np.ndarray
    versions: np.ndarray
    mismatch_sums: MismatchSums | None
    rollout_seconds: float
    reward_seconds: float
    mismatch_seconds: float
    newest_versions: np.ndarray | None = None  # per response, its newest token's version (partial rollouts only)

    @classmethod
    def of(cls, share: ScoredRollout) -> "ShareMeta":
        r = share.rollout
        return cls(step=share.step, prompt_lengths=np.array([len(p) for p in r.prompt_ids], np.int64),
                   response_lengths=r.response_lengths, finished=np.asarray(r.finished, bool),
                   rewards=np.asarray(share.rewards), versions=np.asarray(share.versions, np.int64),
                   mismatch_sums=share.mismatch_sums, rollout_seconds=r.seconds, reward_seconds=share.reward_seconds,
                   mismatch_seconds=share.mismatch_seconds,
                   newest_versions=share.newest_versions)


@dataclasses.dataclass
class StepRollout:
    """A step's scored rollout as the trainer holds it: `own`, responses `held` of the step (in order), and every
    response's metadata (arrays [N] over the whole rollout). Reads like a `ScoredRollout` where the step record, the
    staleness check and the advantages look."""

    own: ScoredRollout
    held: range
    prompt_lengths: np.ndarray
    response_lengths: np.ndarray
    finished: np.ndarray
    rewards: np.ndarray
    versions: np.ndarray
    mismatch: dict[str, float]
    rollout_seconds: float
    reward_seconds: float
    mismatch_seconds: float
    exchange_seconds: float = 0.0
    newest_versions: np.ndarray | None = None  # per response, its newest token's version (partial rollouts only)

    @property
    def step(self) -> int:
        return self.own.step

    @property
    def holds_all(self) -> bool:
        """Whether this process holds every response of the step."""
        return len(self.held) == len(self.rewards)

    @property
    def trainer_logprobs(self):
        """The held responses' (see `ScoredRollout.trainer_logprobs`)."""
        return self.own.trainer_logprobs

    @property
    def seconds(self) -> float:
        return self.rollout_seconds + self.reward_seconds + self.mismatch_seconds + self.exchange_seconds

    def __len__(self) -> int:
        return len(self.rewards)

    @property
    def sequence_lengths(self) -> np.ndarray:
        """Tokens each response's training sequence has (prompt + response - 1): what the planner balances."""
        return self.prompt_lengths + self.response_lengths - 1

    def width(self, bucket: int) -> int:
        """The row width of a forward pass over the whole rollout (the longest prompt + response, rounded up to
        `bucket`): passes over any part of it use it too, so their shapes differ only in rows."""
        return -(-int((self.prompt_lengths + self.response_lengths).max()) // bucket) * bucket

    @classmethod
    def from_metas(cls, own: ScoredRollout, metas: Sequence[ShareMeta], process: int,
                   exchange_seconds: float = 0.0) -> "StepRollout":
        """Process `process`'s view: its share `own` and every process's `ShareMeta`, in process order."""
        measured = _check_shares("StepRollout", [m.step for m in metas], [m.mismatch_sums is not None for m in metas])
        bounds = np.cumsum([0] + [len(m.rewards) for m in metas])

        def joined(field):
            return np.concatenate([getattr(m, field) for m in metas])

        sums = MismatchSums.combined([m.mismatch_sums for m in metas]) if measured else None
        return cls(own=own, held=range(int(bounds[process]), int(bounds[process + 1])),
                   prompt_lengths=joined("prompt_lengths"), response_lengths=joined("response_lengths"),
                   finished=joined("finished").astype(bool), rewards=joined("rewards"), versions=joined("versions"),
                   mismatch=mismatch_metrics(sums), rollout_seconds=max(m.rollout_seconds for m in metas),
                   reward_seconds=max(m.reward_seconds for m in metas),
                   mismatch_seconds=max(m.mismatch_seconds for m in metas), exchange_seconds=exchange_seconds,
                   newest_versions=None if all(m.newest_versions is None for m in metas) else np.concatenate(
                       [m.versions if m.newest_versions is None else m.newest_versions for m in metas]))

    @classmethod
    def from_whole(cls, whole: ScoredRollout, held: range | None = None) -> "StepRollout":
        """The view of a process holding responses `held` (default: all) of `whole` (a rollout sampled in one
        piece, exchanged whole, or read from a checkpoint), with no exchange."""
        held = range(len(whole)) if held is None else held
        r = whole.rollout
        return cls(own=whole if len(held) == len(whole) else whole.select(held), held=held,
                   prompt_lengths=np.array([len(p) for p in r.prompt_ids], np.int64),
                   response_lengths=r.response_lengths, finished=np.asarray(r.finished, bool), rewards=whole.rewards,
                   versions=whole.versions, mismatch=whole.mismatch, rollout_seconds=r.seconds,
                   reward_seconds=whole.reward_seconds, mismatch_seconds=whole.mismatch_seconds,
                   exchange_seconds=whole.exchange_seconds,
                   newest_versions=whole.newest_versions)
