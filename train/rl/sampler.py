"""The sampler side of an RL step: the scored rollout of step s from the weights of one policy version.

`RolloutSampler(step, params, version)` draws step s's prompts (a pure function of (seed, s)), samples
`group_size` responses each with the sampler's copy of the weights, split in whole groups over the engine's devices
(each device sampling its share; across processes each process samples and scores only its devices' shares, and
the scored shares are exchanged once: `rollout_exchange.py`), scores them, and measures the rollout/trainer
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

from ..core.model import mesh_devices
from .config import RolloutConfig
from .policy_weights import PolicyWeights
from .reference import ReferencePolicy
from .rewards import RewardFunction, score
from .rollout import Rollout, device_shares, encode_prompts, sample_rollout
from .rollout_exchange import gather_shares
from .tasks import Problem, Task, step_problems


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
    exchange_seconds: float = 0.0  # across processes: waiting for and receiving the other processes' shares

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

    @classmethod
    def concat(cls, parts: Sequence["ScoredRollout"], exchange_seconds: float = 0.0) -> "ScoredRollout":
        """One step's rollout from its shares (in prompt order); times are the slowest share's, the mismatch is
        measured over the whole rollout."""
        steps = {p.step for p in parts}
        if len(steps) != 1:
            raise ValueError(f"ScoredRollout.concat: shares of steps {sorted(steps)}")
        with_trainer = {p.trainer_logprobs is not None for p in parts}
        if len(with_trainer) != 1:
            raise ValueError("ScoredRollout.concat: some shares measured the mismatch and some did not")
        rollout = Rollout.concat([p.rollout for p in parts])
        trainer = [x for p in parts for x in p.trainer_logprobs] if True in with_trainer else None
        return cls(step=parts[0].step, rollout=rollout, rewards=np.concatenate([p.rewards for p in parts]),
                   versions=np.concatenate([p.versions for p in parts]), trainer_logprobs=trainer,
                   mismatch=logprob_mismatch(rollout.logprobs, trainer) if trainer is not None else {},
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
                             "finished": np.asarray(r["finished"], bool)})
        return cls(**{**data, "rollout": rollout, "rewards": np.asarray(data["rewards"], np.float64),
                      "versions": np.asarray(data["versions"], np.int64),
                      "trainer_logprobs": arrays(data["trainer_logprobs"], np.float32)})


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
    """Produces step s's `ScoredRollout` from the weights of a given policy version (see the module docstring), as
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
    exchange_timeout_s: float | None = None  # across processes: how long to wait for another process's share
    # (index, count) of the MPI process a sampler child process works for (it is outside the MPI job, so its own
    # JAX sees one process); None: JAX's own
    process: tuple[int, int] | None = None

    def rollout_key(self, step: int) -> jax.Array:
        """The key of 0-based step `step` (a pure function of (seed, step)); response j of the step's prompt i
        samples with fold_in(fold_in(this key, i), j) (`response_keys`), wherever it is sampled."""
        return jax.random.fold_in(jax.random.PRNGKey(self.seed), step)

    def local_devices(self, num_prompts: int | None = None) -> tuple[range, list[jax.Device]]:
        """(the prompts this process samples, its devices that sample them) of `num_prompts` prompts (default: a
        step's): the shares (`device_shares`) of this process's devices among the engine's `devices`
        (process-major, as the engine's mesh)."""
        shares = device_shares(self.rollout.prompts_per_step if num_prompts is None else num_prompts, self.devices)
        if self.process is not None:  # a child sampling for MPI process `index`: its devices are the index-th block
            index, count = self.process  # of the process-major mesh (as many in every process)
            per_process = self.devices // count
            mine = shares[index * per_process:(index + 1) * per_process]
            devices = jax.local_devices(backend=self.platform)
            if len(devices) < per_process:  # (it would sample several devices' shares as one batch: other numbers)
                raise RuntimeError(f"the sampler process of MPI process {index} has {len(devices)} {self.platform} "
                                   f"device(s); its process drives {per_process} (engine.devices={self.devices} over "
                                   f"{count} processes)")
            return range(mine[0].start, mine[-1].stop), devices[:per_process]
        devices = mesh_devices(self.platform, self.devices)  # the engine's mesh, in its order
        mine = [(share, d) for share, d in zip(shares, devices) if d.process_index == jax.process_index()]
        if not mine:
            raise RuntimeError(f"process {jax.process_index()} holds none of the {len(devices)} sampling devices")
        return range(mine[0][0].start, mine[-1][0].stop), [d for _, d in mine]

    def process_shares(self) -> list[range]:
        """The responses of a step each process samples, in process order (the shares of its devices, which are the
        process's consecutive block of the process-major mesh)."""
        shares = device_shares(self.rollout.prompts_per_step, self.devices)
        count = jax.process_count() if self.process is None else self.process[1]
        per_process, g = self.devices // count, self.rollout.group_size
        return [range(shares[p * per_process].start * g, shares[(p + 1) * per_process - 1].stop * g)
                for p in range(count)]

    def __call__(self, step: int, params, version: int):
        """Step `step`'s scored rollout, sampled with `params` of policy `version` (a `PolicyWeights`: the copies
        resharded on the devices, or host fp32 group pytrees: the sampler process's). Across
        processes each process samples and scores its share (`share`), every response once, and the processes
        exchange (`exchange`): with `rollout.assembly: sharded` their shares' metadata (a `ShardedRollout`:
        `assembly.py`), with `replicated` the whole shares (every process gets the whole rollout)."""
        if jax.process_count() == 1:
            return self.share(step, params, version)
        return exchange(step, lambda: self.share(step, params, version), sharded=self.rollout.assembly == "sharded",
                        timeout_s=self.exchange_timeout_s)

    def share(self, step: int, params, version: int) -> ScoredRollout:
        """This process's share of step `step`'s scored rollout (all of it in one process), sampled over its
        devices and scored (each response once)."""
        r = self.rollout
        problems = step_problems(self.task, self.seed, step, r.prompts_per_step, pool=self.pool,
                                 held_out=self.held_out)
        prompts = [p.prompt for p in problems]
        mine, devices = self.local_devices()
        if isinstance(params, PolicyWeights):  # already on the sampling devices, in the sampler's dtype
            if params.sampler.dtype != jnp.dtype(r.dtype).name:
                raise ValueError(f"weights in {params.sampler.dtype} for a {r.dtype} sampler")
            config, weights, fp32 = sampler_config(self.model_config, r.dtype), params.sampler, params.trainer
        else:
            (config, weights), fp32 = sampler_weights(self.model_config, params, r.dtype), params
        rollout = sample_rollout(config, weights, self.tokenizer, prompts[mine.start:mine.stop],
                                 group_size=r.group_size, sampling=self.sampling, key=self.rollout_key(step),
                                 prompt_indices=mine, devices=devices,
                                 prompt_width=max(len(ids) for ids in encode_prompts(self.tokenizer, prompts)))
        started = time.perf_counter()
        rewards = score(self.reward_fn, rollout.prompts, rollout.responses, step=step + 1,
                        first_sample=mine.start * r.group_size)
        reward_seconds = time.perf_counter() - started
        started = time.perf_counter()
        trainer = None
        if measures_mismatch(r):
            trainer = (trainer_logprobs(self.model_config, fp32, rollout, temperature=r.temperature,
                                        bucket=r.prompt_bucket) if len(rollout) else [])
        mismatch_seconds = time.perf_counter() - started
        return ScoredRollout(step=step, rollout=rollout, rewards=rewards,
                             versions=np.full(len(rollout), version, np.int64), trainer_logprobs=trainer,
                             mismatch=logprob_mismatch(rollout.logprobs, trainer) if trainer is not None else {},
                             reward_seconds=reward_seconds, mismatch_seconds=mismatch_seconds)


def exchange(step: int, share: Callable[[], ScoredRollout], *, sharded: bool, timeout_s: float | None):
    """Step `step`'s rollout across processes from this process's `share()`: a `ShardedRollout` (`sharded`: the
    metadata exchanged, `assembly.exchange_rollout`) or the whole `ScoredRollout` (`exchange_shares`)."""
    if not sharded:
        return exchange_shares(step, share, timeout_s=timeout_s)
    from .assembly import exchange_rollout  # (assembly.py builds on this module)

    return exchange_rollout(step, share, process=jax.process_index(), timeout_s=timeout_s)


def exchange_shares(step: int, share: Callable[[], ScoredRollout], *, timeout_s: float | None) -> ScoredRollout:
    """Step `step`'s whole scored rollout across processes: this process's `share()`, exchanged with every other
    process's (`rollout_exchange.gather_shares`: a share that fails or does not come fails every process)."""
    started = time.perf_counter()
    parts = gather_shares(share, what=f"step {step + 1}'s rollout", timeout_s=timeout_s)
    own = parts[jax.process_index()]
    return ScoredRollout.concat(parts, exchange_seconds=max(0.0, time.perf_counter() - started - own.seconds))


@dataclasses.dataclass
class ExchangedShares:
    """`produce(step, params, version)` for the sampler thread of an asynchronous run across processes whose shares
    come from a sampler child process (`sampler_process.py`): the child computes this process's share, this
    process's sampler thread exchanges it."""

    share: Callable[[int, Any, int], ScoredRollout]  # a `SamplerProcess` of a sampler with `process` set
    timeout_s: float | None = None
    sharded: bool = True  # rollout.assembly: sharded (see `exchange`)

    def __call__(self, step: int, params, version: int):
        return exchange(step, lambda: self.share(step, params, version), sharded=self.sharded,
                        timeout_s=self.timeout_s)

    def close(self) -> None:
        self.share.close()


def trainer_logprobs(config: DecoderConfig, params, rollout: Rollout, *, temperature: float,
                     bucket: int, width: int = 0) -> list[np.ndarray]:
    """Per response, fp32 [n_i]: the log-probs of its tokens under the trainer's fp32 forward pass with `params`
    (one compiled forward over the rollout: the extra pass of recomputed old / proximal log-probs); rows padded to
    at least `width`."""
    return ReferencePolicy(config, params, temperature=temperature, bucket=bucket).response_logprobs(rollout,
                                                                                                    width=width)
