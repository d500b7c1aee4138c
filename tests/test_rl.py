"""The RL trainer end to end on the tiny preset (2 simulated devices, ODC, deterministic): a warm-started policy
raises its mean reward on the arithmetic task, every output is written, a stopped and resumed run equals the
uninterrupted one bit for bit, a reward function that raises or returns a non-number stops the run with an
error naming the sample and leaves the checkpoints as they were, and the loss name switches the loss in a run
started from the command line."""
import os
import shutil

import jax
import numpy as np
import pytest

from jodc.train.core.checkpoint import CheckpointStore
from jodc.train.core.metrics import read_metrics
from jodc.train.core.preemption import Preempted
from jodc.train.rl.loop import CHECKPOINT_DIR, format_summary, run_rl
from jodc.train.cli import main as train_main
from jodc.train.rl.config import load_rl_config
from jodc.train.rl.rewards import RewardError
from jodc.train.rl.warmstart import WARMSTART_DIR

from stop_signals import SigtermAt

STEPS = 20
#: Metrics that depend only on the computation (not on timing); a resumed run must reproduce them exactly.
EXACT_KEYS = ("reward_mean", "accuracy", "response_length", "loss", "grad_norm", "policy_kl", "policy_kl_max",
              "ratio_mean", "entropy", "trust_region_fraction", "tokens", "microbatches")


def overrides(out_dir, *extra):
    return ["--preset", "tiny", "--attention_block_size", "16", "--token_cap", "64", "--prompt_bucket", "8",
            "--max_new_tokens", "4", "--max_digits", "1", "--max_terms", "2", "--pool_size", "8",
            "--sft_steps", "300", "--sft_examples", "4096", "--prompts_per_step", "16", "--group_size", "8",
            "--updates_per_step", "4", "--learning_rate", "3e-4", "--steps", str(STEPS), "--devices", "2",
            "--deterministic", "--no-progress", "--save_every", "4", "--keep_checkpoints", "2", "--eval_every",
            "10", "--eval_problems", "32", "--out_dir", str(out_dir), *extra]


def quiet(_message):
    pass


def with_warm_start(source_out, target_out):
    """A new run directory holding the warm start of `source_out` (reused, as a resumed run would)."""
    os.makedirs(target_out, exist_ok=True)
    shutil.copytree(os.path.join(source_out, WARMSTART_DIR), os.path.join(target_out, WARMSTART_DIR))
    return target_out


def engine_state(out_dir, step):
    """The flat parameters and optimizer state saved in checkpoint `step`, as a list of numpy arrays."""
    import orbax.checkpoint as ocp

    path = os.path.join(out_dir, CHECKPOINT_DIR, str(step), "engine")
    return [np.asarray(x) for x in jax.tree.leaves(ocp.StandardCheckpointer().restore(path))]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl_straight")
    summary = run_rl(load_rl_config(None, overrides(out)), log=quiet)
    return str(out), summary


def test_reward_rises_and_outputs_are_written(straight):
    out, summary = straight
    records = read_metrics(summary["metrics"])
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    rewards = [r["reward_mean"] for r in records]
    start, end = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert start > 0.05, "the warm start should give a non-zero reward"
    assert end > start + 0.05, rewards
    first = records[0]
    for key in ("accuracy", "response_length", "trust_region_fraction", "policy_kl", "entropy", "ratio_mean",
                "ratio_std", "rollout_seconds", "train_seconds", "rollout_fraction", "train_fraction"):
        assert key in first, key
    assert first["policy_kl_max"] >= first["policy_kl"] >= 0 and 0 <= first["trust_region_fraction"] < 1
    assert len(first["microbatches"]) == 4 and all(len(m) == 2 for m in first["microbatches"])
    # synchronous fp32 rollouts: the current version, the trainer's numerics: no mismatch pass, nothing recomputed
    assert all(r["staleness"] == 0 and r["policy_version"] == r["step"] - 1 for r in records)
    assert all("logprob_mismatch" not in r and "recompute_seconds" not in r for r in records)
    assert [r["step"] for r in records if "eval_accuracy" in r] == [1, 11]
    assert all(0 <= r["eval_sampled_reward"] <= 1 for r in records if "eval_accuracy" in r)
    assert summary["final_eval_accuracy"] is not None and summary["final_eval_sampled_reward"] is not None
    # the summary line: the held-out change (from the evaluation before step 1) first, the training reward second
    assert summary["first_eval_accuracy"] == records[0]["eval_accuracy"]
    assert summary["first_eval_sampled_reward"] == records[0]["eval_sampled_reward"]
    done_line = format_summary(summary).splitlines()[0]
    held_out = (f"held-out greedy accuracy {summary['first_eval_accuracy']:.3f} -> "
                f"{summary['final_eval_accuracy']:.3f}, sampled reward {summary['first_eval_sampled_reward']:.3f} -> "
                f"{summary['final_eval_sampled_reward']:.3f}; training reward {summary['first_reward']:.3f} -> ")
    assert held_out in done_line, done_line
    without_start = format_summary({**summary, "first_eval_accuracy": None})  # no evaluation before the first step
    assert "held-out greedy" not in without_start.splitlines()[0]
    assert "held-out evaluation at the end: greedy accuracy" in without_start
    assert os.path.exists(summary["curves"]) and os.listdir(summary["tensorboard"])
    assert os.path.exists(os.path.join(summary["hf_export"], "config.json"))
    store = CheckpointStore(os.path.join(out, CHECKPOINT_DIR), keep=2)
    try:
        assert store.steps() == [16, 20]
        assert store.read_trainer_state(20)["optimizer_updates"] == STEPS * 4
    finally:
        store.close()


def test_planning_time_is_logged_next_to_step_time(straight):
    _, summary = straight
    records = read_metrics(summary["metrics"])
    for r in records:  # every update's plan: real work, part of the step's training time
        assert np.isfinite(r["plan_ms"]) and 0.0 < r["plan_ms"] <= r["train_seconds"] * 1e3, r
        assert r["train_seconds"] <= r["step_seconds"]
    plan_ms = [r["plan_ms"] for r in records]
    assert summary["plan_ms_mean"] == pytest.approx(np.mean(plan_ms)) and summary["plan_ms_max"] == max(plan_ms)
    assert summary["step_seconds_mean"] == pytest.approx(np.mean([r["step_seconds"] for r in records]))
    assert "planning:" in format_summary(summary)


def test_resume_is_exact_and_a_failing_reward_leaves_the_checkpoints_intact(straight, tmp_path):
    """A synchronous run stopped by SIGTERM in the middle of step 6 (it finishes and checkpoints step 6), then
    twice by a failing reward function in step 7 (nothing of it is saved), resumes to the uninterrupted run's
    metrics and state bit for bit."""
    out, _ = straight
    run_dir = with_warm_start(out, tmp_path / "run")
    config = load_rl_config(None, overrides(run_dir))
    with pytest.raises(Preempted, match="after step 6"):  # SIGTERM mid-step 6: it finishes, is checkpointed
        run_rl(config, log=quiet, callbacks=[SigtermAt(5)])
    assert not os.path.exists(os.path.join(run_dir, "hf"))  # the export is the finished run's
    saved = engine_state(run_dir, 6)

    def raising(prompt, response):
        if response.startswith("1"):
            raise ZeroDivisionError("bad sample")
        return 0.0

    for bad, message in [(raising, r"raised ZeroDivisionError on step 7, sample \d+ \(prompt '\d[+-]\d=', "
                                    r"response '1"),
                         (lambda p, r: None, r"returned None \(NoneType\) on step 7, sample 0 ")]:
        with pytest.raises(RewardError, match=message):
            run_rl(config, reward_fn=bad, log=quiet)
        store = CheckpointStore(os.path.join(run_dir, CHECKPOINT_DIR), keep=2)
        try:
            assert store.steps() == [4, 6]  # nothing of step 7 was saved
        finally:
            store.close()
        for a, b in zip(saved, engine_state(run_dir, 6)):
            assert a.tobytes() == b.tobytes()

    second = run_rl(config, log=quiet)
    assert second["start_step"] == 6 and second["steps_done"] == STEPS
    want = read_metrics(os.path.join(out, "metrics.jsonl"))
    got = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for key in EXACT_KEYS:
        assert [r[key] for r in got] == [r[key] for r in want], key
    for a, b in zip(engine_state(out, STEPS), engine_state(run_dir, STEPS)):
        assert a.tobytes() == b.tobytes()


def test_the_command_line_runs_another_loss(straight, tmp_path):
    out, _ = straight
    run_dir = with_warm_start(out, tmp_path / "ppo")
    assert train_main(["rl", *overrides(run_dir, "--loss.name", "ppo", "--steps", "2", "--eval_every", "0",
                                        "--no-export_hf")]) == 0
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    assert len(records) == 2
    assert "loss_clip_fraction" in records[0] and "loss_masked_fraction" not in records[0]
    straight_records = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert records[0]["reward_mean"] == straight_records[0]["reward_mean"]  # same rollout, another loss
    assert records[1]["loss"] != straight_records[1]["loss"]


def test_continuous_batching_trains_on_the_static_samplers_rollouts(straight, tmp_path):
    """`rollout.batching: continuous` (each device streams its share through 5 slots over a paged cache) samples
    the static sampler's responses: the same rewards and tokens at every step, the
    loss to rounding (the behaviour log-probs differ by ~1e-6)."""
    out, _ = straight
    run_dir = with_warm_start(out, tmp_path / "continuous")
    args = overrides(run_dir, "--rollout.batching", "continuous", "--rollout.slots", "5", "--rollout.page_size", "4",
                     "--rollout.cache_tokens", "48", "--rollout.decode_chunk", "2", "--steps", "2", "--eval_every",
                     "0", "--no-export_hf")
    run_rl(load_rl_config(None, args), log=quiet)
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    straight_records = read_metrics(os.path.join(out, "metrics.jsonl"))[:2]
    for mine, theirs in zip(records, straight_records):
        for key in ("reward_mean", "accuracy", "response_length", "tokens", "microbatches"):
            assert mine[key] == theirs[key], key
        np.testing.assert_allclose(mine["loss"], theirs["loss"], rtol=1e-3, atol=1e-6)


def test_the_lockstep_engines_train_rl_alike(straight, tmp_path):
    """Every registered engine trains RL: the XLA-SPMD engine (once refused by the RL config) and the collective one
    run the same lock-step plans and agree up to floating-point reassociation."""
    out, _ = straight
    params = {}
    for name in ("collective", "xla_spmd"):
        run_dir = with_warm_start(out, tmp_path / name)
        args = overrides(run_dir, "--engine", name, "--steps", "1", "--eval_every", "0", "--no-export_hf")
        args.remove("--deterministic")  # ODC only
        summary = run_rl(load_rl_config(None, args), log=quiet)
        assert summary["steps_done"] == 1
        params[name] = engine_state(run_dir, 1)
    for a, b in zip(params["collective"], params["xla_spmd"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_prompts_from_a_file_need_a_reward_function(tmp_path):
    from jodc.train.core.config import ConfigError

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "2+2="}\n')
    config = load_rl_config(None, overrides(tmp_path / "out", "--task.name", "jsonl", "--path", str(prompts),
                                            "--sft_steps", "0", "--pool_size", "0"))
    with pytest.raises(ConfigError, match="jsonl has no built-in reward: set task.reward_fn"):
        run_rl(config, log=quiet)


def test_a_config_asking_for_more_devices_than_exist_fails_before_the_warm_start(tmp_path):
    """engine.devices beyond the devices that exist is an error before anything runs, not after the SFT warm start
    (the shipped async config's is 600 steps)."""
    config = load_rl_config(None, overrides(tmp_path, "--devices", str(len(jax.devices()) * 2)))
    with pytest.raises(RuntimeError, match=f"engine.devices={len(jax.devices()) * 2} but only"):
        run_rl(config, log=quiet)
    assert not os.path.exists(os.path.join(tmp_path, WARMSTART_DIR))
