"""The RL sampler in a child process (`rollout.sampler: process`): it computes what it is asked with the weights
it was sent, at the requested OS priority; a failure in it comes back as an error that names the step (its
traceback included), a child that dies is reported with its exit code instead of hanging the trainer, a child
whose trainer is killed exits, and what cannot be sent to a child is refused before one starts. The run-level
equivalence with the sampler thread (bit for bit, across a resume) is in test_rl_async.py."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from step_runner import process_alive  # tools/step_runner.py (tests/conftest.py puts tools/ on the path)

from jodc.train.core.config import ConfigError
from jodc.train.rl.config import RolloutConfig
from jodc.train.rl.sampler_process import SamplerProcess, SamplerProcessError

TESTS = os.path.dirname(os.path.abspath(__file__))


class ScriptedSampler:
    """Stands in for a `RolloutSampler`: reports what it computed with and where; step 1 raises, step 2 kills
    its process."""

    def __call__(self, step, params, version):
        if step == 1:
            raise ValueError("the reward server is down")
        if step == 2:
            os._exit(7)
        return {"step": step, "version": version, "weights": params["w"].tolist(), "pid": os.getpid(),
                "nice": os.nice(0)}


def test_the_child_samples_with_the_weights_it_was_sent_at_its_priority_and_reports_failures():
    sampler = SamplerProcess(ScriptedSampler(), nice=5, poll_seconds=0.2)
    try:
        out = sampler(0, {"w": np.arange(3.0)}, 0)
        assert out["step"] == 0 and out["version"] == 0 and out["weights"] == [0.0, 1.0, 2.0]
        assert out["pid"] == sampler.pid != os.getpid()
        assert out["nice"] == min(19, os.nice(0) + 5)
        # the weights of a version are sent once: a second request for version 0 uses the child's copy
        assert sampler(3, {"w": np.ones(3)}, 0)["weights"] == [0.0, 1.0, 2.0]
        assert sampler(4, {"w": np.ones(3)}, 1)["weights"] == [1.0, 1.0, 1.0]
        with pytest.raises(SamplerProcessError, match=r"(?s)step 2: the sampler process raised:.*Traceback.*"
                                                      r"ValueError: the reward server is down"):
            sampler(1, {"w": np.ones(3)}, 1)
        assert sampler(5, {"w": np.ones(3)}, 1)["step"] == 5  # an error in one rollout leaves the child serving
        started = time.monotonic()
        with pytest.raises(SamplerProcessError, match=r"step 3: the sampler process exited \(code 7\)"):
            sampler(2, {"w": np.ones(3)}, 1)
        assert time.monotonic() - started < 30
        with pytest.raises(SamplerProcessError, match=r"step 7: the sampler process exited \(code 7\)"):
            sampler(6, {"w": np.ones(3)}, 2)
    finally:
        sampler.close(timeout=10)
    assert not sampler._process.is_alive()


def test_close_stops_a_live_child():
    sampler = SamplerProcess(ScriptedSampler(), nice=0)
    assert sampler(0, {"w": np.zeros(1)}, 0)["nice"] == os.nice(0)
    sampler.close(timeout=10)
    assert not sampler._process.is_alive() and sampler._process.exitcode == 0


def test_a_sampler_that_cannot_be_sent_is_refused_before_a_child_starts():
    with pytest.raises(ValueError, match="cannot be sent to a child process.*module-level reward function"):
        SamplerProcess(lambda step, params, version: None)
    with pytest.raises(ValueError, match="nice must be in 0..19"):
        SamplerProcess(ScriptedSampler(), nice=20)


def test_the_config_refuses_a_process_sampler_without_asynchrony_and_a_bad_priority():
    assert RolloutConfig(max_staleness=2, sampler="process").sampler_nice == 10
    with pytest.raises(ConfigError, match="rollout.sampler=process needs rollout.max_staleness >= 1"):
        RolloutConfig(sampler="process")
    with pytest.raises(ConfigError, match="rollout.sampler_nice must be in 0..19, got 20"):
        RolloutConfig(max_staleness=2, sampler="process", sampler_nice=20)
    with pytest.raises(ConfigError, match="sampler_nice"):
        RolloutConfig(max_staleness=2, sampler="process", sampler_nice=-1)


CHILD_OF_A_KILLED_TRAINER = f"""
import sys, time
sys.path[:0] = [{TESTS!r}, {os.path.join(os.path.dirname(TESTS), "tools")!r}]
import numpy as np
from jodc.train.rl.sampler_process import SamplerProcess
from test_rl_sampler_process import ScriptedSampler
sampler = SamplerProcess(ScriptedSampler(), nice=0)
sampler(0, {{"w": np.zeros(1)}}, 0)
print(sampler.pid, flush=True)
time.sleep(600)
"""


def test_the_child_of_a_killed_trainer_exits():
    """SIGKILL leaves the parent no chance to stop its child: the child sees its pipe close and exits."""
    parent = subprocess.Popen([sys.executable, "-c", CHILD_OF_A_KILLED_TRAINER], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and process_alive(child):
            time.sleep(0.2)
        assert not process_alive(child), f"the sampler process {child} outlived its killed trainer"
    finally:
        if parent.poll() is None:
            parent.kill()


SHARE_IN_A_CHILD = f"""
import dataclasses, sys
sys.path[:0] = [{TESTS!r}, {os.path.join(os.path.dirname(TESTS), "tools")!r}]
import jax
jax.config.update("jax_num_cpu_devices", 2)  # as the CLI sets it (no XLA_FLAGS): a child does not inherit it
import numpy as np
from jodc.train.rl.sampler_process import SamplerProcess
from rl_sampling_setup import CountingReward, make_params, make_sampler
# what the sampler child of MPI process 1 of 2 (2 devices each) computes: that process's 2 shares of step 3
sampler = dataclasses.replace(make_sampler(4, CountingReward()), process=(1, 2))
here = sampler(3, make_params(), 3)
child = SamplerProcess(sampler, nice=0)
try:
    there = child(3, make_params(), 3)
finally:
    child.close(timeout=10)
a, b = here.rollout, there.rollout
assert a.prompts == b.prompts and len(a.prompts) == 6, (a.prompts, b.prompts)
assert all(np.array_equal(x, y) for x, y in zip(a.response_ids, b.response_ids))
assert all(x.tobytes() == y.tobytes() for x, y in zip(a.logprobs, b.logprobs))
assert here.rewards.tolist() == there.rewards.tolist()
print("SAME", len(jax.local_devices()))
"""


def test_the_child_samples_on_as_many_devices_as_its_trainer_however_the_count_was_set():
    """A trainer that set its CPU device count with `jax_num_cpu_devices` (the CLI, no XLA_FLAGS): the child of
    MPI process 1 of 2 samples that process's two shares on two devices, as the process itself does, bit for bit
    (it had one device and sampled both shares as one batch: other numbers)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    done = subprocess.run([sys.executable, "-c", SHARE_IN_A_CHILD], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0 and "SAME 2" in done.stdout, (done.stdout + done.stderr)[-3000:]


def test_the_child_environment_carries_the_trainers_device_count_and_flags():
    import jax

    from jodc.train.rl.sampler_process import child_environment

    env = child_environment("cpu", {"XLA_FLAGS": "--xla_some_flag=1", "OTHER": "x"})
    assert env == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_FLAGS": "--xla_some_flag=1",
                   "JAX_NUM_CPU_DEVICES": str(jax.local_device_count("cpu"))}
    assert child_environment("gpu", {}) == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def test_a_child_with_fewer_devices_than_its_process_drives_says_so():
    import dataclasses

    from rl_sampling_setup import CountingReward, make_params, make_sampler

    sampler = dataclasses.replace(make_sampler(32, CountingReward()), process=(1, 2))  # 16 per process; 8 here
    with pytest.raises(RuntimeError, match="sampler process of MPI process 1 has 8 cpu device.*drives 16 "
                                           r"\(engine.devices=32 over 2 processes\)"):
        sampler(3, make_params(), 3)
