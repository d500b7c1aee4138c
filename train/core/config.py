"""Training configs: dataclass sections read by `draccus` from YAML plus command-line overrides.

Both trainers share `model`, `optimizer`, `engine`, `run`, `checkpoint` and `logging` (`TrainingConfig`);
`SFTConfig` adds `data`, the RL config (`train/rl/config.py`) adds `task`, `rollout`, `loss` and `warmstart`.
Names are read from what they name: `engine.name` from `jodc.fsdp.ENGINES` (and an engine's facts from its class),
the `optimizer` section is `jodc.fsdp.OptimizerConfig`, RL's loss and estimator names come from `jodc.losses`.
draccus decodes each value as its field's type (its error names the field); every section checks ranges and the
relations between its fields in `__post_init__`, so a config built in code is checked like one from YAML; a finished
config resolves `total_steps` once. Over draccus, a thin command-line layer: `--section.field value` or `=value`, a
unique field name alone (`--devices 4`), a section alone for its `name` (`--engine odc`), a bool alone for true and
`--no-<field>` for false, YAML scalar values, did-you-mean for unknown keys.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from typing import Any, Literal, Sequence

import draccus
import mergedeep
import yaml
from draccus.utils import DecodingError, ParsingError, deflatten

from jodc.fsdp import ENGINES, OptimizerConfig, engine_class
from jodc.fsdp.sharding import hsdp_shards

from .export import EXPORT_DTYPES
from .presets import MODEL_PRESETS

EMBEDDED = "embedded"
#: What a config or checkpoint in the layout before the `trainer` section was split is told.
TRAINER_SPLIT = ("the 'trainer' section was split: trainer.engine is now engine.name, trainer.sequences_per_minibatch "
                 "data.sequences_per_minibatch, and its other fields are in engine, run, checkpoint and logging")


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field and what is allowed."""


class Section:
    """Base of the config sections: `__post_init__` refuses non-finite numbers and values below `minimum` (a lower
    bound per field name), then runs the section's own `check` (relations between its fields)."""

    name_in_config = ""  # the section's key in a config ('engine'), for error messages
    minimum: dict[str, float] = {}

    def __post_init__(self):
        for field in dataclasses.fields(self):
            key, value, low = f"{self.name_in_config}.{field.name}", getattr(self, field.name), \
                self.minimum.get(field.name)
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

    name_in_config, minimum = "model", {"attention_block_size": 8, "num_layers": 1, "vocab_size": 1}
    preset: Literal[tuple(MODEL_PRESETS)] = "small"  # built-in shape (ignored with hf_path)
    num_layers: int | None = None  # layers instead of the preset's (null: the preset's; ignored with hf_path)
    # embedding rows instead of the tokenizer's (null: the tokenizer's, rounded up; ignored with hf_path)
    vocab_size: int | None = None
    hf_path: str | None = None  # local HF directory (config.json + safetensors); replaces preset
    # flash (fused kernel) on a GPU, else blockwise; or dense (reference)
    attention_impl: Literal["auto", "blockwise", "flash", "dense"] = "auto"
    attention_block_size: int = 128  # query/key block of the blockwise attention


@dataclasses.dataclass
class DataConfig(Section):
    """Where SFT examples come from, how they become token sequences, and how many make a minibatch."""

    name_in_config = "data"
    minimum = {"max_length": 8, "embedded_examples": 1, "sequences_per_minibatch": 1}
    path: str = EMBEDDED  # a .jsonl file of prompt/completion or messages records, or 'embedded'
    tokenizer: str | None = None  # tokenizer.json or HF directory; default: the model's, else bytes
    max_length: int = 1024  # longest sequence in tokens (prompt + completion)
    overlong: Literal["truncate", "drop"] = "truncate"  # what to do with longer sequences
    embedded_examples: int = 4096  # size of the generated default dataset
    embedded_seed: int = 0  # seed of the generated default dataset
    sequences_per_minibatch: int = 32  # sequences per optimizer step


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
    # odc (on-demand), collective (lock-step FSDP), xla_spmd (NamedSharding + jit), reference: jodc.fsdp.ENGINES
    name: Literal[tuple(ENGINES)] = "odc"
    devices: int = 4  # data-parallel devices (simulated CPU devices on a CPU host)
    # HSDP replica groups: parameters sharded over devices / replicas devices, replicated over the groups (1: flat)
    replicas: int = 1
    platform: Literal["cpu", "gpu"] = "cpu"  # JAX platform whose devices form the mesh
    # default: the engine's (lb_mini for odc, lb_micro for the lock-step ones)
    planner: Literal["lb_mini", "lb_micro", "local_sort"] | None = None
    cost_model: Literal["flops", "linear"] = "flops"  # how the planner weighs a sequence
    token_cap: int | None = None  # tokens per microbatch buffer; SFT's default: data.max_length
    # split sequences longer than token_cap over groups of devices (context parallelism, jodc.balance.cp_planners):
    # data.max_length may then reach devices x token_cap; planned by lb_mini_cp for odc, lockstep_cp for collective
    context_parallel: bool = False
    # with context_parallel, how sequences are planned (jodc.balance.CP_PLANNERS): lb_mini_cp (groups only for the
    # sequences over the cap, on lightly loaded devices, the rest balanced around them; odc only), lockstep_cp (such
    # groups in waves, every device the same number of steps), fixed_cp (every sequence split over all devices, as a
    # fixed CP mesh axis does: a baseline); null: lb_mini_cp for odc, lockstep_cp for the lock-step engines
    cp_planner: Literal["lb_mini_cp", "lockstep_cp", "fixed_cp"] | None = None
    # how a CP group's members see each other's K/V: stream (one member's at a time: a member's memory does not grow
    # with its group) or all_gather (the group's K/V of a layer at once); null: the engine's (odc streams, the
    # lock-step engines all-gather over the mesh axis and take no other)
    cp_kv_exchange: Literal["stream", "all_gather"] | None = None
    # shorter buffer lengths a microbatch may run at, comma-separated ('256,512'): it runs at the smallest that
    # holds it; use multiples of the attention block size; LB-Mini then plans for the padded lengths
    length_buckets: str | None = None
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    deterministic: bool = False  # bit-for-bit reproducible gradient accumulation (odc, reference)
    # seconds an ODC device waits in a barrier for the others before the step fails naming the missing ones
    # (null: forever); a device that fails aborts the step at once whatever this is
    barrier_timeout_s: float | None = 300.0

    @property
    def planner_name(self) -> str:
        """The planner in effect (the engine's default when `planner` is null)."""
        return self.planner or ENGINES[self.name].default_planner

    def check(self) -> None:
        engine = engine_class(self.name)  # ValueError naming the engines (draccus has checked a config's name)
        if self.barrier_timeout_s is not None and not self.barrier_timeout_s > 0:
            raise ConfigError(f"engine.barrier_timeout_s must be > 0 seconds or null (wait forever), got "
                              f"{self.barrier_timeout_s}")
        if self.deterministic and not engine.supports_deterministic:
            able = " or ".join(n for n, e in ENGINES.items() if e.supports_deterministic)
            raise ConfigError(f"engine.deterministic=true needs engine {able} (the {self.name} engine's reductions "
                              "are not guaranteed bit-for-bit reproducible)")
        if self.context_parallel and not engine.supports_context_parallel:
            able = " and ".join(n for n, e in ENGINES.items() if e.supports_context_parallel)
            raise ConfigError(f"engine.context_parallel=true: the {self.name} engine does not run context-parallel "
                              f"microbatches ({able} do); use one of them, or set it to false and keep every "
                              "sequence within engine.token_cap")
        if self.cp_planner is not None and not self.context_parallel:
            raise ConfigError(f"engine.cp_planner={self.cp_planner} plans context-parallel groups: set "
                              "engine.context_parallel=true, or leave engine.cp_planner null")
        if self.cp_planner == "lb_mini_cp" and engine.lockstep:
            raise ConfigError(f"engine.cp_planner=lb_mini_cp gives devices different step counts, which the lock-step "
                              f"{self.name} engine does not run; use lockstep_cp or fixed_cp, or engine.name=odc")
        if self.cp_kv_exchange is not None and "cp_kv_exchange" not in engine.options:
            able = " and ".join(n for n, e in ENGINES.items() if "cp_kv_exchange" in e.options)
            raise ConfigError(f"engine.cp_kv_exchange={self.cp_kv_exchange}: the {self.name} engine has no choice of "
                              f"K/V exchange (it all-gathers over its mesh axis; {able} has); leave it null")
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
    # dtype of the export's tensors: bfloat16 (half the size, what inference loads) or float32 (the masters exactly)
    export_dtype: Literal[tuple(EXPORT_DTYPES)] = "bfloat16"
    # resume even though the data differ from those the checkpoint was trained on (their fingerprint is saved
    # with every checkpoint)
    accept_changed_data: bool = False

    def check(self) -> None:
        if self.export_dtype not in EXPORT_DTYPES:  # draccus checks a YAML value; this, one set in code
            raise ConfigError(f"checkpoint.export_dtype must be one of {', '.join(EXPORT_DTYPES)}, got "
                              f"{self.export_dtype!r}")


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


@dataclasses.dataclass
class TrainingConfig:
    """The sections both trainers have. A finished config (`__post_init__`) has checked the relations between its
    sections (`check`) and resolved the learning-rate schedule's length once: `total_steps`."""

    # Fields of RESUME_KEYS' sections that say how a value is computed, not what: a run may resume with others (a
    # CPU run resumed on a GPU picks the fused attention kernel), at floating-point rounding's difference.
    RESUME_FREE = ("model.attention_impl", "model.attention_block_size")

    model: ModelConfig = defaults(ModelConfig)
    # AdamW with warm-up, a schedule and global-norm clipping (total_steps: null = the run's optimizer updates)
    optimizer: OptimizerConfig = defaults(OptimizerConfig, learning_rate=1e-3, schedule="cosine", warmup_steps=10)
    engine: EngineConfig = defaults(EngineConfig)
    run: RunConfig = defaults(RunConfig)
    checkpoint: CheckpointConfig = defaults(CheckpointConfig)
    logging: LoggingConfig = defaults(LoggingConfig)

    def __post_init__(self):
        self.check()
        #: the optimizer the engines run: the section with the schedule's length in effect
        self.schedule_optimizer = dataclasses.replace(
            self.optimizer, total_steps=self.optimizer.total_steps or self.optimizer_updates)

    @property
    def total_steps(self) -> int:
        """Length of the learning-rate schedule in effect, in optimizer updates."""
        return self.schedule_optimizer.total_steps

    @property
    def optimizer_updates(self) -> int:
        """The run's length in optimizer updates (the schedule's length when `optimizer.total_steps` is null)."""
        return self.run.steps

    def check(self) -> None:
        """Relations between sections (ConfigError naming the fields)."""


@dataclasses.dataclass
class SFTConfig(TrainingConfig):
    """The SFT job: the shared sections and `data`."""

    data: DataConfig = defaults(DataConfig)
    # Fields that decide what a checkpoint means: resuming with other values would silently train something else
    RESUME_KEYS = ("model", "data", "run.seed")

    @property
    def token_cap(self) -> int:
        """Microbatch buffer length in effect."""
        return self.engine.token_cap or self.data.max_length

    def check(self) -> None:
        engine, capacity = self.engine, self.engine.devices * self.token_cap
        if self.token_cap < self.data.max_length and not engine.context_parallel:
            raise ConfigError(f"engine.token_cap={self.token_cap} is below data.max_length={self.data.max_length}: "
                              "the longest sequences would not fit in a microbatch (engine.context_parallel=true "
                              "splits them over devices, with an engine that supports it)")
        if self.data.max_length > capacity:
            raise ConfigError(f"data.max_length={self.data.max_length} exceeds the world's capacity, engine.devices="
                              f"{engine.devices} x token_cap={self.token_cap} = {capacity} tokens: a longer sequence "
                              "fits no context-parallel group")
        if self.engine.length_buckets is not None:
            buckets = parse_length_buckets(self.engine.length_buckets)
            if any(b > self.token_cap for b in buckets):
                raise ConfigError(f"engine.length_buckets {list(buckets)} must not exceed the token cap "
                                  f"{self.token_cap}")


# ---------------------------------------------------------------------------------------------------------------
# keys, YAML files and command-line overrides (the thin layer over draccus)
# ---------------------------------------------------------------------------------------------------------------


def sections(cls) -> dict[str, type]:
    """{section name: section class} of a config class."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def all_keys(cls=SFTConfig) -> list[str]:
    """Every dotted key, e.g. 'engine.devices'."""
    return [f"{s}.{f.name}" for s, section in sections(cls).items() for f in dataclasses.fields(section)]


def resolve_key(name: str, cls=SFTConfig) -> str:
    """'engine.devices', 'devices' (a field name in one section only), 'learning-rate' or 'engine' (a section with a
    `name` field) -> the dotted key; ConfigError naming close matches."""
    name, keys = name.replace("-", "_"), all_keys(cls)
    if name.startswith("trainer."):
        raise ConfigError(TRAINER_SPLIT)
    owners = [name] if name in keys else [k for k in keys if k.split(".", 1)[1] == name or k == f"{name}.name"]
    if len(owners) == 1:
        return owners[0]
    if owners:
        raise ConfigError(f"'{name}' is ambiguous: use one of {', '.join(owners)}")
    close = difflib.get_close_matches(name, keys + [k.split(".", 1)[1] for k in keys], n=3, cutoff=0.6)
    raise ConfigError(f"unknown config key '{name}'" + (f" (did you mean {' or '.join(close)}?)" if close else
                                                         f"; keys are {', '.join(keys)} (or the field name alone)"))


def is_bool(name: str, cls) -> bool:
    """Whether `name` is a key (see `resolve_key`) of a bool field."""
    try:
        section, field = resolve_key(name, cls).split(".")
    except ConfigError:
        return False
    return typing.get_type_hints(sections(cls)[section])[field] is bool


def parse_overrides(tokens: Sequence[str], cls=SFTConfig) -> dict[str, Any]:
    """{dotted key: value} of command-line overrides (see the module docstring)."""
    out, tokens = {}, list(tokens)
    while tokens:
        token = tokens.pop(0)
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"expected an override like --run.steps 20, got {token!r}")
        name, eq, text = token[2:].partition("=")
        if not eq and name.replace("-", "_").startswith("no_") and is_bool(name[3:], cls):
            name, text = name[3:], "false"
        elif not eq and tokens and not tokens[0].startswith("--"):
            text = tokens.pop(0)
        elif not eq and not is_bool(name, cls):
            resolve_key(name, cls)  # an unknown key says so first
            raise ConfigError(f"override --{name} needs a value")
        out[resolve_key(name, cls)] = draccus.cfgparsing.parse_string(text if eq or text else "true")
    return out


def flatten(raw: Any, cls=SFTConfig, source: str = "config") -> dict[str, Any]:
    """{dotted key: value} of nested {section: {field: value}} (a YAML file's, `to_dict`'s); ConfigError naming the
    first unknown or malformed section or key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(raw).__name__}")
    if "trainer" in raw:
        raise ConfigError(f"{source}: {TRAINER_SPLIT}")
    bad = [name for name, values in raw.items() if not isinstance(values, (dict, type(None)))]
    if bad:
        raise ConfigError(f"{source}: section '{bad[0]}' must be a mapping of fields, got {raw[bad[0]]!r}")
    try:
        return {resolve_key(f"{name}.{field}", cls): value for name, values in raw.items()
                for field, value in (values or {}).items()}
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def decode(cls, flat: dict[str, Any]):
    """A config of class `cls` from {dotted key: value} over its defaults, decoded by draccus and checked by every
    section's and the config's `__post_init__`."""
    try:  # over the config's defaults: draccus builds a section given in part from the section class's defaults
        return draccus.decode(cls, mergedeep.merge({}, draccus.encode(cls()), deflatten(flat)))
    except DecodingError as e:  # a value draccus cannot read as the field's type (the innermost reason)
        reason = e
        while isinstance(reason.__cause__, DecodingError):
            reason = reason.__cause__
        raise ConfigError(f"{'.'.join(e.key_path)}: {re.sub(r' [(]<class .*?>[)]', '', reason.message)}") from None
    except ParsingError as e:  # a __post_init__ refused it
        cause = e
        while cause is not None and not isinstance(cause, ValueError):
            cause = cause.__cause__
        raise ConfigError(str(cause or e)) from None


def config_from_dict(raw: dict | None, cls=SFTConfig, *, source: str = "config"):
    """A config of class `cls` from nested {section: {field: value}} (missing fields take their defaults)."""
    return decode(cls, flatten(raw or {}, cls, source))


def to_dict(config) -> dict[str, dict[str, Any]]:
    """Nested plain dict (YAML- and JSON-serialisable), the inverse of `config_from_dict`."""
    return draccus.encode(config)


def read_yaml(path: str) -> Any:
    """What the YAML file at `path` holds; ConfigError naming the file when it is absent or malformed."""
    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None


def load(cls, path: str | None = None, overrides: Sequence[str] = ()):
    """Defaults, then the YAML file at `path` (if any), then `overrides`; checked."""
    raw = (read_yaml(path) if path else None) or {}
    return decode(cls, {**flatten(raw, cls, path or "config"), **parse_overrides(overrides, cls)})


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
    """The `RESUME_KEYS` fields of `current`'s class where a checkpoint's saved config differs from `current`:
    'key: saved -> now'."""
    if "trainer" in saved:
        raise ConfigError(f"the checkpoint's config: {TRAINER_SPLIT}")
    cls, now = type(current), flatten(to_dict(current), type(current))
    old = {f"{section}.{field}": value for section, values in saved.items() for field, value in (values or {}).items()}
    keys = [k for r in cls.RESUME_KEYS for k in now if r in (k, k.split(".")[0]) and k not in cls.RESUME_FREE]
    return [f"{k}: {old[k]!r} -> {now[k]!r}" for k in keys if old.get(k, now[k]) != now[k]]
