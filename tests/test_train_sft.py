"""The SFT trainer end to end on the tiny preset: the loss drops, checkpoints keep the latest N, a stopped and
resumed deterministic ODC run equals an uninterrupted one bit for bit, the engines agree, the HF export loads
back, checkpoints of another run are refused, and the CLI runs in a fresh process (where it sets XLA_FLAGS)."""
import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from jodc.train import load_config

from jodc.train import run_sft
from jodc.train.core.checkpoint import CheckpointStore
from jodc.train.core.preemption import Preempted
from jodc.train.core.metrics import read_metrics
from jodc.train.sft.loop import CHECKPOINT_DIR, format_summary

from stop_signals import SigtermAt

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 10


def overrides(out_dir, *extra):
    return ["--preset", "tiny", "--max_length", "128", "--embedded_examples", "256", "--devices", "2",
            "--sequences_per_minibatch", "8", "--steps", str(STEPS), "--learning_rate", "1e-2",
            "--schedule", "constant", "--warmup_steps", "0", "--deterministic", "--no-progress",
            "--save_every", "3", "--keep_checkpoints", "2", "--timeline_every", "5", "--out_dir", str(out_dir), *extra]


def quiet(_message):
    pass


def final_state(out_dir, step=STEPS):
    """The engine state saved in checkpoint `step` of out_dir."""
    store = CheckpointStore(os.path.join(out_dir, CHECKPOINT_DIR), keep=10)
    try:
        return store.restore(step, engine_state_template(load_config(None, overrides(out_dir))))[0]
    finally:
        store.close()


def engine_state_template(config):
    """A state_dict of the run's model and optimizer (any engine's: the checkpoint form is canonical)."""
    from jodc.fsdp import ReferenceEngine
    from jodc.train.core.staged_decoder import decoder_staged_model
    from jodc.train.core.model import build_decoder
    from jodc.models.tokenizer import byte_level_tokenizer

    decoder_config, groups = build_decoder(config.model, byte_level_tokenizer(), max_length=config.data.max_length,
                                           compute_dtype="float32", seed=0)
    model, groups = decoder_staged_model(decoder_config, groups)
    return ReferenceEngine(model, groups, optimizer=config.schedule_optimizer).state_dict()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    summary = run_sft(load_config(None, overrides(out)), log=quiet)
    return out, summary


def test_loss_drops_and_outputs_are_written(straight):
    out, summary = straight
    records = read_metrics(summary["metrics"])
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in records]
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.0, losses
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 and len(r["microbatches"]) == 2 for r in records)
    assert summary["first_loss"] == losses[0] and summary["last_loss"] == losses[-1]
    assert [r["step"] for r in records if "bubble_rate" in r] == [5, 10]
    assert os.path.exists(summary["timeline"]) and summary["timeline"].endswith("step_000010.png")
    assert 0.0 <= summary["bubble_rate"] < 1.0
    assert os.path.exists(os.path.join(out, "config.yaml")) and os.listdir(summary["tensorboard"])


def test_planning_time_is_logged_next_to_step_time(straight):
    _, summary = straight
    records = read_metrics(summary["metrics"])
    for r in records:  # the planner's own wall time: real work, part of the host time of the step
        assert np.isfinite(r["plan_ms"]) and 0.0 < r["plan_ms"] <= r["host_seconds"] * 1e3, r
    plan_ms = [r["plan_ms"] for r in records]
    assert summary["plan_ms_mean"] == pytest.approx(np.mean(plan_ms)) and summary["plan_ms_max"] == max(plan_ms)
    assert summary["step_seconds_mean"] == pytest.approx(np.mean([r["step_seconds"] for r in records]))
    assert "planning:" in format_summary(summary)


def test_only_the_latest_checkpoints_are_kept(straight):
    out, summary = straight
    store = CheckpointStore(os.path.join(out, CHECKPOINT_DIR), keep=2)
    try:
        assert store.steps() == [9, 10]  # saved at 3, 6, 9 and at the end; keep_checkpoints=2
        assert summary["checkpoint"] == store.step_dir(10)
        assert store.read_trainer_state(10)["sampler"]["next_minibatch"] == 10
    finally:
        store.close()


def test_stopped_and_resumed_run_equals_the_uninterrupted_one(straight, tmp_path):
    out, _ = straight
    config = load_config(None, overrides(tmp_path))
    first = run_sft(config, stop_at_step=4, log=quiet)   # "preempted" after step 4 (checkpoints 3 and 4)
    assert first["steps_done"] == 4 and first["hf_export"] is None
    second = run_sft(config, log=quiet)
    assert second["start_step"] == 4 and second["steps_done"] == STEPS
    straight_losses = [r["loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))]
    resumed_losses = [r["loss"] for r in read_metrics(os.path.join(tmp_path, "metrics.jsonl"))]
    assert resumed_losses == straight_losses  # bit for bit, one record per step
    a, b = final_state(str(out)), final_state(str(tmp_path))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    again = run_sft(config, log=quiet)  # already finished: nothing to run
    assert again["start_step"] == STEPS and again["losses"] == []


def test_sigterm_finishes_the_step_checkpoints_it_and_the_resume_is_exact(straight, tmp_path):
    """SIGTERM (a scheduler's notice before SIGKILL) in the middle of step 5 does not end the process at once
    (Python's default): step 5 finishes, is checkpointed (between the scheduled 3 and 6), and the run stops with
    `Preempted`; the previous SIGTERM handler is back afterwards. The resumed run equals the uninterrupted one bit for
    bit."""
    out, _ = straight
    config = load_config(None, overrides(tmp_path))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted, match="stopped by SIGTERM after step 5") as stopped:
        run_sft(config, log=quiet, callbacks=[SigtermAt(4)])
    assert signal.getsignal(signal.SIGTERM) is before
    assert stopped.value.step == 5 and stopped.value.checkpoint == os.path.join(tmp_path, CHECKPOINT_DIR, "5")
    store = CheckpointStore(os.path.join(tmp_path, CHECKPOINT_DIR), keep=2)
    assert store.steps() == [3, 5]
    store.close()
    assert not os.path.exists(os.path.join(tmp_path, "hf"))  # the final export is the resumed run's
    second = run_sft(config, log=quiet)
    assert second["start_step"] == 5 and second["steps_done"] == STEPS
    straight_losses = [r["loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))]
    assert [r["loss"] for r in read_metrics(os.path.join(tmp_path, "metrics.jsonl"))] == straight_losses
    for x, y in zip(jax.tree.leaves(final_state(str(out))), jax.tree.leaves(final_state(str(tmp_path)))):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_engines_agree_on_the_same_minibatches(straight, tmp_path):
    out, _ = straight
    want = [r["loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))][:2]
    for engine in ("collective", "reference"):
        config = load_config(None, overrides(tmp_path / engine, "--engine", engine, "--steps", "2",
                                             "--no-deterministic", "--no-export_hf", "--timeline_every", "0"))
        summary = run_sft(config, log=quiet)
        np.testing.assert_allclose([loss for _, loss in summary["losses"]], want, rtol=2e-5, err_msg=engine)


def test_xla_spmd_draws_its_timelines_from_the_plan(straight, tmp_path):
    """The XLA-SPMD engine cannot record timelines (one program for all devices, `supports_timeline` false): a
    run asking for one every step gets the planner-cost estimate instead of a crash at the first due step."""
    out, _ = straight
    config = load_config(None, overrides(tmp_path, "--engine", "xla_spmd", "--steps", "2", "--timeline_every", "1",
                                         "--no-deterministic", "--no-export_hf"))
    summary = run_sft(config, log=quiet)
    records = read_metrics(summary["metrics"])
    assert [r["step"] for r in records if "bubble_rate" in r] == [1, 2]
    assert summary["timeline"].endswith("step_000002.png") and os.path.exists(summary["timeline"])
    events = json.load(open(summary["timeline"][:-4] + ".json"))  # estimated: whole microbatches, no stages
    assert events and all(e["label"].startswith(("mb", "wait mb", "barrier", "idle")) for e in events)
    assert not any("fwd" in e["label"] or "bwd" in e["label"] for e in events)
    want = [r["loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))][:2]
    np.testing.assert_allclose([r["loss"] for r in records], want, rtol=2e-5)


def test_hf_export_loads_back_with_the_trained_parameters(straight):
    from jodc.models import load_pretrained, load_tokenizer

    out, summary = straight
    model = load_pretrained(summary["hf_export"])
    assert model.config.num_layers == 2 and model.config.vocab_size == 264
    state = final_state(str(out))
    import ml_dtypes

    # exported in bf16 (checkpoint.export_dtype's default): the masters rounded to bf16, exactly
    want = state["params"]["embed"][: 264 * model.config.hidden_size].astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(model.embed.embedding[...]).reshape(-1), want)
    tokenizer = load_tokenizer(summary["hf_export"])
    ids = np.array([tokenizer.encode("copy: kalo\n", add_special_tokens=False)], np.int32)
    assert np.isfinite(np.asarray(model(ids))).all()


def test_another_runs_checkpoints_are_refused(straight):
    out, _ = straight
    with pytest.raises(RuntimeError, match="another model, data or data order.*model.preset: 'tiny' -> 'small'"):
        run_sft(load_config(None, overrides(out, "--preset", "small")), log=quiet)
    with pytest.raises(RuntimeError, match="already holds checkpoints .* checkpoint.resume is false"):
        run_sft(load_config(None, overrides(out, "--no-resume")), log=quiet)


def test_too_few_devices_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="engine.devices=16 but only 8 cpu device.*jax_num_cpu_devices"):
        run_sft(load_config(None, overrides(tmp_path, "--devices", "16")), log=quiet)


def test_cli_end_to_end_in_a_fresh_process(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join('{"prompt": "say %d\\n", "completion": "%d %d"}' % (i, i, i) for i in range(20)))
    cmd = [sys.executable, "-m", "jodc.train", "sft", "--preset", "tiny", "--data.path", str(data),
           "--max_length", "64", "--devices", "2", "--sequences_per_minibatch", "4", "--steps", "2",
           "--warmup_steps", "0", "--no-progress", "--out_dir", str(tmp_path / "run")]
    env = {**os.environ, "XLA_FLAGS": ""}  # the CLI itself must make the 2 devices exist
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data: 20 examples from" in proc.stdout and "done: 2 steps" in proc.stdout
    assert f"HF export:  {tmp_path / 'run' / 'hf'}" in proc.stdout
    assert len(read_metrics(str(tmp_path / "run" / "metrics.jsonl"))) == 2
    bad = subprocess.run(cmd[:4] + ["--engine", "mpi"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert bad.returncode == 2 and "engine.name: Cannot convert 'mpi' into one of" in bad.stderr


def test_training_starts_from_a_hf_checkpoint_and_its_tokenizer(straight, tmp_path):
    _, summary = straight
    config = load_config(None, overrides(tmp_path, "--model.hf_path", summary["hf_export"], "--steps", "1",
                                         "--no-export_hf", "--timeline_every", "0"))
    resumed_from_weights = run_sft(config, log=quiet)
    # the exported model has learned the data: its first loss is far below a fresh model's (~5.6)
    assert resumed_from_weights["first_loss"] < summary["first_loss"] - 1.0


def test_ctrl_c_between_steps_saves_and_during_a_step_does_not(tmp_path, monkeypatch):
    from jodc.train.core import metrics
    from jodc.train.sft import loop as sft

    config = load_config(None, overrides(tmp_path, "--engine", "reference", "--save_every", "0",
                                         "--timeline_every", "0", "--no-export_hf"))
    calls = []

    def interrupt_after_third_step(self, steps=1):
        calls.append(steps)
        if len(calls) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(metrics.MetricsLogger, "advance", interrupt_after_third_step)
    with pytest.raises(KeyboardInterrupt):
        run_sft(config, log=quiet)
    store = CheckpointStore(os.path.join(tmp_path, CHECKPOINT_DIR), keep=2)
    assert store.steps() == [3]
    store.close()
    monkeypatch.undo()

    real_step = sft.SFTRun.train_step

    def interrupt_inside_the_third_step(self, step):
        if step == 5:  # steps 4 and 5 ran in this invocation; the interrupt hits inside step 6
            raise KeyboardInterrupt
        return real_step(self, step)

    monkeypatch.setattr(sft.SFTRun, "train_step", interrupt_inside_the_third_step)
    with pytest.raises(KeyboardInterrupt):
        run_sft(config, log=quiet)
    store = CheckpointStore(os.path.join(tmp_path, CHECKPOINT_DIR), keep=2)
    assert store.steps() == [3]  # nothing saved from an engine that may be half-way through a step
    store.close()
    assert [r["step"] for r in read_metrics(os.path.join(tmp_path, "metrics.jsonl"))] == [1, 2, 3, 4, 5]
