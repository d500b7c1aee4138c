"""Multi-process GPU heaps without GPUs: the transport chosen from a mesh's process and node layout, the exchanges
(key-value store, in-process), and the CUDA IPC protocol of jodc.ops.transports.cuda_ipc run by several threads, each playing
one process with a fake CUDA library. The real handles are exchanged on GPU runners (tests/test_ops_cuda.py)."""
import json
import os
import threading
import time
import types

import pytest

from jodc.ops.transports import cuda_ipc, exchange
from jodc.ops.transports.choice import select
from jodc.ops.transports.cuda_ipc import IpcHeap
from jodc.ops.transports.exchange import LocalExchange


# ---- transport selection -------------------------------------------------------------------------------------------

def test_one_process_is_local_without_talking_to_anyone():
    assert select("gpu", "auto", [0]) == "local"
    assert select("gpu", "local", [3]) == "local"
    for forced in ("cuda_ipc", "nvshmem"):
        with pytest.raises(ValueError, match=f"transport='{forced}' needs a mesh spanning several processes"):
            select("gpu", forced, [0])


def test_processes_on_one_node_use_cuda_ipc_and_several_nodes_nvshmem():
    one_node = {0: "a/1", 1: "a/1", 2: "a/1", 3: "a/1"}
    two_nodes = {0: "a/1", 1: "a/1", 2: "b/7", 3: "b/7"}
    assert select("gpu", "auto", [0, 1, 2, 3], one_node) == "cuda_ipc"
    assert select("gpu", "auto", [0, 1, 2, 3], two_nodes) == "nvshmem"
    assert select("gpu", "nvshmem", [0, 1, 2, 3], one_node) == "nvshmem"  # may be forced on one node
    with pytest.raises(ValueError, match=r"'cuda_ipc' needs every process on one node; this mesh spans 2 nodes "
                                         r"\(processes per node: \[\[0, 1\], \[2, 3\]\]\)"):
        select("gpu", "cuda_ipc", [0, 1, 2, 3], two_nodes)
    with pytest.raises(ValueError, match=r"transport='local' cannot serve a mesh over processes \[0, 1\]"):
        select("gpu", "local", [0, 1], one_node)
    with pytest.raises(ValueError, match="must be one of"):
        select("gpu", "mpi", [0, 1], one_node)
    with pytest.raises(ValueError, match="node of every process is needed"):
        select("gpu", "auto", [0, 1], {0: "a"})


def test_one_gpu_per_process_on_the_axis():
    along = [types.SimpleNamespace(process_index=p, local_hardware_id=0) for p in (0, 1, 1)]
    assert cuda_ipc.local_position(along, 0) == (0, along[0])
    with pytest.raises(ValueError, match=r"exactly one GPU per process .* process 1 has positions \[1, 2\]"):
        cuda_ipc.local_position(along, 1)


def test_node_id_names_host_and_boot():
    host, _, boot = exchange.node_id().partition("/")
    assert host and exchange.node_id() == exchange.node_id()


# ---- exchanges -----------------------------------------------------------------------------------------------------

def run_ranks(size, fn):
    """Runs fn(rank) on `size` threads; returns their results (or raises the first exception, by rank)."""
    results, errors = [None] * size, [None] * size

    def target(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[r] = e

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, errors


def test_local_exchange_gathers_in_rank_order():
    group = LocalExchange.group(3)
    results, errors = run_ranks(3, lambda r: [group[r].allgather("k", bytes([r])) for _ in range(2)])
    assert errors == [None] * 3
    assert results == [[[b"\x00", b"\x01", b"\x02"]] * 2] * 3


class FakeKeyValueClient:
    """jax.distributed's client API subset: key_value_set and blocking_key_value_get (string values)."""

    def __init__(self):
        self.store, self.cv = {}, threading.Condition()

    def key_value_set(self, key, value):
        with self.cv:
            assert key not in self.store, f"key {key} written twice"
            self.store[key] = value
            self.cv.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self.cv:
            assert self.cv.wait_for(lambda: key in self.store, timeout=timeout_ms / 1000)
            return self.store[key]


def test_key_value_exchange_round_trips_binary_values():
    client = FakeKeyValueClient()
    exchanges = [exchange.KeyValueExchange(client, r, 2, "g1", timeout_s=10) for r in range(2)]
    payload = [bytes(range(256)), b"\x00" * 192]
    results, errors = run_ranks(2, lambda r: (exchanges[r].allgather("a", payload[r]),
                                              exchanges[r].allgather("a", b"again")))
    assert errors == [None, None]
    for first, second in results:
        assert first == payload and second == [b"again", b"again"]
    assert all(k.startswith("jodc/g1/") for k in client.store)


# ---- the CUDA IPC protocol with fake libraries ----------------------------------------------------------------------

class FakeIpcLibrary:
    """One process's CUDA library: handles encode (owner position, bucket id, kind) so imports can be checked."""

    def __init__(self, shared, position, *, atomics=True, access=True, fail_register=None):
        self.shared, self.position = shared, position
        self.atomics, self.access, self.fail_register = atomics, access, fail_register
        self.created, self.imports, self.published, self.freed, self.unlinked = [], [], [], [], []
        self.links_asked = []
        self._next = 100 * (position + 1)

    def pci_bus_id(self, gpu):
        return f"0000:{gpu:02x}:00.0"

    def ipc_links(self, gpu, peers):
        assert self.pci_bus_id(gpu) not in peers.split("\n")  # only other GPUs have links
        self.links_asked.append(peers)
        return self.access, self.atomics

    def ipc_heap_create(self, world, deterministic, landing, timeout, position, gpu, name, create):
        with self.shared["lock"]:
            if create:
                assert name not in self.shared["segments"]
                self.shared["segments"].add(name)
            elif name not in self.shared["segments"]:
                raise ValueError(f"opening the heap's shared control block {name} failed")
        self.created.append((world, deterministic, landing, position, gpu, name, create))
        return 7

    def ipc_unlink(self, name):
        self.unlinked.append(name)

    def ipc_bucket_register(self, heap_id, numel, dtype):
        if self.fail_register is not None:
            raise self.fail_register
        self._next += 1
        handles = json.dumps([self.position, self._next, numel]).encode().ljust(192, b"\0")
        return self._next, handles

    def ipc_bucket_import(self, heap_id, bucket_id, position, handles):
        owner, their_bucket, numel = json.loads(handles.rstrip(b"\0"))
        assert owner == position
        self.imports.append((bucket_id, position, their_bucket))

    def ipc_bucket_publish(self, heap_id, bucket_id):
        self.published.append(bucket_id)

    def bucket_free(self, heap_id, bucket_id):
        self.freed.append(bucket_id)

    def heap_free(self, heap_id):
        self.freed.append(("heap", heap_id))


def make_group(size, positions=None, **per_rank):
    shared = {"lock": threading.Lock(), "segments": set()}
    positions = positions or list(range(size))
    libs = [FakeIpcLibrary(shared, positions[r], **{k: v[r] for k, v in per_rank.items()}) for r in range(size)]
    return libs, LocalExchange.group(size), positions


def test_heap_creation_and_bucket_exchange_across_three_processes():
    positions = [2, 0, 1]  # exchange rank r holds mesh position positions[r]
    libs, group, _ = make_group(3, positions)

    def process(r):
        heap = IpcHeap.create(libs[r], group[r], 3, positions[r], gpu=r, deterministic=False, barrier_timeout_s=5.0)
        return heap, heap.register(1000, "float32", "w"), heap.register(10, "bfloat16", "b")

    results, errors = run_ranks(3, process)
    assert errors == [None] * 3
    owner = positions.index(0)
    name = libs[owner].created[0][5]
    assert name.startswith("/jodc-") and libs[owner].unlinked == [name]
    for r, lib in enumerate(libs):
        world, det, landing, pos, gpu, seg, create = lib.created[0]
        assert (world, det, landing, pos, gpu, seg, create) == (3, False, False, positions[r], r, name, r == owner)
        heap, b1, b2 = results[r]
        assert heap.positions == positions and lib.published == [b1, b2]
        # every other position's handles imported for each bucket, naming that position's own bucket
        imported = sorted((p, theirs) for bucket, p, theirs in lib.imports if bucket == b1)
        assert [p for p, _ in imported] == sorted(set(range(3)) - {positions[r]})
        for p, theirs in imported:
            assert theirs == results[positions.index(p)][1]


def test_one_pair_without_native_atomics_puts_every_process_on_landing_slots():
    libs, group, positions = make_group(2, atomics=[True, False])
    results, errors = run_ranks(2, lambda r: IpcHeap.create(libs[r], group[r], 2, positions[r], r, False, 5.0))
    assert errors == [None, None]
    assert [lib.created[0][2] for lib in libs] == [True, True]


def test_processes_without_peer_access_are_refused_everywhere():
    libs, group, positions = make_group(2, access=[True, False])
    _, errors = run_ranks(2, lambda r: IpcHeap.create(libs[r], group[r], 2, positions[r], r, False, 5.0))
    for e in errors:
        assert isinstance(e, ValueError) and "positions [1] cannot access every other GPU" in str(e)
    assert all(lib.created == [] for lib in libs)


def test_positions_must_cover_the_axis_once_each():
    libs, group, _ = make_group(2, [0, 0])
    _, errors = run_ranks(2, lambda r: IpcHeap.create(libs[r], group[r], 2, 0, r, False, 5.0))
    assert all(isinstance(e, ValueError) and "positions [0, 0]" in str(e) for e in errors)


def test_a_registration_that_fails_in_one_process_fails_in_all_and_frees_the_rest():
    libs, group, positions = make_group(3, fail_register=[None, MemoryError("needs 4096 bytes on GPU 1"), None])

    def process(r):
        heap = IpcHeap.create(libs[r], group[r], 3, positions[r], r, False, 5.0)
        return heap.register(1024, "float32", "w")

    _, errors = run_ranks(3, process)
    for e in errors:
        assert isinstance(e, RuntimeError)
        assert "process 1 of the heap failed: out of GPU memory on position 1: needs 4096 bytes" in str(e)
    assert libs[0].freed == [101] and libs[2].freed == [301] and libs[1].freed == []
    assert all(lib.published == [] for lib in libs)


def test_processes_registering_different_buckets_are_told_which():
    libs, group, positions = make_group(2)

    def process(r):
        heap = IpcHeap.create(libs[r], group[r], 2, positions[r], r, False, 5.0)
        return heap.register(1000 if r == 0 else 999, "float32", f"layer{r}")

    _, errors = run_ranks(2, process)
    for e in errors:
        assert isinstance(e, ValueError)
        assert ("process 0: bucket #1 'layer0' of 1000 float32; process 1: bucket #1 'layer1' of 999 float32"
                in str(e))
    assert libs[0].freed == [101] and libs[1].freed == [201]


def test_a_process_that_cannot_open_the_control_block_fails_everyone_and_heaps_are_freed():
    libs, group, positions = make_group(2)
    original = libs[1].ipc_heap_create

    def broken(*args):
        raise ValueError("opening the heap's shared control block failed: No such file or directory")

    libs[1].ipc_heap_create = broken
    _, errors = run_ranks(2, lambda r: IpcHeap.create(libs[r], group[r], 2, positions[r], r, False, 5.0))
    assert all(isinstance(e, RuntimeError) and "ipc-heap-opened: process 1" in str(e) for e in errors)
    assert libs[0].freed == [("heap", 7)] and libs[0].unlinked  # the owner cleaned up its segment too
    libs[1].ipc_heap_create = original


def test_barrier_waits_for_every_process():
    libs, group, positions = make_group(2)
    order = []

    def process(r):
        heap = IpcHeap.create(libs[r], group[r], 2, positions[r], r, False, 5.0)
        if r == 1:
            threading.Event().wait(0.2)
        order.append(("before", r))
        heap.barrier("free-heap")
        order.append(("after", r))

    _, errors = run_ranks(2, process)
    assert errors == [None, None]
    assert {x for x, _ in order[:2]} == {"before"} and {x for x, _ in order[2:]} == {"after"}


# ---- processes sharing one GPU --------------------------------------------------------------------------------------

def test_xla_pool_fraction_reads_the_environment_like_jax():
    fraction = cuda_ipc.xla_pool_fraction
    assert fraction({}) == 0.75  # jax's default preallocation
    for off in ("false", "False", "0"):
        assert fraction({"XLA_PYTHON_CLIENT_PREALLOCATE": off, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}) == 0.0
    assert fraction({"XLA_PYTHON_CLIENT_PREALLOCATE": "true", "XLA_PYTHON_CLIENT_MEM_FRACTION": ".3"}) == 0.3
    assert fraction({"XLA_CLIENT_MEM_FRACTION": "0.2", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}) == 0.2  # newer name
    assert fraction({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}) == 0.0  # no pool at all
    assert fraction({"XLA_PYTHON_CLIENT_MEM_FRACTION": "lots"}) == 0.75


def _info(position, pci, pool):
    return {"position": position, "pci": pci, "xla_pool": pool}


def test_shared_gpu_warnings_name_the_gpu_the_positions_and_the_fix():
    a, b = "0000:1b:00.0", "0000:2c:00.0"
    assert cuda_ipc.positions_by_gpu([_info(1, a, 0), _info(0, a, 0), _info(2, b, 0)]) == {a: [0, 1], b: [2]}
    (message,) = cuda_ipc.shared_gpu_warnings([_info(0, a, 0.75), _info(1, a, 0.75)])
    assert message.startswith(f"GPU {a} is shared by the processes of positions [0, 1], whose XLA memory pools take "
                              "150% of it")
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in message and "XLA_PYTHON_CLIENT_MEM_FRACTION=0.40" in message
    assert cuda_ipc.shared_gpu_warnings([_info(0, a, 0.4), _info(1, a, 0.4)]) == []  # 20% left for the heap
    assert cuda_ipc.shared_gpu_warnings([_info(0, a, 0.75), _info(1, b, 0.75)]) == []  # one process per GPU
    assert cuda_ipc.shared_gpu_warnings([_info(0, a, 0.0), _info(1, a, 0.0)]) == []  # pools grow on demand
    three = cuda_ipc.shared_gpu_warnings([_info(p, a, 0.31) for p in range(3)] + [_info(3, b, 0.75)])
    assert len(three) == 1 and "positions [0, 1, 2]" in three[0] and "MEM_FRACTION=0.27" in three[0]


@pytest.mark.parametrize("preallocate", [True, False])
def test_processes_on_one_gpu_share_it_with_native_atomics(monkeypatch, preallocate):
    """Two processes on GPU 0: nothing to link (the other process's memory is on this GPU), so atomic mode stays;
    both know the GPU is shared, and both warn when their XLA pools leave it no room for the heap."""
    warned = []
    monkeypatch.setattr(cuda_ipc.warnings, "warn", lambda message, *a, **k: warned.append(message))
    environ = {} if preallocate else {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    libs, group, positions = make_group(2)
    results, errors = run_ranks(2, lambda r: IpcHeap.create(libs[r], group[r], 2, positions[r], 0, False, 5.0,
                                                            environ=environ))
    assert errors == [None, None]
    for heap, lib in zip(results, libs):
        assert heap.gpu_sharing == {"0000:00:00.0": [0, 1]} and heap.shared_gpu
        assert lib.links_asked == [""] and lib.created[0][2] is False  # no peer GPU; atomics
    assert len(warned) == (2 if preallocate else 0)
    assert all("GPU 0000:00:00.0 is shared by the processes of positions [0, 1]" in w for w in warned)


def test_processes_on_their_own_gpus_link_only_to_the_others():
    libs, group, positions = make_group(3)
    results, errors = run_ranks(3, lambda r: IpcHeap.create(libs[r], group[r], 3, positions[r], r, True, 5.0))
    assert errors == [None] * 3
    assert [lib.links_asked for lib in libs] == [["0000:01:00.0\n0000:02:00.0"], ["0000:00:00.0\n0000:02:00.0"],
                                                 ["0000:00:00.0\n0000:01:00.0"]]
    assert not any(heap.shared_gpu for heap in results)


# ---- the launcher of the GPU test's processes (tests/cuda_ipc_cases.py) -------------------------------------------

def test_processes_are_planned_on_one_gpu_or_one_each():
    import cuda_ipc_cases

    assert cuda_ipc_cases.plan_devices(2, 1, share=True) == [0, 0]
    assert cuda_ipc_cases.plan_devices(2, 8, share=True) == [0, 0]
    assert cuda_ipc_cases.plan_devices(3, 4, share=False) == [0, 1, 2]
    with pytest.raises(ValueError, match="one GPU per process needs 2 GPUs, this machine has 1"):
        cuda_ipc_cases.plan_devices(2, 1, share=False)
    with pytest.raises(ValueError, match="at least two processes"):
        cuda_ipc_cases.plan_devices(1, 1, share=True)


def test_launched_processes_cap_their_xla_pools():
    import cuda_ipc_cases

    env = cuda_ipc_cases.child_environment({"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "HOME": "/h"},
                                           root="/repo")
    assert "XLA_FLAGS" not in env and env["HOME"] == "/h"
    assert env["PYTHONPATH"].split(os.pathsep) == ["/repo", os.path.join("/repo", "tests")]
    kept = cuda_ipc_cases.child_environment({"PYTHONPATH": "/overlay/site"}, root="/repo")
    assert kept["PYTHONPATH"].split(os.pathsep) == ["/repo", os.path.join("/repo", "tests"), "/overlay/site"]
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" and cuda_ipc.xla_pool_fraction(env) == 0.0
    assert float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == cuda_ipc_cases.CHILD_POOL_FRACTION
    # jax refuses both fraction variables at once: the one the test process uses is the one set
    newer = cuda_ipc_cases.child_environment({"XLA_CLIENT_MEM_FRACTION": "0.75"})
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in newer
    assert float(newer["XLA_CLIENT_MEM_FRACTION"]) == cuda_ipc_cases.CHILD_POOL_FRACTION
    infos = [_info(p, "0000:00:00.0", cuda_ipc.xla_pool_fraction(env)) for p in range(2)]
    assert cuda_ipc.shared_gpu_warnings(infos) == []


def test_process_timeout_comes_from_the_environment():
    import cuda_ipc_cases

    assert cuda_ipc_cases.process_timeout_s(300.0, {}) == 300.0
    assert cuda_ipc_cases.process_timeout_s(300.0, {"JODC_TEST_PROCESS_TIMEOUT_S": "90"}) == 90.0
    with pytest.raises(ValueError, match="JODC_TEST_PROCESS_TIMEOUT_S must be a positive number"):
        cuda_ipc_cases.process_timeout_s(300.0, {"JODC_TEST_PROCESS_TIMEOUT_S": "0"})


def test_case_options_are_checked_before_jax_starts():
    import cuda_ipc_cases

    base = ["--process-id", "1", "--num-processes", "2", "--port", "1234", "--device-id", "0"]
    args = cuda_ipc_cases.parse_args(base + ["--faults"])
    assert args.modes == ["atomic", "deterministic"] and args.faults and args.transport == "auto"
    assert cuda_ipc_cases.parse_args(base + ["--modes", "deterministic"]).modes == ["deterministic"]
    for bad in (["--modes", "fast"], ["--transport", "nvshmem", "--faults"]):
        with pytest.raises(SystemExit):
            cuda_ipc_cases.parse_args(base + bad)


def _script(tmp_path, body):
    path = tmp_path / "child.py"
    path.write_text("import sys, time\nargs = sys.argv[1:]\nme = int(args[args.index('--process-id') + 1])\n" + body)
    return str(path)


def test_launch_runs_every_process_with_its_gpu_and_collects_output(tmp_path):
    import cuda_ipc_cases

    script = _script(tmp_path, "print('ARGS', ' '.join(args))\n")
    results = cuda_ipc_cases.launch(2, 1, share=True, timeout_s=60, case_args=["--faults"], script=script)
    assert [code for code, _ in results] == [0, 0]
    for i, (_, out) in enumerate(results):
        assert f"--process-id {i} --num-processes 2 --port " in out and "--device-id 0 --faults" in out


def test_launch_ends_the_others_when_one_fails_and_everyone_at_the_deadline(tmp_path):
    import cuda_ipc_cases

    script = _script(tmp_path, "if me == 1:\n    print('broken'); sys.exit(3)\ntime.sleep(60)\n")
    start = time.monotonic()
    results = cuda_ipc_cases.launch(2, 2, share=False, timeout_s=60, script=script)
    assert time.monotonic() - start < 30  # not the 60 s process 0 would have slept
    assert results[1] == (3, "broken\n") and results[0][0] is None
    script = _script(tmp_path, "time.sleep(60)\n")
    start = time.monotonic()
    results = cuda_ipc_cases.launch(2, 1, share=True, timeout_s=1.0, script=script)
    assert time.monotonic() - start < 30 and [code for code, _ in results] == [None, None]


# ---- NVSHMEM: initialisation from one unique id, collective registration, the op targets ---------------------------

class FakeNvshmemLibrary:
    def __init__(self):
        self.inits, self.registered = [], []

    def unique_id(self):
        return b"uid-" + bytes(range(8))

    def init(self, rank, nranks, uid, gpu):
        self.inits.append((rank, nranks, uid, gpu))

    def bucket_register(self, heap_id, numel, dtype):
        self.registered.append((numel, dtype))
        return len(self.registered)


def test_nvshmem_processes_share_one_unique_id():
    from jodc.ops.transports import nvshmem_library

    group = LocalExchange.group(3)
    libs = [FakeNvshmemLibrary() for _ in range(3)]
    results, errors = run_ranks(3, lambda r: nvshmem_library.share_unique_id(libs[r], group[r]))
    assert errors == [None] * 3 and results == [libs[0].unique_id()] * 3


def test_nvshmem_initialize_once_per_process(monkeypatch):
    from jodc.ops.transports import nvshmem_library

    monkeypatch.setattr(nvshmem_library, "_initialized", None)
    lib = FakeNvshmemLibrary()
    exchange = LocalExchange.group(1)[0]
    nvshmem_library.initialize(lib, exchange, 0, 1, gpu=0)
    nvshmem_library.initialize(lib, exchange, 0, 1, gpu=0)  # a second heap over the same layout reuses NVSHMEM
    assert len(lib.inits) == 1
    with pytest.raises(ValueError, match=r"already runs here as PE 0 of 1; .* \(PE 1 of 2\)"):
        nvshmem_library.initialize(lib, exchange, 1, 2, gpu=0)


def test_nvshmem_registration_is_checked_across_processes():
    from jodc.ops.transports import nvshmem_library

    group = LocalExchange.group(2)
    libs = [FakeNvshmemLibrary() for _ in range(2)]
    heaps = [nvshmem_library.NvshmemHeap(libs[r], group[r], 5) for r in range(2)]
    results, errors = run_ranks(2, lambda r: heaps[r].register(64, "float32", "a"))
    assert errors == [None, None] and results == [1, 1]
    _, errors = run_ranks(2, lambda r: heaps[r].register(64 + r, "float32", f"b{r}"))
    assert all(isinstance(e, ValueError) and "process 1: 'b1' of 65 float32" in str(e) for e in errors)
    assert [len(lib.registered) for lib in libs] == [1, 1]  # nothing allocated on a mismatch


def test_ops_target_the_transports_handlers():
    from jodc.ops import _call

    for transport, prefix in (("local", "jodc_"), ("cuda_ipc", "jodc_"), ("mpi", "jodc_mpi_"),
                              ("nvshmem", "jodc_nvshmem_")):
        assert _call.target(types.SimpleNamespace(transport=transport), "gather") == prefix + "gather"


def test_missing_nvshmem_build_names_the_wheel(monkeypatch, tmp_path):
    from jodc.ops.transports import nvshmem_library

    monkeypatch.setattr(nvshmem_library, "_library", None)
    monkeypatch.setattr(nvshmem_library, "default_path", lambda: str(tmp_path / "_ffi_nvshmem.so"))
    with pytest.raises(ImportError, match="NVSHMEM backend .* not built: .*nvidia-nvshmem-cu12"):
        nvshmem_library.library()
