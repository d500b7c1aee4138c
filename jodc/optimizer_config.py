"""The optimizer's hyper-parameters (`OptimizerConfig`), on their own and free of JAX imports, so that the trainer's
config (`train/core/config.py`, whose `optimizer` section is this class with the trainer's defaults) and its CLI
can check them before JAX loads. The optimizer itself is `jodc.fsdp.optim`."""
from __future__ import annotations

import dataclasses
import math
from typing import Literal

Schedule = Literal["constant", "cosine", "linear"]


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW hyper-parameters. `schedule` is 'constant', 'cosine' or 'linear' (decay to 0 over `total_steps`),
    after `warmup_steps` of linear warm-up. `max_grad_norm=None` disables clipping. Weight decay applies to every
    parameter (buckets are flat; use 0 to keep norms and biases undecayed)."""

    learning_rate: float = 1e-4
    schedule: Schedule = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0

    def __post_init__(self):
        self.check()
        if self.schedule != "constant" and not self.total_steps:
            raise ValueError(f"optimizer.schedule={self.schedule!r} needs optimizer.total_steps")

    def check(self) -> None:
        """ValueError naming the first hyper-parameter out of range (the schedule's length aside: a trainer config
        may leave it to the run's length)."""
        for name in ("learning_rate", "b1", "b2", "eps", "weight_decay", "max_grad_norm"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"optimizer.{name} must be a finite number, got {value}")
        if not self.learning_rate > 0:
            raise ValueError(f"optimizer.learning_rate must be > 0, got {self.learning_rate}")
        if self.eps < 0 or self.weight_decay < 0:
            raise ValueError(f"optimizer.eps and optimizer.weight_decay must be >= 0, got {self.eps} and "
                             f"{self.weight_decay}")
        if self.schedule not in ("constant", "cosine", "linear"):
            raise ValueError(f"optimizer.schedule must be constant, cosine or linear, got {self.schedule!r}")
        if self.warmup_steps < 0 or (self.total_steps is not None and self.total_steps < 1):
            raise ValueError(f"optimizer.warmup_steps must be >= 0 and optimizer.total_steps >= 1 or null, got "
                             f"{self.warmup_steps} and {self.total_steps}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"optimizer.max_grad_norm must be > 0 or null (None: no clipping), got "
                             f"{self.max_grad_norm}")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ValueError(f"optimizer.b1 and optimizer.b2 must lie in [0, 1), got {self.b1} and {self.b2}")
