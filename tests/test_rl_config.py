"""RL config: YAML + overrides in every form, errors that name the field, loss options (null = the loss's
default, 0 = off), resume compatibility, and the `rl` command line up to the point where JAX would load."""
import pytest

from jodc.train.rl import config as C
from jodc.train.core.config import ConfigError
from jodc.train.rl.cli import add_rl_parser, main


def test_defaults_are_valid_and_dppo_is_the_default_loss():
    cfg = C.load_rl_config()
    assert cfg.loss.name == "dppo" and cfg.loss.options() == {} and not cfg.loss.uses_topk
    assert cfg.trainer.engine == "odc" and cfg.trainer.planner_name == "lb_mini"
    assert cfg.total_steps == cfg.trainer.steps * cfg.trainer.updates_per_step
    assert cfg.rollout.rollout_size == cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert cfg.optimizer.schedule == "constant"  # RL's optimizer defaults, not SFT's


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "rl.yaml"
    path.write_text("loss:\n  name: ppo\n  clip_high: 0.28\ntrainer:\n  steps: 9\nrollout:\n  group_size: 4\n")
    cfg = C.load_rl_config(str(path), ["--steps=5", "--loss.dual_clip", "0", "--group-size", "6", "--no-progress",
                                       "--deterministic", "--task.name", "countdown", "--learning_rate", "3e-5"])
    assert (cfg.loss.name, cfg.trainer.steps, cfg.rollout.group_size) == ("ppo", 5, 6)
    assert cfg.loss.options() == {"clip_high": 0.28, "dual_clip": None}  # 0 switches dual clip off
    assert cfg.trainer.progress is False and cfg.trainer.deterministic is True
    assert cfg.task.name == "countdown" and cfg.task.task_options() == {"min_numbers": 2, "max_numbers": 4,
                                                                        "max_number": 25}
    assert cfg.optimizer.learning_rate == 3e-5
    assert C.config_from_dict(C.to_dict(cfg)) == cfg
    C.save_yaml(cfg, str(tmp_path / "saved.yaml"))
    assert C.load_rl_config(str(tmp_path / "saved.yaml")) == cfg


def test_topk_is_needed_by_the_topk_approximation_only():
    assert C.load_rl_config(None, ["--loss.name", "dppo_topk"]).loss.uses_topk
    assert C.load_rl_config(None, ["--loss.name", "dppo", "--approximation", "topk"]).loss.uses_topk
    assert not C.load_rl_config(None, ["--loss.name", "dppo_topk", "--approximation", "binary"]).loss.uses_topk


@pytest.mark.parametrize("overrides, message", [
    (["--name", "ppo"], "'name' is ambiguous: use one of task.name, loss.name"),
    (["--loss.nmae", "ppo"], "unknown config key 'loss.nmae' .*did you mean loss.name"),
    (["--group_size", "1"], "rollout.group_size must be >= 2"),
    (["--temperature", "0"], "rollout.temperature must be > 0"),
    (["--updates_per_step", "1000"], "trainer.updates_per_step=1000 exceeds the rollout's 128 responses"),
    (["--task.name", "jsonl"], "task.name=jsonl needs task.path"),
    (["--min_terms", "4"], "task.min_terms=4 exceeds task.max_terms=3"),
    (["--engine", "collective", "--deterministic"], "deterministic=true needs engine odc or reference"),
    (["--kl_estimator", "k4"], "loss.kl_estimator must be one of k1, k2, k3"),
    (["--divergence", "js"], "loss.divergence must be one of tv, kl"),
    (["--steps"], "override --steps needs a value"),
    (["steps", "3"], "expected an override like"),
])
def test_bad_configs_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        C.load_rl_config(None, overrides)


def test_unknown_sections_and_keys_in_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollouts:\n  group_size: 4\n")
    with pytest.raises(ConfigError, match="unknown section.*'rollouts'"):
        C.load_rl_config(str(path))
    path.write_text("loss:\n  clip: 0.2\n")
    with pytest.raises(ConfigError, match="unknown key .loss.clip. .did you mean loss.clip_low or "):
        C.load_rl_config(str(path))


def test_resume_mismatches_name_what_changed():
    saved = C.to_dict(C.load_rl_config())
    assert C.resume_mismatches(saved, C.load_rl_config(None, ["--steps", "99", "--loss.name", "ppo"])) == []
    changed = C.resume_mismatches(saved, C.load_rl_config(None, ["--max_digits", "3", "--seed", "1"]))
    assert changed == ["task.max_digits: 2 -> 3", "trainer.seed: 0 -> 1"]


def test_cli_prints_the_resolved_config_and_reports_config_errors(capsys):
    assert main(["--print-config", "--loss.name", "dapo", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "name: dapo" in out and "steps: 3" in out
    assert main(["--group_size", "1"]) == 2
    assert "config error: rollout.group_size must be >= 2" in capsys.readouterr().err


def test_the_rl_subcommand_registers_on_a_parent_parser():
    import argparse

    parser = argparse.ArgumentParser(prog="jodc-train")
    add_rl_parser(parser.add_subparsers(dest="command", required=True))
    args, overrides = parser.parse_known_args(["rl", "--config", "c.yaml", "--steps", "3"])
    assert (args.command, args.config, args.print_config, overrides) == ("rl", "c.yaml", False, ["--steps", "3"])
    assert "loss.name" in C.all_keys() and "warmstart.sft_steps" in C.all_keys()
