"""A bucket's layout and byte counts, checked before anything native is asked: the Python mirror of
``ffi/common/layout.h`` (``ShardNumel``, ``CheckedBucketBytes``, ``TimeoutNanos``), one function for each.

Python integers do not overflow, so each function computes the exact value and refuses what the native side could
not represent in int64 (it would refuse too). Memory checks (:func:`check_host_memory`) name the bucket and the bytes
asked for, so an impossible request fails with a ``MemoryError`` instead of an allocation failing half-way (or the
kernel's out-of-memory killer ending the process).
"""
from __future__ import annotations

import dataclasses
import math
import os

INT64_MAX = 2**63 - 1
SHARD_ALIGN_BYTES = 64
ACCUMULATOR_BYTES = 4  # accumulators and landing slots are fp32 whatever the master dtype
FOREVER_NS = INT64_MAX  # a barrier timeout this long (or +inf) waits forever


def shard_quantum(master_bytes: int) -> int:
    """Elements per 64 bytes of the narrower of the master and the fp32 accumulator types."""
    return SHARD_ALIGN_BYTES // min(int(master_bytes), ACCUMULATOR_BYTES)


def shard_numel(numel: int, world: int, master_bytes: int) -> int:
    """Padded elements per shard: ceil(numel / world) rounded up to a whole number of 64-byte quanta.

    Raises ValueError for invalid arguments or a result beyond int64 (where the native ``ShardNumel`` gives -1).
    """
    numel, world, master_bytes = int(numel), int(world), int(master_bytes)
    if numel < 1 or world < 1 or master_bytes not in (2, 4):
        raise ValueError(f"invalid layout: numel={numel} (>= 1), world={world} (>= 1), master_bytes={master_bytes} "
                         f"(2 or 4)")
    quantum = shard_quantum(master_bytes)
    per = -(-numel // world)  # ceil(numel / world)
    out = -(-per // quantum) * quantum
    if out > INT64_MAX:
        raise ValueError(f"a bucket of {numel} elements over {world} devices has shards of {out} elements, beyond "
                         f"64-bit sizes")
    return out


@dataclasses.dataclass(frozen=True)
class BucketBytes:
    """Bytes of one bucket's memory (``ffi/common/layout.h`` ``BucketBytes``)."""

    shard: int        # one master shard
    accumulator: int  # one fp32 accumulator shard
    landing: int      # one owner's fp32 landing slots (world shards; 0 without landing slots)
    per_device: int   # what one device's memory holds: shard + accumulator + landing
    total: int        # per_device * world

    def describe(self, world: int) -> str:
        parts = f"shard {self.shard} + accumulator {self.accumulator}"
        if self.landing:
            parts += f" + landing slots {self.landing}"
        return f"{self.total} bytes ({parts} bytes per device, {world} devices)"


def bucket_bytes(numel: int, world: int, master_bytes: int, landing_slots: bool, *,
                 name: str = "bucket") -> BucketBytes:
    """The bucket's byte counts; ValueError naming `name` and the bytes when any of them does not fit int64
    (the native allocator refuses such a bucket too; before this check it wrapped round to a tiny allocation)."""
    if int(numel) < 1:
        raise ValueError(f"bucket {name!r} must hold at least one element, got {numel}")
    shard = shard_numel(numel, world, master_bytes)
    b = BucketBytes(shard=shard * master_bytes, accumulator=shard * ACCUMULATOR_BYTES,
                    landing=shard * ACCUMULATOR_BYTES * world if landing_slots else 0,
                    per_device=0, total=0)
    per_device = b.shard + b.accumulator + b.landing
    b = dataclasses.replace(b, per_device=per_device, total=per_device * world)
    rounded = -(-b.total // SHARD_ALIGN_BYTES) * SHARD_ALIGN_BYTES
    if max(shard * world, b.per_device, rounded) > INT64_MAX:
        raise ValueError(f"bucket {name!r} of {numel} elements is too large: it needs {b.describe(world)}, beyond "
                         f"64-bit byte counts (at most {INT64_MAX})")
    return b


def available_host_bytes() -> int:
    """Host memory a new allocation can still get (MemAvailable + SwapFree; total physical memory where
    /proc/meminfo is unavailable; INT64_MAX when unknown). The native side uses the same rule."""
    try:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
        if "MemAvailable" in fields:
            return fields["MemAvailable"] + fields.get("SwapFree", 0)
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGESIZE")
    except (ValueError, OSError, AttributeError):
        return INT64_MAX


def check_host_memory(needed: BucketBytes, world: int, *, name: str) -> None:
    """MemoryError naming the bucket and its bytes when host memory cannot hold it."""
    available = available_host_bytes()
    if needed.total > available:
        raise MemoryError(f"bucket {name!r} needs {needed.describe(world)}, but only {available} bytes of host "
                          f"memory are available")


def timeout_nanos(seconds: float) -> int:
    """A barrier timeout as the native barrier uses it: nanoseconds, :data:`FOREVER_NS` for +inf and for timeouts
    too long for int64 nanoseconds (about 292 years), -1 for invalid values (NaN, zero, negative)."""
    seconds = float(seconds)
    if not seconds > 0:
        return -1
    if math.isinf(seconds) or not seconds * 1e9 < 9.2e18:
        return FOREVER_NS
    return max(1, int(seconds * 1e9))


def check_barrier_timeout(seconds) -> float:
    """The timeout as a float; ValueError for what is not a positive number of seconds (+inf: wait forever)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) and not hasattr(seconds, "__float__"):
        raise ValueError(f"barrier_timeout_s must be a number of seconds, got {seconds!r}")
    value = float(seconds)
    if math.isnan(value) or value <= 0:
        raise ValueError(f"barrier_timeout_s must be > 0 seconds (or inf to wait forever), got {seconds!r}")
    return value
