"""The sampler side of an RL step: the scored rollout of step s from the weights of one policy version.

`RolloutSampler(step, params, version)` draws step s's prompts (a pure function of (seed, s)), samples
`group_size` responses each with the sampler's copy of the weights, split in whole groups over the engine's devices
(each device sampling its share; across processes each process samples and scores only its devices' shares, and
the layout makes the step's rollout of them: `layout.py`), scores them, and measures the rollout/trainer
mismatch: the log-probs of the sampled tokens under the trainer's fp32 forward pass *at the same weights* against
the behaviour log-probs the sampler stored. A *policy version* is the number of RL steps applied to the weights
(version s = the weights at the start of step s). With `rollout.dtype: bfloat16` the sampler's parameters and
compute are bf16 while the trainer stays fp32, a dialable rollout/trainer mismatch like an inference engine's.

The records (`ScoredRollout`, `StepRollout`: the version of every response, so the trainer can refuse samples that
are too stale; JSON for the checkpoints of rollouts sampled ahead) are in scored.py.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jodc.models import DecoderConfig, SamplingParams
from jodc.models.stream import StreamShape
from jodc.models.tokenizer import Tokenizer

from .config import RolloutConfig
from .layout import RolloutLayout
from .policy_weights import PolicyWeights
from .reference import ReferencePolicy
from .rewards import RewardFunction, score
from .rollout import Rollout, encode_prompts, sample_rollout
from .scored import ScoredRollout, StepRollout
from .tasks import Problem, Task, step_problems


def measures_mismatch(rollout) -> bool:
    """Whether the sampler runs the trainer's fp32 forward at the sampling weights (the mismatch metrics): only
    when the sampler's numerics differ from the trainer's (`rollout.dtype` other than float32). An fp32 sampler,
    synchronous or stale, computes what the trainer computes at the same weights (the difference is kernel
    rounding, ~1e-6), so the pass would cost about as much as the sampling for nothing; stale rollouts' old /
    proximal log-probs are recomputed by the trainer at its own, newer weights, not at the sampling ones."""
    return rollout.dtype != "float32"


def stream_shape(rollout: RolloutConfig) -> StreamShape | None:
    """The continuous sampler's shape of `rollout.batching: continuous` (None: the static batch)."""
    if rollout.batching == "static":
        return None
    return StreamShape(slots=rollout.slots, page_size=rollout.page_size,
                       pages=rollout.cache_tokens // rollout.page_size, chunk=rollout.decode_chunk,
                       prefill_rows=min(8, rollout.slots))


def sampler_config(config: DecoderConfig, dtype: str) -> DecoderConfig:
    """The sampler's model config (`rollout.dtype`): the trainer's for float32, else parameters and compute in it."""
    return config if dtype == "float32" else config.replace(param_dtype=dtype, compute_dtype=dtype)


def sampler_weights(config: DecoderConfig, params, dtype: str) -> tuple[DecoderConfig, Any]:
    """The sampler's model config and parameters (`rollout.dtype`) from host fp32 group pytrees (the sampler
    process's path; the trainer's own sampler gets `policy_weights.PolicyWeights`, resharded on device): the
    trainer's for float32, else cast (parameters and compute)."""
    if dtype == "float32":  # the trainer's own numerics (today's synchronous sampler)
        return config, params
    return sampler_config(config, dtype), jax.tree.map(lambda x: jnp.asarray(x, jnp.dtype(dtype)), params)


@dataclasses.dataclass
class RolloutSampler:
    """Produces step s's `StepRollout` from the weights of a given policy version (see the module docstring), as
    the `rollout` section says (prompts per step, group size, temperature, prompt bucket, sampler dtype).

    Thread-safe as long as `reward_fn` is: it holds no state between calls."""

    task: Task
    seed: int
    pool: list[Problem] | None
    rollout: RolloutConfig
    model_config: DecoderConfig
    tokenizer: Tokenizer
    sampling: SamplingParams
    reward_fn: RewardFunction
    held_out: frozenset[str] = frozenset()  # evaluation prompts that fresh training draws skip (`step_problems`)
    platform: str = "cpu"  # the engine's devices (`engine.platform`, `engine.devices`): the step's prompts are
    devices: int = 1  # split over all of them (`device_shares`), each process sampling its own devices' shares
    # where the step's rollout lives (layout.py); a sampler process keeps its trainer's (it is outside the MPI job)
    layout: RolloutLayout = dataclasses.field(default_factory=RolloutLayout)

    def rollout_key(self, step: int) -> jax.Array:
        """The key of 0-based step `step` (a pure function of (seed, step)); response j of the step's prompt i
        samples with fold_in(fold_in(this key, i), j) (`response_keys`), wherever it is sampled."""
        return jax.random.fold_in(jax.random.PRNGKey(self.seed), step)

    def local_devices(self, num_prompts: int | None = None) -> tuple[range, list[jax.Device]]:
        """(the prompts this process samples, its devices that sample them) of `num_prompts` prompts (default: a
        step's): the shares (`device_shares`) of this process's devices among the engine's `devices`
        (process-major, as the engine's mesh)."""
        count = self.rollout.prompts_per_step if num_prompts is None else num_prompts
        return (self.layout.prompt_range(count, self.devices),
                self.layout.sampling_devices(self.platform, self.devices))

    def __call__(self, step: int, params, version: int) -> StepRollout:
        """Step `step`'s rollout, sampled with `params` of policy `version` (a `PolicyWeights`: the copies resharded
        on the devices, or host fp32 group pytrees: the sampler process's): this process's share (`share`), every
        response sampled and scored once, made a `StepRollout` by the layout."""
        return self.layout.step_rollout(step, lambda: self.share(step, params, version))

    def share(self, step: int, params, version: int) -> ScoredRollout:
        """This process's share of step `step`'s scored rollout (all of it in one process), sampled over its
        devices and scored (each response once)."""
        prompts, mine, devices, width = self.step_prompts(step)
        config, weights, fp32 = self.weights(params)
        rollout = sample_rollout(config, weights, self.tokenizer, prompts[mine.start:mine.stop],
                                 group_size=self.rollout.group_size, sampling=self.sampling,
                                 key=self.rollout_key(step), prompt_indices=mine, devices=devices,
                                 stream=stream_shape(self.rollout), prompt_width=width)
        return self.scored(step, rollout, np.full(len(rollout), version, np.int64), fp32)

    def step_prompts(self, step: int) -> tuple[list[str], range, list[jax.Device], int]:
        """Step `step`'s prompts (a pure function of (seed, step)), the range of them this process samples, its
        sampling devices, and the step's prompt width (every share pads to it)."""
        problems = step_problems(self.task, self.seed, step, self.rollout.prompts_per_step, pool=self.pool,
                                 held_out=self.held_out)
        prompts = [p.prompt for p in problems]
        mine, devices = self.local_devices()
        return prompts, mine, devices, max(len(ids) for ids in encode_prompts(self.tokenizer, prompts))

    def weights(self, params) -> tuple[DecoderConfig, Any, Any]:
        """(the sampler's model config, its weights, the trainer's fp32 weights) of `params`: a `PolicyWeights`
        (already on the sampling devices, in the sampler's dtype) or host fp32 group pytrees."""
        dtype = self.rollout.dtype
        if isinstance(params, PolicyWeights):
            if params.sampler.dtype != jnp.dtype(dtype).name:
                raise ValueError(f"weights in {params.sampler.dtype} for a {dtype} sampler")
            return sampler_config(self.model_config, dtype), params.sampler, params.trainer
        return (*sampler_weights(self.model_config, params, dtype), params)

    def scored(self, step: int, rollout: Rollout, versions: np.ndarray, fp32) -> ScoredRollout:
        """`rollout` (this process's share of step `step`, responses of policy `versions`) scored, each response
        once, with the rollout/trainer mismatch where the sampler's numerics differ from the trainer's."""
        r = self.rollout
        started = time.perf_counter()
        rewards = score(self.reward_fn, rollout.prompts, rollout.responses, step=step + 1,
                        first_sample=self.layout.prompt_range(r.prompts_per_step, self.devices).start * r.group_size)
        reward_seconds = time.perf_counter() - started
        started = time.perf_counter()
        trainer = None
        if measures_mismatch(r):
            trainer = (trainer_logprobs(self.model_config, fp32, rollout, temperature=r.temperature,
                                        bucket=r.prompt_bucket) if len(rollout) else [])
        mismatch_seconds = time.perf_counter() - started
        return ScoredRollout(step=step, rollout=rollout, rewards=rewards, versions=versions, trainer_logprobs=trainer,
                             reward_seconds=reward_seconds, mismatch_seconds=mismatch_seconds)


def trainer_logprobs(config: DecoderConfig, params, rollout: Rollout, *, temperature: float,
                     bucket: int, width: int = 0) -> list[np.ndarray]:
    """Per response, fp32 [n_i]: the log-probs of its tokens under the trainer's fp32 forward pass with `params`
    (one compiled forward over the rollout: the extra pass of recomputed old / proximal log-probs); rows padded to
    at least `width`."""
    return ReferencePolicy(config, params, temperature=temperature, bucket=bucket).response_logprobs(rollout,
                                                                                                    width=width)
