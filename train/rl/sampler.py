"""The sampler side of an RL step: the scored rollout of step s from the weights of one policy version.

`RolloutSampler(step, params, version)` draws step s's prompts (a pure function of (seed, s)), samples
`group_size` responses each with the sampler's copy of the weights, scores them, and measures the rollout/trainer
mismatch: the log-probs of the sampled tokens under the trainer's fp32 forward pass *at the same weights* against
the behaviour log-probs the sampler stored. A *policy version* is the number of RL steps applied to the weights
(version s = the weights at the start of step s). With `rollout.dtype: bfloat16` the sampler's parameters and
compute are bf16 while the trainer stays fp32, a dialable rollout/trainer mismatch like an inference engine's.

A `ScoredRollout` records the version of every response, so the trainer can refuse samples that are too stale,
and serialises to JSON (exactly: float32 values survive the float64 round trip) so that rollouts sampled ahead
of the trainer can be saved in a checkpoint.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jodc.models import DecoderConfig, SamplingParams
from jodc.models.tokenizer import Tokenizer

from .reference import ReferencePolicy
from .rewards import RewardFunction, score
from .rollout import Rollout, sample_rollout
from .tasks import Problem, Task, step_problems

#: Dtypes the sampler may run in (`rollout.dtype`).
SAMPLER_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass
class ScoredRollout:
    """Step `step`'s rollout, its rewards, the policy version of each response and the mismatch diagnostics.

    trainer_logprobs: per response, fp32 [n_i]: the trainer's forward pass at the sampling weights (the reference
      of the mismatch; at version == step it is also the trainer's "old" / proximal log-probs); None when the
      mismatch is not measured (synchronous fp32 rollouts: the sampler is the trainer's own numerics).
    mismatch: `logprob_mismatch` (mean |behaviour - trainer| per response token), `logprob_mismatch_max`, and
      `mismatch_kl` (k3 estimate of KL(behaviour || trainer) from the rollout's tokens).
    """

    step: int
    rollout: Rollout
    rewards: np.ndarray
    versions: np.ndarray
    trainer_logprobs: list[np.ndarray] | None
    mismatch: dict[str, float]
    reward_seconds: float = 0.0
    mismatch_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        """The sampler's wall time for this rollout: sampling, scoring and the mismatch forward."""
        return self.rollout.seconds + self.reward_seconds + self.mismatch_seconds

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict (`from_json` restores it bit for bit)."""
        r = self.rollout

        def arrays(xs):
            return None if xs is None else [np.asarray(x).tolist() for x in xs]

        return {"step": self.step, "versions": self.versions.tolist(), "rewards": self.rewards.tolist(),
                "trainer_logprobs": arrays(self.trainer_logprobs), "mismatch": dict(self.mismatch),
                "reward_seconds": self.reward_seconds, "mismatch_seconds": self.mismatch_seconds,
                "rollout": {"prompts": list(r.prompts), "prompt_ids": arrays(r.prompt_ids),
                            "response_ids": arrays(r.response_ids), "logprobs": arrays(r.logprobs),
                            "topk_ids": arrays(r.topk_ids), "topk_logprobs": arrays(r.topk_logprobs),
                            "responses": list(r.responses), "finished": r.finished.tolist(),
                            "group_size": r.group_size, "seconds": r.seconds}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ScoredRollout":
        r = data["rollout"]

        def arrays(xs, dtype, shape_tail=()):
            if xs is None:
                return None
            return [np.asarray(x, dtype).reshape((-1,) + shape_tail) for x in xs]

        k = len(r["topk_ids"][0][0]) if r["topk_ids"] and r["topk_ids"][0] else 0
        topk_tail = (k,) if k else ()
        rollout = Rollout(prompts=list(r["prompts"]), prompt_ids=arrays(r["prompt_ids"], np.int32),
                          response_ids=arrays(r["response_ids"], np.int32), logprobs=arrays(r["logprobs"], np.float32),
                          topk_ids=arrays(r["topk_ids"], np.int32, topk_tail),
                          topk_logprobs=arrays(r["topk_logprobs"], np.float32, topk_tail),
                          responses=list(r["responses"]), finished=np.asarray(r["finished"], bool),
                          group_size=int(r["group_size"]), seconds=float(r["seconds"]))
        return cls(step=int(data["step"]), rollout=rollout, rewards=np.asarray(data["rewards"], np.float64),
                   versions=np.asarray(data["versions"], np.int64),
                   trainer_logprobs=arrays(data["trainer_logprobs"], np.float32), mismatch=dict(data["mismatch"]),
                   reward_seconds=float(data["reward_seconds"]), mismatch_seconds=float(data["mismatch_seconds"]))


def logprob_mismatch(behaviour: Sequence[np.ndarray], trainer: Sequence[np.ndarray]) -> dict[str, float]:
    """Per-token mismatch between the sampler's and the trainer's log-probs of the same tokens at the same
    weights: mean and max |difference|, and the k3 estimate of KL(behaviour || trainer) (r - 1 - log r with
    r = pi_trainer / mu_behaviour, averaged over the tokens sampled from mu)."""
    b = np.concatenate([np.asarray(x, np.float64) for x in behaviour])
    t = np.concatenate([np.asarray(x, np.float64) for x in trainer])
    if b.size == 0:
        return {"logprob_mismatch": 0.0, "logprob_mismatch_max": 0.0, "mismatch_kl": 0.0}
    log_ratio = np.clip(t - b, -20.0, 20.0)
    return {"logprob_mismatch": float(np.mean(np.abs(t - b))), "logprob_mismatch_max": float(np.max(np.abs(t - b))),
            "mismatch_kl": float(np.mean(np.exp(log_ratio) - 1.0 - log_ratio))}


def measures_mismatch(rollout) -> bool:
    """Whether the sampler runs the trainer's fp32 forward at the sampling weights (the mismatch metrics): only
    when the sampler's numerics differ from the trainer's (`rollout.dtype` other than float32). An fp32 sampler,
    synchronous or stale, computes what the trainer computes at the same weights (the difference is kernel
    rounding, ~1e-6), so the pass would cost about as much as the sampling for nothing; stale rollouts' old /
    proximal log-probs are recomputed by the trainer at its own, newer weights, not at the sampling ones."""
    return rollout.dtype != "float32"


def sampler_weights(config: DecoderConfig, params, dtype: str) -> tuple[DecoderConfig, Any]:
    """The sampler's model config and parameters: the trainer's for float32, else cast (parameters and compute)."""
    if dtype not in SAMPLER_DTYPES:
        raise ValueError(f"sampler dtype must be one of {SAMPLER_DTYPES}, got {dtype!r}")
    if dtype == "float32":  # the trainer's own numerics (today's synchronous sampler)
        return config, params
    return (config.replace(param_dtype=dtype, compute_dtype=dtype),
            jax.tree.map(lambda x: jnp.asarray(x, jnp.dtype(dtype)), params))


@dataclasses.dataclass
class RolloutSampler:
    """Produces step s's `ScoredRollout` from the weights of a given policy version (see the module docstring).

    Thread-safe as long as `reward_fn` is: it holds no state between calls."""

    task: Task
    seed: int
    pool: list[Problem] | None
    prompts_per_step: int
    group_size: int
    model_config: DecoderConfig
    tokenizer: Tokenizer
    sampling: SamplingParams
    reward_fn: RewardFunction
    temperature: float
    prompt_bucket: int
    dtype: str = "float32"
    key_fn: Callable[[int], jax.Array] | None = None
    measure_mismatch: bool = True  # run the trainer's forward at the sampling weights (the mismatch metrics)

    def __post_init__(self):
        self.sampler_config, _ = sampler_weights(self.model_config, {}, self.dtype)

    def rollout_key(self, step: int) -> jax.Array:
        """The sampling key of 0-based step `step` (a pure function of (seed, step))."""
        if self.key_fn is not None:
            return self.key_fn(step)
        return jax.random.fold_in(jax.random.PRNGKey(self.seed), step)

    def __call__(self, step: int, params, version: int) -> ScoredRollout:
        """Step `step`'s scored rollout, sampled with `params` (host fp32 group pytrees) of policy `version`."""
        problems = step_problems(self.task, self.seed, step, self.prompts_per_step, pool=self.pool)
        config, weights = sampler_weights(self.model_config, params, self.dtype)
        rollout = sample_rollout(config, weights, self.tokenizer, [p.prompt for p in problems],
                                 group_size=self.group_size, sampling=self.sampling, key=self.rollout_key(step))
        started = time.perf_counter()
        rewards = score(self.reward_fn, rollout.prompts, rollout.responses, step=step + 1)
        reward_seconds = time.perf_counter() - started
        started = time.perf_counter()
        trainer = (trainer_logprobs(self.model_config, params, rollout, temperature=self.temperature,
                                    bucket=self.prompt_bucket) if self.measure_mismatch else None)
        mismatch_seconds = time.perf_counter() - started
        return ScoredRollout(step=step, rollout=rollout, rewards=rewards,
                             versions=np.full(len(rollout), version, np.int64), trainer_logprobs=trainer,
                             mismatch=logprob_mismatch(rollout.logprobs, trainer) if trainer is not None else {},
                             reward_seconds=reward_seconds, mismatch_seconds=mismatch_seconds)


def trainer_logprobs(config: DecoderConfig, params, rollout: Rollout, *, temperature: float,
                     bucket: int) -> list[np.ndarray]:
    """Per response, fp32 [n_i]: the log-probs of its tokens under the trainer's fp32 forward pass with `params`
    (one compiled forward over the rollout: the extra pass of recomputed old / proximal log-probs)."""
    return ReferencePolicy(config, params, temperature=temperature, bucket=bucket).response_logprobs(rollout)
