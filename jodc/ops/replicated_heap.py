"""Hybrid sharding (HSDP): one symmetric heap per replica group of a 2-D mesh ``(replica_axis, axis_name)``.

Each replica group (one row of the mesh along `replica_axis`) is its own ODC world: its own native heap, so its
gathers, scatter-accumulates and barriers never touch another group's shards, accumulators or barrier counters. The
ops accept a :class:`ReplicatedHeap` / :class:`ReplicatedBucket` wherever they accept a heap / bucket: inside
``shard_map`` over the 2-D mesh each device selects its own group's heap by its index along `replica_axis`
(``lax.switch`` over the groups, one native call per branch; the handlers are unchanged). Summing the groups'
accumulated shards across replicas is the caller's collective (``lax.psum`` over `replica_axis`), once per minibatch.

Layouts across processes: each group inside one process (in-process heaps, one process per node: shards inside,
replicas across; the cross-replica reduce is the only traffic between processes), or every group spread over the
same processes (MPI heaps: shards across processes, replicas inside). Others are refused (`local_replicas`).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from jodc.ops.heap import Bucket, FreedOnExit, SymmetricHeap
from jodc.ops.transports import mesh_processes


def replica_groups(mesh: jax.sharding.Mesh, axis_name: str, replica_axis: str) -> np.ndarray:
    """The mesh's devices as [replicas, shards]: row r is replica group r in position order along `axis_name`.
    ValueError when either axis is missing or another axis has size > 1."""
    for name in (axis_name, replica_axis):
        if name not in mesh.shape:
            raise ValueError(f"a replicated heap needs mesh axes {replica_axis!r} and {axis_name!r}, got "
                             f"{dict(mesh.shape)}")
    if axis_name == replica_axis:
        raise ValueError(f"the replica axis and the shard axis must differ, both are {axis_name!r}")
    others = {n: int(s) for n, s in mesh.shape.items() if n not in (axis_name, replica_axis) and int(s) > 1}
    if others:
        raise ValueError(f"a replicated heap's mesh may have no axis of size > 1 besides {replica_axis!r} and "
                         f"{axis_name!r}, got {others}")
    order = [mesh.axis_names.index(replica_axis), mesh.axis_names.index(axis_name)]
    order += [i for i in range(mesh.devices.ndim) if i not in order]
    devices = np.transpose(mesh.devices, order)
    return devices.reshape(int(mesh.shape[replica_axis]), int(mesh.shape[axis_name]))


def local_replicas(groups: np.ndarray, process: int) -> list[int]:
    """The replica groups (rows of `groups`, [replicas, shards] devices) whose heap `process` creates.

    Two layouts work: every group inside one process (its heap is in-process memory; a process creates its own
    groups' heaps), or every group spread over the same processes (shards across processes, replicas inside: every
    process creates every group's heap, in order, each an MPI heap, collective over those processes). ValueError
    for any other layout, naming the groups' processes."""
    spans = [mesh_processes(row) for row in groups]
    if all(len(s) == 1 for s in spans):
        local = [r for r, s in enumerate(spans) if s == [process]]
        if not local:
            raise ValueError(f"no replica group holds a device of process {process} (groups' processes: {spans})")
        return local
    if all(s == spans[0] for s in spans):
        return list(range(len(spans)))
    raise ValueError(
        f"replica groups over processes {spans}: each group must lie in one process (shards inside a process, "
        f"replicas across: the fast layout), or every group must span the same processes (shards across processes, "
        f"replicas inside)")


class ReplicatedHeap(FreedOnExit):
    """Buckets sharded along `axis_name` and replicated along `replica_axis`: one `SymmetricHeap` per replica group.

    Args as `SymmetricHeap` (each group's heap gets them), plus `replica_axis`. This process creates the heaps of
    the groups whose devices it holds (`heaps`: replica index -> heap; layouts: `local_replicas`). ``world`` is the
    group size (shards per bucket), ``replicas`` the number of groups.
    """

    def __init__(self, mesh: jax.sharding.Mesh, axis_name: str = "d", replica_axis: str = "r", *,
                 deterministic: bool = False, barrier_timeout_s: float | None = None,
                 transport: str = "auto"):
        groups = replica_groups(mesh, axis_name, replica_axis)
        local = local_replicas(groups, jax.process_index())
        self.mesh = mesh
        self.axis_name, self.replica_axis = axis_name, replica_axis
        self.replicas, self.world = groups.shape
        self.deterministic = bool(deterministic)
        self.heaps: dict[int, SymmetricHeap] = {}
        self.world_heap: SymmetricHeap | None = None
        try:
            for r in local:
                sub = jax.sharding.Mesh(groups[r], (axis_name,))
                self.heaps[r] = SymmetricHeap(sub, axis_name, deterministic=deterministic,
                                              barrier_timeout_s=barrier_timeout_s, transport=transport)
            # no buckets: only the barrier of every device of every group (`jodc.ops.replica_barrier`), position
            # r * world + d; in-process, or MPI when the groups span processes (CPU). GPUs of several processes
            # have no transport for it (CUDA IPC and NVSHMEM serve one GPU per process): None there
            everyone = groups.reshape(-1)
            several = len(mesh_processes(everyone)) > 1
            if self.members()[0].platform == "cpu" or not several:
                self.world_heap = SymmetricHeap(jax.sharding.Mesh(everyone, (axis_name,)), axis_name,
                                                barrier_timeout_s=barrier_timeout_s,
                                                transport="auto" if transport == "local" else transport)
        except BaseException:
            self.free()
            raise
        # a device's position in the whole data-parallel world (replica * world + shard position)
        self.positions = {d: r * self.world + p for r, h in self.heaps.items() for d, p in h.positions.items()}
        self._buckets: list[ReplicatedBucket] = []

    @property
    def device_axes(self) -> tuple[str, str]:
        """The mesh axes a device's values vary over: (replica_axis, axis_name)."""
        return (self.replica_axis, self.axis_name)

    @property
    def id(self) -> int:
        """The first local group's heap id (for messages)."""
        return self.members()[0].id

    @property
    def transport(self) -> str:
        return self.members()[0].transport

    def members(self) -> list[SymmetricHeap]:
        """The heap serving each replica index, in order; a group of another process maps to this process's first
        group (never run: a device runs only its own group's branch)."""
        first = self.heaps[min(self.heaps)]
        return [self.heaps.get(r, first) for r in range(self.replicas)]

    # -- lifetime ----------------------------------------------------------------------------------------------
    def _all_heaps(self) -> list[SymmetricHeap]:
        return list(self.heaps.values()) + ([self.world_heap] if self.world_heap is not None else [])

    @property
    def freed(self) -> bool:
        return all(h.freed for h in self._all_heaps())

    def free(self) -> None:
        for h in self._all_heaps():
            h.free()
        for b in self._buckets:
            b._freed = True

    def check_alive(self) -> None:
        for h in self._all_heaps():
            h.check_alive()

    @property
    def poisoned(self) -> str:
        return next((p for p in (h.poisoned for h in self._all_heaps()) if p), "")

    def abort(self, reason: str) -> str:
        """Aborts every local group's heap and the all-groups barrier: a failed device's group peers leave their
        barrier, and the other groups' devices leave `replica_barrier` instead of waiting in the cross-replica
        collective after it (which nothing could wake). Returns the poison message now recorded."""
        for h in self._all_heaps():
            h.abort(reason)
        return self.poisoned

    def block_until_ready(self, outputs):
        """As `SymmetricHeap.block_until_ready`; positions are in the whole world (replica * world + shard)."""
        from jodc.ops.failure import block_until_ready

        return block_until_ready(outputs, self)

    @property
    def barrier_timeout_s(self) -> float:
        return self.members()[0].barrier_timeout_s

    def generations(self) -> dict[int, list[int]]:
        """Per local replica group, how many barriers each of its devices has entered."""
        return {r: h.generations() for r, h in self.heaps.items()}

    # -- buckets -----------------------------------------------------------------------------------------------
    def register(self, shape: int | Sequence[int], dtype=np.float32, *, name: str | None = None) -> "ReplicatedBucket":
        """Registers the bucket in every local group's heap (same order and sizes in each)."""
        self.check_alive()
        name = name or f"bucket{len(self._buckets)}"
        bucket = ReplicatedBucket(self, {r: h.register(shape, dtype, name=name) for r, h in self.heaps.items()})
        self._buckets.append(bucket)
        return bucket

    def __repr__(self) -> str:
        return (f"ReplicatedHeap(replicas={self.replicas}, world={self.world}, axes={self.device_axes}, "
                f"local groups={sorted(self.heaps)}, deterministic={self.deterministic})")


@dataclasses.dataclass(eq=False)
class ReplicatedBucket:
    """One bucket registered in every local replica group's heap (`members_by_replica`: replica index -> `Bucket`).
    Its shape, dtype and shard size are its members' (equal in every group: each registers the same bucket)."""

    heap: ReplicatedHeap
    members_by_replica: dict[int, Bucket]
    _freed: bool = False

    @property
    def _first(self) -> Bucket:
        return self.members_by_replica[min(self.members_by_replica)]

    shape = property(lambda self: self._first.shape)
    numel = property(lambda self: self._first.numel)
    master_dtype = property(lambda self: self._first.master_dtype)
    shard_numel = property(lambda self: self._first.shard_numel)
    name = property(lambda self: self._first.name)
    np_dtype = property(lambda self: self._first.np_dtype)

    def members(self) -> list[Bucket]:
        """The bucket serving each replica index, in order (see `ReplicatedHeap.members`)."""
        return [self.members_by_replica.get(r, self._first) for r in range(self.heap.replicas)]

    def check_alive(self) -> None:
        if self._freed:
            raise ValueError(f"bucket {self.name!r} has been freed")
        for b in self.members_by_replica.values():
            b.check_alive()

    def set_full(self, values) -> None:
        """Writes the whole bucket into every local replica group."""
        for b in self.members_by_replica.values():
            b.set_full(values)

    def full(self, replica: int) -> np.ndarray:
        """A host copy of replica group `replica`'s whole bucket (a group of this process)."""
        return self._member(replica).full()

    def accumulated(self, replica: int) -> np.ndarray:
        """Replica group `replica`'s accumulated gradient (fp32, bucket shape): its own devices' pushes only."""
        return self._member(replica).accumulated()

    def _member(self, replica: int) -> Bucket:
        if replica not in self.members_by_replica:
            raise ValueError(f"replica group {replica} of {self.name!r} is not in this process (local groups "
                             f"{sorted(self.members_by_replica)})")
        return self.members_by_replica[replica]

    def __repr__(self) -> str:
        return (f"ReplicatedBucket({self.name!r}, shape={self.shape}, shard_numel={self.shard_numel}, "
                f"replicas={self.heap.replicas}, world={self.heap.world})")
