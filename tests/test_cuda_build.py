"""The CUDA kernels compile and link (sm_80 and sm_90) with the build's own nvcc command, export every symbol the
Python side needs, and load without a GPU. Needs only nvcc: a broken kernel fails here, on machines with no GPU.

The compile (about a minute on two cores) is `make cuda-check`'s job, which CI runs (.ci/run): it builds
build/cuda-check/_ffi_cuda.so and then runs this module with JODC_CUDA_CHECK_LIBRARY naming it. In the plain suite
the tests that need the library skip with that reason, so `make test` pays no nvcc time; the command-line checks run
everywhere.
"""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from jodc import _ffi
from jodc.ops.transports import cuda_library, nvshmem_library, target_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import build_cuda  # noqa: E402  (ffi/build_cuda.py: the nvcc command line setup.py uses)
import build_nvshmem  # noqa: E402  (ffi/build_nvshmem.py: the NVSHMEM backend's)

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


CHECK_LIBRARY_ENV = "JODC_CUDA_CHECK_LIBRARY"


@pytest.fixture(scope="module")
def built_library():
    """The library `make cuda-check` just built (path, 0.0); skips in the plain suite (no compile time there)."""
    path = os.environ.get(CHECK_LIBRARY_ENV)
    if not path:
        pytest.skip(f"built and checked by `make cuda-check` ({CHECK_LIBRARY_ENV} unset)")
    assert os.path.isfile(path), f"{CHECK_LIBRARY_ENV}={path} does not exist: run `make cuda-check`"
    return path, 0.0


def exported_symbols(path: str) -> set[str] | None:
    """Names of the library's defined dynamic symbols (None when binutils' nm is unavailable)."""
    nm = shutil.which("nm")
    if nm is None:
        return None
    listing = subprocess.run([nm, "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in listing.splitlines() if line.strip()}


def assert_exports_exactly(path: str, expected) -> None:
    """Every symbol the Python side binds is exported by the library at `path`, and nothing else of ours leaks
    (-fvisibility=hidden works). Skips when nm is unavailable."""
    symbols = exported_symbols(path)
    if symbols is None:
        pytest.skip("nm is not available to list the exports")
    ours = {s for s in symbols if s.lower().startswith("jodc")}
    assert ours == set(expected), (sorted(set(expected) - ours), sorted(ours - set(expected)))


def test_every_source_compiles_to_its_own_object_for_sm80_and_sm90():
    objects = {build_cuda.object_path("/b", s) for s in build_cuda.sources()}
    assert len(objects) == len(build_cuda.sources())  # one object per source, none shared
    names = {os.path.basename(s) for s in build_cuda.sources()}
    assert {"gather.cu", "scatter_accumulate.cu", "barrier.cu", "accumulator.cu", "publish.cu", "heap.cu",
            "management.cu", "diagnostics.cu", "after.cu", "depend_on.cu", "ipc.cu", "errors.cu"} <= names
    source = os.path.join(ROOT, "ffi", "cuda", "gather.cu")
    cmd = build_cuda.compile_command(source, "/b/cuda_gather.o", "/include")
    pairs = list(zip(cmd, cmd[1:]))
    for arch in ("80", "90"):
        assert ("-gencode", f"arch=compute_{arch},code=sm_{arch}") in pairs
    assert "-c" in cmd and cmd[-3:] == [source, "-o", "/b/cuda_gather.o"] and ("-isystem", "/include") in pairs
    assert "--keep" not in cmd
    assert "-lineinfo" in cmd  # compute-sanitizer names source lines
    kept = build_cuda.compile_command(source, "/b/cuda_gather.o", "/include", keep_dir="/tmp/keep")
    assert ("--keep-dir", "/tmp/keep") in list(zip(kept, kept[1:]))
    only90 = build_cuda.compile_command(source, "/b/cuda_gather.o", "/include", archs=("90",))
    assert [a for a in only90 if a.startswith("arch=")] == ["arch=compute_90,code=sm_90"]
    link = build_cuda.link_command(["/b/a.o", "/b/b.o"], "/tmp/out.so")
    assert "-shared" in link and ("-cudart", "static") in list(zip(link, link[1:]))
    assert link[-4:] == ["/b/b.o", "-lrt", "-o", "/tmp/out.so"]
    assert "-lcuda" not in link  # runtime API only: links without a driver or its stubs


def test_archs_and_jobs_options():
    assert build_cuda.parse_archs("90") == ("90",)
    assert build_cuda.parse_archs(" 90,80,90 ") == ("80", "90")
    assert build_cuda.parse_archs("90a") == ("90a",)
    for bad in ("", "sm_90", "9", "80;90", "compute_90"):
        with pytest.raises(ValueError, match="compute capabilities separated by commas"):
            build_cuda.parse_archs(bad)
    assert build_cuda.default_jobs() >= 1


def _fake_compiler(tmp_path, fail=()):
    """compile_for / link_for that run Python instead of nvcc: each 'object' holds its source's name, the 'library'
    their concatenation; sources named in `fail` exit 1 with a message."""
    def compile_for(source, obj):
        code = (f"import sys; print('error in {source}'); sys.exit(1)" if source in fail else
                f"open({obj!r}, 'w').write({source!r} + '\\n')")
        return [sys.executable, "-c", code]

    def link_for(objects):
        out = str(tmp_path / "lib.so")
        return [sys.executable, "-c", f"open({out!r}, 'w').write(''.join(open(o).read() for o in {objects!r}))"]

    return compile_for, link_for


def test_parallel_build_compiles_each_source_then_links_once(tmp_path):
    sources = [f"/src/cuda/k{i}.cu" for i in range(6)]
    compile_for, link_for = _fake_compiler(tmp_path)
    out = build_cuda.build_objects(sources, str(tmp_path / "lib.so"), compile_for, link_for, jobs=3,
                                   build_dir=str(tmp_path / "objs"))
    assert open(out).read().split() == sources  # every object, linked in source order
    assert sorted(os.listdir(tmp_path / "objs")) == [f"cuda_k{i}.o" for i in range(6)]  # kept where asked
    before = set(os.listdir(tempfile.gettempdir()))
    build_cuda.build_objects(sources, str(tmp_path / "lib.so"), compile_for, link_for, jobs=1)
    leftovers = {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("jodc-nvcc-")}
    assert leftovers == set()  # the temporary build directory is removed
    with pytest.raises(ValueError, match="jobs must be at least 1"):
        build_cuda.build_objects(sources, str(tmp_path / "lib.so"), compile_for, link_for, jobs=0)


def test_parallel_build_reports_every_failing_source_and_does_not_link(tmp_path):
    sources = [f"/src/cuda/k{i}.cu" for i in range(4)]
    compile_for, link_for = _fake_compiler(tmp_path, fail={sources[1], sources[3]})
    with pytest.raises(RuntimeError, match=r"2 of 4 CUDA sources failed to compile") as info:
        build_cuda.build_objects(sources, str(tmp_path / "lib.so"), compile_for, link_for, jobs=2)
    assert f"error in {sources[1]}" in str(info.value) and f"error in {sources[3]}" in str(info.value)
    assert not (tmp_path / "lib.so").exists()


def test_reduction_check_reads_the_kept_ptx(tmp_path):
    """The PTX check of `make cuda-check` (defect 4): sm_90 must use the vector reduction, sm_80 must not."""
    good = {"80": "red.global.sys.add.f32 [%rd1], %f1;", "90": f"{build_cuda.VECTOR_RED} [%rd1], {{%f1, %f2, %f3, "
                                                                 "%f4}};\nred.global.sys.add.f32 [%rd2], %f5;"}
    for arch, text in good.items():
        (tmp_path / f"scatter_accumulate.compute_{arch}.ptx").write_text(text)
    lines = build_cuda.check_reductions(str(tmp_path))
    assert lines == ["sm_80: 0 vector + 1 scalar f32 reductions in scatter_accumulate",
                     "sm_90: 1 vector + 1 scalar f32 reductions in scatter_accumulate"]
    assert build_cuda.check_reductions(str(tmp_path), archs=("90",)) == lines[1:]  # a build for sm_90 only
    single = tmp_path / "single"  # nvcc names the PTX of a one-architecture build <stem>.ptx
    single.mkdir()
    (single / "scatter_accumulate.ptx").write_text(good["90"])
    only = build_cuda.kept_ptx(str(single), "scatter_accumulate", "90", ("90",))
    assert only == [str(single / "scatter_accumulate.ptx")]
    assert build_cuda.kept_ptx(str(single), "scatter_accumulate", "90", ("80", "90")) == []
    assert build_cuda.check_reductions(str(single), archs=("90",)) == lines[1:]
    (tmp_path / "scatter_accumulate.compute_90.ptx").write_text(good["80"])
    with pytest.raises(RuntimeError, match="sm_90 scatter kernel has no red.relaxed.sys.global.add.v4.f32"):
        build_cuda.check_reductions(str(tmp_path))
    (tmp_path / "scatter_accumulate.compute_90.ptx").write_text(good["90"])
    (tmp_path / "scatter_accumulate.compute_80.ptx").write_text(good["90"])
    with pytest.raises(RuntimeError, match="sm_80 scatter kernel uses .* which needs sm_90"):
        build_cuda.check_reductions(str(tmp_path))


def test_library_builds_and_exports_exactly_the_api(built_library):
    path, seconds = built_library
    assert os.path.getsize(path) > 0
    assert_exports_exactly(path, cuda_library.EXPORTED_SYMBOLS)


def test_library_loads_and_reports_errors_without_a_gpu(built_library):
    path, _ = built_library
    try:
        lib = cuda_library.CudaLibrary(path)
    except OSError as e:  # the runtime is linked statically, so this should not happen; be explicit if it does
        if "libcuda" in str(e):
            pytest.skip(f"loading needs the CUDA driver here: {e}")
        raise
    handlers = lib.handlers()
    assert sorted(handlers) == sorted(target_names.expected_targets("local", "cuda"))  # ffi/common/ops.h's table
    # the layout math is the same code as the CPU side's (ffi/common/layout.h)
    for numel, world, master_bytes in [(1, 1, 4), (1, 8, 2), (17, 3, 4), (10**6 + 1, 8, 2), (123457, 7, 4),
                                       (2**62, 4, 4), (2**63 - 1, 1, 4), (2**63 - 1, 3, 2), (0, 4, 4), (10, 4, 3)]:
        assert lib.shard_numel(numel, world, master_bytes) == _ffi.shard_numel(numel, world, master_bytes)
    assert lib.shard_numel(2**63 - 1, 1, 4) == -1  # overflow is refused, not wrapped, on both sides
    assert lib.live_heaps() == 0 and lib.live_bytes() == 0
    with pytest.raises(ValueError, match=r"world size must be in \[1, 64\]"):
        lib.heap_create(0, False, 1.0)
    with pytest.raises(ValueError, match="placement lists 1 GPUs for a heap of 2 devices|no usable CUDA device|no CUDA"):
        lib.heap_create(2, False, 1.0, [0])
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


NVSHMEM_CHECK_ENV = "JODC_NVSHMEM_CHECK_LIBRARY"


def test_nvshmem_commands_are_relocatable_and_link_the_wheel():
    source = os.path.join(ROOT, "ffi", "nvshmem", "gather.cu")
    cmd = build_nvshmem.compile_command(source, "/b/nvshmem_gather.o", "/include", "/wheel")
    pairs = list(zip(cmd, cmd[1:]))
    assert "-rdc=true" in cmd and "-c" in cmd and ("-isystem", "/wheel/include") in pairs
    for arch in ("80", "90"):
        assert ("-gencode", f"arch=compute_{arch},code=sm_{arch}") in pairs
    link = build_nvshmem.link_command(["/b/nvshmem_gather.o"], "/tmp/out.so", "/wheel", archs=("90",))
    assert "-rdc=true" in link and "-lnvshmem_device" in link and "-l:libnvshmem_host.so.3" in link
    assert ("-L", "/wheel/lib") in list(zip(link, link[1:])) and "-rpath,/wheel/lib" in link
    assert [a for a in link if a.startswith("arch=")] == ["arch=compute_90,code=sm_90"]  # the device link's archs
    names = [os.path.basename(s) for s in build_nvshmem.sources()]
    assert {"gather.cu", "scatter_accumulate.cu", "barrier.cu", "accumulator.cu", "publish.cu", "heap.cu",
            "errors.cu"} <= set(names)
    # ffi/nvshmem/gather.cu and ffi/cuda/errors.cu never share an object with a same-named file of the other folder
    assert len({build_cuda.object_path("/b", s) for s in build_nvshmem.sources()}) == len(names)


def test_nvshmem_library_exports_exactly_the_api():
    path = os.environ.get(NVSHMEM_CHECK_ENV)
    if not path:
        pytest.skip(f"built and checked by `make cuda-check` ({NVSHMEM_CHECK_ENV} unset)")
    assert os.path.isfile(path), f"{NVSHMEM_CHECK_ENV}={path} does not exist: run `make cuda-check`"
    assert_exports_exactly(path, nvshmem_library.EXPORTED_SYMBOLS)
    # linked against the wheel's host library, resolvable through the baked-in rpath
    ldd = shutil.which("ldd")
    if ldd is not None:
        listing = subprocess.run([ldd, path], capture_output=True, text=True).stdout
        assert "libnvshmem_host.so.3 =>" in listing and "not found" not in listing.split("libnvshmem_host")[1][:80]
    # loads without a GPU or driver, and refuses use before NVSHMEM is initialised with a message
    lib = nvshmem_library.NvshmemLibrary(path)
    assert sorted(lib.handlers()) == sorted(target_names.expected_targets("nvshmem")) and lib.live_heaps() == 0
    with pytest.raises(ValueError, match=r"NVSHMEM is not initialised \(jodc_nvshmem_init first\)"):
        lib.heap_create(False, 1.0)
    with pytest.raises(ValueError, match="NVSHMEM heap 12345 is not registered"):
        lib.bucket_register(12345, 10, "float32")
