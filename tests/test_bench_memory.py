"""bench/memory.py: the slope and ratio arithmetic on made-up numbers (a known line is recovered, the larger process
counts, the targets' verdicts), the phase meter on an allocation of known size, and the quick run itself (its JSON
keys, positive slopes from two sizes, the checkpoint / export / restore phases having done their work)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from bench import memory


def test_slope_recovers_a_line_and_refuses_one_size():
    k, b = memory.slope((10e6, 300e6 + 24 * 10e6), (30e6, 300e6 + 24 * 30e6))
    assert k == pytest.approx(24.0) and b == pytest.approx(300e6)
    with pytest.raises(ValueError, match="same parameter count"):
        memory.slope((10e6, 1.0), (10e6, 2.0))


def fake_process(params, layers, process, per_param, fixed=500e6, processes=1):
    """A worker's numbers where phase p peaks at fixed + per_param[p] x params and the steady state (after the step
    phase) and the RL steady state are fixed + 20 and + 22 B/param."""
    phases = {name: {"rss_start": fixed, "peak": fixed + per_param[name] * params, "rss_after": fixed,
                     "seconds": 1.0 + process} for name in memory.PHASE_NAMES}
    phases["step"]["rss_after"] = fixed + 20.0 * params
    phases["rl_step"]["rss_after"] = fixed + 22.0 * params
    return {"layout": "2x1" if processes > 1 else "1x2", "process": process, "processes": processes,
            "local_devices": 2 // processes, "layers": layers, "vocab": 512, "params": params, "phases": phases}


def test_analyse_takes_the_larger_process_and_judges_the_targets():
    good = {name: 22.0 for name in memory.PHASE_NAMES}  # 1.1x the steady slope of 20
    bad = {**good, "save": 60.0}  # 3x
    # process 1 is worse at save only: the 2x1 figure is its
    small = [fake_process(10e6, 1, 0, good, processes=2), fake_process(10e6, 1, 1, bad, processes=2)]
    large = [fake_process(30e6, 3, 0, good, processes=2), fake_process(30e6, 3, 1, bad, processes=2)]
    a = memory.analyse("2x1", small, large)
    assert a["steady_bytes_per_param"] == pytest.approx(20.0) and a["rl_steady_bytes_per_param"] == pytest.approx(22)
    assert a["state_share_bytes_per_param"] == 10.0  # (12 + 8) / 2 processes
    assert a["steady_over_share"] == pytest.approx(2.0) and a["steady_passes"] is False
    save, init = a["phases"]["save"], a["phases"]["init"]
    assert save["peak_bytes_per_param"] == pytest.approx(60.0) and save["peak_over_steady"] == pytest.approx(3.0)
    assert save["intercept_bytes"] == pytest.approx(500e6) and not save["passes"]
    assert init["peak_over_steady"] == pytest.approx(1.1) and init["passes"]
    assert save["predicted_gb_per_process_7b"] == pytest.approx(60.0 * 7.6)
    assert save["seconds"] == 2.0  # the slower process, at the larger size
    keys = memory.summary_keys(a)
    assert keys["memory_peak_over_steady_save_2x1"] == 3.0 and keys["memory_steady_bytes_per_param_2x1"] == 20.0
    assert keys["memory_predicted_gb_per_process_7b_init_2x1"] == pytest.approx(167.2)
    assert keys["memory_state_share_bytes_per_param_2x1"] == 10.0 and keys["save_seconds_2x1"] == 2.0
    assert keys["memory_phases_within_target_2x1"] is False and keys["memory_steady_within_share_target_2x1"] is False


def test_a_third_size_measures_how_far_each_phase_is_off_its_line():
    per_param = {name: 30.0 for name in memory.PHASE_NAMES}
    small, large = [fake_process(10e6, 1, 0, per_param)], [fake_process(30e6, 3, 0, per_param)]
    on_line = fake_process(20e6, 2, 0, per_param)
    on_line["phases"]["save"]["peak"] *= 1.1  # 10% above the line at the third size
    a = memory.analyse("1x2", small, large, [on_line])
    assert a["check_layers"] == 2 and a["steady_fit_error"] == pytest.approx(0.0, abs=1e-12)
    assert a["phases"]["init"]["fit_error"] == pytest.approx(0.0, abs=1e-12)
    assert a["phases"]["save"]["fit_error"] == pytest.approx(1 - 1 / 1.1)
    keys = memory.summary_keys(a)
    assert keys["memory_fit_max_abs_error_1x2"] == pytest.approx(1 - 1 / 1.1, abs=1e-4)
    assert keys["memory_fit_error_steady_1x2"] == 0.0
    assert memory.analyse("1x2", small, large)["phases"]["save"]["fit_error"] is None


def test_one_process_has_the_whole_share_and_no_share_verdict():
    per_param = {name: 20.0 for name in memory.PHASE_NAMES}
    a = memory.analyse("1x2", [fake_process(10e6, 1, 0, per_param)], [fake_process(30e6, 3, 0, per_param)])
    assert a["state_share_bytes_per_param"] == 20.0 and a["steady_passes"] is None
    assert all(p["passes"] for p in a["phases"].values())
    assert "memory_steady_within_share_target_1x2" not in memory.summary_keys(a)


def test_measure_sees_a_phase_peak_that_is_freed_before_it_ends():
    """A phase that touches 200 MiB and frees it: its peak is at least that above its start, while what it leaves
    resident is not (the high-water mark was reset when it started, so an earlier peak does not count)."""
    size = 200 * 2**20
    first = memory.measure(lambda: np.ones(size // 8))  # an earlier, equal peak
    r = memory.measure(lambda: np.ones(size // 8))
    for m in (first, r):
        assert m["peak"] - m["rss_start"] >= 0.95 * size
        assert m["rss_after"] - m["rss_start"] < 0.5 * size
    quiet = memory.measure(lambda: None)
    assert quiet["peak"] - quiet["rss_start"] < 0.25 * size  # the reset forgot the phases before


@pytest.mark.slow
def test_the_quick_run_reports_every_phase_from_two_sizes(tmp_path):
    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, "-m", "bench.memory", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    saved = json.loads(out.read_text())
    assert saved["summary"] == summary and summary["quick"] is True
    n1, n2 = summary["memory_params_1x2"]
    assert n2 - n1 > 10e6  # one Qwen2.5-0.5B-shaped layer more (~14.9M parameters)
    # the slope is the two sizes' difference, as recomputed from the raw numbers
    small, large = saved["runs"]["1x2"]
    assert (small[0]["params"], large[0]["params"]) == (n1, n2)
    steady = ((large[0]["phases"]["step"]["rss_after"] - small[0]["phases"]["step"]["rss_after"]) / (n2 - n1))
    assert summary["memory_steady_bytes_per_param_1x2"] == pytest.approx(steady, abs=0.01)
    # a process holds at least its fp32 parameters and Adam's moments, and not absurdly more
    assert 12 <= steady < 200
    assert summary["memory_state_share_bytes_per_param_1x2"] == 20.0
    for phase in memory.PHASE_NAMES:
        ratio = summary[f"memory_peak_over_steady_{phase}_1x2"]
        assert 0.5 < ratio < 20, (phase, ratio)
        assert summary[f"memory_predicted_gb_per_process_7b_{phase}_1x2"] > 0
    assert summary["save_seconds_1x2"] > 0 and summary["restore_seconds_1x2"] > 0
    assert "2x1" not in saved["runs"] and len(saved["runs"]["1x2"]) == 2  # no third size in --quick
    assert "steady (between SFT steps)" in proc.stdout and "rl_step" in proc.stdout
