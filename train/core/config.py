"""Training configs: dataclass sections read by `draccus` from YAML plus command-line overrides.

Both trainers share `model`, `optimizer`, `engine`, `run`, `checkpoint` and `logging` (`TrainingConfig`);
`SFTConfig` adds `data`, the RL config (`train/rl/config.py`) adds `task`, `rollout`, `loss` and `warmstart`.
Every section checks its fields in `__post_init__`, so a config built in code is checked like one from YAML.
Over draccus, a thin command-line layer: `--section.field value` or `=value`, a unique field name alone
(`--devices 4`), a section alone for its `name` (`--engine odc`), a bool alone for true and `--no-<field>` for
false, YAML scalar values, did-you-mean for unknown keys, and the old `trainer` section read with a note.
Imports no JAX: the CLI validates the config and sets XLA flags before JAX loads.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import typing
from typing import Any, Literal, Sequence

import draccus
import mergedeep
import yaml
from draccus.utils import DecodingError, ParsingError, deflatten

from jodc import optimizer_config
from jodc.engine_facts import ENGINE_FACTS, ENGINE_NAMES, hsdp_shards
from jodc.optimizer_config import Schedule

from .presets import MODEL_PRESETS

Preset = Literal[tuple(MODEL_PRESETS)]
Engine = Literal[ENGINE_NAMES]
Planner = Literal["lb_mini", "lb_micro", "local_sort"]
CostModel = Literal["flops", "linear"]
ComputeDtype = Literal["float32", "bfloat16"]
Platform = Literal["cpu", "gpu"]
AttentionImpl = Literal["auto", "blockwise", "flash", "dense"]
Overlong = Literal["truncate", "drop"]
EMBEDDED = "embedded"


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field and what is allowed."""


def _parts(annotation) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    optional = typing.get_origin(annotation) is not Literal and len(args) < len(typing.get_args(annotation))
    return (args[0] if optional else annotation), optional


def describe(annotation) -> str:
    """What a field of this type accepts, for error messages: 'an integer', 'one of odc, collective or null'."""
    base, optional = _parts(annotation)
    kind = ("one of " + ", ".join(map(str, typing.get_args(base))) if typing.get_origin(base) is Literal else
            {bool: "true or false", int: "an integer", float: "a number", str: "a non-empty string"}[base])
    return kind + (" or null" if optional else "")


def _fits(value, annotation) -> bool:
    base, optional = _parts(annotation)
    if value is None or typing.get_origin(base) is Literal:
        return optional if value is None else value in typing.get_args(base)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return {float: number, int: number and isinstance(value, int), str: isinstance(value, str) and value != "",
            bool: isinstance(value, bool)}[base]


class Section:
    """Base of the config sections: `__post_init__` checks every field against its type and `minimum` (a lower
    bound per field name), then runs the section's own `check` (relations between its fields)."""

    name_in_config = ""  # the section's key in a config ('engine'), for error messages
    minimum: dict[str, float] = {}

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            key, value, low = f"{self.name_in_config}.{field.name}", getattr(self, field.name), \
                self.minimum.get(field.name)
            if not _fits(value, hints[field.name]):
                raise ConfigError(f"{key} must be {describe(hints[field.name])}, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):  # nan/inf would reach the parameters
                raise ConfigError(f"{key} must be a finite number, got {value!r}")
            if low is not None and value is not None and value < low:
                raise ConfigError(f"{key} must be >= {low}, got {value!r}")
        self.check()

    def check(self) -> None:
        """Relations between this section's fields (ConfigError naming them)."""


@dataclasses.dataclass
class ModelConfig(Section):
    """Which decoder to train: a built-in preset trained from scratch, or a local HF checkpoint directory."""

    name_in_config, minimum = "model", {"attention_block_size": 8}
    preset: Preset = "small"  # built-in shape (ignored with hf_path)
    hf_path: str | None = None  # local HF directory (config.json + safetensors); replaces preset
    attention_impl: AttentionImpl = "auto"  # flash (fused kernel) on a GPU, else blockwise; or dense (reference)
    attention_block_size: int = 128  # query/key block of the blockwise attention


@dataclasses.dataclass
class DataConfig(Section):
    """Where SFT examples come from, how they become token sequences, and how many make a minibatch."""

    name_in_config = "data"
    minimum = {"max_length": 8, "embedded_examples": 1, "sequences_per_minibatch": 1}
    path: str = EMBEDDED  # a .jsonl file of prompt/completion or messages records, or 'embedded'
    tokenizer: str | None = None  # tokenizer.json or HF directory; default: the model's, else bytes
    max_length: int = 1024  # longest sequence in tokens (prompt + completion)
    overlong: Overlong = "truncate"  # what to do with longer sequences
    embedded_examples: int = 4096  # size of the generated default dataset
    embedded_seed: int = 0  # seed of the generated default dataset
    sequences_per_minibatch: int = 32  # sequences per optimizer step


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Section, optimizer_config.OptimizerConfig):
    """AdamW with warm-up, a schedule and global-norm clipping: `jodc.optimizer_config.OptimizerConfig` (its fields
    and checks) with the trainer's defaults. `total_steps: null` means the run's length in optimizer updates."""

    name_in_config, minimum = "optimizer", {"total_steps": 1}
    learning_rate: float = 1e-3
    schedule: Schedule = "cosine"
    warmup_steps: int = 10

    def check(self) -> None:
        try:
            optimizer_config.OptimizerConfig.check(self)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def parse_length_buckets(text) -> tuple[int, ...]:
    """'256,512' -> (256, 512); ConfigError unless every entry is a positive integer."""
    parts = [p.strip() for p in str(text).replace(" ", ",").split(",") if p.strip()]
    try:
        buckets = tuple(sorted({int(p) for p in parts}))
    except ValueError:
        buckets = ()
    if not buckets or buckets[0] < 1:
        raise ConfigError(f"engine.length_buckets must be positive integers like '256,512', got {text!r}")
    return buckets


@dataclasses.dataclass
class EngineConfig(Section):
    """How a step runs: which engine on how many devices, how sequences are balanced, precision."""

    name_in_config, minimum = "engine", {"devices": 1, "token_cap": 8, "replicas": 1}
    name: Engine = "odc"  # odc (on-demand), collective (lock-step FSDP), xla_spmd (NamedSharding + jit), reference
    devices: int = 4  # data-parallel devices (simulated CPU devices on a CPU host)
    # HSDP replica groups: parameters sharded over devices / replicas devices, replicated over the groups (1: flat)
    replicas: int = 1
    platform: Platform = "cpu"  # JAX platform whose devices form the mesh
    planner: Planner | None = None  # default: the engine's (lb_mini for odc, lb_micro for the lock-step ones)
    cost_model: CostModel = "flops"  # how the planner weighs a sequence
    token_cap: int | None = None  # tokens per microbatch buffer; SFT's default: data.max_length
    # shorter buffer lengths a microbatch may run at, comma-separated ('256,512'): it runs at the smallest that
    # holds it; use multiples of the attention block size; LB-Mini then plans for the padded lengths
    length_buckets: str | None = None
    compute_dtype: ComputeDtype = "float32"
    deterministic: bool = False  # bit-for-bit reproducible gradient accumulation (odc, reference)
    # seconds an ODC device waits in a barrier for the others before the step fails naming the missing ones
    # (null: forever); a device that fails aborts the step at once whatever this is
    barrier_timeout_s: float | None = 300.0

    @property
    def planner_name(self) -> str:
        """The planner in effect (the engine's default when `planner` is null)."""
        return self.planner or ENGINE_FACTS[self.name].default_planner

    def check(self) -> None:
        if self.barrier_timeout_s is not None and not self.barrier_timeout_s > 0:
            raise ConfigError(f"engine.barrier_timeout_s must be > 0 seconds or null (wait forever), got "
                              f"{self.barrier_timeout_s}")
        if self.deterministic and not ENGINE_FACTS[self.name].supports_deterministic:
            able = " or ".join(n for n, f in ENGINE_FACTS.items() if f.supports_deterministic)
            raise ConfigError(f"engine.deterministic=true needs engine {able} (the {self.name} engine's reductions "
                              "are not guaranteed bit-for-bit reproducible)")
        if self.length_buckets is not None:
            parse_length_buckets(self.length_buckets)
        try:
            hsdp_shards(self.devices, self.replicas)
        except ValueError as e:
            raise ConfigError(f"engine.replicas: {e} (engine.devices={self.devices})") from None


@dataclasses.dataclass
class RunConfig(Section):
    """The run as a whole: its length, seed, output directory and what a non-finite step does."""

    name_in_config, minimum = "run", {"steps": 1}
    steps: int = 100  # training steps of the whole run
    seed: int = 0  # model initialisation and data order
    out_dir: str = "runs/sft"  # checkpoints, metrics, plots and the HF export go here
    # a step with a non-finite loss, grad norm or update is never applied; false: stop the run there, true: skip
    # it (counted in the metrics as skipped_updates) and go on
    skip_nonfinite_steps: bool = False


@dataclasses.dataclass
class CheckpointConfig(Section):
    """When checkpoints are written and kept, how a run resumes, and the HF export at the end."""

    name_in_config, minimum = "checkpoint", {"save_every": 0, "keep_checkpoints": 1}
    resume: bool = True  # continue from the latest checkpoint in run.out_dir
    save_every: int = 50  # checkpoint period in steps (0: only at the end)
    keep_checkpoints: int = 3  # most recent checkpoints kept
    export_hf: bool = True  # write a HF checkpoint to out_dir/hf at the end
    # resume even though the data differ from those the checkpoint was trained on (their fingerprint is saved
    # with every checkpoint)
    accept_changed_data: bool = False


@dataclasses.dataclass
class LoggingConfig(Section):
    """What the run reports while it goes."""

    name_in_config, minimum = "logging", {"log_every": 1, "timeline_every": 0}
    log_every: int = 1  # metrics period in steps
    timeline_every: int = 0  # record and plot a per-device timeline every N steps (0: off)
    progress: bool = True  # show a progress bar


def defaults(section, **values):
    """A config's section field whose default is `section(**values)` (RL's defaults for a shared section); values
    not set in a YAML file or override keep these defaults (see `config_from_dict`)."""
    return dataclasses.field(default_factory=lambda: section(**values))


def config_class(cls):
    """`@dataclass` for a config of sections: a section declared without a default gets a fresh instance."""
    hints = typing.get_type_hints(cls)
    for name in cls.__dict__.get("__annotations__", {}):
        if name not in cls.__dict__ and issubclass(hints[name], Section):
            setattr(cls, name, dataclasses.field(default_factory=hints[name]))
    return dataclasses.dataclass(cls)


@config_class
class TrainingConfig:
    """The sections both trainers have."""

    # Fields of RESUME_KEYS' sections that say how a value is computed, not what: a run may resume with others (a
    # CPU run resumed on a GPU picks the fused attention kernel), at floating-point rounding's difference.
    RESUME_FREE = ("model.attention_impl", "model.attention_block_size")

    model: ModelConfig
    optimizer: OptimizerConfig
    engine: EngineConfig
    run: RunConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig


@config_class
class SFTConfig(TrainingConfig):
    """The SFT job: the shared sections and `data`."""

    data: DataConfig
    # Fields that decide what a checkpoint means: resuming with other values would silently train something else
    RESUME_KEYS = ("model", "data", "run.seed")

    @property
    def token_cap(self) -> int:
        """Microbatch buffer length in effect."""
        return self.engine.token_cap or self.data.max_length

    @property
    def total_steps(self) -> int:
        """Length of the learning-rate schedule in effect."""
        return self.optimizer.total_steps or self.run.steps

    def __post_init__(self):
        if self.token_cap < self.data.max_length:
            raise ConfigError(f"engine.token_cap={self.token_cap} is below data.max_length={self.data.max_length}: "
                              "the longest sequences would not fit in a microbatch")
        if self.engine.length_buckets is not None:
            buckets = parse_length_buckets(self.engine.length_buckets)
            if any(b > self.token_cap for b in buckets):
                raise ConfigError(f"engine.length_buckets {list(buckets)} must not exceed the token cap "
                                  f"{self.token_cap}")




# ---------------------------------------------------------------------------------------------------------------
# keys and command-line overrides (the thin layer over draccus)
# ---------------------------------------------------------------------------------------------------------------


def sections(cls) -> dict[str, type]:
    """{section name: section class} of a config class."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def all_keys(cls=SFTConfig) -> list[str]:
    """Every dotted key, e.g. 'engine.devices'."""
    return [f"{s}.{f.name}" for s, section in sections(cls).items() for f in dataclasses.fields(section)]


def aliases(cls=SFTConfig) -> dict[str, str]:
    """Short name -> dotted key: every field name that occurs in one section only, and every section that has a
    `name` field (`engine` -> 'engine.name')."""
    owners: dict[str, list[str]] = {}
    for key in all_keys(cls):
        owners.setdefault(key.split(".", 1)[1], []).append(key)
    out = {name: keys[0] for name, keys in owners.items() if len(keys) == 1}
    out.update({s: f"{s}.name" for s in sections(cls) if f"{s}.name" in all_keys(cls)})
    return out


def resolve_key(name: str, cls=SFTConfig) -> str:
    """'engine.devices', 'devices', 'learning-rate' or 'engine' -> the dotted key; the old 'trainer.steps' ->
    'run.steps'; ConfigError naming close matches."""
    given = name = name.replace("-", "_")
    keys, short = all_keys(cls), aliases(cls)
    if name.startswith("trainer.") and name not in keys:  # the layout before the trainer section was split
        name = name.split(".", 1)[1]
    if name in keys:
        return name
    if name in short:
        return short[name]
    owners = [k for k in keys if k.split(".", 1)[1] == name]
    if owners:
        raise ConfigError(f"'{given}' is ambiguous: use one of {', '.join(owners)}")
    close = difflib.get_close_matches(name, keys + list(short), n=3, cutoff=0.6)
    if close:
        raise ConfigError(f"unknown config key '{given}' (did you mean {' or '.join(close)}?)")
    raise ConfigError(f"unknown config key '{given}'; keys are {', '.join(keys)} (or the field name alone)")


def _field_type(cls, key: str):
    section, field = key.split(".", 1)
    return typing.get_type_hints(sections(cls)[section])[field]


def apply_overrides(raw: dict | None, overrides: Sequence[str], cls=SFTConfig) -> dict:
    """A copy of nested `raw` with command-line overrides applied (see the module docstring)."""
    flat, tokens, i = {}, list(overrides), 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"expected an override like --run.steps 20, got {token!r}")
        name, eq, text = token[2:].partition("=")
        negated = None
        if not eq and name.replace("-", "_").startswith("no_"):
            try:
                negated = resolve_key(name[3:], cls)
            except ConfigError:
                pass
            negated = negated if negated and _field_type(cls, negated) is bool else None
        key = negated or resolve_key(name, cls)
        if negated:
            text = "false"
        elif not eq:
            if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                text, i = tokens[i + 1], i + 1
            elif _field_type(cls, key) is bool:
                text = "true"
            else:
                raise ConfigError(f"override --{name} needs a value")
        flat[key] = draccus.cfgparsing.parse_string(text)
        i += 1
    return mergedeep.merge({}, raw or {}, deflatten(flat))


def migrate(raw: dict, cls=SFTConfig, *, log=None) -> dict:
    """`raw` with an old `trainer` section (configs saved before it was split into engine, run, checkpoint and
    logging) moved to the new keys; `log` is told the renames once."""
    if "trainer" in sections(cls) or not isinstance(raw.get("trainer"), dict):
        return raw
    out = {name: dict(values) if isinstance(values, dict) else values for name, values in raw.items()
           if name != "trainer"}
    moved = []
    for field, value in raw["trainer"].items():
        key = resolve_key(f"trainer.{field}", cls)
        section, new = key.split(".", 1)
        out.setdefault(section, {}).setdefault(new, value)
        moved.append(f"trainer.{field} -> {key}")
    if log is not None:
        log(f"note: the 'trainer' section was split into engine, run, checkpoint and logging; read {', '.join(moved)}")
    return out


def check_keys(raw: Any, cls, source: str) -> None:
    """ConfigError naming the first unknown section or key of nested `raw` (with close matches)."""
    known, keys = sections(cls), all_keys(cls)
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections ({', '.join(known)}), got "
                          f"{type(raw).__name__}")
    unknown = [s for s in raw if s not in known]
    if unknown:
        raise ConfigError(f"{source}: unknown section(s) {', '.join(map(repr, unknown))}; sections are "
                          f"{', '.join(known)}")
    for name, values in raw.items():
        if values is not None and not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{name}' must be a mapping, got {type(values).__name__}")
        for key in [f"{name}.{k}" for k in values or {} if f"{name}.{k}" not in keys]:
            close = difflib.get_close_matches(key, [k for k in keys if k.startswith(f"{name}.")], n=3, cutoff=0.6)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise ConfigError(f"{source}: unknown key '{key}'{hint}; section '{name}' has "
                              f"{', '.join(k.split('.', 1)[1] for k in keys if k.startswith(f'{name}.'))}")


def config_from_dict(raw: dict | None, cls=SFTConfig, *, source: str = "config", log=None):
    """A config of class `cls` from nested {section: {field: value}} (missing fields take their defaults),
    decoded by draccus and checked by every section's `__post_init__`."""
    raw = {} if raw is None else raw
    if isinstance(raw, dict):
        raw = migrate(raw, cls, log=log)
    check_keys(raw, cls, source)
    raw = {name: values for name, values in raw.items() if values is not None}
    try:  # over the config's defaults: draccus builds a section given in part from the section class's defaults
        return draccus.decode(cls, mergedeep.merge({}, draccus.encode(cls()), raw))
    except DecodingError as e:  # a value draccus cannot read as the field's type
        key = ".".join(e.key_path[:2])
        value = raw.get(e.key_path[0], {}).get(e.key_path[1]) if len(e.key_path) > 1 else None
        raise ConfigError(f"{key} must be {describe(_field_type(cls, key))}, got {value!r}") from None
    except ParsingError as e:  # a section's __post_init__ refused it
        cause = e
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__
        raise (cause or ConfigError(f"{source}: {e}")) from None


def to_dict(config) -> dict[str, dict[str, Any]]:
    """Nested plain dict (YAML- and JSON-serialisable), the inverse of `config_from_dict`."""
    return draccus.encode(config)


def read_yaml(path: str) -> dict:
    """The mapping in a YAML file; ConfigError naming the file when it is absent or malformed."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    return raw or {}


def load(cls, path: str | None = None, overrides: Sequence[str] = (), *, log=lambda m: print(m, file=sys.stderr)):
    """Defaults, then the YAML file at `path` (if any), then `overrides`; checked."""
    raw = migrate(read_yaml(path), cls, log=log) if path else {}
    return config_from_dict(apply_overrides(raw, overrides, cls), cls, source=path or "config", log=log)


def load_config(path: str | None = None, overrides: Sequence[str] = ()) -> SFTConfig:
    """The SFT config: defaults, then the YAML file at `path` (if any), then `overrides`; checked."""
    return load(SFTConfig, path, overrides)


def dump(config) -> str:
    """The config as YAML (every field, defaults included)."""
    return draccus.dump(config, sort_keys=False)


def save_yaml(config, path: str) -> None:
    """Writes the config as YAML (every field, defaults included)."""
    with open(path, "w") as f:
        f.write(dump(config))


def resume_mismatches(saved: dict, current) -> list[str]:
    """The `RESUME_KEYS` fields of `current`'s class where a checkpoint's saved config (either layout) differs
    from `current`: 'key: saved -> now'."""
    saved, now, out = migrate(saved, type(current)), to_dict(current), []
    for key in type(current).RESUME_KEYS:
        section, _, field = key.partition(".")
        for name in [field] if field else list(now[section]):
            if f"{section}.{name}" in type(current).RESUME_FREE:
                continue
            old = (saved.get(section) or {}).get(name, now[section][name])
            if old != now[section][name]:
                out.append(f"{section}.{name}: {old!r} -> {now[section][name]!r}")
    return out
