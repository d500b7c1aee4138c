"""bench/profile_step.py: HLO labels, and a traced CPU step whose top operations are the matmuls."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from bench import profile_step


def test_hlo_labels_and_kinds():
    text = ('  %fusion.12 = f32[4]{0} fusion(%p), kind=kLoop, metadata={op_name="jit(f)/jvp()/exp" '
            'source_file="/x/models/attention.py" source_line=213}\n'
            '  ROOT %dot.3 = f32[4,4]{1,0} dot(%a, %b), metadata={op_name="jit(f)/dot_general" stack_frame_id=3}\n'
            '  %p = f32[4]{0} parameter(0)\n')
    assert profile_step.hlo_op_names(text) == {"fusion.12": "jit(f)/jvp()/exp @ models/attention.py:213",
                                               "dot.3": "jit(f)/dot_general"}
    assert profile_step.op_kind("fusion.12") == "fusion" and profile_step.op_kind("cond.5.1") == "cond"
    assert profile_step.op_kind("ynn_fusion") == "ynn_fusion"


def test_a_traced_cpu_step_reports_its_top_operations():
    proc = subprocess.run([sys.executable, "-m", "bench.profile_step", "--steps", "1",
                           "--top", "6", "--attention-impl", "blockwise"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["platform"] == "cpu" and r["attention_impl"] == "blockwise" and len(r["top_ops"]) == 6
    shares = [row["share"] for row in r["top_ops"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1.0
    assert r["op_ms_per_step_total"] > 0 and all(row["ms_per_step"] > 0 for row in r["top_ops"])
    assert any("dot_general" in row["jax_op"] for row in r["top_ops"][:3])  # a decoder step is its matmuls
    assert not any(profile_step.op_kind(row["op"]) in profile_step.CONTROL_FLOW for row in r["top_ops"])
