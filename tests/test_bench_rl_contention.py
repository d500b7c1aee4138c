"""bench/rl_contention.py's pieces: the per-step means, the summary's ratios and the background sampler's protocol."""

import pytest

from bench import rl_contention


def _record(step, seconds):
    return {"step": step, "step_seconds": seconds, "train_seconds": seconds / 2, "rollout_seconds": seconds / 4}


def test_phase_means_leave_out_the_first_steps():
    records = [_record(1, 10.0), _record(2, 1.0), _record(3, 3.0)]
    assert rl_contention.phase_means(records, skip=1) == {"step_seconds": 2.0, "train_seconds": 1.0,
                                                          "rollout_seconds": 0.5}
    with pytest.raises(ValueError, match="no steps after the first 3"):
        rl_contention.phase_means(records, skip=3)


def test_summary_gives_each_mode_its_ratio_to_the_trainer_alone_and_the_background_cpu():
    def run(seconds, cpu=None):
        out = rl_contention.phase_means([_record(1, seconds)], skip=0)
        return {**out, "background": {"seconds": 10.0, "cpu_seconds": cpu}} if cpu is not None else out

    summary = rl_contention.summarize({"alone": [run(1.0), run(3.0)], "nice19": [run(3.0, 6.0), run(3.0, 8.0)]})
    assert summary["alone_step_seconds"] == 2.0 and summary["nice19_train_seconds"] == 1.5
    assert summary["step_slowdown_nice19"] == 1.5 and summary["rollout_slowdown_nice19"] == 1.5
    assert summary["background_cpu_nice19"] == 0.7
    assert "background_cpu_alone" not in summary and "step_slowdown_alone" not in summary


def test_background_sampler_reports_its_rollouts_and_cpu_when_stopped():
    proc = rl_contention.start_background(19, ["--preset", "tiny", "--prompts_per_step", "2", "--group_size", "2"])
    try:
        used = rl_contention.stop_background(proc)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert set(used) == {"rollouts", "seconds", "cpu_seconds"} and used["seconds"] > 0 and used["cpu_seconds"] >= 0


def test_a_skip_that_leaves_no_step_is_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        rl_contention.main(["--steps", "5", "--skip", "5", "--no-save"])
    assert "--skip 5 leaves no step" in capsys.readouterr().err
