"""bench/sft_smoke.py: the loss check on made-up metrics (falls, flat, gaps, NaN, too short), the committed GPU
config as the trainer reads it, and the smoke run itself on the CPU (the same command with the platform switched)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from bench import sft_smoke


def records(losses, steps=None):
    steps = steps or range(1, len(losses) + 1)
    return [{"step": s, "loss": loss, "tokens_per_s": 100.0 * s, "step_seconds": 1.0 / s}
            for s, loss in zip(steps, losses)]


def test_a_falling_loss_passes_and_reports_the_windows():
    r = sft_smoke.check_losses(records([5.6, 5.5, 5.4, 5.0, 4.8, 4.6]), window=2, min_drop=0.5)
    assert r["fell"] and r["problems"] == []
    assert r["loss_first_window"] == pytest.approx(5.55) and r["loss_last_window"] == pytest.approx(4.7)
    assert r["loss_drop"] == pytest.approx(0.85) and r["first_step_seconds"] == 1.0
    assert r["tokens_per_s"] == 400.0  # median of the steps after the first (which compiles)


@pytest.mark.parametrize("losses, steps, problem", [
    ([5.6, 5.5, 5.5, 5.4], None, "fell by 0.1000"),
    ([5.6, 5.5, 4.0, 3.0], [1, 2, 4, 5], "not 1..4 without a gap"),
    ([5.6, float("nan"), 4.0, 3.0], None, "non-finite loss at steps [2]"),
    ([5.6, 3.0, 2.0], None, "3 logged steps, need at least 4"),
])
def test_a_loss_that_did_not_fall_is_refused_with_the_reason(losses, steps, problem):
    r = sft_smoke.check_losses(records(losses, steps), window=2, min_drop=0.5)
    assert not r["fell"] and any(problem in p for p in r["problems"]), r["problems"]


def test_the_committed_config_is_the_one_gpu_odc_bf16_run_of_30_steps():
    from jodc.train import load_config

    c = load_config(sft_smoke.CONFIG, [])
    assert (c.engine.name, c.engine.devices, c.engine.platform, c.engine.compute_dtype) == ("odc", 1, "gpu", "bfloat16")
    assert c.run.steps == 30 and c.checkpoint.resume is False
    # every minibatch fits one microbatch buffer: one shape, one compilation
    assert c.data.sequences_per_minibatch * c.data.max_length <= c.engine.token_cap


def test_check_only_exits_nonzero_when_the_loss_did_not_fall(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records([5.0, 5.0, 5.1, 5.0, 5.0, 5.1])))
    with pytest.raises(SystemExit) as e:
        sft_smoke.main(["--check", str(path), "--no-save"])
    assert e.value.code == 1
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["sft_loss_fell"] is False and line["problems"]


@pytest.mark.slow
def test_the_smoke_run_on_the_cpu_trains_and_the_loss_falls(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.sft_smoke", "--platform", "cpu",
                           "--out-dir", str(tmp_path / "run"), "--no-save"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["sft_loss_fell"] is True and r["platform"] == "cpu" and r["steps"] == 8
    assert os.path.exists(os.path.join(tmp_path, "run", "metrics.jsonl"))
    again = subprocess.run([sys.executable, "-m", "bench.sft_smoke", "--platform", "cpu",
                            "--out-dir", str(tmp_path / "run"), "--no-save"], capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
    assert again.returncode != 0 and "not empty" in again.stderr  # a rerun never "passes" on the old metrics
