"""jodc.train config: YAML + overrides, aliases, validation errors that name the field, resume checks, and the
CLI's CPU device count (set before JAX's backend first starts)."""
import dataclasses
import os
import subprocess
import sys

import pytest

import jodc.train
from jodc.fsdp import ENGINES
from jodc.train.core import config as C
from jodc.train.cli import COMMANDS, any_engine, main


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
    (["--engine", "mpi"], "engine.name: Cannot convert 'mpi' into one of: odc, collective, xla_spmd, reference"),
    (["--planner", "greedy"], "engine.planner: .*'greedy'.* lb_mini, lb_micro, local_sort"),
    (["--devices", "two"], "engine.devices: Couldn't parse 'two' into an int"),
    (["--devices", "0"], "engine.devices must be >= 1"),
    (["--deterministic", "yes please"], "engine.deterministic: Couldn't parse 'yes please' into a bool"),
    (["--learning_rate", "fast"], "optimizer.learning_rate: Couldn't parse 'fast' into a float"),
    (["--steps"], "override --steps needs a value"),
    (["steps", "3"], "expected an override like"),
    (["--token_cap", "64"], "engine.token_cap=64 is below data.max_length=1024"),
    (["--engine", "collective", "--deterministic"], "deterministic=true needs engine odc or reference"),
    (["--learning_rate", "0"], "optimizer.learning_rate must be > 0, got 0.0"),
    (["--max_grad_norm", "0"], "optimizer.max_grad_norm must be > 0 or null"),
    (["--b2", "1.0"], "optimizer.b1 and optimizer.b2 must lie in"),
    (["--overlong", "wrap"], "data.overlong: Cannot convert 'wrap' into one of: truncate, drop"),
    (["--preset", "huge"], "model.preset: Cannot convert 'huge' into one of: tiny, small, base"),
    (["--trainer.steps", "5"], "the 'trainer' section was split: trainer.engine is now engine.name"),
    (["--export_dtype", "float16"],
     "checkpoint.export_dtype: Cannot convert 'float16' into one of: (bfloat16, float32|float32, bfloat16)"),
])
def test_bad_overrides_name_the_field(overrides, message):
    with pytest.raises(C.ConfigError, match=message):
        C.load_config(None, overrides)


def test_bad_yaml_files_name_the_problem(tmp_path):
    with pytest.raises(C.ConfigError, match="does not exist"):
        C.load_config(str(tmp_path / "absent.yaml"))
    with pytest.raises(C.ConfigError, match="not valid YAML"):
        C.load_config(write(tmp_path, "trainer: [engine: odc\n"))
    with pytest.raises(C.ConfigError, match="c.yaml: unknown config key 'trainr.engine'"):
        C.load_config(write(tmp_path, "trainr:\n  engine: odc\n"))
    with pytest.raises(C.ConfigError, match="unknown config key 'data.max_len' .*did you mean data.max_length"):
        C.load_config(write(tmp_path, "data:\n  max_len: 5\n"))
    with pytest.raises(C.ConfigError, match="section 'model' must be a mapping"):
        C.load_config(write(tmp_path, "model: small\n"))
    with pytest.raises(C.ConfigError, match="top level must be a mapping"):
        C.load_config(write(tmp_path, "- a\n- b\n"))


def test_short_keys_cover_unique_names_and_refuse_ambiguous_ones():
    assert C.resolve_key("engine") == "engine.name" and C.resolve_key("learning-rate") == "optimizer.learning_rate"
    assert all(C.resolve_key(key.split(".")[1]) == key for key in C.all_keys())  # every field name is unique today

    @dataclasses.dataclass
    class Extra(C.Section):
        devices: int = 1

    @dataclasses.dataclass
    class Clash(C.SFTConfig):
        extra: Extra = C.defaults(Extra)

    with pytest.raises(C.ConfigError, match="'devices' is ambiguous: use one of engine.devices, extra.devices"):
        C.resolve_key("devices", Clash)
    assert C.load(Clash, None, ["--extra.devices", "3"]).extra.devices == 3


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


def test_cli_reports_config_errors_and_prints_config(tmp_path, capsys):
    assert main(["sft", "--engine", "mpi"]) == 2
    assert "config error: engine.name: Cannot convert 'mpi' into one of" in capsys.readouterr().err
    assert main(["sft", "--devices", "3", "--print-config"]) == 0
    assert "devices: 3" in capsys.readouterr().out


def test_both_commands_name_every_registered_engine_and_the_package_exports_both_trainers():
    """The engines a command offers come from the registry (`jodc.fsdp.ENGINES`), never a list written twice; and
    `jodc.train` hands out both trainers' entry points."""
    assert any_engine() == "the odc, collective, xla_spmd or reference engine" and len(ENGINES) == 4
    for name, (*_, description) in COMMANDS.items():
        assert any_engine() in description, name
    assert {"run_sft", "load_config", "SFTConfig", "run_rl", "load_rl_config", "RLConfig"} <= set(jodc.train.__all__)
    assert jodc.train.run_rl is COMMANDS["rl"][2] and jodc.train.load_rl_config is COMMANDS["rl"][1]


def test_the_optimizer_section_is_the_engines_optimizer_config():
    """One definition of the optimizer's fields and checks (jodc.fsdp.OptimizerConfig): the section is that class with
    the trainer's defaults, its checks reach the CLI as config errors, and the finished config resolves the
    schedule's length once (null: the run's optimizer updates) into the optimizer the engines run."""
    from jodc.fsdp import OptimizerConfig

    config = C.load_config(None, ["--steps", "40"])
    assert type(config.optimizer) is OptimizerConfig and C.sections(C.SFTConfig)["optimizer"] is OptimizerConfig
    assert (config.optimizer.learning_rate, config.optimizer.schedule, config.optimizer.total_steps) == \
        (1e-3, "cosine", None)
    assert config.schedule_optimizer == dataclasses.replace(config.optimizer, total_steps=40) and \
        config.total_steps == 40
    assert C.load_config(None, ["--total_steps", "7"]).schedule_optimizer.total_steps == 7
    with pytest.raises(C.ConfigError, match="optimizer.eps and optimizer.weight_decay must be >= 0"):
        C.load_config(None, ["--eps", "-1"])
    assert main(["sft", "--weight_decay", "-0.5", "--print-config"]) == 2


def test_the_cli_sets_the_cpu_device_count_before_the_backend_starts():
    """Importing the CLI, configs and trainers starts no JAX backend, so the CLI may set the CPU device count after
    loading them; it never lowers what XLA_FLAGS asks for."""
    code = ("import jax, jodc.train, jodc.train.cli as cli, jodc.train.rl.loop; cli.use_cpu_devices(3); "
            "cli.use_cpu_devices(2); print(jax.device_count('cpu'))")
    for flags, devices in (("", 3), ("--xla_force_host_platform_device_count=5", 5)):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"})
        assert out.stdout.strip() == str(devices)


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



def test_configs_and_checkpoints_in_the_old_trainer_layout_are_refused_naming_the_renames(tmp_path):
    old = write(tmp_path, "model:\n  preset: tiny\ntrainer:\n  engine: collective\n  steps: 7\n")
    with pytest.raises(C.ConfigError, match="the 'trainer' section was split: trainer.engine is now engine.name"):
        C.load_config(old)
    saved = {**C.to_dict(C.load_config()), "trainer": {"steps": 7}}
    with pytest.raises(C.ConfigError, match="checkpoint's config: the 'trainer' section was split"):
        C.resume_mismatches(saved, C.load_config())


def test_context_parallel_is_an_explicit_setting_refused_for_engines_that_do_not_run_it():
    with pytest.raises(C.ConfigError, match="splits them over devices, with an engine that supports it"):
        C.SFTConfig(engine=C.EngineConfig(token_cap=64))
    for name in ("xla_spmd", "reference"):
        with pytest.raises(C.ConfigError, match=f"the {name} engine does not run context-parallel microbatches "
                                                r"\(odc and collective do\)"):
            C.SFTConfig(engine=C.EngineConfig(name=name, token_cap=256, context_parallel=True))
    for name in ("odc", "collective"):
        C.SFTConfig(engine=C.EngineConfig(name=name, token_cap=256, context_parallel=True))


def test_the_cp_kv_exchange_reaches_the_odc_engine_and_is_refused_for_engines_without_a_choice():
    import fsdp_toy
    from jodc.train.core.model import make_engine

    from jodc.ops.group.members import streaming_compiles

    model, groups = fsdp_toy.make_model(num_layers=1)
    choices = [(None, "stream" if streaming_compiles() else "all_gather"), ("all_gather", "all_gather")]
    for choice, expected in choices + ([("stream", "stream")] if streaming_compiles() else []):
        cfg = C.SFTConfig(engine=C.EngineConfig(devices=2, token_cap=256, context_parallel=True,
                                                cp_kv_exchange=choice), data=C.DataConfig(max_length=512))
        engine = make_engine(cfg, model, groups)
        try:
            assert engine.cp_kv_exchange == expected
        finally:
            engine.close()
    with pytest.raises(C.ConfigError, match="engine.cp_kv_exchange=stream: the collective engine has no choice of "
                                            r"K/V exchange \(it all-gathers over its mesh axis; odc has\)"):
        C.SFTConfig(engine=C.EngineConfig(name="collective", token_cap=256, context_parallel=True,
                                          cp_kv_exchange="stream"))


def test_the_cp_planner_needs_context_parallel_and_a_layout_the_engine_runs():
    from jodc.balance import fixed_cp, lb_mini_cp, lockstep_cp
    from jodc.train.core.model import make_planner

    for name, engine, planner in ((None, "odc", lb_mini_cp), (None, "collective", lockstep_cp),
                                  ("fixed_cp", "collective", fixed_cp), ("lockstep_cp", "odc", lockstep_cp),
                                  ("fixed_cp", "odc", fixed_cp)):
        cfg = C.SFTConfig(engine=C.EngineConfig(name=engine, token_cap=256, context_parallel=True, cp_planner=name))
        assert make_planner(cfg) is planner
    with pytest.raises(C.ConfigError, match="engine.cp_planner=fixed_cp plans context-parallel groups: set "
                                            "engine.context_parallel=true"):
        C.SFTConfig(engine=C.EngineConfig(token_cap=256, cp_planner="fixed_cp"))
    with pytest.raises(C.ConfigError, match="engine.cp_planner=lb_mini_cp gives devices different step counts, which "
                                            "the lock-step collective engine does not run"):
        C.SFTConfig(engine=C.EngineConfig(name="collective", token_cap=256, context_parallel=True,
                                          cp_planner="lb_mini_cp"))


def test_context_parallel_allows_max_length_up_to_the_world_capacity():
    cfg = C.SFTConfig(engine=C.EngineConfig(devices=4, token_cap=256, context_parallel=True),
                      data=C.DataConfig(max_length=1024))
    assert cfg.token_cap == 256 and cfg.data.max_length == 4 * 256
    with pytest.raises(C.ConfigError, match=r"data.max_length=1025 exceeds the world's capacity, engine.devices=4 x "
                                            r"token_cap=256 = 1024 tokens"):
        C.SFTConfig(engine=C.EngineConfig(devices=4, token_cap=256, context_parallel=True),
                    data=C.DataConfig(max_length=1025))


def test_sections_check_themselves_when_built_in_code():
    with pytest.raises(ValueError, match="unknown engine 'mpi'; engines are odc, collective, xla_spmd, reference"):
        C.EngineConfig(name="mpi")  # jodc.fsdp.engine_class's error
    with pytest.raises(C.ConfigError, match="run.steps must be >= 1, got 0"):
        C.RunConfig(steps=0)
    with pytest.raises(C.ConfigError, match="engine.barrier_timeout_s must be a finite number, got nan"):
        C.EngineConfig(barrier_timeout_s=float("nan"))
    with pytest.raises(C.ConfigError, match="engine.token_cap=64 is below data.max_length=1024"):
        C.SFTConfig(engine=C.EngineConfig(token_cap=64))
    with pytest.raises(C.ConfigError, match="checkpoint.export_dtype must be one of bfloat16, float32, got 'float16'"):
        C.CheckpointConfig(export_dtype="float16")


def test_the_hf_export_dtype_defaults_to_bf16_and_takes_float32():
    assert C.load_config(None, []).checkpoint.export_dtype == "bfloat16"
    assert C.load_config(None, ["--export_dtype", "float32"]).checkpoint.export_dtype == "float32"
