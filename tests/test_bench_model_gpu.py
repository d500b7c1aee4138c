"""bench/model.py --device gpu on the CPU at a tiny shape: the transformers side in its child process, the same
weights loaded by jodc (both losses agree), the FLOP count against transformers' own parameter count, the JSON
keys the GPU run reports."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from bench import model

TINY = dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=512, batch=2, seq=128)


def test_step_flops_count_matmuls_six_times_per_token_plus_causal_attention():
    f = model.step_flops(TINY)
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128  # q, k, v (2 KV heads of 16), o, gate/up/down
    assert f["matmul_params"] == 2 * per_layer + 64 * 512
    assert f["dense"] == 6 * f["matmul_params"] * 2 * 128
    assert f["attention"] == 6 * 2 * 128**2 * 64 * 2  # batch x T^2 x heads*head_dim x layers
    assert f["total"] == f["dense"] + f["attention"]


def test_last_json_line_skips_logs_and_refuses_output_without_one():
    assert model.last_json_line('log\n{"a": 1}\nmore log {\n') == {"a": 1}
    with pytest.raises(ValueError, match="no JSON"):
        model.last_json_line("nothing here\n[1, 2]\n")


@pytest.mark.slow
def test_gpu_benchmark_runs_on_the_cpu_at_a_tiny_shape():
    args = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    proc = subprocess.run([sys.executable, "-m", "bench.model", "--device", "gpu", "--platform",
                           "cpu", *args, "--repeats", "2", "--attention-block-size", "64", "--attention-impls",
                           "blockwise,dense", "--no-save"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("gpu_train_step_vs_transformers", "gpu_mfu", "transformers_mfu", "ours_tokens_per_s",
                "transformers_tokens_per_s", "matmul_bf16_tflops"):
        assert r[key] > 0, key
    assert r["params"] == r["params_transformers"]  # our FLOP count's parameters are transformers' own
    assert abs(r["loss_ours"] - r["loss_transformers"]) < 0.02 * r["loss_transformers"]
    assert r["config"]["transformers_attention"] == "sdpa" and r["config"]["attention_block_size"] == 64
    assert r["config"]["dtype"] == "bfloat16" and r["platform"] == "cpu"
    assert r["config"]["attention_impl"] == "blockwise" and set(r["ours_step_ms_by_attention"]) == {"blockwise", "dense"}
    assert r["ours_step_ms"] == r["ours_step_ms_by_attention"]["blockwise"]
