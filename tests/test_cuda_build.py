"""The CUDA kernels compile and link (sm_80 and sm_90) with the build's own nvcc command, export every symbol the
Python side needs, and load without a GPU. Needs only nvcc: a broken kernel fails here, on machines with no GPU.

One nvcc invocation for the whole module (about 30 s on two cores); skipped where nvcc is not on PATH.
"""
import os
import shutil
import subprocess
import sys
import time

import jax
import pytest

from jodc import _ffi
from jodc.ops import _cuda, _targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "ffi"))
import build_cuda  # noqa: E402  (ffi/build_cuda.py: the nvcc command line setup.py uses)

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


@pytest.fixture(scope="module")
def built_library(tmp_path_factory):
    """Builds the CUDA library once into a temporary directory; returns (path, seconds the build took)."""
    out = str(tmp_path_factory.mktemp("cuda_build") / "_ffi_cuda.so")
    start = time.perf_counter()
    build_cuda.build(out, jax.ffi.include_dir())
    return out, time.perf_counter() - start


def exported_symbols(path: str) -> set[str] | None:
    """Names of the library's defined dynamic symbols (None when binutils' nm is unavailable)."""
    nm = shutil.which("nm")
    if nm is None:
        return None
    listing = subprocess.run([nm, "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in listing.splitlines() if line.strip()}


def test_command_targets_sm80_and_sm90_from_every_source():
    cmd = build_cuda.nvcc_command("/tmp/out.so", "/include")
    pairs = list(zip(cmd, cmd[1:]))
    for arch in ("80", "90"):
        assert ("-gencode", f"arch=compute_{arch},code=sm_{arch}") in pairs
    sources = [a for a in cmd if a.endswith(".cu")]
    expected = {"gather.cu", "scatter_accumulate.cu", "barrier.cu", "accumulator.cu", "publish.cu", "heap.cu",
                "management.cu"}
    assert expected <= {os.path.basename(s) for s in sources}
    assert "-lcuda" not in cmd  # runtime API only: links without a driver or its stubs


def test_library_builds_and_exports_exactly_the_api(built_library):
    path, seconds = built_library
    assert os.path.getsize(path) > 0
    print(f"nvcc build of the CUDA library: {seconds:.1f} s")
    symbols = exported_symbols(path)
    if symbols is None:
        pytest.skip("nm is not available to list the exports")
    ours = {s for s in symbols if s.lower().startswith("jodc")}
    # every symbol the Python side binds is exported, and nothing else of ours leaks (-fvisibility=hidden works)
    assert ours == set(_cuda.EXPORTED_SYMBOLS), (sorted(set(_cuda.EXPORTED_SYMBOLS) - ours),
                                                 sorted(ours - set(_cuda.EXPORTED_SYMBOLS)))


def test_library_loads_and_reports_errors_without_a_gpu(built_library):
    path, _ = built_library
    try:
        lib = _cuda.CudaLibrary(path)
    except OSError as e:  # the runtime is linked statically, so this should not happen; be explicit if it does
        if "libcuda" in str(e):
            pytest.skip(f"loading needs the CUDA driver here: {e}")
        raise
    handlers = lib.handlers()
    assert sorted(handlers) == sorted(_targets.expected_targets("local"))  # ffi/common/ops.h's table
    # the layout math is the same code as the CPU side's (ffi/common/layout.h)
    for numel, world, master_bytes in [(1, 1, 4), (1, 8, 2), (17, 3, 4), (10**6 + 1, 8, 2), (123457, 7, 4),
                                       (2**62, 4, 4), (2**63 - 1, 1, 4), (2**63 - 1, 3, 2), (0, 4, 4), (10, 4, 3)]:
        assert lib.shard_numel(numel, world, master_bytes) == _ffi.shard_numel(numel, world, master_bytes)
    assert lib.shard_numel(2**63 - 1, 1, 4) == -1  # overflow is refused, not wrapped, on both sides
    assert lib.live_heaps() == 0 and lib.live_bytes() == 0
    with pytest.raises(ValueError, match=r"world size must be in \[1, 64\]"):
        lib.heap_create(0, False, 1.0)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="barrier timeout must be > 0"):
            lib.heap_create(2, False, bad)
    with pytest.raises(ValueError, match="heap 12345 is not registered"):
        lib.heap_free(12345)
    with pytest.raises(ValueError, match="master dtype must be float32 or bfloat16, got int8"):
        lib.bucket_register(12345, 10, "int8")
    try:
        gpus = lib.device_count()
    except ValueError as e:
        assert "cudaGetDeviceCount" in str(e)
        gpus = 0
    if gpus == 0:
        with pytest.raises(ValueError, match="no usable CUDA device|no CUDA device"):
            lib.heap_create(2, False, 1.0)
        assert lib.live_heaps() == 0
