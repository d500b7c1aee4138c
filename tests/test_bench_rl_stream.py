"""bench/rl_stream.py at a CI size: it warm-starts a model on the expand task, both samplers sample every prompt,
the stream's responses equal the static sampler's, and the JSON line holds the figures the issue asks for."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_benchmark_compares_the_samplers_on_the_same_responses(tmp_path):
    cmd = [sys.executable, "-m", "bench.rl_stream", "--quick", "--warmstart-steps", "10",
           "--prompts", "16", "--batch", "8", "--slots", "8", "--max-new-tokens", "32", "--work", str(tmp_path),
           "--no-save"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["responses_equal"] == 1.0 and r["max_logprob_difference"] < 1e-4
    assert r["static_cache_tokens"] == r["stream_cache_tokens"]  # equal memory: 8 rows x (prompt width + 32)
    assert r["static_cache_tokens"] % 8 == 0 and (r["static_cache_tokens"] // 8 - 32) % 16 == 0
    for key in ("static_tokens_per_s", "stream_tokens_per_s", "stream_vs_static_tokens_per_s",
                "static_rollout_seconds", "stream_rollout_seconds", "stream_slot_utilisation"):
        assert r[key] > 0, key
    assert r["tokens"] >= 16 and 0 < r["static_slot_utilisation"] <= 1 and 0 < r["stream_slot_utilisation"] <= 1
