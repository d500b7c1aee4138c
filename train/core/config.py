"""The SFT job description: four sections (model, data, optimizer, trainer) of plain dataclasses with defaults.

A config comes from a YAML file (a mapping per section) plus command-line overrides, and is validated as a whole:
unknown keys, values of the wrong type and values outside their allowed set are errors that name the field.
Overrides are `--section.field value` or `--section.field=value`; a field whose name is unique across sections
also has a short alias (`--engine odc`, `--devices 4`, `--learning_rate 3e-3`); a bool field given alone is true
(`--deterministic`), and `--no-<field>` makes it false (`--no-progress`). Values are parsed as YAML scalars (`null`, `true`, `4`, `3e-3`).

This module imports no JAX: the CLI loads and validates the config, then sets XLA flags, then imports JAX.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from typing import Any, Sequence

import yaml

from .presets import MODEL_PRESETS

ENGINES = ("odc", "collective", "xla_spmd", "reference")
PLANNERS = ("lb_mini", "lb_micro", "local_sort")
DEFAULT_PLANNER = {"odc": "lb_mini", "collective": "lb_micro", "xla_spmd": "lb_micro", "reference": "lb_mini"}
COST_MODELS = ("flops", "linear")
COMPUTE_DTYPES = ("float32", "bfloat16")
PLATFORMS = ("cpu", "gpu")
SCHEDULES = ("constant", "cosine", "linear")
ATTENTION_IMPLS = ("blockwise", "dense")
OVERLONG_POLICIES = ("truncate", "drop")
EMBEDDED = "embedded"


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field and what is allowed."""


def _field(default, *, choices: Sequence | None = None, minimum: float | None = None, doc: str = ""):
    """A dataclass field carrying its allowed values (`choices`) or lower bound (`minimum`) for validation."""
    return dataclasses.field(default=default, metadata={"choices": choices, "minimum": minimum, "doc": doc})


@dataclasses.dataclass
class ModelConfig:
    """Which decoder to train: a built-in preset trained from scratch, or a local HF checkpoint directory."""

    preset: str = _field("small", choices=tuple(MODEL_PRESETS), doc="built-in shape (ignored with hf_path)")
    hf_path: str | None = _field(None, doc="local HF directory (config.json + safetensors); replaces preset")
    attention_impl: str = _field("blockwise", choices=ATTENTION_IMPLS, doc="segment-aware blockwise, or dense")
    attention_block_size: int = _field(128, minimum=8, doc="query/key block of the blockwise attention")


@dataclasses.dataclass
class DataConfig:
    """Where examples come from and how they become token sequences."""

    path: str = _field(EMBEDDED, doc="a .jsonl file of prompt/completion or messages records, or 'embedded'")
    tokenizer: str | None = _field(None, doc="tokenizer.json or HF directory; default: the model's, else bytes")
    max_length: int = _field(1024, minimum=8, doc="longest sequence in tokens (prompt + completion)")
    overlong: str = _field("truncate", choices=OVERLONG_POLICIES, doc="what to do with longer sequences")
    embedded_examples: int = _field(4096, minimum=1, doc="size of the generated default dataset")
    embedded_seed: int = _field(0, doc="seed of the generated default dataset")


@dataclasses.dataclass
class OptimizerSettings:
    """AdamW with warm-up, a schedule and global-norm clipping: the fields of `jodc.fsdp.OptimizerConfig`.

    `total_steps: null` means the run's `trainer.steps`.
    """

    learning_rate: float = _field(1e-3, minimum=0.0)
    schedule: str = _field("cosine", choices=SCHEDULES)
    warmup_steps: int = _field(10, minimum=0)
    total_steps: int | None = _field(None, minimum=1)
    b1: float = _field(0.9, minimum=0.0)
    b2: float = _field(0.95, minimum=0.0)
    eps: float = _field(1e-8, minimum=0.0)
    weight_decay: float = _field(0.0, minimum=0.0)
    max_grad_norm: float | None = _field(1.0, minimum=0.0)


@dataclasses.dataclass
class TrainerConfig:
    """How the run is executed: engine and devices, balancing, length, precision, outputs."""

    engine: str = _field("odc", choices=ENGINES,
                         doc="odc (on-demand), collective (lock-step FSDP), xla_spmd (NamedSharding + jit), reference")
    devices: int = _field(4, minimum=1, doc="data-parallel devices (simulated CPU devices on a CPU host)")
    platform: str = _field("cpu", choices=PLATFORMS, doc="JAX platform whose devices form the mesh")
    planner: str | None = _field(None, choices=PLANNERS, doc="default: lb_mini for odc, lb_micro for collective")
    cost_model: str = _field("flops", choices=COST_MODELS, doc="how the planner weighs a sequence")
    sequences_per_minibatch: int = _field(32, minimum=1, doc="sequences per optimizer step")
    token_cap: int | None = _field(None, minimum=8, doc="tokens per microbatch buffer; default data.max_length")
    length_buckets: str | None = _field(None, doc="shorter buffer lengths a microbatch may run at, comma-separated "
                                        "(e.g. '256,512'): it runs at the smallest that holds it; use multiples "
                                        "of the attention block size; LB-Mini then plans for the padded lengths")
    steps: int = _field(100, minimum=1, doc="optimizer steps of the whole run")
    seed: int = _field(0, doc="model initialisation and data order")
    compute_dtype: str = _field("float32", choices=COMPUTE_DTYPES)
    deterministic: bool = _field(False, doc="bit-for-bit reproducible gradient accumulation (odc)")
    barrier_timeout_s: float | None = _field(300.0, doc="seconds an ODC device waits in a barrier for the others "
                                             "before the step fails naming the missing ones (null: forever); a "
                                             "device that fails aborts the step at once whatever this is")
    out_dir: str = _field("runs/sft", doc="checkpoints, metrics, plots and the HF export go here")
    resume: bool = _field(True, doc="continue from the latest checkpoint in out_dir")
    save_every: int = _field(50, minimum=0, doc="checkpoint period in steps (0: only at the end)")
    keep_checkpoints: int = _field(3, minimum=1, doc="most recent checkpoints kept")
    log_every: int = _field(1, minimum=1, doc="metrics period in steps")
    timeline_every: int = _field(0, minimum=0, doc="record and plot a per-device timeline every N steps (0: off)")
    export_hf: bool = _field(True, doc="write a HF checkpoint to out_dir/hf at the end")
    progress: bool = _field(True, doc="show a progress bar")
    skip_nonfinite_steps: bool = _field(False, doc="a step with a non-finite loss, grad norm or update is never "
                                        "applied; false: stop the run there, true: skip it (counted in the "
                                        "metrics as skipped_steps) and go on")
    accept_changed_data: bool = _field(False, doc="resume even though the data differ from those the checkpoint "
                                       "was trained on (their fingerprint is saved with every checkpoint)")

    @property
    def planner_name(self) -> str:
        """The planner in effect (the engine's default when `planner` is null)."""
        return self.planner or DEFAULT_PLANNER[self.engine]


@dataclasses.dataclass
class SFTConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerSettings = dataclasses.field(default_factory=OptimizerSettings)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)

    @property
    def token_cap(self) -> int:
        """Microbatch buffer length in effect."""
        return self.trainer.token_cap or self.data.max_length

    @property
    def total_steps(self) -> int:
        """Length of the learning-rate schedule in effect."""
        return self.optimizer.total_steps or self.trainer.steps


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "optimizer": OptimizerSettings,
                             "trainer": TrainerConfig}


# ---------------------------------------------------------------------------------------------------------------
# field lookup
# ---------------------------------------------------------------------------------------------------------------


# Every loader below takes `sections` ({name: dataclass}); the SFT trainer's are the default, and the RL trainer
# passes its own, so both configs share one set of rules for keys, overrides and values.


def _fields(section: str, sections: dict[str, type] = SECTIONS) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(sections[section])}


def all_keys(sections: dict[str, type] = SECTIONS) -> list[str]:
    """Every dotted key, e.g. 'trainer.engine'."""
    return [f"{s}.{name}" for s in sections for name in _fields(s, sections)]


def aliases(sections: dict[str, type] = SECTIONS) -> dict[str, str]:
    """Short name -> dotted key, for every field name that occurs in one section only."""
    owners: dict[str, list[str]] = {}
    for key in all_keys(sections):
        owners.setdefault(key.split(".", 1)[1], []).append(key)
    return {name: keys[0] for name, keys in owners.items() if len(keys) == 1}


def resolve_key(name: str, sections: dict[str, type] = SECTIONS) -> str:
    """'trainer.engine', 'engine' or 'learning-rate' -> the dotted key; ConfigError naming close matches."""
    name = name.replace("-", "_")
    keys = all_keys(sections)
    if name in keys:
        return name
    if "." not in name:
        owners = [k for k in keys if k.split(".", 1)[1] == name]
        if len(owners) == 1:
            return owners[0]
        if len(owners) > 1:
            raise ConfigError(f"'{name}' is ambiguous: use one of {', '.join(owners)}")
    close = difflib.get_close_matches(name, keys + list(aliases(sections)), n=3, cutoff=0.6)
    if close:
        raise ConfigError(f"unknown config key '{name}' (did you mean {' or '.join(close)}?)")
    raise ConfigError(f"unknown config key '{name}'; keys are {', '.join(keys)} (or the field name alone)")


# ---------------------------------------------------------------------------------------------------------------
# values
# ---------------------------------------------------------------------------------------------------------------


def _coerce(key: str, value: Any, annotation) -> Any:
    """Checks `value` against a field's type (int, float, str, bool, or one of them | None)."""
    args = typing.get_args(annotation)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), annotation) if args else annotation
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key} must be a {base.__name__}, got null")
    if base is bool:
        if isinstance(value, bool):
            return value
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif base is str:
        if isinstance(value, str) and value:
            return value
        if isinstance(value, int) and not isinstance(value, bool):  # a YAML number where text is expected ('512')
            return str(value)
    kind = {bool: "true or false", int: "an integer", float: "a number", str: "a non-empty string"}[base]
    raise ConfigError(f"{key} must be {kind}{' or null' if optional else ''}, got {value!r}")


def _check_bounds(key: str, value: Any, field: dataclasses.Field) -> None:
    choices, minimum = field.metadata.get("choices"), field.metadata.get("minimum")
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):  # nan/inf would reach the parameters
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}; got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value!r}")


def parse_value(text: str) -> Any:
    """A command-line value as a YAML scalar ('4' -> 4, 'null' -> None, 'true' -> True, 'odc' -> 'odc')."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return text if isinstance(value, (dict, list)) else value


# ---------------------------------------------------------------------------------------------------------------
# building
# ---------------------------------------------------------------------------------------------------------------


def build_sections(raw: dict | None, sections: dict[str, type], *, source: str = "config") -> dict[str, Any]:
    """{name: section dataclass instance} from nested {section: {field: value}}; missing fields take their
    defaults; every value is type- and bound-checked, and unknown sections or keys name close matches."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections "
                          f"({', '.join(sections)}), got {type(raw).__name__}")
    unknown = [s for s in raw if s not in sections]
    if unknown:
        raise ConfigError(f"{source}: unknown section(s) {', '.join(map(repr, unknown))}; "
                          f"sections are {', '.join(sections)}")
    built = {}
    for name, cls in sections.items():
        values = raw.get(name) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{name}' must be a mapping, got {type(values).__name__}")
        fields = _fields(name, sections)
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, value in values.items():
            if key not in fields:
                dotted = f"{name}.{key}"
                close = difflib.get_close_matches(str(key), list(fields), n=3, cutoff=0.6)
                hint = f" (did you mean {' or '.join(f'{name}.{c}' for c in close)}?)" if close else ""
                raise ConfigError(f"{source}: unknown key '{dotted}'{hint}; section '{name}' has "
                                  f"{', '.join(fields)}")
            dotted = f"{name}.{key}"
            kwargs[key] = _coerce(dotted, value, hints[key])
            _check_bounds(dotted, kwargs[key], fields[key])
        built[name] = cls(**kwargs)
    return built


def config_from_dict(raw: dict | None, *, source: str = "config") -> SFTConfig:
    """An SFTConfig from nested {section: {field: value}}; missing fields take their defaults; validated."""
    config = SFTConfig(**build_sections(raw, SECTIONS, source=source))
    validate(config)
    return config


def parse_length_buckets(text) -> tuple[int, ...]:
    """'256,512' -> (256, 512); ConfigError unless every entry is a positive integer."""
    parts = [p.strip() for p in str(text).replace(" ", ",").split(",") if p.strip()]
    try:
        buckets = tuple(sorted({int(p) for p in parts}))
    except ValueError:
        buckets = ()
    if not buckets or buckets[0] < 1:
        raise ConfigError(f"trainer.length_buckets must be positive integers like '256,512', got {text!r}")
    return buckets


def check_finite_floats(config, sections: dict[str, type] = SECTIONS) -> None:
    """ConfigError naming the first float field that is NaN or infinite (also for configs built in code, which
    skip the per-value checks of `build_sections`)."""
    for name in sections:
        for field in dataclasses.fields(getattr(config, name)):
            value = getattr(getattr(config, name), field.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{name}.{field.name} must be a finite number, got {value!r}")


def validate(config: SFTConfig) -> None:
    """Checks that span fields (field-local checks happen while building)."""
    t, d, o = config.trainer, config.data, config.optimizer
    check_finite_floats(config)
    if config.token_cap < d.max_length:
        raise ConfigError(f"trainer.token_cap={config.token_cap} is below data.max_length={d.max_length}: the "
                          "longest sequences would not fit in a microbatch")
    if t.barrier_timeout_s is not None and not t.barrier_timeout_s > 0:  # NaN fails too; inf waits forever
        raise ConfigError(f"trainer.barrier_timeout_s must be > 0 seconds or null (wait forever), got "
                          f"{t.barrier_timeout_s}")
    if t.deterministic and t.engine in ("collective", "xla_spmd"):
        raise ConfigError("trainer.deterministic=true needs engine odc or reference (the collective engines' "
                          "reductions are not guaranteed bit-for-bit reproducible)")
    if t.length_buckets is not None:
        buckets = parse_length_buckets(t.length_buckets)
        if any(b > config.token_cap for b in buckets):
            raise ConfigError(f"trainer.length_buckets {list(buckets)} must not exceed the token cap "
                              f"{config.token_cap}")
    if not (o.b1 < 1 and o.b2 < 1):
        raise ConfigError(f"optimizer.b1 and optimizer.b2 must lie in [0, 1), got {o.b1} and {o.b2}")
    if o.learning_rate <= 0:
        raise ConfigError(f"optimizer.learning_rate must be > 0, got {o.learning_rate}")
    if o.max_grad_norm is not None and o.max_grad_norm <= 0:
        raise ConfigError(f"optimizer.max_grad_norm must be > 0 or null, got {o.max_grad_norm}")


def to_dict(config: SFTConfig) -> dict[str, dict[str, Any]]:
    """Nested plain dict (YAML- and JSON-serialisable), the inverse of `config_from_dict`."""
    return {name: dataclasses.asdict(getattr(config, name)) for name in SECTIONS}


def _negated_bool(name: str, sections: dict[str, type] = SECTIONS) -> str | None:
    """'no-progress' / 'no_trainer.progress' -> 'trainer.progress' when that is a bool field, else None."""
    name = name.replace("-", "_")
    if not name.startswith("no_"):
        return None
    try:
        key = resolve_key(name[3:], sections)
    except ConfigError:
        return None
    section, field = key.split(".", 1)
    return key if typing.get_type_hints(sections[section])[field] is bool else None


def apply_overrides(raw: dict | None, overrides: Sequence[str], sections: dict[str, type] = SECTIONS) -> dict:
    """Returns a copy of nested `raw` with command-line overrides applied (see the module docstring)."""
    out = {name: dict(values or {}) for name, values in (raw or {}).items() if isinstance(values, dict)}
    out.update({name: values for name, values in (raw or {}).items() if not isinstance(values, dict)})
    tokens = list(overrides)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"expected an override like --trainer.steps 20, got {token!r}")
        name, eq, text = token[2:].partition("=")
        negated = _negated_bool(name, sections) if not eq else None
        key = negated or resolve_key(name, sections)
        section, field = key.split(".", 1)
        if negated:
            text = "false"
        elif not eq:
            has_value = i + 1 < len(tokens) and not tokens[i + 1].startswith("--")
            if has_value:
                text = tokens[i + 1]
                i += 1
            elif typing.get_type_hints(sections[section])[field] is bool:
                text = "true"
            else:
                raise ConfigError(f"override --{name} needs a value")
        target = out.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"section '{section}' must be a mapping, got {type(target).__name__}")
        target[field] = parse_value(text)
        i += 1
    return out


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


def load_config(path: str | None = None, overrides: Sequence[str] = ()) -> SFTConfig:
    """Defaults, then the YAML file at `path` (if any), then `overrides`; validated."""
    raw = read_yaml(path) if path else {}
    return config_from_dict(apply_overrides(raw, overrides), source=path or "config")


def save_yaml(config: SFTConfig, path: str) -> None:
    """Writes the config as YAML (every field, defaults included)."""
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(config), f, sort_keys=False)


# Fields that decide what a checkpoint means: resuming with different values would silently train something
# else (another model, other data, another data order).
RESUME_KEYS = ("model", "data", "trainer.seed", "trainer.sequences_per_minibatch")


def resume_mismatches(saved: dict, current: SFTConfig) -> list[str]:
    """The RESUME_KEYS fields where a checkpoint's saved config differs from `current`: 'key: saved -> now'."""
    now = to_dict(current)
    out = []
    for key in RESUME_KEYS:
        section, _, field = key.partition(".")
        names = [field] if field else list(now[section])
        for name in names:
            old = (saved.get(section) or {}).get(name, now[section][name])
            if old != now[section][name]:
                out.append(f"{section}.{name}: {old!r} -> {now[section][name]!r}")
    return out
