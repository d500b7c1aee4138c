"""Trainer reliability (issue 11): a non-finite step is never applied or saved (SFT and RL: the run stops with the
latest checkpoint finite, or skips and counts the step), non-finite config values are refused, a failing run's
last line names its error (no orbax shutdown traceback), and resuming notices changed data and keeps the
learning-rate schedule of the original run."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import fsdp_toy
from jodc.fsdp import OptimizerConfig
from jodc.fsdp.optim import learning_rate_schedule
from jodc.train import load_config
from jodc.train import run_sft
from jodc.train.rl import loop as rl_module
from jodc.train.sft import loop as sft_module
from jodc.train.core.config import ConfigError
from jodc.train.core.metrics import read_metrics
from jodc.train.rl.loop import run_rl
from jodc.train.rl.config import load_rl_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def quiet(_message):
    pass


def sft_overrides(out_dir, *extra):
    return ["--preset", "tiny", "--max_length", "64", "--embedded_examples", "64", "--devices", "2",
            "--sequences_per_minibatch", "8", "--steps", "5", "--learning_rate", "1e-2", "--schedule", "constant",
            "--warmup_steps", "0", "--deterministic", "--no-progress", "--save_every", "1", "--keep_checkpoints",
            "10", "--no-export_hf", "--out_dir", str(out_dir), *extra]


def rl_overrides(out_dir, *extra):
    return ["--preset", "tiny", "--attention_block_size", "16", "--token_cap", "64", "--prompt_bucket", "8",
            "--max_new_tokens", "4", "--max_digits", "1", "--max_terms", "2", "--sft_steps", "0",
            "--prompts_per_step", "4", "--group_size", "2", "--updates_per_step", "2", "--steps", "3",
            "--devices", "2", "--deterministic", "--no-progress", "--save_every", "1", "--keep_checkpoints", "10",
            "--eval_every", "0", "--no-export_hf", "--out_dir", str(out_dir), *extra]


def checkpoint_params(out_dir):
    """{step: [flat parameter arrays]} of every checkpoint in out_dir."""
    import orbax.checkpoint as ocp

    root = os.path.join(out_dir, "checkpoints")
    out = {}
    for name in sorted(os.listdir(root), key=lambda n: int(n) if n.isdigit() else -1):
        if name.isdigit():
            state = ocp.StandardCheckpointer().restore(os.path.join(root, name, "engine"))
            out[int(name)] = [np.asarray(x) for x in jax.tree.leaves(state["params"])]
    return out


def assert_all_finite(out_dir):
    saved = checkpoint_params(out_dir)
    assert saved
    for step, arrays in saved.items():
        assert all(np.isfinite(a).all() for a in arrays), f"checkpoint {step} holds non-finite parameters"
    return saved


def poison_model(monkeypatch):
    """The trainer's decoder (both trainers build it in `Trainer.build_engine`) gets a NaN backward pass for
    microbatches marked by `fsdp_toy.poison`."""
    from jodc.train.core import trainer as module

    build = module.decoder_staged_model

    def poisoned(*args, **kwargs):
        model, groups = build(*args, **kwargs)
        return fsdp_toy.poison_backward(model), groups

    monkeypatch.setattr(module, "decoder_staged_model", poisoned)


def poison_sft_step(monkeypatch, bad_step):
    """0-based SFT step `bad_step` gets a NaN gradient on device 1 only (its loss stays finite)."""
    poison_model(monkeypatch)
    minibatch = sft_module.SFTRun.minibatch

    def poisoned(self, step):
        plan, arrays, examples = minibatch(self, step)
        if step == bad_step:
            fsdp_toy.poison(arrays, device=1, microbatch=0)
        return plan, arrays, examples

    monkeypatch.setattr(sft_module.SFTRun, "minibatch", poisoned)


# -- non-finite steps -------------------------------------------------------------------------------------------


def test_sft_a_nan_gradient_on_one_device_stops_the_run_and_no_checkpoint_is_poisoned(tmp_path, monkeypatch):
    poison_sft_step(monkeypatch, 2)
    with pytest.raises(FloatingPointError, match=r"step 3: non-finite gradients or updated parameters \(loss "
                       r"[0-9.]+, global grad norm nan\); the update was not applied; stopping without saving "
                       r"\(latest checkpoint: step 2"):
        run_sft(load_config(None, sft_overrides(tmp_path)), log=quiet)
    assert sorted(assert_all_finite(tmp_path)) == [1, 2]
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2]


def test_sft_skips_and_counts_a_non_finite_step_and_resumes_exactly_after_it(tmp_path, monkeypatch):
    poison_sft_step(monkeypatch, 2)
    straight = tmp_path / "straight"
    run_sft(load_config(None, sft_overrides(straight, "--skip_nonfinite_steps")), log=quiet)
    records = read_metrics(str(straight / "metrics.jsonl"))
    assert [r["skipped_updates"] for r in records] == [0, 0, 1, 1, 1]
    assert [r.get("skipped", False) for r in records] == [False, False, True, False, False]
    assert np.isfinite([r["loss"] for r in records]).all()
    saved = assert_all_finite(straight)
    for a, b in zip(saved[2], saved[3]):  # the skipped step left the parameters as they were
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(saved[3], saved[4]))  # and training went on
    # stopped right after the skipped step and resumed: the same run, bit for bit, the same learning rates
    resumed = tmp_path / "resumed"
    run_sft(load_config(None, sft_overrides(resumed, "--skip_nonfinite_steps")), stop_at_step=3, log=quiet)
    run_sft(load_config(None, sft_overrides(resumed, "--skip_nonfinite_steps")), log=quiet)
    for a, b in zip(saved[5], checkpoint_params(resumed)[5]):
        np.testing.assert_array_equal(a, b)
    again = read_metrics(str(resumed / "metrics.jsonl"))
    assert [(r["loss"], r["learning_rate"], r["skipped_updates"]) for r in again] == \
           [(r["loss"], r["learning_rate"], r["skipped_updates"]) for r in records]


def poison_rl_update(monkeypatch, bad_call):
    """The `bad_call`-th (0-based) RL optimizer update gets a NaN gradient on one device only."""
    poison_model(monkeypatch)
    pack = rl_module.pack_local_minibatch
    calls = []

    def poisoned(*args, **kwargs):
        arrays = pack(*args, **kwargs)
        if len(calls) == bad_call:
            device = int(np.flatnonzero(np.asarray(arrays.counts))[-1])
            fsdp_toy.poison(arrays, device=device, microbatch=0)
        calls.append(1)
        return arrays

    monkeypatch.setattr(rl_module, "pack_local_minibatch", poisoned)


def test_rl_a_nan_gradient_on_one_device_stops_the_run_and_no_checkpoint_is_poisoned(tmp_path, monkeypatch):
    poison_rl_update(monkeypatch, 3)  # step 2, its second update
    with pytest.raises(FloatingPointError, match=r"step 2, update 2 of 2: non-finite gradients .* not applied; "
                       r"stopping without saving \(latest checkpoint: step 1"):
        run_rl(load_rl_config(None, rl_overrides(tmp_path)), log=quiet)
    assert sorted(assert_all_finite(tmp_path)) == [1]


def test_rl_skips_and_counts_a_non_finite_update_and_resumes_after_it(tmp_path, monkeypatch):
    poison_rl_update(monkeypatch, 3)
    run_rl(load_rl_config(None, rl_overrides(tmp_path, "--skip_nonfinite_steps")), stop_at_step=2, log=quiet)
    run_rl(load_rl_config(None, rl_overrides(tmp_path, "--skip_nonfinite_steps")), log=quiet)  # resumes at 2
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["skipped_updates"] for r in records] == [0, 1, 1]
    assert np.isfinite([r["loss"] for r in records]).all()
    assert sorted(assert_all_finite(tmp_path)) == [1, 2, 3]


def test_non_finite_parameters_are_never_written_to_a_checkpoint(tmp_path):
    """The last line of defence: whatever reaches a save with a NaN parameter is refused, nothing is written."""
    import fsdp_toy
    from jodc.fsdp import OptimizerConfig, ReferenceEngine
    from jodc.train.core.trainer import Trainer

    class Run(Trainer):
        def load_data(self):
            return None

        def build(self):
            model, groups = fsdp_toy.make_model(num_layers=1)
            groups["embed"]["table"][3, 1] = np.nan  # checked on the device, where the parameters are
            self.engine = ReferenceEngine(model, groups, optimizer=OptimizerConfig())

    run = Run(load_config(None, sft_overrides(tmp_path)), log=quiet)
    try:
        with pytest.raises(FloatingPointError, match=r"step 1: parameter groups \['embed'\] hold NaN or inf "
                           r"values; refusing to save them \(latest checkpoint: step None\)"):
            run.save(1)
        assert run.store.steps() == []
    finally:
        run.close()


@pytest.mark.parametrize("flag, value", [("--learning_rate", "nan"), ("--learning_rate", "inf"),
                                         ("--learning_rate", ".nan"), ("--max_grad_norm", "nan"),
                                         ("--b2", "-.inf"), ("--weight_decay", "inf"), ("--eps", "nan")])
def test_non_finite_float_settings_are_refused_naming_the_field(tmp_path, flag, value):
    field = flag[2:]
    with pytest.raises(ConfigError, match=rf"optimizer.{field} must be a finite number"):
        load_config(None, sft_overrides(tmp_path, flag, value))
    with pytest.raises(ConfigError, match=rf"optimizer.{field} must be a finite number"):
        load_rl_config(None, rl_overrides(tmp_path, flag, value))


def test_non_finite_rl_settings_are_refused_naming_the_field(tmp_path):
    for flag in ("--temperature", "--warmstart.sft_learning_rate", "--kl_coef", "--unstable_kl", "--clip_high"):
        key = {"--temperature": "rollout.temperature", "--kl_coef": "loss.kl_coef", "--unstable_kl":
               "run.unstable_kl", "--clip_high": "loss.clip_high"}.get(flag, flag[2:])
        with pytest.raises(ConfigError, match=rf"{key} must be a finite number"):
            load_rl_config(None, rl_overrides(tmp_path, flag, "nan"))


def test_a_config_built_in_code_is_checked_too():
    import dataclasses

    from jodc.train.core.config import SFTConfig

    config = SFTConfig()  # the optimizer section is jodc.fsdp.OptimizerConfig: its ValueError (ConfigError in a CLI)
    with pytest.raises(ValueError, match="optimizer.learning_rate must be a finite number"):  # checked when built
        dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer, learning_rate=float("nan")))


# -- the last line of a failed run ------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["sft", "rl"])
def test_a_data_error_is_the_last_thing_the_cli_prints(tmp_path, command):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9", "completion": "b"}\n')
    data = ["--data.path", str(bad)] if command == "sft" else ["--task.name", "jsonl", "--task.path", str(bad),
                                                                "--reward_fn", "math:hypot", "--pool_size", "0"]
    overrides = (sft_overrides if command == "sft" else rl_overrides)(tmp_path / "run", *data)
    proc = subprocess.run([sys.executable, "-m", "jodc.train", command, *overrides], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env={**os.environ, "XLA_FLAGS": ""})
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "bad.jsonl:2: not valid UTF-8 (byte 0xe9 at column 16)" in last, proc.stderr[-3000:]
    assert last.startswith(f"jodc-train{' rl' if command == 'rl' else ''}: error: ")
    assert "cannot schedule new futures" not in proc.stderr and "Exception in thread" not in proc.stderr


# -- resume -----------------------------------------------------------------------------------------------------


def write_data(path, edit=False):
    rows = [{"prompt": f"say {i}\n", "completion": f"{i} {i}"} for i in range(24)]
    if edit:
        rows[5] = {"prompt": "say 5\n", "completion": "5 6"}  # same path, same count, same length
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_resuming_on_changed_data_is_refused_unless_accepted(tmp_path):
    data = write_data(tmp_path / "d.jsonl")
    args = sft_overrides(tmp_path / "run", "--data.path", data, "--steps", "2")
    run_sft(load_config(None, args), log=quiet)
    write_data(tmp_path / "d.jsonl", edit=True)
    more = [*args, "--steps", "3"]
    with pytest.raises(RuntimeError, match=r"the data differ from those checkpoint .*/2 was trained on \(24 "
                       r"examples, sha256 [0-9a-f]{16}\.\.\. then; 24 examples, sha256 [0-9a-f]{16}\.\.\. now\): "
                       r"resuming would silently continue on other data.*checkpoint.accept_changed_data=true"):
        run_sft(load_config(None, more), log=quiet)
    lines = []
    summary = run_sft(load_config(None, [*more, "--accept_changed_data"]), log=lines.append)
    assert summary["steps_done"] == 3
    assert any(line.startswith("warning: the data differ") for line in lines)
    lines = []  # checkpoint 3 was trained on the edited data: resuming on them is silent
    run_sft(load_config(None, [*args, "--steps", "4"]), log=lines.append)
    assert not any("differ" in line for line in lines)


def test_rl_resuming_on_an_edited_prompt_file_is_refused_unless_accepted(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i} + 1 ="}) + "\n" for i in range(8)))
    reward = tmp_path / "reward.py"
    reward.write_text("def odd(prompt, response):\n    return float(len(response) % 2)\n")
    args = rl_overrides(tmp_path / "run", "--task.name", "jsonl", "--task.path", str(prompts), "--reward_fn",
                        f"{reward}:odd", "--pool_size", "0", "--eval_problems", "2", "--steps", "1")
    run_rl(load_rl_config(None, args), log=quiet)
    prompts.write_text(prompts.read_text().replace("3 + 1", "3 + 2"))
    with pytest.raises(RuntimeError, match=r"the data differ from those checkpoint .*/1 was trained on \(8 examples"):
        run_rl(load_rl_config(None, [*args, "--steps", "2"]), log=quiet)
    lines = []
    run_rl(load_rl_config(None, [*args, "--steps", "2", "--accept_changed_data"]), log=lines.append)
    assert any(line.startswith("warning: the data differ") for line in lines)


def test_raising_steps_on_resume_keeps_the_original_learning_rate_schedule(tmp_path):
    args = sft_overrides(tmp_path / "run", "--schedule", "cosine", "--steps", "4")
    run_sft(load_config(None, args), stop_at_step=2, log=quiet)
    lines = []
    run_sft(load_config(None, [*args, "--steps", "6"]), log=lines.append)
    assert any("keeps the original run's length of 4 optimizer updates (the new run.steps would make it 6)"
               in line for line in lines), lines
    cosine = learning_rate_schedule(OptimizerConfig(learning_rate=1e-2, schedule="cosine", total_steps=4))
    logged = [r["learning_rate"] for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl"))]
    np.testing.assert_allclose(logged, [float(cosine(i)) for i in range(6)], rtol=1e-6, atol=1e-9)
    # an explicit optimizer.total_steps changes the length, and says so
    lines = []
    run_sft(load_config(None, [*args, "--steps", "7", "--total_steps", "10"]), log=lines.append)
    assert any("changes from 4 to 10 optimizer updates" in line for line in lines), lines
    logged = [r["learning_rate"] for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl"))]
    longer = learning_rate_schedule(OptimizerConfig(learning_rate=1e-2, schedule="cosine", total_steps=10))
    assert logged[6] == pytest.approx(float(longer(6)), rel=1e-6)


def test_fingerprints_and_schedule_pinning_helpers():
    """The pure helpers behind the resume checks, without a run."""
    from jodc.train.sft.data import Example, fingerprint_examples
    from jodc.train.rl.tasks import Problem, fingerprint_task
    from jodc.train.core.trainer import check_data_fingerprint, pin_schedule_length

    def ex(tokens, mask):
        return Example(np.array(tokens, np.int32), np.array(mask, bool))

    a = fingerprint_examples([ex([1, 2, 3], [0, 1, 1]), ex([4, 5], [0, 1])])
    assert a == fingerprint_examples([ex([1, 2, 3], [0, 1, 1]), ex([4, 5], [0, 1])]) and a["examples"] == 2
    assert a != fingerprint_examples([ex([1, 2, 3], [0, 0, 1]), ex([4, 5], [0, 1])])  # the mask counts
    assert a != fingerprint_examples([ex([1, 2], [0, 1]), ex([3, 4, 5], [0, 1, 1])])  # and the boundaries
    check_data_fingerprint(None, a, accept=False, where="ckpt", log=quiet)  # an older checkpoint: accepted
    check_data_fingerprint(a, a, accept=False, where="ckpt", log=quiet)
    b = dict(a, sha256="0" * 64)
    with pytest.raises(RuntimeError, match="the data differ from those checkpoint ckpt was trained on"):
        check_data_fingerprint(b, a, accept=False, where="ckpt", log=quiet)
    lines = []
    check_data_fingerprint(b, a, accept=True, where="ckpt", log=lines.append)
    assert lines and lines[0].startswith("warning: ")

    class Task:
        problems = [Problem("1 + 1 =", "2"), Problem("2 + 2 =", None)]

    assert fingerprint_task(Task())["examples"] == 2 and fingerprint_task(object()) is None

    config = load_config(None, ["--steps", "10", "--schedule", "cosine"])
    assert pin_schedule_length(config, {}, quiet) is config  # a checkpoint without the length: unchanged
    pinned = pin_schedule_length(config, {"schedule_steps": 6}, lines.append)
    assert pinned.total_steps == 6 and "keeps the original run's length of 6" in lines[-1]
    explicit = load_config(None, ["--steps", "10", "--schedule", "cosine", "--total_steps", "12"])
    assert pin_schedule_length(explicit, {"schedule_steps": 6}, lines.append).total_steps == 12
    assert "changes from 6 to 12" in lines[-1]
