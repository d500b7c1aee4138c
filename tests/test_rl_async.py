"""Asynchronous rollouts with bounded staleness, the bf16 sampler's mismatch and recomputed old / proximal
log-probs: the staleness bound is enforced (a rollout staler than `max_staleness` is refused), the sampler thread
follows its deterministic version schedule and hands errors to the trainer, pending rollouts survive a JSON round
trip bit for bit, an objective that needs them reads the recomputed trainer log-probs, and a stopped and resumed
asynchronous bf16 run equals the uninterrupted one bit for bit (tiny model, no warm start, a length reward)."""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jodc.train.cli import main as train_main
from jodc.train.core.metrics import read_metrics
from jodc.train.core.preemption import Preempted
from jodc.train.rl import async_rollouts
from jodc.train.rl.async_rollouts import AsyncRollouts, StaleRolloutError, behaviour_version, check_staleness
from jodc.train.rl.config import load_rl_config
from jodc.train.rl.loop import format_summary, run_rl
from jodc.train.rl.loss import build_objective
from jodc.train.rl.rollout import Rollout
from jodc.train.rl.scored import ScoredRollout, logprob_mismatch

from test_rl import EXACT_KEYS, engine_state
from test_rl_loss import microbatch
from stop_signals import SigtermAt
from step_runner import process_alive  # tools/step_runner.py (tests/conftest.py puts tools/ on the path)

STEPS = 6


def quiet(_message):
    pass


# -- the staleness bound --------------------------------------------------------------------------------------------
def test_the_schedule_and_the_bound():
    assert [behaviour_version(s, 2) for s in range(5)] == [0, 0, 0, 1, 2]
    assert check_staleness(np.array([3, 3]), 5, 2) == 2
    with pytest.raises(StaleRolloutError, match="1 response.*version 2, 3 versions old, beyond .*max_staleness=2"):
        check_staleness(np.array([3, 2]), 5, 2)
    with pytest.raises(StaleRolloutError, match="newer than the trainer"):
        check_staleness(np.array([6]), 5, 2)
    with pytest.raises(StaleRolloutError):
        check_staleness(np.array([4]), 5, 0)  # synchronous: only the current version


def fake_scored(step, version, n=2):
    rollout = Rollout(prompts=["p"] * n, prompt_ids=[np.array([1, 2], np.int32)] * n,
                      response_ids=[np.array([3], np.int32)] * n, logprobs=[np.array([-0.5], np.float32)] * n,
                      topk_ids=None, topk_logprobs=None, responses=["x"] * n, finished=np.ones(n, bool),
                      group_size=n, seconds=0.0)
    return ScoredRollout(step=step, rollout=rollout, rewards=np.zeros(n), versions=np.full(n, version),
                         trainer_logprobs=[np.array([-0.5], np.float32)] * n)


def test_the_sampler_thread_follows_the_schedule_and_refuses_stale_rollouts(monkeypatch):
    made = []

    def produce(step, params, version):
        assert params == {"version": version}  # the weights of the version it records
        made.append((step, version))
        if step == 5:
            raise ValueError("reward failed")
        return fake_scored(step, version)

    rollouts = AsyncRollouts(produce, max_staleness=2, start_step=0)
    try:
        for step in range(3):
            rollouts.publish(step, {"version": step})
            scored, waited = rollouts.get(step)
            assert scored.step == step and waited >= 0
            assert (scored.versions == behaviour_version(step, 2)).all()
        rollouts.publish(3, {"version": 3})
        assert [p.step for p in rollouts.pending(3)] == [3, 4]  # what a checkpoint of step 3 holds
        for step in (3, 4):
            assert rollouts.get(step)[0].versions.tolist() == [step - 2] * 2
        with pytest.raises(ValueError, match="reward failed"):  # the sampler's error, raised in the trainer
            rollouts.get(5)
    finally:
        rollouts.close()
    assert made == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 2), (5, 3)]

    # a sampler that samples from older weights than the schedule allows: refused when the trainer takes it
    monkeypatch.setattr(async_rollouts, "behaviour_version", lambda step, k: max(0, step - k - 1))
    rollouts = AsyncRollouts(lambda s, p, v: fake_scored(s, v), max_staleness=1, start_step=0)
    try:
        for step in range(2):
            rollouts.publish(step, {"version": step})
            rollouts.get(step)
        rollouts.publish(2, {"version": 2})
        with pytest.raises(StaleRolloutError, match="2 versions old, beyond rollout.max_staleness=1"):
            rollouts.get(2)
    finally:
        rollouts.close()


def test_pending_rollouts_round_trip_through_json_exactly():
    rng = np.random.default_rng(0)
    scored = fake_scored(3, 1, n=3)
    scored.rollout.logprobs = [rng.normal(size=4).astype(np.float32) for _ in range(3)]
    scored.rollout.topk_ids = [rng.integers(0, 9, (4, 2)).astype(np.int32) for _ in range(3)]
    scored.rollout.topk_logprobs = [rng.normal(size=(4, 2)).astype(np.float32) for _ in range(3)]
    scored.trainer_logprobs = [rng.normal(size=4).astype(np.float32) for _ in range(3)]
    import json

    back = ScoredRollout.from_json(json.loads(json.dumps(scored.to_json())))
    for a, b in [(scored.rollout.logprobs, back.rollout.logprobs), (scored.trainer_logprobs, back.trainer_logprobs),
                 (scored.rollout.topk_ids, back.rollout.topk_ids),
                 (scored.rollout.topk_logprobs, back.rollout.topk_logprobs)]:
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and np.array_equal(x, y)
    assert back.versions.tolist() == [1, 1, 1] and back.step == 3


def test_logprob_mismatch():
    out = logprob_mismatch([np.array([-1.0, -2.0])], [np.array([-1.5, -2.0])])
    assert out["logprob_mismatch"] == pytest.approx(0.25) and out["logprob_mismatch_max"] == pytest.approx(0.5)
    r = np.exp(-0.5)
    assert out["mismatch_kl"] == pytest.approx((r - 1 + 0.5) / 2)


# -- recomputed old / proximal log-probs ----------------------------------------------------------------------------
def objective(*overrides):
    cfg = load_rl_config(None, list(overrides))
    return build_objective(cfg.loss, cfg.rollout)


def test_only_losses_that_read_old_logprobs_recompute_them_and_only_off_policy():
    assert not objective("--loss", "ppo").recompute  # synchronous fp32: they are the behaviour log-probs
    for loss in ("ppo", "decoupled_ppo", "tis", "grpo", "cispo"):
        assert objective("--loss", loss, "--max_staleness", "1").recompute, loss
        assert objective("--loss", loss, "--rollout.dtype", "bfloat16").recompute, loss
        assert "trainer_logprobs" in objective("--loss", loss, "--max_staleness", "1").extras
    for loss in ("dppo", "dppo_topk", "dg"):
        assert not objective("--loss", loss, "--max_staleness", "2", "--rollout.dtype", "bfloat16").recompute


@pytest.mark.parametrize("loss", ["ppo", "decoupled_ppo", "tis"])
def test_the_old_policy_is_the_trainers_log_probs_when_recomputed(loss):
    logits, mb = microbatch()
    current = jnp.take_along_axis(jax.nn.log_softmax(logits), mb["targets"][..., None], -1)[..., 0]
    mb = dict(mb, trainer_logprobs=current)  # the trainer's log-probs before the update = the current policy's
    recomputing = objective("--loss", loss, "--rollout.dtype", "bfloat16")
    _, metrics = recomputing.policy_loss(logits, mb)
    assert float(metrics["clip_fraction"]) == 0.0  # ratio pi / pi_old == 1: nothing clipped
    if loss == "decoupled_ppo":  # the behaviour weight pi_prox / mu is not 1: behaviour still used there
        assert abs(float(metrics["behaviour_weight_mean"]) - 1.0) > 0.05
    _, stale_metrics = objective("--loss", loss).policy_loss(logits, mb)  # anchored at the behaviour log-probs
    assert float(stale_metrics["clip_fraction"]) > 0.0


# -- a run ----------------------------------------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARD_SOURCE = "def length_reward(prompt, response):\n    return float(len(response) <= 2)\n"


def async_overrides(out_dir, reward_file, *extra):
    """configs/rl_async.yaml (2 versions stale, bf16 sampler) shrunk to the tiny preset without a warm start,
    with decoupled PPO (which needs recomputed proximal log-probs) and a reward a random policy gets."""
    return ["--config", os.path.join(ROOT, "configs", "rl_async.yaml"), "--preset", "tiny",
            "--attention_block_size", "16", "--token_cap", "48", "--prompt_bucket", "8", "--sft_steps", "0",
            "--pool_size", "8", "--prompts_per_step", "4", "--group_size", "4", "--updates_per_step", "2",
            "--learning_rate", "1e-3", "--total_steps", str(2 * STEPS), "--loss", "decoupled_ppo", "--kl_coef", "0",
            "--task.reward_fn", f"{reward_file}:length_reward", "--eval_every", "0", "--deterministic",
            "--no-progress", "--save_every", "3", "--keep_checkpoints", "3", "--no-export_hf",
            "--out_dir", str(out_dir), *extra]


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "length_reward.py"
    path.write_text(REWARD_SOURCE)
    return str(path)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, reward_file):
    out = tmp_path_factory.mktemp("rl_async")
    args = async_overrides(out, reward_file, "--steps", str(STEPS), "--rollout.sampler", "thread")
    summary = run_rl(load_rl_config(args[1], args[2:]), log=quiet)
    return str(out), summary


def test_an_async_bf16_run_records_versions_overlap_and_mismatch(straight):
    out, summary = straight
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [r["staleness"] for r in records] == [0, 1, 2, 2, 2, 2]
    assert [r["policy_version"] for r in records] == [0, 0, 0, 1, 2, 3]
    for r in records:
        assert 0 < r["logprob_mismatch"] < 0.5 and r["mismatch_kl"] >= 0  # bf16 sampler vs fp32 trainer
        assert 0 <= r["trainer_idle_fraction"] <= 1 and 0 <= r["sampler_idle_fraction"] <= 1
        assert r["rollout_wait_seconds"] >= 0 and "recompute_seconds" in r
        assert np.isfinite(r["loss"]) and "loss_behaviour_weight_mean" in r
    assert len({r["loss"] for r in records}) > 1
    assert summary["max_staleness"] == 2 and 0 < summary["logprob_mismatch"] < 0.5
    assert "rollouts: max_staleness 2, sampler bfloat16; trainer idle" in format_summary(summary)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, reward_file):
    """The run directory of the async config stopped after 3 steps from the command line, with the config's sampler
    process (its checkpoint holds rollouts 4 and 5, sampled from versions 1 and 2, also in the child): each resume
    below continues a copy of it."""
    out = tmp_path_factory.mktemp("rl_async_stopped")
    assert train_main(["rl", *async_overrides(out, reward_file, "--steps", "3")]) == 0
    return out


@pytest.mark.parametrize("second", ["process", "thread"])
def test_the_async_config_resumes_from_the_command_line_exactly(straight, stopped, reward_file, tmp_path, second):
    """Stopped after 3 steps with the config's sampler process (`stopped`) and run again to 6 with the process or
    the sampler thread: the same rollouts and updates as the uninterrupted thread-only run, bit for bit (the child
    loads the `task.reward_fn` file again and computes with the trainer's XLA flags)."""
    import shutil

    out, _ = straight
    tmp_path = tmp_path / "run"
    shutil.copytree(stopped, tmp_path)
    assert train_main(["rl", *async_overrides(tmp_path, reward_file, "--steps", str(STEPS), "--rollout.sampler",
                                              second)]) == 0
    a, b = read_metrics(os.path.join(out, "metrics.jsonl")), read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        for key in EXACT_KEYS + ("staleness", "policy_version", "logprob_mismatch", "loss_behaviour_weight_mean"):
            assert x[key] == y[key], (x["step"], key)
    for x, y in zip(engine_state(out, STEPS), engine_state(str(tmp_path), STEPS)):
        assert np.array_equal(x, y)


def test_sigterm_mid_step_checkpoints_the_rollouts_sampled_ahead_and_resumes_exactly(straight, reward_file,
                                                                                     tmp_path):
    """SIGTERM in the middle of step 4 of the asynchronous run (sampler thread ahead of the trainer): step 4
    finishes and is checkpointed with the rollouts sampled ahead, the run stops with `Preempted`, and the resumed run
    equals the uninterrupted one bit for bit."""
    out, _ = straight
    args = async_overrides(tmp_path, reward_file, "--steps", str(STEPS), "--rollout.sampler", "thread")
    config = load_rl_config(args[1], args[2:])
    with pytest.raises(Preempted, match="after step 4"):
        run_rl(config, log=quiet, callbacks=[SigtermAt(3)])
    assert read_metrics(os.path.join(tmp_path, "metrics.jsonl"))[-1]["step"] == 4
    second = run_rl(config, log=quiet)
    assert second["start_step"] == 4 and second["steps_done"] == STEPS
    a, b = read_metrics(os.path.join(out, "metrics.jsonl")), read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        for key in EXACT_KEYS + ("staleness", "policy_version", "logprob_mismatch"):
            assert x[key] == y[key], (x["step"], key)
    for x, y in zip(engine_state(out, STEPS), engine_state(str(tmp_path), STEPS)):
        assert np.array_equal(x, y)


def test_the_sampler_process_gets_the_trainers_cpu_device_count(reward_file, tmp_path):
    """As a new user runs it: no XLA_FLAGS, the CLI sets the CPU device count through `jax_num_cpu_devices` (which a
    child process does not inherit). The sampler process computes on as many devices as the trainer, so the async
    config runs (it failed with "engine.devices=2 but only 1 cpu device(s) exist")."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    command = [sys.executable, "-m", "jodc.train", "rl",
               *async_overrides(tmp_path, reward_file, "--steps", "1", "--rollout.sampler", "process")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert [r["step"] for r in read_metrics(os.path.join(tmp_path, "metrics.jsonl"))] == [1]


@pytest.mark.parametrize("stop_signal", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_stops_the_trainer_and_its_sampler_process(reward_file, tmp_path, stop_signal):
    """Ctrl-C (SIGINT) or a scheduler's SIGTERM reaches the trainer and the sampler process (one process group, as
    in a terminal or a batch job): the child ignores it and keeps sampling, so the trainer can checkpoint the
    rollouts sampled ahead before it stops, and the child is gone when the trainer has exited. Ctrl-C saves the last
    finished step; SIGTERM lets the step under way finish, saves it and exits with status 143."""
    import signal
    import subprocess
    import sys
    import time

    command = [sys.executable, "-m", "jodc.train", "rl",
               *async_overrides(tmp_path, reward_file, "--steps", "400", "--log_every", "1", "--save_every", "2",
                                "--rollout.sampler", "process")]
    # Ctrl-C's default action in the trainer even when this test runs with SIGINT ignored (`nohup make test &`: a
    # process that starts with it ignored keeps it ignored, and Python then installs no KeyboardInterrupt handler).
    # A handled signal is reset to its default across exec, so the test handles it while it starts the trainer (no
    # preexec_fn: Python code between fork and exec in a process with JAX's threads may deadlock).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        trainer = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True, cwd=ROOT)
    finally:
        signal.signal(signal.SIGINT, previous)
    metrics = os.path.join(tmp_path, "metrics.jsonl")
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and trainer.poll() is None and (
                not os.path.exists(metrics) or len(read_metrics(metrics)) < 3):
            time.sleep(0.2)
        children = _children(trainer.pid)
        assert trainer.poll() is None and children, "the run did not reach step 3 with a sampler process"
        os.killpg(trainer.pid, getattr(signal, stop_signal))
        output, _ = trainer.communicate(timeout=120)
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
    if stop_signal == "SIGINT":
        assert trainer.returncode != 0 and "interrupted; the latest checkpoint is" in output, output[-3000:]
    else:
        assert trainer.returncode == 143, (trainer.returncode, output[-3000:])
        stopped = re.search(r"jodc-train rl: stopped by SIGTERM after step (\d+) \(checkpoint (\S+)\)", output)
        assert stopped and stopped.group(2) == os.path.join(tmp_path, "checkpoints", stopped.group(1)), output[-3000:]
        assert os.path.isdir(stopped.group(2)) and int(stopped.group(1)) >= 3
        assert output.rstrip().endswith("run the same command again to resume"), output[-3000:]
    # no traceback of the child (it ignored Ctrl-C): a spawned child's runs through multiprocessing/spawn.py or
    # process.py (the trainer's own may pass through multiprocessing/queues.py: tensorboardX writes through a queue)
    assert not any(f"multiprocessing/{m}.py" in output for m in ("spawn", "process")), output[-3000:]
    deadline = time.monotonic() + 30  # a child may still be tearing down (state R, empty cmdline) for a moment
    while time.monotonic() < deadline and any(process_alive(pid) for pid in children):
        time.sleep(0.2)
    assert not any(process_alive(pid) for pid in children), f"processes {children} outlived the interrupted trainer"


def _children(pid: int) -> list[int]:
    """The child processes of `pid` (the sampler process and the multiprocessing resource tracker)."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except FileNotFoundError:  # a thread that ended since the listing (a worker pool's, say): no children
            continue
    return out


def test_only_a_sampler_with_other_numerics_runs_the_mismatch_pass():
    """An fp32 sampler (synchronous or stale) computes the trainer's numbers at the same weights: the extra fp32
    forward of the mismatch metrics runs only for a bf16 sampler (it used to run for every stale rollout, costing
    about as much as the sampling inside the asynchronous regime's timed steps)."""
    from jodc.train.rl.config import RolloutConfig
    from jodc.train.rl.sampler import measures_mismatch

    assert not measures_mismatch(RolloutConfig())
    assert not measures_mismatch(RolloutConfig(max_staleness=2))
    assert measures_mismatch(RolloutConfig(dtype="bfloat16"))
    assert measures_mismatch(RolloutConfig(max_staleness=2, dtype="bfloat16"))


def test_the_summary_line_of_stale_fp32_rollouts_has_no_mismatch():
    """Stale fp32 rollouts measure no mismatch (None): the summary says so instead of failing to format it."""
    from jodc.train.rl.metrics import overlap_lines

    base = {"max_staleness": 2, "rollout_dtype": "float32", "trainer_idle_fraction": 0.0,
            "sampler_idle_fraction": 0.25, "logprob_mismatch": None}
    assert overlap_lines(base) == ["rollouts: max_staleness 2, sampler float32; trainer idle 0%, sampler idle 25% "
                                   "of the step"]
    bf16 = overlap_lines({**base, "rollout_dtype": "bfloat16", "logprob_mismatch": 0.004})
    assert bf16[0].endswith("; log-prob mismatch 4.00e-03 per token")
    assert overlap_lines({**base, "max_staleness": 0}) == []


def test_the_rollout_source_is_chosen_once_from_the_config():
    """rollout.max_staleness 0: the trainer samples itself; k > 0: a sampler thread (in one process or several: the
    layout decides what it exchanges; the sampler process across processes is tests/test_multiprocess.py's); the
    synchronous source holds nothing for checkpoints."""
    import types

    from jodc.train.rl.rollout_source import AsyncRolloutSource, SyncRollouts, make_rollout_source

    sync = make_rollout_source(types.SimpleNamespace(max_staleness=0), sampler=None, reward_spec=None, trainer=None)
    assert isinstance(sync, SyncRollouts) and sync.checkpoint_state(3) == {}
    thread = make_rollout_source(types.SimpleNamespace(max_staleness=2, sampler="thread", partial_rollouts=False),
                                 sampler=None, reward_spec=None, trainer=None)
    assert isinstance(thread, AsyncRolloutSource) and thread.process is None and thread.partial is None
    assert thread.checkpoint_state(0) == {"pending_rollouts": []}
    with pytest.raises(RuntimeError, match="does not hold the rollouts of steps 5..6"):
        thread.restore(4, {"pending_rollouts": []}, "ckpt/4")