"""The RL sampler in a child process at a lower OS priority (`rollout.sampler: process`).

Why a process: the sampler thread (`async_rollouts.py`) computes on the trainer's own XLA CPU client, so its
kernels run on the same worker threads as the engine's, at the same priority, and every core they take is
taken from the trainer (bench/rl_contention.py measures that cost). A child process is scheduled by the OS on
its own; at a higher `nice` (`rollout.sampler_nice`, 10) it runs mostly on the cycles the trainer leaves idle (the
engine's simulated devices wait on each other, and Python dispatch leaves gaps) and yields most of the rest.

`SamplerProcess` is a drop-in `produce(step, params, version) -> ScoredRollout` for `AsyncRollouts`: the sampler
thread keeps the schedule, the staleness bound and the checkpoints, and only the computation moves. The child
holds a pickled `RolloutSampler` (task, tokenizer, sampling parameters and reward function must pickle; a
`task.reward_fn` is loaded again from its spec there) and the weights of the version it last sampled from; the
parent sends a version's weights once (host numpy), then sample requests. The child computes with the trainer's
XLA flags, on as many devices as the engine's, split the same way (the same compiled programs), so a rollout is the
same as the thread's for the same (step, weights, version) (tested bit for bit on CPU). Across processes (mpirun)
the child, outside the MPI job, computes its process's share only (`RolloutSampler.process`) and the parent's
sampler thread exchanges it (`sampler.ExchangedShares`).

Failures: an exception in the child comes back as `SamplerProcessError` with the child's traceback for the step
that raised it; a child that dies (killed, out of memory) is reported with its exit code instead of hanging
the trainer; `close()` stops the child (kills it if it does not exit within the timeout).
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pickle
import signal
import traceback
from typing import Any

import jax
import numpy as np

from .rewards import load_reward_function
from .sampler import RolloutSampler, ScoredRollout


class SamplerProcessError(RuntimeError):
    """The sampler process failed (its traceback is in the message) or exited."""


def _serve(conn, payload: bytes, reward_spec: str | None, nice: int, env: dict[str, str]) -> None:
    """The child's loop: ("params", version, weights) keeps the weights of `version`; ("sample", step, version)
    answers ("rollout", ScoredRollout) or ("error", traceback); ("stop",) ends it."""
    os.environ.update(env)  # before JAX initialises a backend (unpickling the sampler only imports modules)
    if "JAX_NUM_CPU_DEVICES" in env:  # (JAX read its environment when this module imported it)
        jax.config.update("jax_num_cpu_devices", int(env["JAX_NUM_CPU_DEVICES"]))
    # Ctrl-C and a scheduler's SIGTERM (sent to the whole job) are the trainer's: it finishes the step,
    # checkpoints (which waits for the rollouts sampled ahead) and then stops this process
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, signal.SIG_IGN)
    if nice:
        os.nice(nice)
    sampler: RolloutSampler = pickle.loads(payload)
    if reward_spec:
        sampler = dataclasses.replace(sampler, reward_fn=load_reward_function(reward_spec))
    weights: dict[int, Any] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            return
        if message[0] == "stop":
            return
        if message[0] == "params":
            _, version, params = message
            weights = {version: params}
            continue
        _, step, version = message
        try:
            if version not in weights:
                raise RuntimeError(f"no weights of policy version {version} (holding {sorted(weights)})")
            conn.send(("rollout", sampler(step, weights[version], version)))
        except BaseException:  # noqa: BLE001 (reported to the trainer, which raises it for this step)
            conn.send(("error", traceback.format_exc()))


def child_environment(platform: str, environ=os.environ) -> dict[str, str]:
    """What the child's JAX must see of the trainer's (set before it starts a backend): the trainer's XLA flags,
    no preallocation of an accelerator's memory (it stays the trainer's), and on CPU the trainer's device count
    however the trainer set it (XLA_FLAGS, or `jax_num_cpu_devices`, which the CLI sets and a child does not
    inherit), so the child splits a step over as many devices as the engine's, as the sampler thread does."""
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if "XLA_FLAGS" in environ:
        env["XLA_FLAGS"] = environ["XLA_FLAGS"]
    if platform == "cpu":
        env["JAX_NUM_CPU_DEVICES"] = str(jax.local_device_count("cpu"))
    return env


def _host(params) -> Any:
    """`params` with every leaf a numpy array (what pickles cheaply and needs no device in the child)."""
    return jax.tree.map(np.asarray, params)


class SamplerProcess:
    """`RolloutSampler.__call__` computed by a child process at `nice` (see the module docstring).

    Calls must come from one thread at a time (the `AsyncRollouts` sampler thread).
    """

    def __init__(self, sampler: RolloutSampler, *, nice: int = 10, reward_spec: str | None = None,
                 poll_seconds: float = 1.0):
        if not 0 <= nice <= 19:
            raise ValueError(f"nice must be in 0..19, got {nice}")
        try:  # a reward function loaded from `task.reward_fn` is loaded again in the child (a file's module is
            # not importable there by name)
            payload = pickle.dumps(dataclasses.replace(sampler, reward_fn=None) if reward_spec else sampler)
        except Exception as e:  # noqa: BLE001 (a lambda reward function, an open file in a task, ...)
            raise ValueError(f"rollout.sampler=process: the sampler cannot be sent to a child process ({e}); "
                             "give a module-level reward function (task.reward_fn: 'module:function') or use "
                             "rollout.sampler=thread") from None
        env = child_environment(getattr(sampler, "platform", "cpu"))
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: forking a live XLA client is unsafe
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_serve, args=(child_conn, payload, reward_spec, nice, env),
                                        name="rl-sampler", daemon=True)
        self._process.start()
        child_conn.close()
        self._version: int | None = None  # the version whose weights the child holds
        self.poll_seconds = poll_seconds

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _exited(self, step: int) -> SamplerProcessError:
        self._process.join(5.0)  # its exit code, once the pipe says it is gone
        return SamplerProcessError(f"step {step + 1}: the sampler process exited (code {self._process.exitcode}) "
                                   "before returning the rollout")

    def _receive(self, step: int):
        """The child's answer for `step`, or SamplerProcessError if it exits first."""
        while not self._conn.poll(self.poll_seconds):
            if not self._process.is_alive():
                raise self._exited(step)
        try:
            return self._conn.recv()
        except EOFError:
            raise self._exited(step) from None

    def __call__(self, step: int, params, version: int) -> ScoredRollout:
        """Step `step`'s scored rollout from `params` of policy `version`, computed in the child."""
        try:
            if version != self._version:
                self._conn.send(("params", version, _host(params)))
                self._version = version
            self._conn.send(("sample", step, version))
        except (BrokenPipeError, ConnectionResetError):
            raise self._exited(step) from None
        kind, value = self._receive(step)
        if kind == "error":
            raise SamplerProcessError(f"step {step + 1}: the sampler process raised:\n{value}")
        return value

    def close(self, timeout: float = 30.0) -> None:
        """Asks the child to stop; kills it if it has not exited after `timeout` seconds."""
        try:
            self._conn.send(("stop",))
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass
        self._process.join(timeout)
        if self._process.is_alive():  # (it ignores SIGTERM: see _serve)
            self._process.kill()
            self._process.join(5.0)
        self._conn.close()
