"""The RL trainer's update with context parallelism (ODC, `lb_mini_cp`): prompts + responses longer than
`engine.token_cap` are split over groups of devices; the first step's loss and gradient norm equal those of the same
run with a cap that holds every sequence (the same rollout: same seed and weights), and each step's record counts
its split sequences."""
import numpy as np
import pytest

from jodc.train.core.metrics import read_metrics
from jodc.train.rl.config import load_rl_config
from jodc.train.rl.loop import run_rl

# jaxlib 0.11 compiles the group ops with Shardy off only (docs/context_parallel.md, "Known issues")
pytestmark = pytest.mark.usefixtures("shardy_off_on_jaxlib_0_11")


def overrides(out_dir, token_cap, *extra):
    return ["--preset", "tiny", "--attention_block_size", "8", "--token_cap", str(token_cap), "--prompt_bucket", "8",
            "--max_new_tokens", "8", "--max_digits", "1", "--max_terms", "2", "--pool_size", "8",
            "--prompts_per_step", "4", "--group_size", "2", "--updates_per_step", "1", "--learning_rate", "3e-4",
            # an entropy bonus: a gradient even while every reward (and advantage) of the untrained policy is 0
            "--entropy_coeff", "0.1", "--steps", "1", "--devices", "2", "--deterministic", "--no-progress",
            "--eval_every", "0", "--no-export_hf", "--out_dir", str(out_dir), *extra]


def test_rl_update_splits_long_responses_over_groups_like_one_device(tmp_path, record_property):
    split = read_metrics(run_rl(load_rl_config(None, overrides(tmp_path / "cp", 8, "--context_parallel", "true")),
                                log=lambda _: None)["metrics"])
    whole = read_metrics(run_rl(load_rl_config(None, overrides(tmp_path / "whole", 16)), log=lambda _: None)["metrics"])
    assert split[0]["cp_sequences"] > 0 and "cp_sequences" not in whole[0]
    assert split[0]["tokens"] == whole[0]["tokens"]  # the same rollout
    errors = {k: abs(split[0][k] - whole[0][k]) / max(abs(whole[0][k]), 1e-30) for k in ("loss", "grad_norm")}
    record_property("relative_errors", errors)
    print(f"cp_sequences {split[0]['cp_sequences']}; relative errors {errors}")
    assert whole[0]["grad_norm"] > 0 and max(errors.values()) <= 1e-5, (errors, split[0], whole[0])
    assert np.isfinite(split[0]["loss"])
