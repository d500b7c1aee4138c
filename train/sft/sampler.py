"""Which examples form minibatch k: a pure function of (seed, k), so a resumed run sees exactly the same data.

The example order is a fresh seeded permutation per epoch; minibatch k takes positions k*B .. k*B + B - 1 of the
concatenated epochs (a minibatch may straddle two epochs). Nothing is consumed or buffered, so the sampler's
whole state is the next minibatch index, which checkpoints store along with a description of the dataset it
was made for, to refuse resuming on other data.
"""
from __future__ import annotations

import numpy as np


class MinibatchSampler:
    """Deterministic minibatches of `minibatch_size` example indices out of `num_examples`."""

    def __init__(self, num_examples: int, minibatch_size: int, seed: int = 0):
        if num_examples < 1:
            raise ValueError(f"the sampler needs at least one example, got {num_examples}")
        if minibatch_size < 1:
            raise ValueError(f"minibatch_size must be >= 1, got {minibatch_size}")
        self.num_examples = int(num_examples)
        self.minibatch_size = int(minibatch_size)
        self.seed = int(seed)
        self._epoch_cache: dict[int, np.ndarray] = {}

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of example indices used in `epoch`."""
        order = self._epoch_cache.get(epoch)
        if order is None:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            self._epoch_cache = {epoch: order}  # minibatches are read in order: one epoch kept is enough
        return order

    def minibatch(self, index: int) -> np.ndarray:
        """Example indices (int64 [minibatch_size]) of minibatch `index` (0-based)."""
        if index < 0:
            raise ValueError(f"minibatch index must be >= 0, got {index}")
        start = index * self.minibatch_size
        positions = np.arange(start, start + self.minibatch_size)
        out = np.empty(self.minibatch_size, np.int64)
        for epoch in np.unique(positions // self.num_examples):
            here = positions // self.num_examples == epoch
            out[here] = self.epoch_order(int(epoch))[positions[here] % self.num_examples]
        return out

    def state_dict(self, next_minibatch: int) -> dict:
        """What a checkpoint stores: the next minibatch index and the sampler's identity."""
        return {"next_minibatch": int(next_minibatch), "seed": self.seed, "num_examples": self.num_examples,
                "minibatch_size": self.minibatch_size}

    def check_state(self, state: dict) -> int:
        """Validates a saved state against this sampler; returns the next minibatch index to read."""
        for key in ("seed", "num_examples", "minibatch_size"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"the checkpoint's data sampler had {key}={state.get(key)}, this run has "
                                 f"{getattr(self, key)}: the data changed, so resuming would not continue the run")
        return int(state["next_minibatch"])
