"""Where an RL step's rollout lives: decided once per run (`RolloutLayout.of_run`), read by the sampler, the rollout
sources and the trainer, which branch on nothing themselves.

The engine's devices each sample a share of a step's prompts (`device_shares`, process-major as the engine's mesh),
so process p samples the shares of its devices. What happens next depends on the layout, and only here:

- one process: it holds the whole rollout; nothing is exchanged (and MPI is never touched);
- several processes, `rollout.assembly: sharded` (the default under mpirun): each process keeps its share and
  gets every response's metadata (`assembly.exchange_rollout`); the trainer's forward passes run over the share,
  what the batch-level quantities read is exchanged (`assembly.exchange_step_inputs`) and each training sequence
  goes to the processes whose devices the plan puts it on (`assembly.send_sequences`: one, or each process with a
  member of the context-parallel group it is split over);
- several processes, `rollout.assembly: replicated`: the shares are exchanged whole, so every process holds (and
  runs the passes over) the whole rollout, as one process does.

Either way the trainer gets a `StepRollout` (its held responses and the whole rollout's metadata) and runs one
minibatch path (`RLRun.minibatches`); with one process, or replicated, the exchanges below return at once.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from .assembly import StepInputs, exchange_rollout, exchange_step_inputs, send_sequences, sequence_destinations
from .rollout import device_shares
from .rollout_exchange import CHECKPOINT_TAGS, SHARE_TAGS, gather_shares
from .scored import ScoredRollout, StepRollout


@dataclasses.dataclass(frozen=True)
class RolloutLayout:
    """Process `process` of `processes`; `replicated`: every process holds the whole rollout (see the module
    docstring); `timeout_s`: how long an exchange waits for another process (None: forever)."""

    process: int = 0
    processes: int = 1
    replicated: bool = False
    timeout_s: float | None = None

    @classmethod
    def of_run(cls, *, replicated: bool = False, timeout_s: float | None = None) -> "RolloutLayout":
        """This process's layout in the running JAX job (`jax.process_index()` of `jax.process_count()`)."""
        return cls(process=jax.process_index(), processes=jax.process_count(), replicated=replicated,
                   timeout_s=timeout_s)

    @property
    def whole_here(self) -> bool:
        """Whether every process holds the whole rollout (one process, or replicated): nothing but the shares is
        exchanged then."""
        return self.processes == 1 or self.replicated

    # -- who samples what ------------------------------------------------------------------------------------------
    def _device_block(self, devices: int) -> range:
        """This process's devices among the engine's `devices` (a consecutive block of the process-major mesh)."""
        if devices % self.processes:
            raise ValueError(f"engine.devices={devices} does not split over {self.processes} processes")
        per_process = devices // self.processes
        return range(self.process * per_process, (self.process + 1) * per_process)

    def prompt_range(self, num_prompts: int, devices: int) -> range:
        """The prompts of `num_prompts` this process samples: the shares of its devices among `devices`."""
        return self._prompts_of(self._device_block(devices), device_shares(num_prompts, devices))

    @staticmethod
    def _prompts_of(block: range, shares: list[range]) -> range:
        """The prompts of devices `block` (consecutive) given every device's `shares`."""
        return range(shares[block.start].start, shares[block.stop - 1].stop)

    def sampling_devices(self, platform: str, devices: int) -> list[jax.Device]:
        """The devices this process samples on: its first `devices / processes` local devices of `platform` (in a
        sampler child process, outside the MPI job, the child's own). RuntimeError when it has fewer (it would
        sample several devices' shares as one batch: other numbers)."""
        needed = len(self._device_block(devices))
        try:
            local = jax.local_devices(backend=platform)
        except RuntimeError as e:
            raise RuntimeError(f"engine.platform={platform!r} has no devices here: {e}") from None
        if len(local) < needed:
            where = f"process {self.process} of {self.processes}" if self.processes > 1 else "this process"
            raise RuntimeError(f"the sampler of {where} has {len(local)} {platform} device(s); it samples on "
                               f"{needed} (engine.devices={devices} over {self.processes} process(es))")
        return local[:needed]

    def response_shares(self, num_prompts: int, group_size: int, devices: int) -> list[range]:
        """The responses of a step each process samples, in process order."""
        shares = device_shares(num_prompts, devices)
        prompts = [self._prompts_of(dataclasses.replace(self, process=p)._device_block(devices), shares)
                   for p in range(self.processes)]
        return [range(r.start * group_size, r.stop * group_size) for r in prompts]

    # -- the exchanges ---------------------------------------------------------------------------------------------
    def gather(self, produce: Callable[[], Any], *, what: str, tags: tuple[int, int] = SHARE_TAGS) -> list[Any]:
        """Every process's `produce()`, in process order (`rollout_exchange.gather_shares`; one process: its own,
        and an error in it is raised as it is)."""
        if self.processes == 1:
            return [produce()]
        return gather_shares(produce, what=what, timeout_s=self.timeout_s, tags=tags)

    def step_rollout(self, step: int, share: Callable[[], ScoredRollout]) -> StepRollout:
        """Step `step`'s rollout from this process's `share()`: held whole, exchanged whole (replicated), or kept
        with every process's metadata (sharded)."""
        if self.processes == 1:
            return StepRollout.from_whole(share())
        if self.replicated:
            started = time.perf_counter()
            parts = gather_shares(share, what=f"step {step + 1}'s rollout", timeout_s=self.timeout_s)
            waited = max(0.0, time.perf_counter() - started - parts[self.process].seconds)
            return StepRollout.from_whole(ScoredRollout.concat(parts, exchange_seconds=waited))
        return exchange_rollout(step, share, process=self.process, timeout_s=self.timeout_s)

    def step_inputs(self, step: int, passes: Callable[[], StepInputs], *, kl_in_reward: bool, critic: bool,
                    behaviour_logprobs: Sequence[np.ndarray]) -> StepInputs:
        """The held responses' forward passes (`passes()`), with what the batch-level quantities read of every
        response (the KL in the reward's log-probs, the critic's values): exchanged unless held here."""
        if self.whole_here:
            own = passes()
            kl = own.old_logprobs if own.old_logprobs is not None else list(behaviour_logprobs)
            return dataclasses.replace(own, kl_logprobs_all=kl if kl_in_reward else None,
                                       ref_logprobs_all=own.ref_logprobs if kl_in_reward else None,
                                       values_all=own.values if critic else None)
        return exchange_step_inputs(step, passes, kl_in_reward=kl_in_reward, critic=critic,
                                    behaviour_logprobs=behaviour_logprobs, timeout_s=self.timeout_s)

    def training_arrays(self, step: int, scored: StepRollout, plans: Sequence, minibatches: Sequence[np.ndarray],
                        device_processes: Sequence[int], inputs: StepInputs, *, fields: Sequence[str]
                        ) -> dict[int, dict[str, np.ndarray]]:
        """{response: its arrays `fields`} of every response the `plans` (of `minibatches`) put on this process's
        devices (`device_processes`: each engine device's process): taken from the held ones, or sent
        point-to-point (sharded)."""
        destinations = sequence_destinations(plans, minibatches, device_processes, len(scored))
        return send_sequences(step, scored, destinations, inputs, process=self.process, processes=self.processes,
                              fields=fields, timeout_s=None if self.whole_here else self.timeout_s)

    def whole(self, scored: StepRollout) -> ScoredRollout:
        """The whole `ScoredRollout` of `scored` (sharded: every process's share all-gathered, a collective): what a
        checkpoint holds of a rollout sampled ahead, so that a resume in any layout reads it."""
        if scored.holds_all:
            return scored.own
        parts = gather_shares(lambda: scored.own, what=f"step {scored.step + 1}'s rollout for the checkpoint",
                              timeout_s=self.timeout_s, tags=CHECKPOINT_TAGS)
        return ScoredRollout.concat(parts, exchange_seconds=scored.exchange_seconds)

    def view(self, whole: ScoredRollout, *, num_prompts: int, group_size: int, devices: int) -> StepRollout:
        """This process's `StepRollout` of a whole rollout (a checkpoint's), with no exchange."""
        if self.whole_here:
            return StepRollout.from_whole(whole)
        return StepRollout.from_whole(whole, self.response_shares(num_prompts, group_size, devices)[self.process])
