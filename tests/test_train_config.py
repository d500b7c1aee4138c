"""jodc.train config: YAML + overrides, aliases, validation errors that name the field, resume checks, and the
CLI's handling of XLA flags (which must happen before JAX is imported)."""
import dataclasses
import os
import subprocess
import sys

import pytest

from jodc.train.core import config as C
from jodc.train.cli import main, set_host_device_count


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_are_valid_and_engine_picks_the_planner():
    cfg = C.load_config()
    assert cfg.engine.name == "odc" and cfg.engine.planner_name == "lb_mini"
    assert cfg.token_cap == cfg.data.max_length and cfg.total_steps == cfg.run.steps
    assert C.load_config(None, ["--engine", "collective"]).engine.planner_name == "lb_micro"
    assert C.load_config(None, ["--engine", "collective", "--planner", "local_sort"]).engine.planner_name == "local_sort"


def test_yaml_then_overrides_in_every_form(tmp_path):
    path = write(tmp_path, "engine:\n  name: collective\n  devices: 2\noptimizer:\n  learning_rate: 1.0e-3\n")
    cfg = C.load_config(path, ["--engine.devices", "8", "--steps=7", "--learning-rate", "3e-3", "--deterministic",
                               "--engine", "odc", "--no-progress", "--optimizer.max_grad_norm", "null"])
    assert cfg.engine.devices == 8 and cfg.run.steps == 7 and cfg.engine.name == "odc"
    assert cfg.optimizer.learning_rate == 3e-3  # YAML 1.1 reads '3e-3' as a string: coerced to float
    assert cfg.engine.deterministic is True and cfg.logging.progress is False
    assert cfg.optimizer.max_grad_norm is None


def test_round_trip_through_dict_and_yaml(tmp_path):
    cfg = C.load_config(None, ["--engine", "collective", "--max_length", "256", "--seed", "3"])
    assert C.config_from_dict(C.to_dict(cfg)) == cfg
    C.save_yaml(cfg, str(tmp_path / "saved.yaml"))
    assert C.load_config(str(tmp_path / "saved.yaml")) == cfg


@pytest.mark.parametrize("overrides, message", [
    (["--engine.nmae", "odc"], "unknown config key 'engine.nmae' .*did you mean engine.name"),
    (["--engine", "mpi"], "engine.name must be one of odc, collective, xla_spmd, reference, got 'mpi'"),
    (["--planner", "greedy"], "engine.planner must be one of lb_mini, lb_micro, local_sort"),
    (["--devices", "two"], "engine.devices must be an integer"),
    (["--devices", "0"], "engine.devices must be >= 1"),
    (["--deterministic", "yes please"], "engine.deterministic must be true or false"),
    (["--steps"], "override --steps needs a value"),
    (["steps", "3"], "expected an override like"),
    (["--token_cap", "64"], "engine.token_cap=64 is below data.max_length=1024"),
    (["--engine", "collective", "--deterministic"], "deterministic=true needs engine odc or reference"),
    (["--learning_rate", "0"], "optimizer.learning_rate must be > 0, got 0.0"),
    (["--max_grad_norm", "0"], "optimizer.max_grad_norm must be > 0 or null"),
    (["--b2", "1.0"], "optimizer.b1 and optimizer.b2 must lie in"),
    (["--overlong", "wrap"], "data.overlong must be one of truncate, drop"),
    (["--preset", "huge"], "model.preset must be one of tiny, small, base"),
])
def test_bad_overrides_name_the_field(overrides, message):
    with pytest.raises(C.ConfigError, match=message):
        C.load_config(None, overrides)


def test_bad_yaml_files_name_the_problem(tmp_path):
    with pytest.raises(C.ConfigError, match="does not exist"):
        C.load_config(str(tmp_path / "absent.yaml"))
    with pytest.raises(C.ConfigError, match="not valid YAML"):
        C.load_config(write(tmp_path, "trainer: [engine: odc\n"))
    with pytest.raises(C.ConfigError, match="unknown section\\(s\\) 'trainr'"):
        C.load_config(write(tmp_path, "trainr:\n  engine: odc\n"))
    with pytest.raises(C.ConfigError, match="unknown key 'data.max_len' .*did you mean data.max_length"):
        C.load_config(write(tmp_path, "data:\n  max_len: 5\n"))
    with pytest.raises(C.ConfigError, match="section 'model' must be a mapping"):
        C.load_config(write(tmp_path, "model: small\n"))
    with pytest.raises(C.ConfigError, match="top level must be a mapping"):
        C.load_config(write(tmp_path, "- a\n- b\n"))


def test_aliases_cover_unique_names_and_refuse_ambiguous_ones():
    alias = C.aliases()
    assert alias["engine"] == "engine.name" and alias["learning_rate"] == "optimizer.learning_rate"
    assert set(alias.values()) == set(C.all_keys())  # every field name is unique today

    @dataclasses.dataclass
    class Extra(C.Section):
        devices: int = 1

    @dataclasses.dataclass
    class Clash(C.SFTConfig):
        extra: Extra = dataclasses.field(default_factory=Extra)

    with pytest.raises(C.ConfigError, match="'devices' is ambiguous: use one of engine.devices, extra.devices"):
        C.resolve_key("devices", Clash)


def test_optimizer_section_mirrors_the_engines_optimizer_config():
    from jodc.fsdp import OptimizerConfig

    assert [f.name for f in dataclasses.fields(C.OptimizerConfig)] == \
        [f.name for f in dataclasses.fields(OptimizerConfig)]


def test_resume_mismatches_list_what_changed():
    base = C.load_config()
    saved = C.to_dict(base)
    assert C.resume_mismatches(saved, base) == []
    # engine, devices, steps may change between a run and its resumption; model, data and order may not
    assert C.resume_mismatches(saved, C.load_config(None, ["--engine", "collective", "--devices", "2",
                                                           "--steps", "500"])) == []
    changed = C.resume_mismatches(saved, C.load_config(None, ["--preset", "tiny", "--seed", "1"]))
    assert changed == ["model.preset: 'small' -> 'tiny'", "run.seed: 0 -> 1"]
    # how attention is computed may change (a run saved before "auto" existed, resumed on a GPU), what may not
    saved["model"].update(attention_impl="blockwise", attention_block_size=64)
    assert C.resume_mismatches(saved, base) == []


def test_set_host_device_count_keeps_other_flags_and_never_lowers():
    env = {"XLA_FLAGS": "--xla_cpu_foo=1 --xla_force_host_platform_device_count=2"}
    set_host_device_count(4, env)
    assert env["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=4"
    set_host_device_count(2, env)
    assert env["XLA_FLAGS"].endswith("device_count=4")
    empty = {}
    set_host_device_count(3, empty)
    assert empty["XLA_FLAGS"] == "--xla_force_host_platform_device_count=3"


def test_cli_reports_config_errors_and_prints_config(tmp_path, capsys):
    assert main(["sft", "--engine", "mpi"]) == 2
    assert "config error: engine.name must be one of" in capsys.readouterr().err
    assert main(["sft", "--devices", "3", "--print-config"]) == 0
    assert "devices: 3" in capsys.readouterr().out


def test_the_optimizer_section_is_the_engines_optimizer_config():
    """One definition of the optimizer's fields and checks (jodc.optimizer_config): the section is that class with the
    trainer's defaults, and the library's checks reach the CLI as config errors."""
    from jodc.optimizer_config import OptimizerConfig

    section = C.load_config().optimizer
    assert isinstance(section, OptimizerConfig) and (section.learning_rate, section.schedule) == (1e-3, "cosine")
    assert [f.name for f in dataclasses.fields(section)] == [f.name for f in dataclasses.fields(OptimizerConfig)]
    with pytest.raises(C.ConfigError, match="optimizer.eps and optimizer.weight_decay must be >= 0"):
        C.load_config(None, ["--eps", "-1"])
    assert main(["sft", "--weight_decay", "-0.5", "--print-config"]) == 2


def test_cli_module_does_not_import_jax():
    code = "import sys, jodc.train, jodc.train.cli, jodc.train.core.config; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "XLA_FLAGS": ""})
    assert out.stdout.strip() == "False"


def test_length_buckets_and_spmd_engine_are_configurable():
    from jodc.train.core.config import ConfigError, load_config, parse_length_buckets

    assert parse_length_buckets("512, 256") == (256, 512)
    with pytest.raises(ConfigError, match="positive integers"):
        parse_length_buckets("a,b")
    config = load_config(None, ["--engine", "xla_spmd", "--engine.length_buckets", "64,128"])
    assert config.engine.planner_name == "lb_micro"
    with pytest.raises(ConfigError, match="must not exceed the token cap"):
        load_config(None, ["--engine.length_buckets", "999999"])
    with pytest.raises(ConfigError, match="deterministic"):
        load_config(None, ["--engine", "xla_spmd", "--deterministic"])


def test_lb_mini_is_told_the_engines_length_buckets():
    from jodc.balance import QuadraticCost, lb_micro, lb_mini
    from jodc.train.core.config import load_config
    from jodc.train.core.model import make_planner

    assert make_planner(load_config(None, ["--engine", "odc"])) is lb_mini
    assert make_planner(load_config(None, ["--engine", "collective", "--engine.length_buckets", "256"])) is lb_micro
    planner = make_planner(load_config(None, ["--engine", "odc", "--engine.length_buckets", "512,256"]))
    lengths = [250, 500, 120, 90, 700, 40]
    cost = QuadraticCost(a=0.05, b=0.1, scale=1024)
    assert planner(lengths, 2, 1024, cost_model=cost) == lb_mini(lengths, 2, 1024, cost_model=cost,
                                                                 length_buckets=(256, 512))



def _old_layout(new: dict) -> dict:
    """A config dict as the code before the split saved it: engine, run, checkpoint and logging in `trainer`."""
    old = {k: dict(v) for k, v in new.items() if k not in ("engine", "run", "checkpoint", "logging")}
    trainer = {"engine": new["engine"]["name"], **{k: v for k, v in new["engine"].items() if k != "name"}}
    for section in ("run", "checkpoint", "logging"):
        trainer.update(new[section])
    if "sequences_per_minibatch" in old.get("data", {}):
        trainer["sequences_per_minibatch"] = old["data"].pop("sequences_per_minibatch")
    return {**old, "trainer": trainer}


def test_configs_in_the_old_trainer_layout_load_with_a_note(tmp_path, capsys):
    old = write(tmp_path, "model:\n  preset: tiny\ntrainer:\n  engine: collective\n  devices: 2\n  steps: 7\n"
                          "  save_every: 3\n  timeline_every: 2\n  sequences_per_minibatch: 8\n")
    cfg = C.load_config(old, ["--trainer.seed", "5"])
    assert (cfg.engine.name, cfg.engine.devices, cfg.run.steps, cfg.checkpoint.save_every, cfg.logging.timeline_every,
            cfg.data.sequences_per_minibatch, cfg.run.seed) == ("collective", 2, 7, 3, 2, 8, 5)
    err = capsys.readouterr().err
    assert "'trainer' section was split" in err and "trainer.engine -> engine.name" in err
    assert "trainer.steps -> run.steps" in err and "trainer.sequences_per_minibatch -> data.sequences_per_minibatch" in err
    with pytest.raises(C.ConfigError, match="unknown config key 'trainer.engnie' .*did you mean engine"):
        C.load_config(write(tmp_path, "trainer:\n  engnie: odc\n", "typo.yaml"))
    # a full config saved by the old code (every field) reads back as the same config
    assert C.config_from_dict(_old_layout(C.to_dict(cfg))) == cfg


def test_a_checkpoint_config_in_the_old_layout_is_compared_field_by_field():
    base = C.load_config()
    saved = _old_layout(C.to_dict(base))
    assert "trainer" in saved and C.resume_mismatches(saved, base) == []
    assert C.resume_mismatches(saved, C.load_config(None, ["--seed", "1", "--sequences_per_minibatch", "16"])) == \
        ["data.sequences_per_minibatch: 32 -> 16", "run.seed: 0 -> 1"]


def test_sections_check_themselves_when_built_in_code():
    with pytest.raises(C.ConfigError, match="engine.name must be one of odc, collective, xla_spmd, reference"):
        C.EngineConfig(name="mpi")
    with pytest.raises(C.ConfigError, match="optimizer.learning_rate must be a finite number"):
        C.OptimizerConfig(learning_rate=float("nan"))
    with pytest.raises(C.ConfigError, match="run.out_dir must be a non-empty string, got None"):
        C.RunConfig(out_dir=None)
    with pytest.raises(C.ConfigError, match="engine.token_cap=64 is below data.max_length=1024"):
        C.SFTConfig(engine=C.EngineConfig(token_cap=64))
