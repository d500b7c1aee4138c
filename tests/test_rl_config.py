"""RL config: YAML + overrides in every form, errors that name the field, loss options (null = the loss's
default, 0 = off), resume compatibility, and the `rl` command line up to the point where JAX would load."""
import pytest

from jodc.train.rl import config as C
from jodc.train.core import config as core
from jodc.train.core.config import ConfigError
from jodc.train.cli import _parser, main


def test_defaults_are_valid_and_dppo_is_the_default_loss():
    cfg = C.load_rl_config()
    assert cfg.loss.name == "dppo" and cfg.loss.options() == {}
    assert cfg.engine.name == "odc" and cfg.engine.planner_name == "lb_mini"
    assert cfg.total_steps == cfg.schedule_optimizer.total_steps == cfg.run.steps * cfg.run.updates_per_step
    assert cfg.rollout.rollout_size == cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert cfg.optimizer.schedule == "constant"  # RL's optimizer defaults, not SFT's


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "rl.yaml"
    path.write_text("loss:\n  name: ppo\n  clip_high: 0.28\nrun:\n  steps: 9\nrollout:\n  group_size: 4\n")
    cfg = C.load_rl_config(str(path), ["--steps=5", "--loss.dual_clip", "0", "--group-size", "6", "--no-progress",
                                       "--deterministic", "--task.name", "countdown", "--learning_rate", "3e-5"])
    assert (cfg.loss.name, cfg.run.steps, cfg.rollout.group_size) == ("ppo", 5, 6)
    assert cfg.loss.options() == {"clip_high": 0.28, "dual_clip": None}  # 0 switches dual clip off
    assert cfg.logging.progress is False and cfg.engine.deterministic is True
    assert cfg.task.name == "countdown" and cfg.task.task_options() == {"min_numbers": 2, "max_numbers": 4,
                                                                        "max_number": 25}
    assert cfg.optimizer.learning_rate == 3e-5
    expand = C.load_rl_config(None, ["--task.name", "expand", "--task.max_runs", "8", "--task.tail", "1.5"]).task
    assert expand.task_options() == {"min_runs": 1, "max_runs": 8, "max_count": 9, "letters": 5, "tail": 1.5}
    with pytest.raises(ConfigError, match="cannot hold one response"):
        C.load_rl_config(None, ["--rollout.batching", "continuous", "--rollout.cache_tokens", "16",
                                "--rollout.max_new_tokens", "64"])
    with pytest.raises(ConfigError, match="partial_rollouts needs rollout.batching=continuous"):
        C.load_rl_config(None, ["--rollout.partial_rollouts", "true", "--rollout.max_staleness", "1"])
    with pytest.raises(ConfigError, match="partial_rollouts needs"):
        C.load_rl_config(None, ["--rollout.partial_rollouts", "true", "--rollout.batching", "continuous"])
    with pytest.raises(ConfigError, match="max_count"):
        C.load_rl_config(None, ["--task.name", "expand", "--task.max_count", "10"])
    # a section given in part keeps RL's defaults for the rest (not the shared section class's)
    assert (cfg.optimizer.schedule, cfg.optimizer.warmup_steps, cfg.engine.devices, cfg.engine.token_cap) == \
        ("constant", 0, 2, 256)
    assert C.load_rl_config(None, ["--save_every", "3"]).checkpoint.keep_checkpoints == 2
    assert core.config_from_dict(core.to_dict(cfg), C.RLConfig) == cfg
    core.save_yaml(cfg, str(tmp_path / "saved.yaml"))
    assert C.load_rl_config(str(tmp_path / "saved.yaml")) == cfg


# The RL sections' own checks (the override syntax and the shared sections' checks: tests/test_train_config.py).
@pytest.mark.parametrize("overrides, message", [
    (["--name", "ppo"], "'name' is ambiguous: use one of engine.name, task.name, loss.name"),
    (["--loss.nmae", "ppo"], "unknown config key 'loss.nmae' .*did you mean loss.name"),
    (["--group_size", "1"], "rollout.group_size must be >= 2"),
    (["--temperature", "0"], "rollout.temperature must be > 0"),
    (["--updates_per_step", "1000"], "run.updates_per_step=1000 exceeds the rollout's 128 responses"),
    (["--task.name", "jsonl"], "task.name=jsonl needs task.path"),
    (["--min_terms", "4"], "task.min_terms=4 exceeds task.max_terms=3"),
    (["--kl_estimator", "k4"], "loss.kl_estimator: Cannot convert 'k4' into one of: k1, k2, k3"),
    (["--divergence", "js"], "loss.divergence: Cannot convert 'js' into one of: tv, kl"),
    # the names are the registries' of jodc.losses
    (["--loss.name", "ppo2"], "loss.name: Cannot convert 'ppo2' into one of: dppo, dppo_tv"),
    (["--advantage", "gpro"], "loss.advantage: Cannot convert 'gpro' into one of: grpo, dr_grpo"),
    (["--aggregation", "mean"], "loss.aggregation: Cannot convert 'mean' into one of: token-mean"),
])
def test_bad_configs_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        C.load_rl_config(None, overrides)


def test_unknown_sections_and_keys_in_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollouts:\n  group_size: 4\n")
    with pytest.raises(ConfigError, match="unknown config key 'rollouts.group_size' .*did you mean rollout.group_size"):
        C.load_rl_config(str(path))
    path.write_text("loss:\n  clip: 0.2\n")
    with pytest.raises(ConfigError, match="unknown config key 'loss.clip' .did you mean loss.clip_low or "):
        C.load_rl_config(str(path))


def test_resume_mismatches_name_what_changed():
    saved = core.to_dict(C.load_rl_config())
    assert core.resume_mismatches(saved, C.load_rl_config(None, ["--steps", "99", "--loss.name", "ppo"])) == []
    changed = core.resume_mismatches(saved, C.load_rl_config(None, ["--max_digits", "3", "--seed", "1"]))
    assert changed == ["task.max_digits: 2 -> 3", "run.seed: 0 -> 1"]


def test_cli_prints_the_resolved_config_and_reports_config_errors(capsys):
    assert main(["rl", "--print-config", "--loss.name", "dapo", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "name: dapo" in out and "steps: 3" in out
    assert main(["rl", "--group_size", "1"]) == 2
    assert "config error: rollout.group_size must be >= 2" in capsys.readouterr().err


def test_the_rl_subcommand_of_jodc_train():
    args, overrides = _parser().parse_known_args(["rl", "--config", "c.yaml", "--steps", "3"])
    assert (args.command, args.config, args.print_config, overrides) == ("rl", "c.yaml", False, ["--steps", "3"])
    assert "loss.name" in core.all_keys(C.RLConfig) and "warmstart.sft_steps" in core.all_keys(C.RLConfig)


def test_what_the_rl_trainer_does_not_support_is_refused():
    assert C.load_rl_config(None, ["--engine", "xla_spmd"]).engine.name == "xla_spmd"  # every engine trains RL
    with pytest.raises(ConfigError, match="does not support .*logging.timeline_every"):
        C.load_rl_config(None, ["--timeline_every", "5"])
    assert C.load_rl_config(None, ["--context_parallel", "true"]).engine.context_parallel  # odc, collective
    with pytest.raises(ConfigError, match="the xla_spmd engine does not run context-parallel microbatches"):
        C.load_rl_config(None, ["--context_parallel", "true", "--engine", "xla_spmd"])
