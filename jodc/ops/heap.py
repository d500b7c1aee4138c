"""The symmetric heap: buckets registered collectively, one padded shard and one fp32 accumulator per device.

A bucket is one parameter group flattened into a vector. Every device of a mesh axis owns the slice
``[d * shard_numel, (d + 1) * shard_numel)`` of it (the last shards may be partly or wholly padding). The shards
live in native memory managed by jodc, not in JAX arrays, so that any device can pull a peer's shard (``gather``)
or push into a peer's accumulator (``scatter_accumulate``) without a collective.
"""
from __future__ import annotations

import dataclasses
import math
import os
import warnings
import weakref
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jodc import dtypes
from jodc.ops import layout, transports

MASTER_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
MASTER_DTYPE_NAMES = tuple(MASTER_DTYPES)
DEFAULT_BARRIER_TIMEOUT_S = 300.0
# Overrides DEFAULT_BARRIER_TIMEOUT_S for heaps created without an explicit timeout: a time-boxed GPU check
# (tools/gpu_check.py) sets seconds, so a device that never arrives fails its test long before the check's limit.
BARRIER_TIMEOUT_ENV = "JODC_BARRIER_TIMEOUT_S"


def default_barrier_timeout_s(environ=None) -> float:
    """The barrier timeout of a heap created without one: ``$JODC_BARRIER_TIMEOUT_S`` when set (a positive number of
    seconds, or ``inf``), else DEFAULT_BARRIER_TIMEOUT_S. ValueError naming the variable for anything else."""
    text = (os.environ if environ is None else environ).get(BARRIER_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_BARRIER_TIMEOUT_S
    try:
        return layout.check_barrier_timeout(float(text))
    except ValueError:
        raise ValueError(f"{BARRIER_TIMEOUT_ENV} must be a positive number of seconds or inf, got {text!r}") from None


def dtype_name(dtype) -> str:
    """'float32' or 'bfloat16' for any spelling of those dtypes (a name, jnp.bfloat16, a numpy dtype); ValueError
    naming the allowed ones otherwise."""
    return dtypes.dtype_name(dtype, MASTER_DTYPE_NAMES, "a jodc bucket's master dtype")


def wait_for_ops() -> None:
    """Waits until every dispatched computation with side effects (our native ops) has finished.

    Dispatch is asynchronous: host reads of shards and freeing memory must not overtake queued ops.
    """
    jax.effects_barrier()


def _settle_ops_before_free(what: str) -> None:
    """Waits for queued ops before memory is released. If one of them failed (e.g. a barrier timeout), its error is
    reported as a warning and JAX's record of it is dropped, so it does not resurface in every later host call."""
    try:
        wait_for_ops()
    except Exception as e:  # noqa: BLE001 - any runtime error of a queued computation
        warnings.warn(f"freeing {what}: a queued computation had failed: {e}", RuntimeWarning, stacklevel=3)
        try:
            from jax._src import dispatch

            dispatch.runtime_tokens.clear()
        except Exception:  # private API moved: the error will resurface at the next barrier, nothing worse
            pass


def check_one_replica(mesh: jax.sharding.Mesh, axis_name: str) -> None:
    """Refuses a mesh with an axis of size > 1 besides the heap's: every replica along it would run the same ops on
    the same heap (one set of barrier counters and accumulators), so devices would leave barriers early and sum
    each other's gradients, silently. One heap serves exactly one group of devices: the heap's axis."""
    others = {name: int(size) for name, size in mesh.shape.items() if name != axis_name and int(size) > 1}
    if others:
        raise ValueError(
            f"a heap on axis {axis_name!r} of mesh {dict(mesh.shape)} would be shared by the replicas along "
            f"{others}: they would share barrier counters and accumulators (wrong results). jodc heaps support one "
            f"device group: use a mesh whose only axis of size > 1 is {axis_name!r}")


class FreedOnExit:
    """`with heap: ...` frees the heap (`free()`) when the block ends, however it ends."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.free()


class SymmetricHeap(FreedOnExit):
    """Buckets shared by the devices along one mesh axis.

    Args:
      mesh: the mesh the ops will run under (inside ``jax.shard_map``).
      axis_name: the mesh axis whose devices share the heap; its size is the world size.
      deterministic: accumulate pushes in per-source landing slots reduced in a fixed order, so accumulated
        gradients are bit-for-bit reproducible whatever the thread timing (costs world x the accumulator memory).
      barrier_timeout_s: how long ``barrier`` waits before failing with the names of the missing devices; ``inf``
        waits forever. None (default): ``default_barrier_timeout_s()``, 300 s unless ``$JODC_BARRIER_TIMEOUT_S``
        says otherwise. A device that fails (rather than never arriving) aborts the heap at once: see ``abort`` and
        ``block_until_ready``.
      transport: 'auto' (default: 'mpi' when the mesh holds devices of several processes, else 'local'), 'local'
        (in-process memory) or 'mpi' (MPI one-sided windows, see
        ``jodc.ops.transports.mpi_library``; needs the ``jodc[mpi]`` extra).
        GPU meshes: 'local' (one process: peer pointers), 'cuda_ipc' (several processes on one node, one GPU each:
        CUDA IPC handles), 'nvshmem' (several nodes); 'auto' picks by the mesh's process and node layout
        (``jodc.ops.transports.cuda_ipc``).
        The choice is ``heap.transport``. An MPI heap is created, registered and freed collectively by every
        process of ``MPI.COMM_WORLD``.
      progress_thread: MPI transport only: run a thread that enters MPI every ~50 us so peers' one-sided operations
        progress while this process computes. None (default): on when the processes span several nodes.

    Buckets must be registered in the same order with the same sizes everywhere (one process registers for all of
    its devices). Use as a context manager, or call ``free()``: native memory is released at once.

    The mesh's only axis of size > 1 must be `axis_name` (replicas along another axis would share the heap). A local
    heap holds this process's devices only (``jodc.ops.transports.check_single_process``); an MPI heap spans processes.
    """

    def __init__(self, mesh: jax.sharding.Mesh, axis_name: str = "d", *, deterministic: bool = False,
                 barrier_timeout_s: float | None = None, transport: str = "auto",
                 progress_thread: bool | None = None):
        if axis_name not in mesh.shape:
            raise ValueError(f"mesh has axes {tuple(mesh.shape)}, not {axis_name!r}")
        platforms = {d.platform for d in mesh.devices.flat}
        if len(platforms) != 1:
            raise ValueError(f"a heap's mesh must hold devices of one platform, got {sorted(platforms)}")
        barrier_timeout_s = (default_barrier_timeout_s() if barrier_timeout_s is None
                             else layout.check_barrier_timeout(barrier_timeout_s))
        check_one_replica(mesh, axis_name)
        self.mesh = mesh
        self.axis_name = axis_name
        self.world = int(mesh.shape[axis_name])
        self.platform = platforms.pop()
        self.deterministic = bool(deterministic)
        self._transport = transports.open_transport(mesh, axis_name, self.platform, transport,
                                                    deterministic=self.deterministic,
                                                    barrier_timeout_s=float(barrier_timeout_s),
                                                    progress_thread=progress_thread)
        self._lib, self.id = self._transport.lib, self._transport.heap_id
        # device p of the axis (the index the ops pass to the handlers); other axes have size 1
        self.positions = {d: p for p, d in enumerate(transports.along_axis(mesh, axis_name))}
        self._barrier_timeout_s = float(barrier_timeout_s)
        self._buckets: list[Bucket] = []
        self._freed = False
        self._finalizer = weakref.finalize(self, _free_quietly, self._lib, self.id)

    @property
    def device_axes(self) -> tuple[str]:
        """The mesh axes a device's values vary over: the heap's axis (a `ReplicatedHeap` adds its replica axis)."""
        return (self.axis_name,)

    @property
    def transport(self) -> str:
        """How the heap reaches its devices: 'local', 'mpi', 'cuda_ipc' or 'nvshmem' (`jodc.ops.transports`)."""
        return self._transport.name

    # -- lifetime -------------------------------------------------------------------------------------------
    @property
    def freed(self) -> bool:
        return self._freed

    def free(self) -> None:
        """Releases every bucket's native memory; later ops on this heap raise. Idempotent."""
        if self._freed:
            return
        _settle_ops_before_free(f"heap {self.id}")  # queued ops still reference this heap
        self._freed = True
        self._finalizer.detach()
        self._transport.before_free("heap")
        self._lib.heap_free(self.id)
        self._transport.after_free()
        for b in self._buckets:
            b._freed = True

    def check_alive(self) -> None:
        if self._freed:
            raise ValueError(f"heap {self.id} has been freed")
        poisoned = self.poisoned
        if poisoned:
            raise RuntimeError(poisoned)

    @property
    def poisoned(self) -> str:
        """Why the heap is unusable ("" while healthy): a barrier timeout, an abort, a failed op."""
        return "" if self._freed else str(self._lib.heap_poisoned(self.id))

    def abort(self, reason: str) -> str:
        """Poisons the heap with "aborted: <reason>" and wakes every device waiting in its barrier, which then fails
        with that message instead of waiting for the timeout; every later op fails too (free and re-create the heap).
        The first cause recorded stays. Returns the poison message now recorded. Safe from any thread."""
        if self._freed:
            return ""
        self._lib.heap_abort(self.id, str(reason))
        return self.poisoned

    def block_until_ready(self, outputs):
        """Waits for `outputs` of computations that use this heap (like ``jax.block_until_ready``), but fails fast:
        the first device whose computation fails (a native op error, a host callback that raised) aborts the heap,
        so devices waiting for it in a barrier fail at once; raises :class:`jodc.ops.DeviceFailed` naming it."""
        from jodc.ops.failure import block_until_ready

        return block_until_ready(outputs, self)

    # -- buckets --------------------------------------------------------------------------------------------
    def register(self, shape: int | Sequence[int], dtype=jnp.float32, *, name: str | None = None) -> "Bucket":
        """Registers a bucket of `shape` (its flat size is what is sharded) with master shards of `dtype`.

        ValueError when its sizes overflow 64-bit byte counts, MemoryError when the memory it needs (named, in bytes)
        cannot be had; both before anything is allocated."""
        self.check_alive()
        shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
        name = name or f"bucket{len(self._buckets)}"
        if any(s < 0 for s in shape):
            raise ValueError(f"bucket {name!r}: shape must be non-negative, got {shape}")
        numel = math.prod(shape)
        if numel < 1:
            raise ValueError(f"bucket {name!r} must hold at least one element, got shape {shape}")
        master = dtype_name(dtype)
        needed = layout.bucket_bytes(numel, self.world, MASTER_DTYPES[master].itemsize, self.landing_slots, name=name)
        if self._transport.host_memory:
            layout.check_host_memory(needed, self.world, name=name)
        try:  # collective for the multi-process transports
            bucket_id = self._transport.register(numel, master, name, index=len(self._buckets), shape=shape)
        except MemoryError as e:
            raise MemoryError(f"bucket {name!r} ({needed.describe(self.world)}): {e}") from None
        bucket = Bucket(self, bucket_id, shape, numel, master, int(self._lib.bucket_shard_numel(self.id, bucket_id)),
                        name)
        self._buckets.append(bucket)
        return bucket

    @property
    def landing_slots(self) -> bool:
        """Whether pushes land in per-source fp32 slots (deterministic heap; CUDA without peer atomics)."""
        if self.deterministic:
            return True
        probe = getattr(self._lib, "heap_landing_slots", None)
        return bool(probe(self.id)) if probe is not None and not self._freed else False

    @property
    def buckets(self) -> tuple["Bucket", ...]:
        return tuple(b for b in self._buckets if not b._freed)

    # -- barrier --------------------------------------------------------------------------------------------
    @property
    def barrier_timeout_s(self) -> float:
        return self._barrier_timeout_s

    @barrier_timeout_s.setter
    def barrier_timeout_s(self, seconds: float) -> None:
        seconds = layout.check_barrier_timeout(seconds)
        self.check_alive()
        self._lib.heap_set_barrier_timeout(self.id, float(seconds))
        self._barrier_timeout_s = float(seconds)

    def generations(self) -> list[int]:
        """Per device, how many barriers it has entered."""
        self.check_alive()
        wait_for_ops()
        return [int(g) for g in self._lib.heap_generations(self.id)]

    def __repr__(self) -> str:
        state = "freed" if self._freed else f"{len(self.buckets)} buckets"
        return (f"SymmetricHeap(id={self.id}, axis={self.axis_name!r}, world={self.world}, platform={self.platform}, "
                f"transport={self.transport}, deterministic={self.deterministic}, {state})")


def _free_quietly(lib, heap_id: int) -> None:
    try:
        lib.heap_free(heap_id)
    except Exception:  # already freed, or interpreter shutting down
        pass


@dataclasses.dataclass(eq=False)
class Bucket:
    """One registered bucket: `shape` elements sharded over the heap's devices, `shard_numel` (padded) each."""

    heap: SymmetricHeap
    id: int
    shape: tuple[int, ...]
    numel: int
    master_dtype: str
    shard_numel: int
    name: str
    _freed: bool = False

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.heap.world

    @property
    def np_dtype(self) -> np.dtype:
        return MASTER_DTYPES[self.master_dtype]

    def owner_range(self, device: int) -> tuple[int, int]:
        """[begin, end) of `device`'s slice of the flat (unpadded) bucket."""
        b = min(device * self.shard_numel, self.numel)
        return b, min((device + 1) * self.shard_numel, self.numel)

    def check_alive(self) -> None:
        if self._freed:
            raise ValueError(f"bucket {self.name!r} (id {self.id}) has been freed")
        self.heap.check_alive()

    def free(self) -> None:
        """Releases this bucket's native memory; ops on it raise afterwards. Idempotent."""
        if self._freed:
            return
        if not self.heap.freed:
            _settle_ops_before_free(f"bucket {self.name!r}")
            self.heap._transport.before_free("bucket")  # collective: peers stop using this bucket's memory first
            self.heap._lib.bucket_free(self.heap.id, self.id)
        self._freed = True

    def _device(self, device: int) -> int:
        if not 0 <= int(device) < self.heap.world:
            raise ValueError(f"device {device} outside [0, {self.heap.world}) of {self.name!r}")
        return int(device)

    # -- host access (initialisation, checkpoints, tests) ----------------------------------------------------
    def set_full(self, values) -> None:
        """Writes the whole bucket from the host: `values` (bucket shape or flat) is split into the shards."""
        self.check_alive()
        flat = np.asarray(values).reshape(-1)
        if flat.size != self.numel:
            raise ValueError(f"{self.name!r} holds {self.numel} elements, got {flat.size}")
        padded = np.zeros(self.padded_numel, self.np_dtype)
        padded[: self.numel] = flat.astype(self.np_dtype)
        for d in range(self.heap.world):
            self.set_shard(d, padded[d * self.shard_numel:(d + 1) * self.shard_numel])

    def set_shard(self, device: int, shard) -> None:
        """Writes device `device`'s (padded) master shard from the host."""
        self.check_alive()
        wait_for_ops()
        shard = np.ascontiguousarray(np.asarray(shard).reshape(-1).astype(self.np_dtype))
        if shard.size != self.shard_numel:
            raise ValueError(f"{self.name!r} shards hold {self.shard_numel} elements, got {shard.size}")
        self.heap._lib.bucket_set_shard(self.heap.id, self.id, self._device(device), shard.view(np.uint8))

    def _read(self, what: str, device: int, dtype) -> np.ndarray:
        """A host copy of device `device`'s `what` ('shard' or 'accumulator'), once queued ops have finished."""
        self.check_alive()
        wait_for_ops()
        raw = getattr(self.heap._lib, f"bucket_get_{what}")(self.heap.id, self.id, self._device(device))
        return np.frombuffer(raw, dtype=dtype).copy()

    def _assemble(self, read) -> np.ndarray:
        """The whole bucket, in its shape, from every device's padded part read(d)."""
        return np.concatenate([read(d) for d in range(self.heap.world)])[: self.numel].reshape(self.shape)

    def shard(self, device: int) -> np.ndarray:
        """A host copy of device `device`'s (padded) master shard."""
        return self._read("shard", device, self.np_dtype)

    def full(self) -> np.ndarray:
        """A host copy of the whole bucket in its shape and master dtype."""
        return self._assemble(self.shard)

    def accumulator(self, device: int) -> np.ndarray:
        """A host copy of the fp32 gradient accumulated into device `device`'s shard (padded)."""
        return self._read("accumulator", device, np.float32)

    def accumulated(self) -> np.ndarray:
        """The whole accumulated gradient (fp32, bucket shape), assembled on the host."""
        return self._assemble(self.accumulator)

    def zero_accumulators(self) -> None:
        self.check_alive()
        wait_for_ops()
        for d in range(self.heap.world):
            self.heap._lib.bucket_zero_accumulator(self.heap.id, self.id, d)

    def __repr__(self) -> str:
        return (f"Bucket({self.name!r}, id={self.id}, shape={self.shape}, master={self.master_dtype}, "
                f"shard_numel={self.shard_numel}, world={self.heap.world}{', freed' if self._freed else ''})")
