"""Host memory that is freed goes back to the operating system at once.

On a CPU backend the engines' state lives in host memory, in one buffer per device shard of each parameter group (tens
of MB at real model sizes). glibc's malloc serves such a buffer with mmap only above a threshold that it raises, after
the first large free, to up to 32 MiB; below it, a freed buffer stays in the process's heap: resident, and reusable
only by an allocation that fits the same hole. A resume (the fresh engine's state freed, the checkpoint's read in)
or a step (the optimizer's new moments beside the old) then leaves the process holding its state twice, measured as
1.4-1.5x the steady memory (bench/memory.py). A fixed threshold serves every buffer of `MMAP_THRESHOLD_BYTES` or more
with its own mapping, returned by munmap when freed; smaller allocations keep glibc's heap. The cost is a page fault
per page of each new large buffer (XLA reuses its temporaries within a program; measured no step-time change on CPU).
"""
from __future__ import annotations

import ctypes
import ctypes.util

MMAP_THRESHOLD_BYTES = 4 << 20
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_applied = False


def return_freed_memory_promptly(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Makes glibc serve allocations of `threshold_bytes` or more with mmap (and so return them to the system when
    freed), for the rest of the process. True when applied (or applied before); False where the C library is not
    glibc (musl, macOS: nothing to do). Set MALLOC_MMAP_THRESHOLD_ in the environment to choose another value: it
    wins, and this leaves it alone."""
    global _applied
    import os

    if _applied or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it (and its mallopt's meaning of -3)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes)))
    return _applied
