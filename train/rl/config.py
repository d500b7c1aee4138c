"""The RL job description: seven sections of plain dataclasses with defaults (model, task, rollout, loss,
optimizer, trainer, warmstart), loaded from YAML plus command-line overrides exactly like the SFT config.

The field helpers, value coercion, bounds checks and the `model` / `optimizer` sections are the SFT config's
(`train/core/config.py`); this module adds the RL sections and the section-generic loading. Overrides are
`--section.field value`, `--section.field=value`, or the bare field name when it occurs in one section only
(`--steps 20`, `--group_size 4`; `name` is in `task` and `loss`, so write `--loss.name ppo`).

Loss hyper-parameters left at null take the loss's own (published) default; only the ones set are passed, and
one the chosen loss does not take is an error at start-up. `dual_clip: 0` and `ratio_cap: 0` switch those off.

This module imports no JAX (the CLI validates the config before JAX is loaded).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import yaml

from ..core import config as sft_config
from ..core.config import (
    COMPUTE_DTYPES,
    COST_MODELS,
    DEFAULT_PLANNER,
    ENGINES,
    PLANNERS,
    PLATFORMS,
    SCHEDULES,
    ConfigError,
    ModelConfig,
    OptimizerSettings,
    _field,
    read_yaml,
)
from .tasks import TASK_NAMES

#: jodc.losses.KL_ESTIMATORS and the names of jodc.losses.ADVANTAGE_ESTIMATORS (this module imports no JAX; a test
#: keeps the lists in step).
KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "k1+", "k2+", "k3+")
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax",
                        "grpo_passk", "gpg")
#: Loss hyper-parameters that may be set in the `loss` section; null = the loss's default.
LOSS_OPTIONS = ("divergence", "approximation", "delta_low", "delta_high", "ratio_cap", "clip_low", "clip_high",
                "dual_clip", "tau_pos", "tau_neg", "eta", "tis_cap", "behaviour_weight_cap")
#: Options where 0 in the config means "off" (passed to the loss as None).
ZERO_MEANS_OFF = ("dual_clip", "ratio_cap", "behaviour_weight_cap")


@dataclasses.dataclass
class TaskConfig:
    """Where prompts come from and how responses are scored."""

    name: str = _field("arithmetic", choices=TASK_NAMES, doc="arithmetic, countdown, or jsonl (prompts from path)")
    path: str | None = _field(None, doc="jsonl task: file of {\"prompt\": ..., \"solution\": ...} records")
    reward_fn: str | None = _field(None, doc="'module:function' or 'file.py:function'; default: the task's own")
    success_reward: float = _field(1.0, doc="a response with at least this reward counts as correct (accuracy)")
    pool_size: int = _field(0, minimum=0, doc="train on a fixed set of this many problems (0: fresh ones every step)")
    min_terms: int = _field(2, minimum=2, doc="arithmetic: fewest terms")
    max_terms: int = _field(3, minimum=2, doc="arithmetic: most terms")
    max_digits: int = _field(2, minimum=1, doc="arithmetic: most digits per term")
    min_numbers: int = _field(2, minimum=2, doc="countdown: fewest numbers given")
    max_numbers: int = _field(4, minimum=2, doc="countdown: most numbers given")
    max_number: int = _field(25, minimum=1, doc="countdown: largest number")
    eval_problems: int = _field(64, minimum=1, doc="size of the fixed greedy evaluation set")

    def task_options(self) -> dict[str, Any]:
        """Keyword arguments of `rl_tasks.make_task` for this task."""
        if self.name == "arithmetic":
            return {"min_terms": self.min_terms, "max_terms": self.max_terms, "max_digits": self.max_digits}
        if self.name == "countdown":
            return {"min_numbers": self.min_numbers, "max_numbers": self.max_numbers, "max_number": self.max_number}
        return {"path": self.path}


@dataclasses.dataclass
class RolloutConfig:
    """How responses are sampled from the current policy."""

    prompts_per_step: int = _field(16, minimum=1, doc="prompts per step")
    group_size: int = _field(8, minimum=2, doc="responses per prompt (GRPO group)")
    max_new_tokens: int = _field(8, minimum=1, doc="generation budget per response")
    temperature: float = _field(1.0, doc="sampling temperature (> 0); the losses use the same one")
    top_k: int = _field(20, minimum=1, doc="behaviour top-k stored for DPPO's Top-K approximation (K)")
    prompt_bucket: int = _field(16, minimum=1, doc="prompt width is rounded up to a multiple (fewer compiles)")

    @property
    def rollout_size(self) -> int:
        """Responses per step."""
        return self.prompts_per_step * self.group_size


@dataclasses.dataclass
class LossConfig:
    """The policy loss (a name of `jodc.losses.POLICY_LOSSES`), its hyper-parameters, advantages and KL."""

    name: str = _field("dppo", doc="dppo (binary TV), dppo_kl, dppo_topk, ppo, grpo, dapo, gspo, sapo, cispo, ...")
    aggregation: str | None = _field(None, doc="token-mean, seq-mean-token-mean, ...; null: the loss's default")
    advantage: str = _field("grpo", choices=ADVANTAGE_ESTIMATORS, doc="advantage estimator (verl's names)")
    normalize_std: bool = _field(True, doc="divide group advantages by the group's std (false: Dr.GRPO)")
    kl_coef: float = _field(0.0, minimum=0.0, doc="weight of a KL penalty to the initial policy (0: none)")
    kl_estimator: str = _field("k3", choices=KL_ESTIMATORS)
    divergence: str | None = _field(None, choices=("tv", "kl"), doc="DPPO divergence")
    approximation: str | None = _field(None, choices=("binary", "topk"), doc="DPPO divergence approximation")
    delta_low: float | None = _field(None, minimum=0.0, doc="DPPO threshold for A < 0")
    delta_high: float | None = _field(None, minimum=0.0, doc="DPPO threshold for A > 0")
    ratio_cap: float | None = _field(None, minimum=0.0, doc="DPPO ratio truncation (0: off)")
    clip_low: float | None = _field(None, minimum=0.0, doc="PPO-family lower clip")
    clip_high: float | None = _field(None, minimum=0.0, doc="PPO-family upper clip")
    dual_clip: float | None = _field(None, minimum=0.0, doc="dual-clip constant (0: off)")
    tau_pos: float | None = _field(None, minimum=0.0, doc="SAPO temperature for A > 0")
    tau_neg: float | None = _field(None, minimum=0.0, doc="SAPO temperature for A < 0")
    eta: float | None = _field(None, minimum=0.0, doc="DG temperature")
    tis_cap: float | None = _field(None, minimum=0.0, doc="TIS weight cap")
    behaviour_weight_cap: float | None = _field(None, minimum=0.0, doc="decoupled PPO weight cap (0: off)")

    def options(self) -> dict[str, Any]:
        """The hyper-parameters that are set, as loss keyword arguments (0 -> None where that means 'off')."""
        out = {}
        for name in LOSS_OPTIONS:
            value = getattr(self, name)
            if value is not None:
                out[name] = None if (name in ZERO_MEANS_OFF and value == 0) else value
        return out

    @property
    def uses_topk(self) -> bool:
        """Whether the loss is DPPO's Top-K approximation (the rollout must then store the behaviour top-k)."""
        return (self.approximation or ("topk" if self.name == "dppo_topk" else "binary")) == "topk"


@dataclasses.dataclass
class RLOptimizerSettings(OptimizerSettings):
    """AdamW as in SFT, with RL defaults (a small constant learning rate). `total_steps: null` = the run's
    optimizer updates (trainer.steps x trainer.updates_per_step)."""

    learning_rate: float = _field(1e-4, minimum=0.0)
    schedule: str = _field("constant", choices=SCHEDULES)
    warmup_steps: int = _field(0, minimum=0)


@dataclasses.dataclass
class RLTrainerConfig:
    """How the run is executed: engine and devices, updates per rollout, outputs."""

    engine: str = _field("odc", choices=ENGINES, doc="odc (on-demand), collective (lock-step FSDP), reference")
    devices: int = _field(2, minimum=1, doc="data-parallel devices (simulated CPU devices on a CPU host)")
    platform: str = _field("cpu", choices=PLATFORMS)
    planner: str | None = _field(None, choices=PLANNERS, doc="default: lb_mini for odc, lb_micro for collective")
    cost_model: str = _field("flops", choices=COST_MODELS)
    token_cap: int = _field(256, minimum=8, doc="tokens per microbatch buffer (>= the longest prompt + response)")
    steps: int = _field(50, minimum=1, doc="RL steps (one rollout each)")
    updates_per_step: int = _field(4, minimum=1, doc="optimizer updates (minibatches) per rollout")
    seed: int = _field(0, doc="prompts, sampling, minibatch split and model initialisation")
    compute_dtype: str = _field("float32", choices=COMPUTE_DTYPES)
    deterministic: bool = _field(False, doc="bit-for-bit reproducible gradient accumulation (odc)")
    barrier_timeout_s: float | None = _field(300.0, doc="seconds an ODC device waits in a barrier for the others "
                                             "before the step fails naming the missing ones (null: forever); a "
                                             "device that fails aborts the step at once whatever this is")
    out_dir: str = _field("runs/rl", doc="checkpoints, metrics, plots and the HF export go here")
    resume: bool = _field(True, doc="continue from the latest checkpoint in out_dir")
    save_every: int = _field(10, minimum=0, doc="checkpoint period in steps (0: only at the end)")
    keep_checkpoints: int = _field(2, minimum=1)
    log_every: int = _field(1, minimum=1)
    eval_every: int = _field(0, minimum=0, doc="greedy accuracy on the evaluation set every N steps (0: off)")
    unstable_kl: float = _field(0.05, minimum=0.0, doc="an update whose KL(behaviour || policy) exceeds this "
                                                         "counts as a blow-up")
    export_hf: bool = _field(True, doc="write a HF checkpoint to out_dir/hf at the end")
    progress: bool = _field(True, doc="show a progress bar")
    skip_nonfinite_steps: bool = _field(False, doc="an update with a non-finite loss, grad norm or update is never "
                                        "applied; false: stop the run there, true: skip that update (counted in "
                                        "the metrics as skipped_updates) and go on")
    accept_changed_data: bool = _field(False, doc="resume even though the task's prompt file (task.path) differs "
                                       "from the one the checkpoint was trained on")

    @property
    def planner_name(self) -> str:
        """The planner in effect (the engine's default when `planner` is null)."""
        return self.planner or DEFAULT_PLANNER[self.engine]


@dataclasses.dataclass
class WarmstartConfig:
    """SFT on the task's solutions before RL (reusing the SFT trainer), so RL starts with a non-zero reward."""

    sft_steps: int = _field(0, minimum=0, doc="SFT steps (0: start RL from the model as configured)")
    sft_examples: int = _field(2048, minimum=1, doc="solved problems to train on")
    sft_sequences_per_minibatch: int = _field(32, minimum=1)
    sft_learning_rate: float = _field(3e-3, minimum=0.0)


@dataclasses.dataclass
class RLConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    optimizer: RLOptimizerSettings = dataclasses.field(default_factory=RLOptimizerSettings)
    trainer: RLTrainerConfig = dataclasses.field(default_factory=RLTrainerConfig)
    warmstart: WarmstartConfig = dataclasses.field(default_factory=WarmstartConfig)

    @property
    def total_steps(self) -> int:
        """Length of the learning-rate schedule in optimizer updates."""
        return self.optimizer.total_steps or self.trainer.steps * self.trainer.updates_per_step


SECTIONS: dict[str, type] = {"model": ModelConfig, "task": TaskConfig, "rollout": RolloutConfig, "loss": LossConfig,
                             "optimizer": RLOptimizerSettings, "trainer": RLTrainerConfig,
                             "warmstart": WarmstartConfig}


def all_keys() -> list[str]:
    """Every dotted key, e.g. 'loss.name'."""
    return sft_config.all_keys(SECTIONS)


def resolve_key(name: str) -> str:
    """'loss.name', 'group_size' or 'group-size' -> the dotted key; ConfigError naming close matches."""
    return sft_config.resolve_key(name, SECTIONS)


def apply_overrides(raw: dict | None, overrides: Sequence[str]) -> dict:
    """A copy of nested `raw` with command-line overrides applied (the SFT config's rules)."""
    return sft_config.apply_overrides(raw, overrides, SECTIONS)


def config_from_dict(raw: dict | None, *, source: str = "config") -> RLConfig:
    """An RLConfig from nested {section: {field: value}}; missing fields take their defaults; validated."""
    config = RLConfig(**sft_config.build_sections(raw, SECTIONS, source=source))
    validate(config)
    return config


def validate(config: RLConfig) -> None:
    """Checks that span fields (field-local checks happen while building)."""
    t, r, task, o = config.trainer, config.rollout, config.task, config.optimizer
    sft_config.check_finite_floats(config, SECTIONS)
    if not r.temperature > 0:
        raise ConfigError(f"rollout.temperature must be > 0 (RL samples; the losses' ratios need the sampling "
                          f"distribution), got {r.temperature}")
    if t.updates_per_step > r.rollout_size:
        raise ConfigError(f"trainer.updates_per_step={t.updates_per_step} exceeds the rollout's "
                          f"{r.rollout_size} responses (rollout.prompts_per_step x rollout.group_size)")
    if task.name == "jsonl" and not task.path:
        raise ConfigError("task.name=jsonl needs task.path (a .jsonl file of {\"prompt\": ...} records)")
    if task.name == "jsonl" and task.pool_size:
        raise ConfigError("task.pool_size applies to the generated tasks; the jsonl task's file is its pool")
    if task.min_terms > task.max_terms:
        raise ConfigError(f"task.min_terms={task.min_terms} exceeds task.max_terms={task.max_terms}")
    if task.min_numbers > task.max_numbers:
        raise ConfigError(f"task.min_numbers={task.min_numbers} exceeds task.max_numbers={task.max_numbers}")
    if t.barrier_timeout_s is not None and not t.barrier_timeout_s > 0:  # NaN fails too; inf waits forever
        raise ConfigError(f"trainer.barrier_timeout_s must be > 0 seconds or null (wait forever), got "
                          f"{t.barrier_timeout_s}")
    if t.deterministic and t.engine == "collective":
        raise ConfigError("trainer.deterministic=true needs engine odc or reference (the collective engine's "
                          "reductions are not guaranteed bit-for-bit reproducible)")
    if not (o.b1 < 1 and o.b2 < 1):
        raise ConfigError(f"optimizer.b1 and optimizer.b2 must lie in [0, 1), got {o.b1} and {o.b2}")
    if o.learning_rate <= 0 or config.warmstart.sft_learning_rate <= 0:
        raise ConfigError("optimizer.learning_rate and warmstart.sft_learning_rate must be > 0")
    if o.max_grad_norm is not None and o.max_grad_norm <= 0:
        raise ConfigError(f"optimizer.max_grad_norm must be > 0 or null, got {o.max_grad_norm}")


def to_dict(config: RLConfig) -> dict[str, dict[str, Any]]:
    """Nested plain dict (YAML- and JSON-serialisable), the inverse of `config_from_dict`."""
    return {name: dataclasses.asdict(getattr(config, name)) for name in SECTIONS}


def load_rl_config(path: str | None = None, overrides: Sequence[str] = ()) -> RLConfig:
    """Defaults, then the YAML file at `path` (if any), then `overrides`; validated."""
    raw = read_yaml(path) if path else {}
    return config_from_dict(apply_overrides(raw, overrides), source=path or "config")


def save_yaml(config: RLConfig, path: str) -> None:
    """Writes the config as YAML (every field, defaults included)."""
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(config), f, sort_keys=False)


# What a checkpoint means: resuming with other values would silently continue a different run (another model,
# task, reward, warm start, prompt stream or rollout shape).
RESUME_KEYS = ("model", "task", "warmstart", "rollout", "trainer.seed", "trainer.updates_per_step")


def resume_mismatches(saved: dict, current: RLConfig) -> list[str]:
    """The RESUME_KEYS fields where a checkpoint's saved config differs from `current`: 'key: saved -> now'."""
    now = to_dict(current)
    out = []
    for key in RESUME_KEYS:
        section, _, field = key.partition(".")
        for name in [field] if field else list(now[section]):
            old = (saved.get(section) or {}).get(name, now[section][name])
            if old != now[section][name]:
                out.append(f"{section}.{name}: {old!r} -> {now[section][name]!r}")
    return out
