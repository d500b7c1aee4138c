"""Checkpoints of a training run (orbax). (The final Hugging Face export streams group by group: export.py.)

A checkpoint is one orbax step directory `out_dir/checkpoints/<step>/` with two items:

* `engine`: the engine's canonical state (`Engine.sharded_state()`: per parameter group a flat fp32 vector of the
  parameters and of each Adam moment, followed by the writing layout's zero padding, and optax's step count),
  saved as the sharded `jax.Array`s it is: every process writes its own devices' shards, once per HSDP replica group,
  into one OCDBT store. A restore reads into the current engine's layout (`Engine.state_targets()`): each process
  reads only the byte ranges its devices own, and the zero tail is padded or cut to this layout's padding, so any
  device count, process count, flat or HSDP mesh, or engine kind restores any checkpoint bit for bit. Checkpoints
  written before sharded saves (one unpadded host vector per group, written by process 0) are the same tree with
  no padding: they load the same way.
* `trainer`: JSON with the step, the data sampler's position, the config, the groups' sizes (`group_numels`: what a
  restore checks the vectors against) and a few numbers for humans.

Orbax writes each step into a temporary directory and renames it into place only when complete, so a crash
while saving leaves the previous checkpoints intact and the half-written one is never taken for a checkpoint
(it is removed the next time a manager opens the directory). Only the `keep` most recent steps are kept.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from .interrupts import interrupts_held


ENGINE_ITEM, TRAINER_ITEM = "engine", "trainer"
NUMELS_KEY = "group_numels"
MIN_WRITE_BUFFER_BYTES = 64 << 20  # the least array data a save encodes at once (CheckpointStore._fit_write_buffer)  # the trainer item's record of each parameter group's size


def _preservation_options(keep: int) -> dict:
    """Keep-the-latest-N option for this orbax version (`preservation_policy` from 0.11.2 on, else max_to_keep)."""
    policies = getattr(ocp, "checkpoint_managers", None)
    if policies is not None and hasattr(policies, "LatestN"):
        return {"preservation_policy": policies.LatestN(keep)}
    return {"max_to_keep": keep}


class CheckpointStore:
    """Saves and restores a run's checkpoints in `directory`, keeping the `keep` most recent."""

    def __init__(self, directory: str, keep: int):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = os.path.abspath(directory)
        self._options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False,
                                                     cleanup_tmp_directories=True, **_preservation_options(keep))
        self.write_buffer_bytes = 0
        self.manager = self._open(MIN_WRITE_BUFFER_BYTES)

    def _open(self, write_buffer_bytes: int):
        """The orbax manager, its handlers registered up front (so metadata can be read before any save), writing at
        most `write_buffer_bytes` of array data at once."""
        handler = ocp.StandardCheckpointHandler(save_concurrent_gb=write_buffer_bytes / 1e9)
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add(ENGINE_ITEM, ocp.args.StandardSave, handler)
        registry.add(ENGINE_ITEM, ocp.args.StandardRestore, handler)
        json_handler = ocp.JsonCheckpointHandler()
        registry.add(TRAINER_ITEM, ocp.args.JsonSave, json_handler)
        registry.add(TRAINER_ITEM, ocp.args.JsonRestore, json_handler)
        manager = ocp.CheckpointManager(self.directory, options=self._options, handler_registry=registry)
        self.manager, self.write_buffer_bytes = manager, write_buffer_bytes
        self._await_tmp_cleanup()
        return manager

    def _fit_write_buffer(self, state) -> None:
        """Sizes the write buffer for `state`: tensorstore encodes every array fragment it writes into a buffer of
        the fragment's size, and unbounded it encodes them all at once, a copy of this process's whole state
        (measured: 1.6x the steady memory during a save). Bounded to twice the largest fragment (a device's shard of
        one group vector; orbax refuses a fragment larger than the bound) and at least MIN_WRITE_BUFFER_BYTES, the
        writes still run in parallel, and a save stays within a few percent of the steady memory at real sizes."""
        largest = max((max(s.data.nbytes for s in x.addressable_shards) if isinstance(x, jax.Array)
                       else np.asarray(x).nbytes for x in jax.tree.leaves(state)), default=0)
        need = max(MIN_WRITE_BUFFER_BYTES, 2 * largest + 1)
        if need > self.write_buffer_bytes:
            self.manager.close()
            self._open(need)

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints present, ascending."""
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, engine_state: dict[str, Any], trainer_state: dict[str, Any]) -> str:
        """Writes checkpoint `step` (replacing nothing: a step that already exists is an error) and returns its
        directory. `engine_state` is `Engine.sharded_state()` (sharded `jax.Array`s, saved without a host copy of the
        whole; host arrays are accepted too); `trainer_state` must be JSON-serialisable. Every process calls it.
        A Ctrl-C during the save is held back until the checkpoint is complete (interrupts.py)."""
        if step in self.manager.all_steps():
            raise ValueError(f"checkpoint step {step} already exists in {self.directory}")
        state = _without_step(engine_state)
        with interrupts_held(f"the checkpoint of step {step}"):  # Ctrl-C raises once it is complete
            self._fit_write_buffer(state)
            saved = self.manager.save(step, args=ocp.args.Composite(**{
                ENGINE_ITEM: ocp.args.StandardSave(state),
                TRAINER_ITEM: ocp.args.JsonSave({**trainer_state, "step": int(step)}),
            }), force=True)
            self.manager.wait_until_finished()
        if not saved:
            raise RuntimeError(f"orbax declined to save checkpoint step {step} in {self.directory}")
        return self.step_dir(step)

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def read_trainer_state(self, step: int) -> dict[str, Any]:
        """The JSON item of checkpoint `step` (cheap: no arrays are read)."""
        restored = self.manager.restore(step, args=ocp.args.Composite(**{TRAINER_ITEM: ocp.args.JsonRestore()}))
        return dict(restored[TRAINER_ITEM])

    def resumable_step(self, resume: bool, mismatches, *, written_for: str = "another run") -> int | None:
        """The latest checkpoint's step when a run may resume from it (None without checkpoints). Refuses when
        `resume` is false, or when `mismatches(saved_config) -> [reasons]` finds the checkpoint was written for
        another run; cheap (no arrays are read), so it runs before anything expensive is built."""
        latest = self.latest_step()
        if latest is None:
            return None
        if not resume:
            raise RuntimeError(f"{self.directory} already holds checkpoints (steps {self.steps()}) and "
                               "checkpoint.resume is false: choose another run.out_dir, or resume")
        reasons = mismatches(self.read_trainer_state(latest).get("config", {}))
        if reasons:
            raise RuntimeError(f"the checkpoint at {self.step_dir(latest)} was written for {written_for} "
                               f"({'; '.join(reasons)}); use another run.out_dir for a new run")
        return latest

    def restore(self, step: int, targets: dict[str, Any], numels: dict[str, int] | None = None
                ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(engine state, trainer state) of checkpoint `step`, the engine state's "step" set to the trainer's.

        `targets`: the tree to restore into, `Engine.state_targets()` (`jax.ShapeDtypeStruct`s with shardings: each
        process reads only its devices' byte ranges, any layout's padding is padded or cut to this one's) or host
        arrays (restored as numpy, shapes exact). `numels`: each parameter group's size; with it, every vector under
        a group must hold that many elements (a checkpoint of another model is refused before anything is read)."""
        template = _without_step(targets)
        trainer_state = self.read_trainer_state(step)
        sharded = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(template))
        if numels is not None:
            self._check_sizes(step, template, numels, trainer_state)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**{
                ENGINE_ITEM: ocp.args.StandardRestore(template, strict=not sharded),
            }))
        except (ValueError, KeyError) as e:
            raise ValueError(f"checkpoint {self.step_dir(step)} does not match this model and optimizer: {e}"
                             ) from None
        engine_state = dict(restored[ENGINE_ITEM])
        _check_shapes(engine_state, template, self.step_dir(step))
        engine_state["step"] = int(trainer_state["step"])
        return engine_state, trainer_state

    def check_restorable(self, step: int, targets: dict[str, Any], numels: dict[str, int]) -> None:
        """Raises the ValueError `restore` would raise for another model's checkpoint, reading only metadata."""
        self._check_sizes(step, _without_step(targets), numels, self.read_trainer_state(step))

    def saved_shapes(self, step: int) -> dict[tuple[str, ...], tuple[int, ...]]:
        """The shapes of checkpoint `step`'s engine arrays as written, by key path (nothing but the metadata is
        read)."""
        metadata = self.manager.item_metadata(step)[ENGINE_ITEM]
        return _shapes_by_path(metadata, is_leaf=lambda m: hasattr(m, "shape"))

    def _check_sizes(self, step: int, template, numels: dict[str, int], trainer_state: dict[str, Any]) -> None:
        """Refuses checkpoint `step` when its tree or its groups' sizes are not this model's: the sizes it records
        (`group_numels`), or, for a checkpoint written before they were recorded, the vectors' own lengths (then
        unpadded)."""
        where = self.step_dir(step)
        recorded = trainer_state.get(NUMELS_KEY)
        if recorded is not None and dict(recorded) != dict(numels):
            differ = sorted(g for g in set(recorded) | set(numels) if recorded.get(g) != numels.get(g))
            raise ValueError(f"checkpoint {where} holds parameter groups of other sizes than this model's (groups "
                             f"{differ}: {[recorded.get(g) for g in differ]} saved, {[numels.get(g) for g in differ]} "
                             "here): it was written for another model")
        saved, wanted = self.saved_shapes(step), _shapes_by_path(template)
        if set(saved) != set(wanted):
            odd = sorted("/".join(p) for p in set(saved) ^ set(wanted))[:4]
            raise ValueError(f"checkpoint {where} does not match this model and optimizer: it holds {len(saved)} "
                             f"arrays, this engine {len(wanted)} (differing: {odd})")
        for path, shape in saved.items():
            g = next((k for k in path if k in numels), None)
            if g is None:
                if shape != wanted[path]:
                    raise ValueError(f"checkpoint {where} holds {'/'.join(path)} of shape {shape}, this engine "
                                     f"{wanted[path]}: it was written for another model")
                continue
            short = len(shape) != 1 or shape[0] < numels[g]
            if short or (recorded is None and shape[0] != numels[g]):
                raise ValueError(f"checkpoint {where} holds an array of shape {shape} for group {g!r}, whose "
                                 f"{numels[g]} parameters this model has: it was written for another model")

    def _await_tmp_cleanup(self) -> None:
        """Waits for the removal of half-written checkpoints that the manager starts in a background thread when it
        opens the directory. `CheckpointManager.close()` does not wait for it: a run that fails right after
        opening its store (e.g. on a bad data file) would otherwise end with that thread's unrelated "cannot
        schedule new futures after interpreter shutdown" traceback instead of the real error."""
        wait = getattr(self.manager, "_maybe_await_cleanup_tmp_directory", None)
        if wait is not None:
            wait()

    def close(self) -> None:
        """Finishes every background operation of the manager and closes it (idempotent)."""
        if self.manager is None:
            return
        try:
            self._await_tmp_cleanup()
        finally:
            self.manager.close()
            self.manager = None


def _without_step(engine_state: dict[str, Any]) -> dict[str, Any]:
    """The engine state without its step count (kept in the JSON item); host scalars (numpy scalars such as optax's
    step counter, which orbax restores only as 0-d arrays) as numpy arrays, jax arrays and shape structs as they
    are."""
    def leaf(x):
        return x if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else np.asarray(x)

    return jax.tree.map(leaf, {k: v for k, v in engine_state.items() if k != "step"})


def _shapes_by_path(tree, is_leaf=None) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{key path as names: shape} of a tree's leaves; a path's keys as names (dict keys, sequence indices, attribute
    names), so an optax state and orbax's metadata of it (dicts for named tuples) name a leaf alike."""
    def names(path):
        return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)

    return {names(p): tuple(np.shape(x)) for p, x in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf)}


def _check_shapes(restored, template, where: str) -> None:
    got = jax.tree.leaves(restored)
    want = jax.tree.leaves(template)
    if len(got) != len(want):
        raise ValueError(f"checkpoint {where} has {len(got)} arrays, this model and optimizer have {len(want)}")
    for a, b in zip(got, want):
        if np.shape(a) != np.shape(b):
            raise ValueError(f"checkpoint {where} holds an array of shape {np.shape(a)} where this model has "
                             f"{np.shape(b)}")
