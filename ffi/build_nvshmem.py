"""Compiles ffi/nvshmem/*.cu (plus ffi/cuda/errors.cu) into jodc/_ffi_nvshmem.so, the multi-node GPU backend.

NVSHMEM comes from its PyPI wheel (``nvidia-nvshmem-cu12`` / ``-cu13``: headers, libnvshmem_host.so.3 and the static
device library libnvshmem_device.a). Device code calls NVSHMEM, so it is compiled relocatable (-rdc=true) and
device-linked against libnvshmem_device.a; the host library is linked by its file name (the wheel ships no
libnvshmem_host.so link) with an rpath to the wheel's lib/ (jodc/ops/transports/nvshmem_library.py also preloads it). Like the CUDA
library it needs no GPU and no driver to build, link or load. Used by setup.py (JODC_NVSHMEM=1) and `make cuda-check`.
Like ffi/build_cuda.py (whose command lines it extends) it compiles one source per nvcc process, `--jobs` at a time,
then links once (the device link included).
"""
import glob
import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import build_cuda  # noqa: E402  (ffi/build_cuda.py: the nvcc command lines)
import run_compiler  # noqa: E402  (ffi/run_compiler.py)

HERE = os.path.dirname(os.path.abspath(__file__))
ARCHS = build_cuda.ARCHS
LIBRARY_NAME = "_ffi_nvshmem.so"
HOST_LIBRARY = "libnvshmem_host.so.3"


def find_nvshmem() -> str | None:
    """The NVSHMEM wheel's root (holding include/ and lib/), or None when no wheel is installed."""
    for name in ("nvidia.nvshmem",):
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            spec = None
        if spec is not None and spec.submodule_search_locations:
            for root in spec.submodule_search_locations:
                if os.path.isfile(os.path.join(root, "include", "nvshmem.h")):
                    return root
    return None


def sources() -> list[str]:
    found = sorted(glob.glob(os.path.join(HERE, "nvshmem", "*.cu")))
    if not found:
        raise RuntimeError(f"no NVSHMEM sources under {os.path.join(HERE, 'nvshmem')}")
    return found + [os.path.join(HERE, "cuda", "errors.cu")]


def compile_command(source: str, obj: str, include_dir: str, nvshmem_root: str, archs=ARCHS) -> list[str]:
    """One source to a relocatable object (device code calls NVSHMEM's device library)."""
    extra = ["-rdc=true", "-isystem", os.path.join(nvshmem_root, "include")]
    return build_cuda.compile_command(source, obj, include_dir, archs, extra=extra)


def link_command(objects, out_path: str, nvshmem_root: str, archs=ARCHS) -> list[str]:
    """The objects, device-linked for `archs` against libnvshmem_device.a, into the shared library; the host library
    by its file name, found at run time through an rpath to the wheel's lib/."""
    lib = os.path.join(nvshmem_root, "lib")
    extra = ["-rdc=true", *build_cuda.gencode_flags(archs), "-L", lib, "-lnvshmem_device", f"-l:{HOST_LIBRARY}",
             "-Xlinker", f"-rpath,{lib}"]
    return build_cuda.link_command(objects, out_path, extra=extra)


def build(out_path: str, include_dir: str, nvshmem_root: str | None = None, archs=ARCHS, jobs: int | None = None,
          build_dir: str | None = None) -> str:
    """Compiles (`jobs` nvcc processes at once) and links; returns out_path. RuntimeError naming the wheel when
    NVSHMEM is not installed, or with nvcc's logs."""
    nvshmem_root = nvshmem_root or find_nvshmem()
    if nvshmem_root is None:
        raise RuntimeError("NVSHMEM is not installed: pip install nvidia-nvshmem-cu12 (CUDA 12) or "
                           "nvidia-nvshmem-cu13 (CUDA 13), matching nvcc")
    archs = tuple(archs)
    return build_cuda.build_objects(sources(), out_path,
                                    lambda s, o: compile_command(s, o, include_dir, nvshmem_root, archs),
                                    lambda objects: link_command(objects, out_path, nvshmem_root, archs),
                                    jobs, build_dir)


if __name__ == "__main__":
    def arguments(parser):
        build_cuda.add_build_arguments(parser)
        parser.add_argument("--nvshmem-root", help="the NVSHMEM wheel's root (default: the installed nvidia.nvshmem)")

    args = run_compiler.parse_args(__doc__, arguments)
    build_cuda.timed_build(
        lambda: build(args.out, args.include_dir, args.nvshmem_root, args.archs, args.jobs, args.build_dir), args)
