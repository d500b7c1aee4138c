"""Host-side logic of the CUDA backend that runs without a GPU (and without nvcc): the PJRT client check (issue 15
defect 8), the placement passed at heap creation (defect 2), the refusal of meshes a GPU heap cannot serve (defect 1:
a second axis of size > 1, devices of other processes), and the consistency of the C API's declarations with
the sources. The kernels themselves run in tests/test_ops_cuda.py on GPU runners; the build in `make cuda-check`.
"""
import dataclasses
import os
import re
import types

import numpy as np
import pytest

from jodc.ops.transports import cuda_library
from jodc.ops import heap as heap_module
from jodc.ops.transports import local

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class FakeGpu:
    """What jodc reads of a jax GPU device (hashable, like one)."""

    local_hardware_id: int
    process_index: int = 0
    platform: str = "gpu"

    @property
    def id(self):
        return 100 + self.local_hardware_id


def fake_gpu(hw_id, process=0):
    return FakeGpu(hw_id, process)


class RecordingLibrary:
    """Stands in for the CUDA library: records heap_create's arguments."""

    def __init__(self):
        self.calls = []

    def heap_create(self, *args):
        self.calls.append(args)
        return 7


# ---- defect 8: PJRT clients the blocking barrier cannot serve ---------------------------------------------------

@pytest.mark.parametrize("value", ["1", "2", " 1 "])
def test_tfrt_gpu_client_is_refused_naming_the_variable(value):
    with pytest.raises(ValueError, match=r"TFRT GPU client \(XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1\).*deadlock"):
        cuda_library.check_pjrt_client({"XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": value})


@pytest.mark.parametrize("environ", [{}, {"XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "0"},
                                     {"XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": ""},
                                     {"XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "no"}])
def test_default_gpu_client_is_accepted(environ):
    cuda_library.check_pjrt_client(environ)  # "no" is jax's own error (int("no")), not a TFRT client


def test_gpu_heap_creation_checks_the_client_before_touching_the_library(monkeypatch):
    lib = RecordingLibrary()
    monkeypatch.setenv("XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT", "1")
    with pytest.raises(ValueError, match="TFRT GPU client"):
        local.create_gpu_heap(lib, [fake_gpu(0), fake_gpu(1)], False, 10.0)
    assert lib.calls == []


# ---- defect 2: the placement travels with heap creation -----------------------------------------------------------

def test_gpu_heap_is_created_with_its_mesh_placement(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT", raising=False)
    lib = RecordingLibrary()
    # a mesh over GPUs 3 and 1 (in that order): nothing may be created on GPU 0 or 2
    heap_id = local.create_gpu_heap(lib, np.array([fake_gpu(3), fake_gpu(1)]), True, 5.0)
    assert heap_id == 7
    assert lib.calls == [(2, True, 5.0, [3, 1])]


def test_cpu_heap_creation_is_unchanged(monkeypatch):
    lib = RecordingLibrary()
    monkeypatch.setattr(local.registration, "cpu_library", lambda: lib)
    monkeypatch.setattr(local.registration, "ensure_registered", lambda platform: None)
    transport = local.LocalCpuTransport([types.SimpleNamespace(process_index=0)] * 3, False, 1.0)
    assert lib.calls == [(3, False, 1.0)] and transport.heap_id == 7 and transport.name == "local"


def test_placement_refuses_shared_or_unknown_gpus():
    assert cuda_library.placement_of([fake_gpu(2), fake_gpu(0), fake_gpu(1)]) == [2, 0, 1]
    with pytest.raises(ValueError, match="positions 0 and 2 of the mesh are both CUDA device 1"):
        cuda_library.placement_of([fake_gpu(1), fake_gpu(0), fake_gpu(1)])
    with pytest.raises(ValueError, match="no local CUDA ordinal"):
        cuda_library.placement_of([fake_gpu(0), types.SimpleNamespace(platform="gpu")])
    with pytest.raises(ValueError, match="no local CUDA ordinal"):
        cuda_library.placement_of([fake_gpu(-1)])


# ---- defect 1: meshes a GPU heap cannot serve, refused through SymmetricHeap before the library is touched --------

class FakeMesh:
    """What SymmetricHeap reads of a jax Mesh (shape, devices, axis_names), over fake GPUs: a real GPU Mesh cannot be
    built on a machine without GPUs."""

    def __init__(self, devices, axis_names):
        flat = np.array(devices, dtype=object)
        self.devices = flat.reshape(flat.shape[:len(axis_names)])
        self.axis_names = tuple(axis_names)
        self.shape = dict(zip(self.axis_names, self.devices.shape))


class PlacementLibrary(RecordingLibrary):
    def heap_free(self, heap_id):
        self.calls.append(("free", heap_id))


@pytest.fixture
def gpu_backend(monkeypatch):
    """The CUDA library as a recorder, and target registration a no-op: the test sees exactly what reached them."""
    monkeypatch.delenv("XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT", raising=False)
    lib = PlacementLibrary()
    monkeypatch.setattr(cuda_library, "library", lambda: lib)
    monkeypatch.setattr(local.registration, "ensure_registered", lambda platform: lib.calls.append(("reg", platform)))
    return lib


def _grid(rows, cols, process=0):
    return [[fake_gpu(r * cols + c, process) for c in range(cols)] for r in range(rows)]


def test_gpu_heap_refuses_a_second_axis_of_size_above_one(gpu_backend):
    """A 2-D GPU mesh: several GPUs would act as the same position (racing on its barrier counter, pushing each
    gradient k times). Refused on the CUDA path as on CPU, before any library call."""
    with pytest.raises(ValueError, match=r"shared by the replicas along \{'x': 2\}.*share barrier counters"):
        heap_module.SymmetricHeap(FakeMesh(_grid(2, 2), ("d", "x")))
    with pytest.raises(ValueError, match=r"replicas along \{'d': 4\}"):
        heap_module.SymmetricHeap(FakeMesh(_grid(4, 1), ("d", "x")), axis_name="x")
    assert gpu_backend.calls == []


def test_gpu_heap_refuses_devices_of_other_processes(gpu_backend, monkeypatch):
    monkeypatch.setattr(heap_module.jax, "process_index", lambda *a, **k: 0)
    # every GPU belongs to process 1: one process, so no multi-process transport applies, and this process has none
    with pytest.raises(ValueError, match=r"devices of process\(es\) \[1\], but this process is 0"):
        heap_module.SymmetricHeap(FakeMesh([fake_gpu(0, 1), fake_gpu(1, 1)], ("d",)))
    # GPUs of processes 0 and 1 cannot share an in-process heap
    with pytest.raises(ValueError, match=r"transport='local' cannot serve a mesh over processes \[0, 1\]"):
        heap_module.SymmetricHeap(FakeMesh([fake_gpu(0, 0), fake_gpu(0, 1)], ("d",)), transport="local")
    assert gpu_backend.calls == []


def test_gpu_heap_over_one_axis_reaches_the_library_with_its_placement(gpu_backend, monkeypatch):
    """The accepted case on the same path: axes of size 1 besides the heap's are harmless, and position p's memory
    goes on the GPU running position p."""
    monkeypatch.setattr(heap_module.jax, "process_index", lambda *a, **k: 0)
    devices = [[fake_gpu(2)], [fake_gpu(0)], [fake_gpu(1)]]
    heap = heap_module.SymmetricHeap(FakeMesh(devices, ("d", "x")), deterministic=True, barrier_timeout_s=7.0)
    assert heap.transport == "local" and heap.world == 3 and heap.platform == "gpu"
    assert gpu_backend.calls == [("reg", "gpu"), (3, True, 7.0, [2, 0, 1])]
    assert [heap.positions[d[0]] for d in devices] == [0, 1, 2]
    heap.free()
    assert gpu_backend.calls[-1] == ("free", 7)


# ---- defect 5: every handler of a heap op aborts its heap when it fails -----------------------------------------------

def _handler_functions(backend: str) -> dict[str, str]:
    """{Camel op name: source of the function its JODC_<BACKEND>_HANDLER(Camel, impl) line names} of ffi/<backend>."""
    folder = os.path.join(ROOT, "ffi", backend)
    found = {}
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".cu"):
            continue
        text = open(os.path.join(folder, name)).read()
        for camel, impl in re.findall(rf"^JODC_{backend.upper()}_HANDLER\((\w+),\s*([\w:]+)\);", text, re.M):
            func = impl.split("::")[-1]
            start = re.search(rf"^ffi::Error {func}\(", text, re.M)
            assert start, f"{name}: no definition of {func} (the handler of {camel})"
            end = text.index("\n}\n", start.start())
            found[camel] = text[start.start():end]
    return found


@pytest.mark.parametrize("backend", ["cuda", "nvshmem"])
def test_every_heap_op_handler_aborts_its_heap_on_error(backend):
    """Issue 15 defect 5: a handler that fails must poison its heap (peers spinning in a barrier for that device leave
    at once): each heap op's handler runs inside RunOp or returns through AbortOnError. The GPU run checks that the
    abort releases a waiting barrier (tests/test_ops_cuda.py, test_stress_c_a_handler_error_...)."""
    from jodc.ops.transports import target_names

    handlers = _handler_functions(backend)
    camel = {op: "".join(w.title() for w in op.split("_")) for op in target_names.HEAP_OPS}
    assert set(camel.values()) <= set(handlers), sorted(set(camel.values()) - set(handlers))
    for op, name in camel.items():
        body = handlers[name]
        assert re.search(r"\breturn (RunOp|AbortOnError)\(", body), f"{backend} {op}: errors do not abort the heap"


def test_every_cuda_handler_selects_the_streams_gpu_before_launching():
    """Issue 15 defect 6: after / depend_on did not select the stream's GPU. Heap ops do it in their preamble (RunOp,
    or the barrier's Prepare); the token ops call SelectStreamDevice themselves, before any launch or copy."""
    from jodc.ops.transports import target_names

    handlers = _handler_functions("cuda")
    for op in target_names.ALL_OPS:
        body = handlers["".join(w.title() for w in op.split("_"))]
        if op in target_names.HEAP_OPS:
            assert "RunOp(" in body or "Impl(" in body, op
            continue
        select = body.find("SelectStreamDevice(")
        work = min(i for i in (body.find("<<<"), body.find("ForwardValues("), body.find("cudaMemcpy")) if i >= 0)
        assert 0 <= select < work, f"{op}: launches before selecting the stream's GPU"
    barrier = open(os.path.join(ROOT, "ffi", "cuda", "barrier.cu")).read()
    assert re.search(r"BarrierImpl\([^)]*\) \{\n(.*\n){0,3}.*Prepare\(\"barrier\"", barrier)


# ---- the C API as declared by the sources -------------------------------------------------------------------------

def _exported_by_sources() -> set[str]:
    names = set()
    for name in os.listdir(os.path.join(ROOT, "ffi", "cuda")):
        if not name.endswith((".cu", ".cuh")):
            continue
        text = open(os.path.join(ROOT, "ffi", "cuda", name)).read()
        names.update(re.findall(r"JODC_EXPORT\s+[\w:*\s]+?\b(jodc_cuda_\w+)\s*\(", text))
        names.update(re.findall(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\(\s*(\w+)", text))
    return names


def test_python_binds_exactly_what_the_sources_export():
    """The cheap twin of `make cuda-check`'s symbol check (which reads the built library with nm): a C function added,
    renamed or removed without its ctypes signature fails here, in the CPU suite, without nvcc."""
    assert _exported_by_sources() == set(cuda_library.EXPORTED_SYMBOLS)


def test_heap_create_signature_carries_the_placement():
    restype, argtypes, fallible = cuda_library._SIGNATURES["jodc_cuda_heap_create"]
    # world, deterministic, timeout, placement array, placement count, out id
    assert len(argtypes) == 6 and fallible
    assert "jodc_cuda_heap_set_placement" not in cuda_library._SIGNATURES  # placement is fixed at creation


# ---- the GPU runner's report and its check that the CUDA tests ran --------------------------------------------------

class FakeCudaLibrary:
    def versions(self):
        return 12090, 13000

    def device_info(self, gpu):
        return {"name": f"NVIDIA H100 #{gpu}", "compute_capability": (9, 0), "total_bytes": 80 * 2**30}

    def peer_info(self, a, b):
        return True, (a, b) != (1, 2)  # GPU 1 -> 2 lacks native atomics (a PCIe pair)


def test_report_names_gpus_driver_pairs_and_transport():
    import cuda_report  # tools/

    text = cuda_report.describe(FakeCudaLibrary(), [0, 1, 2], "local", True)
    assert "CUDA driver 12.9, runtime 13.0 (jodc's library), 3 GPU(s)" in text
    assert "GPU 2: NVIDIA H100 #2, sm_90, 80.0 GiB" in text
    rows = [line for line in text.splitlines() if line.startswith("      1 ")]
    assert rows == ["      1     P/A       -     P/."]
    assert text.endswith("transport in use: local, accumulation: landing slots")
    single = cuda_report.describe(FakeCudaLibrary(), [0])
    assert "peer access" not in single and "transport" not in single


def _junit(tmp_path, cases):
    body = "".join(
        f'<testcase classname="tests.{f}" name="{n}">' + (f'<skipped message="{why}"/>' if why else "") + "</testcase>"
        for f, n, why in cases)
    path = tmp_path / "junit.xml"
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
    return str(path)


def test_junit_check_fails_when_cuda_tests_skip_for_software_reasons(tmp_path):
    import cuda_report  # tools/

    ok, msg = cuda_report.check_junit(_junit(tmp_path, [
        ("test_ops_cuda", "test_a", None),
        ("test_ops_cuda", "test_b", "needs two GPUs for a mesh barrier"),
        ("test_ops", "test_c", "whatever"),  # not a CUDA test
    ]))
    assert ok and msg == "1 CUDA tests ran"
    ok, msg = cuda_report.check_junit(_junit(tmp_path, [
        ("test_ops_cuda", "test_a", None), ("test_ops_cuda", "test_d", "compute-sanitizer is not on PATH")]))
    assert not ok and "test_d: compute-sanitizer is not on PATH" in msg
    ok, msg = cuda_report.check_junit(_junit(tmp_path, [("test_ops", "test_c", None)]))
    assert not ok and "no CUDA test ran" in msg
    assert cuda_report.main(["--check-junit", _junit(tmp_path, [("test_ops_cuda", "t", None)])]) == 0


def test_nvshmem_python_binds_exactly_what_its_sources_export():
    from jodc.ops.transports import nvshmem_library

    names = set()
    folder = os.path.join(ROOT, "ffi", "nvshmem")
    for name in os.listdir(folder):
        if name.endswith((".cu", ".cuh")):
            text = open(os.path.join(folder, name)).read()
            names.update(re.findall(r"JODC_NVSHMEM_EXPORT\s+[\w:*\s]+?\b(jodc_nvshmem_\w+)\s*\(", text))
    # the handlers stay hidden: Python reads them through the exported table
    assert "jodc_nvshmem_handlers" in names
    assert names == set(nvshmem_library.EXPORTED_SYMBOLS)
