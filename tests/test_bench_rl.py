"""bench/rl.py's engine reuse (a run on a reused engine computes exactly what a run on a fresh engine does) and its
warm step time (the steps during which the process compiled are found and left out)."""

from jodc.train.core.metrics import read_metrics
from jodc.train.core import model, trainer
from jodc.train.rl import loop
from jodc.train.rl.config import load_rl_config

from bench import rl as bench_rl

#: Metrics that depend only on the computation, not on timing
EXACT_KEYS = ("reward_mean", "loss", "grad_norm", "policy_kl", "policy_kl_max", "entropy", "tokens")


def _config(out_dir):
    return load_rl_config(None, [
        "--preset", "tiny", "--attention_block_size", "16", "--token_cap", "64", "--prompt_bucket", "8",
        "--max_new_tokens", "4", "--max_digits", "1", "--max_terms", "2", "--sft_steps", "0",
        "--prompts_per_step", "4", "--group_size", "4", "--updates_per_step", "2", "--learning_rate", "1e-3",
        "--steps", "2", "--devices", "2", "--deterministic", "--no-progress", "--save_every", "0",
        "--eval_every", "0", "--eval_problems", "4", "--no-export_hf", "--out_dir", str(out_dir)])


def _parity_reward(prompt, response):
    """A reward with signal for an untrained model (the task's exact match would be 0 for every response)."""
    return float(len(response) % 2)


def _records(summary):
    return [{k: r[k] for k in EXACT_KEYS} for r in read_metrics(summary["metrics"])]


def test_engine_pool_builds_once_and_a_reused_engine_repeats_a_fresh_run(tmp_path, monkeypatch):
    """The second run reuses the first run's engine (no second build) after `load_state_dict` put back the initial
    parameters, optimizer state and step count; its records equal the first run's, which had a fresh engine. Had
    the reset missed the optimizer state or the step (the learning-rate schedule's position), the second run's
    losses and gradient norms would differ. The pool is the runs' engine factory: the library is not patched."""
    built = []
    make = model.make_engine

    def counting(*args):
        built.append(args)
        return make(*args)

    monkeypatch.setattr(model, "make_engine", counting)
    with bench_rl.EnginePool() as pool:
        pool.key = ("test",)
        runs = [_records(loop.run_rl(_config(tmp_path / name), reward_fn=_parity_reward, log=lambda _: None,
                                     engine_factory=pool)) for name in ("a", "b")]
        assert len(built) == 1
    assert trainer.make_engine is make  # nothing of the trainer was replaced
    first, second = runs
    assert len(first) == 2 and first == second
    assert first[0]["loss"] != first[1]["loss"]  # the steps did change the policy
    assert pool.engines == {}  # leaving the pool closed and dropped its engines


def test_the_steps_that_compile_are_found(tmp_path):
    """The first run compiles in its first steps (the sampler, the engine's step, the evaluation), a second
    identical run on a reused engine compiles nothing: `PhaseClock.compiled_steps` tells them apart, which is
    what keeps the warm step time (and `async_speedup`) independent of which regime ran first."""
    import jax
    import jax.numpy as jnp

    bench_rl.count_compiles()
    bench_rl.count_compiles()  # registered once: a second call does not double the count
    x = jnp.ones(7).block_until_ready()
    before = bench_rl.COMPILES[0]
    triple = jax.jit(lambda x: x * 3.0 + 1.0)
    triple(x).block_until_ready()
    triple(x).block_until_ready()  # cached: no second compilation
    assert bench_rl.COMPILES[0] == before + 1
    compiled = []
    with bench_rl.EnginePool() as pool:
        pool.key = ("compiles",)
        for run in range(2):
            clock = bench_rl.PhaseClock()
            loop.run_rl(_config(tmp_path / f"run{run}"), reward_fn=_parity_reward, log=lambda _: None,
                        engine_factory=pool, callbacks=[clock])
            compiled.append(sorted(clock.compiled_steps))
            assert {"rollout_cpu_utilisation", "train_cpu_utilisation", "step_cpu_utilisation"} <= \
                set(clock.utilisation())
    assert 0 in compiled[0] and compiled[1] == []


def test_mean_se_and_comparisons_against_numpy():
    """The headline statistics: the mean and standard error (ddof 1) of per-seed values against numpy in float64; a
    comparison with per-seed baselines averages the paired differences; a difference under NOISE_SES standard
    errors, or with one seed (no error estimate), is reported as inside the noise."""
    import math

    import numpy as np
    import pytest

    values = [0.61, 0.55, 0.58, 0.64, 0.57]
    mean, se = bench_rl.mean_se(values)
    assert mean == pytest.approx(np.mean(values), abs=1e-15)
    assert se == pytest.approx(np.std(values, ddof=1) / np.sqrt(5), abs=1e-15)
    assert math.isnan(bench_rl.mean_se([0.5])[1])
    with pytest.raises(ValueError, match="no values"):
        bench_rl.mean_se([])
    rising = bench_rl.compare("up", values, 0.50)  # +0.09 +- 0.016: a finding
    assert rising["difference"] == pytest.approx(np.mean(values) - 0.50, abs=1e-4) and not rising["within_noise"]
    flat = bench_rl.compare("flat", values, 0.58)  # +0.01 +- 0.016: noise
    assert flat["within_noise"]
    baseline = [0.60, 0.50, 0.60, 0.60, 0.55]
    paired = bench_rl.compare("paired", values, baseline)
    differences = np.subtract(values, baseline)
    assert paired["difference"] == pytest.approx(differences.mean(), abs=1e-4)
    assert paired["se"] == pytest.approx(differences.std(ddof=1) / np.sqrt(5), abs=1e-4)
    assert bench_rl.compare("one seed", [0.9], 0.1)["within_noise"]
    with pytest.raises(ValueError, match="baseline"):
        bench_rl.compare("mismatched", values, baseline[:3])
    def run(final, start):
        return {"final_accuracy": final, "final_eval_sampled_reward": final, "initial_accuracy": start,
                "initial_eval_sampled_reward": start}

    runs = {"sync": {"dppo": [run(v, b) for v, b in zip(values, baseline)],
                     "ppo": [run(b, b) for b in baseline]}}
    comparisons = bench_rl.headline_comparisons(runs)
    labels = [c["comparison"] for c in comparisons]
    assert labels == ["sync dppo final_accuracy - warm start", "sync dppo final_eval_sampled_reward - warm start",
                      "sync ppo final_accuracy - warm start", "sync ppo final_eval_sampled_reward - warm start",
                      "sync ppo - dppo final_eval_sampled_reward"]
    # each seed against the warm start on its own evaluation set (the initial values differ by seed)
    assert comparisons[0]["difference"] == pytest.approx(differences.mean(), abs=1e-4)
    assert comparisons[2]["difference"] == 0.0 and comparisons[2]["within_noise"]
    assert comparisons[4]["difference"] == pytest.approx(-differences.mean(), abs=1e-4)
    assert "inside the noise" in bench_rl.comparison_line(flat)
    assert "inside the noise" not in bench_rl.comparison_line(rising)
