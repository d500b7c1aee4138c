"""The engine core: what every FSDP engine offers (one minibatch step, the current parameters, state for
checkpoints, declared capabilities) and the two pieces every engine's compiled step is made of, written once here:
the microbatch loop (`microbatch_loop`) and the optimizer update (`update_step`). An engine supplies only what is
its own: how a microbatch's forward and backward reach the parameters (gather / push, collectives, a plain
`jax.grad`) and where the gradients come from before the update (accumulated in the loop, or read from the heap).
"""
from __future__ import annotations

import abc
import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jodc.fsdp import sharding, timeline
from jodc.fsdp.batch import MinibatchArrays
from jodc.fsdp.optim import OptimizerConfig, guarded_update, learning_rate_schedule, make_optimizer, squared_norm
from jodc.fsdp.sharding import SHARD_AXIS, MeshLayout
from jodc.fsdp.stages import StagedModel
from jodc.fsdp.state import GroupSource, from_host_canonical, host_copy, to_host_canonical
from jodc.fsdp.timeline import TimelineRecorder


@dataclasses.dataclass
class StepResult:
    loss: float              # minibatch mean loss (sum over devices and microbatches of normalised losses)
    grad_norm: float         # global gradient norm before clipping
    seconds: float           # wall time of the step, dispatch to result
    microbatches: list[int]  # microbatches each device ran
    timeline: list[dict] | None = None  # per-device busy / wait events (see jodc.fsdp.timeline), when recorded
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # the model's metrics, summed over
    # every microbatch of every device (StagedModel.metric_names)
    applied: bool = True     # False: the loss, the grad norm or an updated parameter was not finite, and the
    # engine kept its previous parameters and optimizer state (see `NonFiniteStepError`)


class NonFiniteStepError(FloatingPointError):
    """A step whose loss, global grad norm or updated parameters were not finite (NaN or inf on any device). The
    step was not applied: the engine still holds the parameters and optimizer state from before it, so it may go
    on with other data. `result` is the step's StepResult (`applied=False`)."""

    def __init__(self, result: StepResult, step: int):
        self.result = result
        super().__init__(f"step {step} was not applied: {nonfinite_cause(result)}; the parameters and optimizer "
                         "state are those from before it")


def nonfinite_cause(result: StepResult) -> str:
    """What was not finite in a step that was not applied: 'non-finite loss (loss nan, global grad norm nan)'."""
    what = "loss" if not np.isfinite(result.loss) else "gradients or updated parameters"
    return f"non-finite {what} (loss {result.loss}, global grad norm {result.grad_norm})"


class Engine(abc.ABC):
    """A data-parallel trainer for a `StagedModel`: parameters sharded over `mesh` axis 'd' (fp32 masters),
    compute in `compute_dtype`, AdamW with global-norm clipping. `step` dispatches exactly one minibatch and waits
    for it (never more than one in flight: a blocking barrier must not face queued launches)."""

    # Facts: what the engine is, read by trainers and the trainer's config instead of engine names. Every engine
    # class states each of them in its own body (a class that does not cannot be defined: `__init_subclass__`).
    name: str  # the registry name (`jodc.fsdp.ENGINES`, config `engine.name`)
    lockstep: bool  # every device runs max(counts) microbatches (feed it lock-step plans); else its own count, and a
    # plan's empty microbatches are dropped before the step
    supports_timeline: bool  # `step(record_timeline=True)` records per-device busy / wait events
    default_planner: str  # the planner used when the config names none (a `jodc.balance` planner name)
    supports_deterministic: bool  # gradient accumulation can be made (or always is) bit-for-bit reproducible
    FACTS = ("name", "lockstep", "supports_timeline", "default_planner", "supports_deterministic")
    # runs minibatches with context-parallel groups (`jodc.balance.CPPlan`, `MinibatchArrays.has_context_parallel`);
    # an engine without it refuses them (and the config refuses `engine.context_parallel` for it)
    supports_context_parallel: bool = False
    # the keyword options of the constructor beyond the shape every engine shares, `(model, groups, mesh, *,
    # optimizer, compute_dtype, length_buckets, **options)`
    options: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs):
        """Refuses an engine class that lacks one of `FACTS`: stated in its body, or inherited from the engine class
        it extends (a test's variant of an engine is that engine)."""
        super().__init_subclass__(**kwargs)
        missing = [f for f in cls.FACTS if not hasattr(cls, f)]
        if missing:
            raise TypeError(f"engine class {cls.__name__} must state its facts {missing} in its body")

    def __init__(self, model: StagedModel, groups: dict[str, Any], *, optimizer: OptimizerConfig,
                 compute_dtype=jnp.float32, length_buckets=None):
        missing = [] if isinstance(groups, GroupSource) else [g for g in model.group_names if g not in groups]
        if missing:
            raise ValueError(f"initial parameters lack groups {missing}")
        self.model = model
        self.optimizer = optimizer
        self.compute_dtype = jnp.dtype(compute_dtype)
        if self.compute_dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise ValueError(f"compute_dtype must be float32 or bfloat16, got {self.compute_dtype}")
        self.steps_done = 0
        self._recorder: TimelineRecorder | None = None
        if length_buckets is not None:
            length_buckets = tuple(sorted({int(b) for b in length_buckets}))
            if not length_buckets or length_buckets[0] < 1:
                raise ValueError(f"length_buckets must be positive token counts, got {length_buckets}")
        self.length_buckets = length_buckets
        self.lr_schedule = learning_rate_schedule(optimizer)  # the one schedule: the optimizer's, and what it reports
        self.tx = make_optimizer(optimizer, self.lr_schedule)
        self._compiled: dict[Any, Any] = {}
        self.numels = {g: model.layouts[g].numel for g in model.group_names}  # each group's unpadded size

    def _place_state(self, flats: dict[str, Any], param_sharding, opt_sharding) -> None:
        """Places the parameters (`param_sharding`) and a fresh optimizer state (`opt_sharding`, made on device)
        exactly as `_jit_step`'s program returns them: a state placed otherwise (e.g. an uncommitted optimizer
        count) would make the second step of every shape compile the whole program again. The shardings may be
        pytree prefixes (one sharding for every leaf)."""
        self._state_shardings = (param_sharding, opt_sharding)
        self.flats = jax.device_put(flats, param_sharding)
        self.opt_state = jax.jit(self.tx.init, out_shardings=opt_sharding)(self.flats)

    def _jit_step(self, fn: Callable, scalar_sharding) -> Callable:
        """`fn(flats, opt_state, ...) -> (flats, opt_state, loss, norm, metrics, applied)` compiled with the state
        donated and returned with the shardings `_place_state` gave it (the rest on `scalar_sharding`), so a
        minibatch shape compiles once."""
        return jax.jit(fn, donate_argnums=(0, 1), out_shardings=(*self._state_shardings, *[scalar_sharding] * 4))

    def _cached(self, key, build: Callable[[], Any]):
        """The compiled step for `key` (shapes, lengths, timeline or not), built once by `build()`."""
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compiled[key] = build()
        return fn

    def bucket_lengths(self, token_cap: int) -> tuple[int, ...]:
        """The static lengths a microbatch runs at: the configured buckets below `token_cap`, then `token_cap`.

        A microbatch holds its sequences from position 0, so running only its first L tokens (L >= its token
        count) changes nothing but the cost: with buckets, a short microbatch costs what it holds, not T. Bucket
        lengths must suit the model (e.g. multiples of the attention block size)."""
        short = [b for b in (self.length_buckets or ()) if b < token_cap]
        return tuple(short) + (token_cap,)

    def bucket_indices(self, batch: MinibatchArrays) -> np.ndarray:
        """int32 [D, M]: for every microbatch, the smallest bucket that holds its tokens."""
        lengths = np.asarray(self.bucket_lengths(batch.token_cap))
        used = batch.tokens_per_microbatch()  # every device's, also across processes (placeholder rows)
        return np.searchsorted(lengths, used, side="left").astype(np.int32)

    @abc.abstractmethod
    def _run(self, batch: MinibatchArrays, recorder: TimelineRecorder | None) -> tuple[Any, Any, Any, Any]:
        """Dispatches one minibatch; returns device arrays (loss, grad_norm, {metric: sum}, applied), the update
        made by `optim.guarded_update` (applied only when finite)."""

    def step(self, batch: MinibatchArrays, *, record_timeline: bool = False,
             skip_nonfinite: bool = False) -> StepResult:
        """Runs one minibatch and waits for it. With `record_timeline`, host callbacks mark every stage of every
        microbatch on every device (a separately compiled, slightly slower step).

        A step whose loss, global grad norm or updated parameters are not finite is not applied (the engine keeps
        its previous state, selected on device) and raises `NonFiniteStepError`, or, with `skip_nonfinite`,
        returns its result with `applied=False`. `steps_done` counts applied steps (optax's step count)."""
        self._check_batch(batch)
        self._check_context_parallel(batch)
        if record_timeline and not self.supports_timeline:
            raise ValueError(f"the {self.name} engine cannot record timelines (supports_timeline is False); check "
                             "`engine.supports_timeline` before asking for one")
        recorder = None
        if record_timeline:
            if self._recorder is None:
                self._recorder = TimelineRecorder([st.name for st in self.model.stages])
            recorder = self._recorder
            recorder.reset()
        t0 = time.perf_counter()
        loss, norm, metrics, applied = self._wait(self._run(batch, recorder))
        seconds = time.perf_counter() - t0
        applied = bool(sharding.first_value(applied))
        result = StepResult(sharding.first_value(loss), sharding.first_value(norm), seconds,
                            [int(c) for c in batch.counts], recorder.events() if recorder else None,
                            {k: sharding.first_value(v) for k, v in metrics.items()}, applied)
        if not applied:
            if skip_nonfinite:
                return result
            raise NonFiniteStepError(result, self.steps_done + 1)
        self.steps_done += 1
        return result

    def _wait(self, outputs):
        """Blocks until a dispatched step's outputs are ready (engines with a heap fail fast when a device fails)."""
        return jax.block_until_ready(outputs)

    def _check_batch(self, batch: MinibatchArrays) -> None:
        if batch.num_devices != self.num_devices:
            raise ValueError(f"{self.name} engine runs on {self.num_devices} devices, the minibatch was planned "
                             f"for {batch.num_devices}")

    def _check_context_parallel(self, batch: MinibatchArrays) -> None:
        if batch.has_context_parallel and not self.supports_context_parallel:
            raise ValueError(f"the minibatch splits sequences over context-parallel groups; the {self.name} engine "
                             "does not run them (supports_context_parallel is False: use the odc engine)")

    @property
    @abc.abstractmethod
    def num_devices(self) -> int: ...

    @property
    def learning_rate(self) -> float:
        """The learning rate the schedule gives after `steps_done` applied updates: the rate of the next update (the
        optimizer counts applied updates too), which the trainers log with each step."""
        return float(self.lr_schedule(self.steps_done))

    # -- state -------------------------------------------------------------------------------------------------
    # The canonical form (jodc.fsdp.state): {"params": {group: 1-D fp32, the group's flat vector then zeros},
    # "opt_state": the optax tree, group leaves likewise, the step count a scalar}, as jax.Arrays split over the mesh
    # ('d'; replicated over HSDP replica groups). An engine maps its own layout to it without moving data.

    @abc.abstractmethod
    def _canonical(self) -> dict[str, Any]:
        """The engine's state in canonical form (the engine's own device buffers, no copy)."""

    @abc.abstractmethod
    def _targets(self) -> dict[str, Any]:
        """`jax.ShapeDtypeStruct`s (shape, dtype, sharding) of `_canonical()`: what a checkpoint restores into."""

    @abc.abstractmethod
    def _load_canonical(self, state: dict[str, Any]) -> None:
        """Takes `state` (arrays shaped and placed as `_targets()`) as the engine's state."""

    def sharded_params(self) -> dict[str, jax.Array]:
        """The fp32 master parameters, per group a 1-D vector (its flat parameters in layout order, then zeros:
        cut at `numels[group]`) split over the engine's devices. The engine's own buffers: nothing is copied or
        gathered. `model.layouts[g].unflatten(v[:numels[g]])` gives a group's pytree."""
        return self._canonical()["params"]

    def sharded_state(self) -> dict[str, Any]:
        """Everything a checkpoint needs but the step count, in canonical form (see above), without a copy: orbax
        saves it as it is, each process writing the shards of its own devices once."""
        return self._canonical()

    def state_targets(self) -> dict[str, Any]:
        """Shapes, dtypes and shardings of `sharded_state()` in this engine's layout: a restore reads into them (any
        checkpoint whose group vectors hold the same numels, whatever layout wrote it: the zero tails differ)."""
        return self._targets()

    def load_sharded_state(self, state: dict[str, Any], steps_done: int) -> None:
        """Takes a canonical `state` shaped and placed as `state_targets()` (e.g. restored by orbax) as the engine's
        parameters and optimizer state; `steps_done` applied updates so far. ValueError when a leaf's shape or
        placement differs."""
        targets = self._targets()
        if jax.tree.structure(state) != jax.tree.structure(targets):
            raise ValueError(f"the {self.name} engine's state has the structure {jax.tree.structure(targets)}, got "
                             f"{jax.tree.structure(state)}")
        for (path, x), t in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(targets)):
            if x.shape != t.shape or x.dtype != t.dtype or not x.sharding.is_equivalent_to(t.sharding, x.ndim):
                raise ValueError(f"state leaf {jax.tree_util.keystr(path)}: {x.dtype}{list(x.shape)} on {x.sharding}, "
                                 f"the {self.name} engine needs {t.dtype}{list(t.shape)} on {t.sharding}")
        self._load_canonical(state)
        self.steps_done = int(steps_done)

    def drop_state(self) -> None:
        """Frees the device buffers of the parameters and optimizer state before a restore replaces them, so the
        restored state never lies beside the state it replaces (a resume peaks at the steady state, not twice it).
        Take `state_targets()` first; until `load_sharded_state` the engine cannot step."""
        for x in jax.tree.leaves(self._canonical()):
            x.delete()

    def nonfinite_groups(self) -> list[str]:
        """The parameter groups holding a NaN or an infinity, checked on the devices (one boolean per group comes
        back). Across processes every process must call it (a collective)."""
        flags = _all_finite(self.sharded_params())
        return sorted(g for g, ok in flags.items() if not sharding.first_value(ok))

    def group_to_host(self, group: str) -> np.ndarray:
        """One group's fp32 master parameters, flat (its numel), gathered to this host: a collective across
        processes (every process calls it for the same groups in the same order). One group at a time is what an
        export holds."""
        return host_copy(self.sharded_params()[group])[: self.numels[group]]

    def flat_params(self) -> dict[str, np.ndarray]:
        """Every group's fp32 master parameters on the host (`group_to_host`): the whole model in this process. For
        tests and small models; training, checkpoints and exports never call it."""
        return {g: self.group_to_host(g) for g in self.model.group_names}

    def params(self) -> dict[str, Any]:
        """Current parameters as the model's group pytrees (fp32, host; the whole model: see `flat_params`)."""
        return {g: jax.tree.map(np.asarray, self.model.layouts[g].unflatten(jnp.asarray(v)))
                for g, v in self.flat_params().items()}

    def state_dict(self) -> dict[str, Any]:
        """The canonical state on the host, group vectors cut to their numels, with the step count: the whole model
        and optimizer state in this process (tests, small models; checkpoints save `sharded_state()` instead)."""
        return {**to_host_canonical(self.sharded_state(), self.numels), "step": self.steps_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `state_dict` (any engine's, any layout's: group vectors of their numel or zero-padded)."""
        targets = self._targets()
        loaded = jax.tree.unflatten(jax.tree.structure(targets),
                                    jax.tree.leaves({k: v for k, v in state.items() if k != "step"}))
        self.load_sharded_state(from_host_canonical(loaded, targets, self.numels), int(state["step"]))

    def close(self) -> None:
        """Releases native resources (ODC heap); the engine is unusable afterwards."""


@jax.jit
def _all_finite(params):
    return {g: jnp.all(jnp.isfinite(v)) for g, v in params.items()}


# -- the pieces of a compiled step -------------------------------------------------------------------------------

def scalar_zero(axis: str | None = None) -> jax.Array:
    """fp32 0, typed as varying over `axis` inside shard_map (a per-device loop carry)."""
    zero = jnp.zeros((), jnp.float32)
    return zero if axis is None else lax.pcast(zero, axis, to="varying")


def microbatch_loop(run: Callable, arrays: dict, count, state, *, normalizer, lengths: tuple[int, ...], bucket,
                    metric_names: tuple[str, ...], axis: str | None = None,
                    recorder: TimelineRecorder | None = None):
    """Runs microbatches 0 .. `count` - 1 (a static or a per-device traced count) and sums their losses and metrics.

    `arrays` hold every per-token field as [M, B, T, ...] (microbatch, rows, tokens); microbatch i is row block
    ``arrays[i]`` cut to its static length ``lengths[bucket[i]]`` (one compiled branch per length, `lax.switch`
    between them; no switch with one length), with the minibatch's `normalizer` added. ``run(microbatch, i, state)
    -> (loss, {metric: value}, state)`` does its forward and backward; `state` is what the engine carries from one
    microbatch to the next (summed gradients, an ordering token). With `recorder`, marks the start and end of every
    microbatch (for engines whose first stage has no backward probe). Returns (loss sum, metric sums, state)."""

    def one(length, full, i, state):
        microbatch = {k: v[:, :length] for k, v in full.items()}
        microbatch["normalizer"] = normalizer
        return run(microbatch, i, state)

    def body(i, carry):
        state, loss_sum, metric_sums = carry
        if recorder is not None:
            loss_sum = recorder.mark(loss_sum, i, timeline.MICROBATCH_START)
        full = {k: lax.dynamic_index_in_dim(v, i, keepdims=False) for k, v in arrays.items()}
        if len(lengths) == 1:
            loss, metrics, state = one(lengths[0], full, i, state)
        else:
            branches = [functools.partial(one, length) for length in lengths]
            loss, metrics, state = lax.switch(bucket[i], branches, full, i, state)
        if recorder is not None:
            state = recorder.mark(state, i, timeline.MICROBATCH_END)
        metric_sums = {k: metric_sums[k] + metrics[k] for k in metric_sums}
        return state, loss_sum + loss.astype(jnp.float32), metric_sums

    init = (state, scalar_zero(axis), {m: scalar_zero(axis) for m in metric_names})
    state, loss_sum, metric_sums = lax.fori_loop(0, count, body, init)
    return loss_sum, metric_sums, state


def accumulate(grad_fn: Callable) -> Callable:
    """A `microbatch_loop` step for engines that sum gradients locally: ``grad_fn(microbatch, i)`` returns
    ((loss, metrics), grads); the carried state is the running gradient sum."""

    def run(microbatch, i, grads):
        (loss, metrics), g = grad_fn(microbatch, i)
        return loss, metrics, optax.tree_utils.tree_add(grads, g)

    return run


def device_sum(tree, axis):
    """Every leaf of `tree` summed over the devices of `axis` (a mesh axis or a tuple of them, inside shard_map), added
    in device order: the same bits whether the devices sit in one process or several. A psum adds in its collective's
    own order, and the in-process all-reduce and the cross-process one differ (in the last bit on jax 0.11.2), which
    would break the deterministic ODC engine's bit-for-bit equality between one process driving every device and
    several processes. The leaves here are scalars (a squared norm, the loss, metrics), so gathering them costs
    nothing."""
    return jax.tree.map(lambda x: jnp.sum(lax.all_gather(x, axis), axis=0), tree)


def replica_sum(tree, axis: str, *, ordered: bool = False):
    """HSDP's cross-replica reduce: every leaf (a device's gradient shard) summed over the replica groups along
    `axis`, inside shard_map. `ordered`: added in replica order from an all-gather (`device_sum`; replicas x the
    shard's memory for a moment), so the bits do not depend on how the replicas are spread over processes; else one
    psum (in-process all-reduce on CPU, gloo across processes, NCCL on GPUs)."""
    if ordered:
        return device_sum(tree, axis)
    return lax.psum(tree, axis)


def update_step(tx: optax.GradientTransformation, cfg: OptimizerConfig, grads, params, opt_state, loss_sum,
                metric_sums, *, layout: MeshLayout | None = None):
    """The optimizer update every engine ends its step with, on whole parameters (`layout` None) or on this device's
    shards inside shard_map over `layout`'s mesh (flat: the squared gradient norm, the loss and the metrics are
    summed over the devices in device order, `device_sum`, so clipping sees the global norm). On an HSDP mesh
    (`layout.hsdp`) `grads` are this device's shard already summed over the replicas: every replica group holds the
    whole gradient once, so its squared norm is summed over the shard axis ('d') only, and the loss and metrics over
    every device. Non-finite steps are not applied (`optim.guarded_update`). Returns (params, opt_state, loss,
    grad_norm, metrics, applied)."""
    reduce = (lambda x: x) if layout is None else functools.partial(device_sum, axis=layout.axes)
    if layout is not None and layout.hsdp:
        global_sq, loss = device_sum(squared_norm(grads), SHARD_AXIS), reduce(loss_sum)
    else:  # flat (or no) sharding: norm and loss in one gather
        global_sq, loss = reduce((squared_norm(grads), loss_sum))
    params, opt_state, norm, applied = guarded_update(tx, cfg, grads, params, opt_state, global_sq_norm=global_sq,
                                                      loss=loss, all_reduce=reduce)
    return params, opt_state, loss, norm, reduce(metric_sums), applied
