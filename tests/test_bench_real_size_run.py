"""bench/real_size_run.py at a tiny size: the mpirun run, its checkpoint, the resume in one process on 2 devices and
the HF export all happen, and every rank's peak memory is reported."""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def test_param_count_is_qwen25_05b():
    from bench.real_size_run import param_count

    assert param_count(24, 151936) == 494_032_768


@pytest.mark.slow
def test_a_tiny_real_size_run(tmp_path):
    from mpirun import MPIRUN

    if not os.path.exists(MPIRUN) or not os.path.exists("/usr/bin/time"):
        pytest.skip("needs the jodc[mpi] extra and GNU time")
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "bench.real_size_run", "--layers", "1", "--vocab", "512", "--steps", "1", "--more-steps",
                           "1", "--max-length", "32", "--sequences", "2", "--run-dir", str(tmp_path / "run"),
                           "--timeout", "600", "--out", str(out)], capture_output=True, text=True, timeout=900,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["params"] == 512 * 896 + 14_912_384 + 896
    assert [len(p["peak_gb_per_process"]) for p in result["phases"]] == [2, 1]
    assert all(0 < g < 20 for p in result["phases"] for g in p["peak_gb_per_process"])
    assert len(result["losses"]) == 2 and result["export_bytes"] > 0
