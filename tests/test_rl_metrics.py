"""RL step metrics (rollout statistics, the updates' summary and blow-up flag), the reward / masked-fraction PNG,
and the warm start's SFT job and its refusal to reuse a warm start made for another run."""
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from jodc.train.rl.config import load_rl_config
from jodc.train.rl.metrics import plot_curves, rollout_metrics, step_record, update_metrics
from jodc.train.rl.tasks import make_task
from jodc.train.rl.warmstart import IDENTITY_FILE, WARMSTART_DIR, run_warmstart, warmstart_sft_config


def test_rollout_metrics():
    rewards = np.array([1.0, 0.0, 0.5, 0.5, 1.0, 1.0])  # groups of 2: signal, none, none
    m = rollout_metrics(rewards, 2, np.array([3, 5, 2, 2, 4, 8]), np.array([1, 1, 1, 1, 1, 0], bool),
                        success_reward=1.0)
    assert m["reward_mean"] == pytest.approx(4 / 6) and m["accuracy"] == pytest.approx(3 / 6)
    assert m["response_length"] == 4.0 and m["response_length_max"] == 8
    assert m["unfinished_fraction"] == pytest.approx(1 / 6) and m["zero_advantage_groups"] == pytest.approx(2 / 3)


def test_update_metrics_flag_a_blow_up_by_the_largest_kl():
    updates = [{"loss": 0.1, "grad_norm": 1.0, "policy_kl": 0.0, "trust_region_fraction": 0.0},
               {"loss": 0.3, "grad_norm": 3.0, "policy_kl": 0.2, "trust_region_fraction": 0.1},
               {"loss": 0.2, "grad_norm": 2.0, "policy_kl": 0.04, "trust_region_fraction": 0.3}]
    m = update_metrics(updates, unstable_kl=0.1)
    assert m["loss"] == pytest.approx(0.2) and m["grad_norm_max"] == 3.0
    assert m["policy_kl_max"] == 0.2 and m["policy_kl_last"] == 0.04 and m["unstable"] is True
    assert m["trust_region_fraction_last"] == 0.3
    assert update_metrics(updates, unstable_kl=0.5)["unstable"] is False


def test_step_record_assembles_rollout_updates_time_split_and_extras():
    # what step_record reads of a StepRollout
    scored = SimpleNamespace(response_lengths=np.array([2, 4, 6, 8]), finished=np.array([1, 1, 1, 0], bool),
                             rollout_seconds=2.0, rewards=np.array([1.0, 0.0, 1.0, 1.0]), versions=np.array([3, 3, 4, 4]),
                             reward_seconds=0.5, mismatch_seconds=0.25, mismatch={"logprob_mismatch": 0.01})
    updates = [{"loss": 0.5, "grad_norm": 2.0, "policy_kl": 0.01}]
    r = step_record(scored, 5, updates, group_size=2, success_reward=1.0, unstable_kl=0.1, seconds=8.0,
                    train_seconds=4.0, waited=2.0, sampler_busy=6.0, tokens=100, learning_rate=1e-4, skipped_updates=0)
    assert r["reward_mean"] == 0.75 and r["accuracy"] == 0.75 and r["loss"] == 0.5 and r["unstable"] is False
    assert (r["tokens_per_s"], r["rollout_fraction"], r["train_fraction"]) == (25.0, 0.25, 0.5)
    assert (r["policy_version"], r["staleness"], r["trainer_idle_fraction"], r["sampler_idle_fraction"]) == \
        (3, 2, 0.25, 0.25)
    assert (r["logprob_mismatch"], r["learning_rate"], r["skipped_updates"]) == (0.01, 1e-4, 0)
    skipped = step_record(scored, 5, [], group_size=2, success_reward=1.0, unstable_kl=0.1, seconds=8.0,
                          train_seconds=0.0, waited=0.0, sampler_busy=0.0, tokens=0)
    assert np.isnan(skipped["loss"]) and np.isnan(skipped["grad_norm"]) and skipped["tokens_per_s"] == 0.0


def test_plot_curves_writes_a_png(tmp_path):
    records = [{"step": s, "reward_mean": s / 10, "accuracy": s / 12, "trust_region_fraction": 0.01 * s,
                "trust_region_fraction_last": 0.02 * s, **({"eval_accuracy": 0.2} if s % 2 else {})}
               for s in range(1, 6)]
    path = plot_curves(records, str(tmp_path / "out" / "curves.png"), smoothing=3,
                       final_eval={"eval_accuracy": 0.3, "eval_sampled_reward": 0.25})
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no records"):
        plot_curves([], str(tmp_path / "x.png"))


def test_warmstart_sft_job_and_refusal_of_a_foreign_warm_start(tmp_path):
    config = load_rl_config(None, ["--sft_steps", "7", "--sft_learning_rate", "2e-3", "--devices", "2",
                                   "--out_dir", str(tmp_path), "--token_cap", "64"])
    sft = warmstart_sft_config(config, str(tmp_path / WARMSTART_DIR))
    assert (sft.run.steps, sft.optimizer.learning_rate, sft.engine.devices) == (7, 2e-3, 2)
    assert sft.data.path == str(tmp_path / WARMSTART_DIR / "data.jsonl") and sft.data.max_length == 64
    assert sft.model == config.model and sft.run.out_dir == str(tmp_path / WARMSTART_DIR)
    os.makedirs(tmp_path / WARMSTART_DIR)
    with open(tmp_path / WARMSTART_DIR / IDENTITY_FILE, "w") as f:
        json.dump({"model": {}, "task": {}, "warmstart": {}, "seed": 0, "token_cap": 64}, f)
    with pytest.raises(RuntimeError, match="holds a warm start made for another model, task, warmstart"):
        run_warmstart(config, make_task("arithmetic"), log=lambda _: None)
    with pytest.raises(ValueError, match="warmstart.sft_steps is 0"):
        run_warmstart(load_rl_config(), make_task("arithmetic"))
