"""bench/generate.py on the CPU at a tiny shape: both samplers generate every token, the same weights, the roofline's
byte count, the JSON keys the GPU run reports."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from bench import generate as bench


def test_decode_bytes_count_the_weights_read_and_the_mean_kv_cache():
    shape = dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=512)
    need = bench.decode_bytes(shape, prompt=16, new_tokens=9, batch=3)
    head_dim = 16
    per_layer = 64 * 4 * 16 + 2 * 64 * 2 * 16 + 4 * 16 * 64 + 3 * 64 * 128 + 2 * 64  # q, k+v, o, MLP, norms
    assert need["weights"] == 2 * (2 * per_layer + 64 + 64 * 512)  # + final norm + lm_head, bf16; no embedding
    assert need["kv_cache_mean"] == 2 * 2 * 2 * head_dim * (16 + 4) * 3 * 2  # k and v, mean context 16 + (9-1)/2
    assert need["total"] == need["weights"] + need["kv_cache_mean"]


def test_the_benchmark_runs_on_the_cpu_at_a_tiny_shape(tmp_path):
    out = tmp_path / "generate.json"
    proc = subprocess.run([sys.executable, "-m", "bench.generate", "--platform", "cpu",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r == json.loads(out.read_text())
    for key in ("gpu_generate_tokens_per_s", "gpu_generate_vs_transformers", "gpu_generate_vs_roofline",
                "transformers_tokens_per_s", "roofline_tokens_per_s", "hbm_copy_gb_per_s"):
        assert r[key] > 0, key
    assert r["config"]["new_tokens"] == 16 and r["config"]["top_k_logprobs"] == 4 and r["platform"] == "cpu"
