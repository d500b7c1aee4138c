"""The RL job: the shared sections of `train/core/config.py` with RL's defaults, plus `task`, `rollout`, `loss`
and `warmstart`; read like the SFT config (`--steps 20`, `--group_size 4`, `--loss ppo`). The loss, advantage and
KL estimator names are those of `jodc.losses`' registries.

Loss hyper-parameters left at null take the loss's own (published) default; only the ones set are passed, and
one the chosen loss does not take is an error at start-up. `dual_clip: 0` and `ratio_cap: 0` switch those off.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal, Sequence

from jodc.fsdp import OptimizerConfig
from jodc.losses import ADVANTAGE_ESTIMATORS, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES

from ..core.config import (CheckpointConfig, ConfigError, EngineConfig, RunConfig, Section, TrainingConfig,
                           defaults, load)
from .tasks import TASK_NAMES

TaskName = Literal[TASK_NAMES]
LossName = Literal[tuple(POLICY_LOSSES)]
Aggregation = Literal[AGGREGATIONS]
KlEstimator = Literal[KL_ESTIMATORS]
AdvantageEstimator = Literal[tuple(ADVANTAGE_ESTIMATORS)]
#: Loss hyper-parameters that may be set in the `loss` section; null = the loss's default.
LOSS_OPTIONS = ("divergence", "approximation", "delta_low", "delta_high", "ratio_cap", "clip_low", "clip_high",
                "dual_clip", "tau_pos", "tau_neg", "eta", "tis_cap", "behaviour_weight_cap", "dro_beta")
#: Options where 0 in the config means "off" (passed to the loss as None).
ZERO_MEANS_OFF = ("dual_clip", "ratio_cap", "behaviour_weight_cap")


@dataclasses.dataclass
class TaskConfig(Section):
    """Where prompts come from and how responses are scored."""

    name_in_config = "task"
    minimum = {"pool_size": 0, "min_terms": 2, "max_terms": 2, "max_digits": 1, "min_numbers": 2, "max_numbers": 2,
               "max_number": 1, "min_runs": 1, "max_runs": 1, "max_count": 1, "letters": 2, "eval_problems": 1}
    name: TaskName = "arithmetic"  # arithmetic, countdown, expand, or jsonl (prompts from path)
    path: str | None = None  # jsonl task: file of {"prompt": ..., "solution": ...} records
    reward_fn: str | None = None  # 'module:function' or 'file.py:function'; default: the task's own
    success_reward: float = 1.0  # a response with at least this reward counts as correct (accuracy)
    pool_size: int = 0  # train on a fixed set of this many problems (0: fresh ones every step)
    min_terms: int = 2  # arithmetic: fewest terms
    max_terms: int = 3  # arithmetic: most terms
    max_digits: int = 2  # arithmetic: most digits per term
    min_numbers: int = 2  # countdown: fewest numbers given
    max_numbers: int = 4  # countdown: most numbers given
    max_number: int = 25  # countdown: largest number
    min_runs: int = 1  # expand: fewest runs
    max_runs: int = 32  # expand: most runs (the Pareto tail is cut here)
    max_count: int = 9  # expand: largest count of a run (1..9)
    letters: int = 5  # expand: letters used, from 'a'
    tail: float = 1.2  # expand: Pareto index of the number of runs (smaller: heavier tail)
    eval_problems: int = 64  # size of the fixed greedy evaluation set

    def task_options(self) -> dict[str, Any]:
        """Keyword arguments of `tasks.make_task` for this task."""
        if self.name == "arithmetic":
            return {"min_terms": self.min_terms, "max_terms": self.max_terms, "max_digits": self.max_digits}
        if self.name == "countdown":
            return {"min_numbers": self.min_numbers, "max_numbers": self.max_numbers, "max_number": self.max_number}
        if self.name == "expand":
            return {"min_runs": self.min_runs, "max_runs": self.max_runs, "max_count": self.max_count,
                    "letters": self.letters, "tail": self.tail}
        return {"path": self.path}

    def check(self) -> None:
        if self.name == "jsonl" and not self.path:
            raise ConfigError("task.name=jsonl needs task.path (a .jsonl file of {\"prompt\": ...} records)")
        if self.name == "jsonl" and self.pool_size:
            raise ConfigError("task.pool_size applies to the generated tasks; the jsonl task's file is its pool")
        if self.min_terms > self.max_terms:
            raise ConfigError(f"task.min_terms={self.min_terms} exceeds task.max_terms={self.max_terms}")
        if self.min_numbers > self.max_numbers:
            raise ConfigError(f"task.min_numbers={self.min_numbers} exceeds task.max_numbers={self.max_numbers}")
        if self.min_runs > self.max_runs:
            raise ConfigError(f"task.min_runs={self.min_runs} exceeds task.max_runs={self.max_runs}")
        if self.max_count > 9 or self.letters > 26 or not self.tail > 0:
            raise ConfigError(f"task: expand needs max_count <= 9, letters <= 26 and tail > 0; got {self.max_count}, "
                              f"{self.letters}, {self.tail}")


@dataclasses.dataclass
class RolloutConfig(Section):
    """How responses are sampled from the current policy."""

    name_in_config = "rollout"
    minimum = {"prompts_per_step": 1, "group_size": 2, "max_new_tokens": 1, "top_k": 1, "prompt_bucket": 1,
               "max_staleness": 0, "sampler_nice": 0, "slots": 1, "page_size": 1, "cache_tokens": 0,
               "decode_chunk": 1}
    prompts_per_step: int = 16  # prompts per step
    group_size: int = 8  # responses per prompt (GRPO group)
    max_new_tokens: int = 8  # generation budget per response
    temperature: float = 1.0  # sampling temperature (> 0); the losses use the same one
    top_k: int = 20  # behaviour top-k stored for DPPO's Top-K approximation (K)
    prompt_bucket: int = 16  # prompt width is rounded up to a multiple (fewer compiles)
    max_staleness: int = 0  # k > 0: a sampler thread samples step s's rollout with the weights of step s - k
    dtype: Literal["float32", "bfloat16"] = "float32"  # the sampler's parameters and compute (training: fp32)
    sampler: Literal["thread", "process"] = "thread"  # max_staleness > 0: where the sampler computes
    sampler_nice: int = 10  # sampler: process: the child's OS priority (higher: less taken from the trainer)
    # static: each device samples its share as one batch until its longest response ends (a dense cache per row);
    # continuous: each device streams its share through `slots` rows over a paged KV cache, a finished row's slot
    # taking the next prompt at once (models/stream.py; the same responses, faster on long-tailed lengths)
    batching: Literal["static", "continuous"] = "static"
    slots: int = 64  # continuous: rows decoded at once per device
    page_size: int = 16  # continuous: tokens per KV-cache page
    cache_tokens: int = 0  # continuous: KV cache per device, in tokens (0: every slot's longest row, no waiting)
    decode_chunk: int = 8  # continuous: decode steps per compiled call (the host refills slots between calls)
    # max_staleness > 0 with continuous batching: generation carries on across policy updates (responses may hold
    # tokens of two versions, each token keeping its version and log-prob; train/rl/partial_rollouts.py)
    partial_rollouts: bool = False
    # across processes (mpirun): sharded = each process keeps its share, exchanges per-response metadata and sends
    # each sequence only to the process that trains it (train/rl/assembly.py); replicated = every process gets the
    # whole rollout (all-gathered) and computes every pass over it (the baseline bench/rl_sampling.py compares)
    assembly: Literal["sharded", "replicated"] = "sharded"

    @property
    def rollout_size(self) -> int:
        """Responses per step."""
        return self.prompts_per_step * self.group_size

    def check(self) -> None:
        if not self.temperature > 0:
            raise ConfigError(f"rollout.temperature must be > 0 (RL samples; the losses' ratios need the sampling "
                              f"distribution), got {self.temperature}")
        if self.sampler_nice > 19:
            raise ConfigError(f"rollout.sampler_nice must be in 0..19, got {self.sampler_nice}")
        if self.cache_tokens and self.cache_tokens // self.page_size < 2 + -(-self.max_new_tokens // self.page_size):
            raise ConfigError(f"rollout.cache_tokens={self.cache_tokens} cannot hold one response of max_new_tokens="
                              f"{self.max_new_tokens} and its prompt in pages of {self.page_size} (0: as much as "
                              "every slot's longest row)")
        if self.partial_rollouts and (self.batching != "continuous" or not self.max_staleness
                                      or self.sampler != "thread" or self.dtype != "float32"):
            raise ConfigError("rollout.partial_rollouts needs rollout.batching=continuous, rollout.max_staleness >= 1, "
                              "rollout.sampler=thread and rollout.dtype=float32 (the mismatch against one version's "
                              "weights is not defined for responses of two)")
        if self.sampler == "process" and not self.max_staleness:
            raise ConfigError("rollout.sampler=process needs rollout.max_staleness >= 1 (synchronous rollouts are "
                              "sampled by the trainer itself)")


@dataclasses.dataclass
class LossConfig(Section):
    """The policy loss (a name of `jodc.losses.POLICY_LOSSES`), its hyper-parameters, advantages and KL."""

    name_in_config = "loss"
    minimum = {"kl_coef": 0.0, "entropy_coeff": 0.0, "critic_vf_coef": 0.0, "critic_value_clip": 0.0,
               "critic_gamma": 0.0, "critic_lam": 0.0, "kl_in_reward_coef": 0.0, "kl_in_reward_target": 0.0,
               "kl_in_reward_horizon": 1, **{name: 0.0 for name in LOSS_OPTIONS[2:]}}
    name: LossName = "dppo"  # dppo (binary TV), dppo_kl, dppo_topk, ppo, grpo, dapo, gspo, sapo, cispo, dro, ...
    aggregation: Aggregation | None = None  # token-mean, seq-mean-token-mean, ...; null: the loss's default
    advantage: AdvantageEstimator = "grpo"  # advantage estimator (verl's names)
    normalize_std: bool = True  # divide group advantages by the group's std (false: Dr.GRPO)
    kl_coef: float = 0.0  # weight of a KL penalty to the initial policy (0: none)
    kl_estimator: KlEstimator = "k3"
    entropy_coeff: float = 0.0  # entropy bonus: the loss minus entropy_coeff x the aggregated entropy (0: none)
    kl_in_reward_coef: float = 0.0  # KL in the reward: initial beta of reward - beta x KL per token (0: none)
    kl_in_reward_estimator: KlEstimator = "kl"  # its per-token estimator (verl's default: kl = k1)
    kl_in_reward_controller: Literal["fixed", "adaptive"] = "fixed"  # beta fixed, or moved towards the target
    kl_in_reward_target: float = 0.1  # adaptive controller: target KL (verl's kl_ctrl.target_kl)
    kl_in_reward_horizon: int = 10000  # adaptive controller: horizon in samples (verl's kl_ctrl.horizon)
    critic_vf_coef: float = 0.1  # advantage gae: weight of the value loss in the shared-trunk loss (TRL's vf_coef)
    critic_value_clip: float = 0.5  # advantage gae: value clip around the rollout's values (0: off; verl's 0.5)
    critic_gamma: float = 1.0  # advantage gae: discount (verl's default 1)
    critic_lam: float = 1.0  # advantage gae: GAE lambda (verl's default 1)
    divergence: Literal["tv", "kl"] | None = None  # DPPO divergence
    approximation: Literal["binary", "topk"] | None = None  # DPPO divergence approximation
    delta_low: float | None = None  # DPPO threshold for A < 0
    delta_high: float | None = None  # DPPO threshold for A > 0
    ratio_cap: float | None = None  # DPPO ratio truncation (0: off)
    clip_low: float | None = None  # PPO-family lower clip
    clip_high: float | None = None  # PPO-family upper clip
    dual_clip: float | None = None  # dual-clip constant (0: off)
    tau_pos: float | None = None  # SAPO temperature for A > 0
    tau_neg: float | None = None  # SAPO temperature for A < 0
    eta: float | None = None  # DG temperature
    tis_cap: float | None = None  # TIS weight cap
    behaviour_weight_cap: float | None = None  # decoupled PPO weight cap (0: off)
    dro_beta: float | None = None  # DRO's quadratic penalty weight

    @property
    def critic(self) -> bool:
        """Whether the run trains a critic (the value head): `advantage: gae`."""
        return self.advantage == "gae"

    def check(self) -> None:
        if self.critic_gamma > 1 or self.critic_lam > 1:
            raise ConfigError(f"loss.critic_gamma and loss.critic_lam must be in [0, 1], got {self.critic_gamma} "
                              f"and {self.critic_lam}")
        if self.kl_in_reward_controller == "adaptive" and self.kl_in_reward_target <= 0:
            raise ConfigError("loss.kl_in_reward_controller=adaptive needs loss.kl_in_reward_target > 0, got "
                              f"{self.kl_in_reward_target}")
        if self.kl_in_reward_controller == "adaptive" and not self.kl_in_reward_coef:
            raise ConfigError("loss.kl_in_reward_controller=adaptive needs an initial loss.kl_in_reward_coef > 0 "
                              "(the controller scales it)")

    def options(self) -> dict[str, Any]:
        """The hyper-parameters that are set, as loss keyword arguments (0 -> None where that means 'off')."""
        out = {}
        for name in LOSS_OPTIONS:
            value = getattr(self, name)
            if value is not None:
                out[name] = None if (name in ZERO_MEANS_OFF and value == 0) else value
        return out


@dataclasses.dataclass
class WarmstartConfig(Section):
    """SFT on the task's solutions before RL (reusing the SFT trainer), so RL starts with a non-zero reward."""

    name_in_config = "warmstart"
    minimum = {"sft_steps": 0, "sft_examples": 1, "sft_sequences_per_minibatch": 1, "sft_learning_rate": 0.0}
    sft_steps: int = 0  # SFT steps (0: start RL from the model as configured)
    sft_examples: int = 2048  # solved problems to train on
    sft_sequences_per_minibatch: int = 32
    sft_learning_rate: float = 3e-3

    def check(self) -> None:
        if self.sft_learning_rate <= 0:
            raise ConfigError(f"warmstart.sft_learning_rate must be > 0, got {self.sft_learning_rate}")


@dataclasses.dataclass
class RlRunConfig(RunConfig):
    """The run section of RL: a step is one rollout and its optimizer updates; evaluation and blow-up counting."""

    minimum = {"steps": 1, "updates_per_step": 1, "eval_every": 0, "unstable_kl": 0.0}
    steps: int = 50  # RL steps (one rollout each)
    out_dir: str = "runs/rl"
    updates_per_step: int = 4  # optimizer updates (minibatches) per rollout
    eval_every: int = 0  # greedy accuracy on the evaluation set every N steps (0: off)
    unstable_kl: float = 0.05  # an update whose KL(behaviour || policy) exceeds this counts as a blow-up


@dataclasses.dataclass
class RLConfig(TrainingConfig):
    """The RL job: the shared sections (with RL's defaults) and the RL sections."""

    task: TaskConfig = defaults(TaskConfig)
    rollout: RolloutConfig = defaults(RolloutConfig)
    loss: LossConfig = defaults(LossConfig)
    warmstart: WarmstartConfig = defaults(WarmstartConfig)
    # What a checkpoint means: resuming with other values would silently continue a different run (another
    # model, task, reward, warm start, prompt stream or rollout shape). Where the sampler computes (thread or
    # process, its priority) and how processes assemble the minibatches do not change a step, so they may change.
    RESUME_KEYS = ("model", "task", "warmstart", *(f"rollout.{f.name}" for f in dataclasses.fields(RolloutConfig)
                                                   if f.name not in ("sampler", "sampler_nice", "assembly")),
                   "run.seed", "run.updates_per_step")
    # The shared sections with RL's defaults: a small constant learning rate (total_steps: null = the run's
    # optimizer updates, run.steps x run.updates_per_step), 2 devices and a 256-token buffer (>= the longest prompt +
    # response), checkpoints every 10 steps.
    optimizer: OptimizerConfig = defaults(OptimizerConfig, learning_rate=1e-4, schedule="constant", warmup_steps=0)
    engine: EngineConfig = defaults(EngineConfig, devices=2, token_cap=256)
    run: RlRunConfig = defaults(RlRunConfig)
    checkpoint: CheckpointConfig = defaults(CheckpointConfig, save_every=10, keep_checkpoints=2)

    @property
    def optimizer_updates(self) -> int:
        """The run's length in optimizer updates: run.steps x run.updates_per_step."""
        return self.run.steps * self.run.updates_per_step

    def check(self) -> None:
        e = self.engine
        if self.run.updates_per_step > self.rollout.rollout_size:
            raise ConfigError(f"run.updates_per_step={self.run.updates_per_step} exceeds the rollout's "
                              f"{self.rollout.rollout_size} responses (rollout.prompts_per_step x rollout.group_size)")
        if self.loss.critic and self.rollout.max_staleness:
            raise ConfigError("loss.advantage=gae (critic PPO) runs with synchronous rollouts only "
                              "(rollout.max_staleness: 0): the rollout's values come from the trainer's weights")
        unsupported = ["engine.length_buckets" if e.length_buckets is not None else "",
                       "engine.token_cap=null" if e.token_cap is None else "",
                       "logging.timeline_every" if self.logging.timeline_every else ""]
        if any(unsupported):
            raise ConfigError(f"the RL trainer does not support {', '.join(u for u in unsupported if u)} (token_cap "
                              "is the microbatch buffer; no timelines)")


def load_rl_config(path: str | None = None, overrides: Sequence[str] = ()) -> RLConfig:
    """Defaults, then the YAML file at `path` (if any), then `overrides`; checked."""
    return load(RLConfig, path, overrides)
