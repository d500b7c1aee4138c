"""The FFI targets of jodc's native ops, as the Python side names them.

The one list is ``ffi/common/ops.h`` (an X-macro every C++ backend generates its handlers' declarations and its
handler table from); this module spells the same op names for Python. Each built library hands over its table
(``handlers()``), which :func:`check_handlers` compares with these names before anything is registered, and
tests/test_ops_targets.py compares this module with the header, so the two cannot drift apart silently.
"""
from __future__ import annotations

# Ops on a heap (every backend, the MPI transport included), in ffi/common/ops.h's order.
HEAP_OPS = ("gather", "scatter_accumulate", "barrier", "read_accumulator", "zero_accumulator", "publish")
# Ordering ops on tokens alone (the in-process backends: CPU and CUDA).
TOKEN_OPS = ("after", "depend_on")
ALL_OPS = HEAP_OPS + TOKEN_OPS
# Ops on a group of a heap's devices named at run time (context parallelism): the host backends only (CPU, MPI).
GROUP_OPS = ("group_gather", "group_scatter_accumulate", "group_barrier")
# Platforms whose libraries have the group ops (a CUDA heap's 'local' library does not, yet).
GROUP_OP_PLATFORMS = ("cpu",)

# transport -> the FFI target prefix of its ops, and the ops its library provides (the NVSHMEM backend's heaps run on
# CUDA devices and use the CUDA library's token ops)
PREFIXES = {"local": "jodc_", "mpi": "jodc_mpi_", "nvshmem": "jodc_nvshmem_"}
_OPS = {"local": ALL_OPS + GROUP_OPS, "mpi": HEAP_OPS + GROUP_OPS, "nvshmem": HEAP_OPS}
# Transports whose kernels are another's: a CUDA IPC heap runs the in-process CUDA handlers (peer pointers, some of
# them imported from other processes).
_SAME_TARGETS = {"cuda_ipc": "local"}


def target_name(op: str, transport: str = "local") -> str:
    """The FFI target of `op`: ``jodc_<op>`` in-process and over CUDA IPC, ``jodc_mpi_<op>`` on the MPI transport,
    ``jodc_nvshmem_<op>`` on the NVSHMEM one."""
    transport = _SAME_TARGETS.get(transport, transport)
    if op not in _OPS[transport]:
        raise ValueError(f"jodc has no {transport} FFI op {op!r}; its ops are {_OPS[transport]}")
    return PREFIXES[transport] + op


def expected_targets(transport: str = "local", platform: str = "cpu") -> tuple[str, ...]:
    """Every FFI target a library of `transport` ('local': CPU or CUDA; 'mpi'; 'nvshmem') for `platform` ('cpu',
    'cuda') must provide: the group ops only on the platforms that have them."""
    ops = _OPS[transport]
    if platform.lower() not in GROUP_OP_PLATFORMS:
        ops = tuple(op for op in ops if op not in GROUP_OPS)
    return tuple(target_name(op, transport) for op in ops)


def check_handlers(handlers: dict, transport: str, library: str, platform: str = "cpu") -> None:
    """Raises RuntimeError naming the difference when `library`'s handler table (for `platform`) does not hold
    exactly the targets jodc.ops calls (a stale build, or ffi/common/ops.h and this module out of step)."""
    expected = set(expected_targets(transport, platform))
    missing, extra = sorted(expected - set(handlers)), sorted(set(handlers) - expected)
    if missing or extra:
        raise RuntimeError(
            f"{library}'s FFI handler table does not match jodc.ops (rebuild it: `make native`): missing {missing}, "
            f"unexpected {extra}")
