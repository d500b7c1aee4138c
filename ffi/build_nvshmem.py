"""Compiles ffi/nvshmem/*.cu (plus ffi/cuda/errors.cu) into jodc/_ffi_nvshmem.so, the multi-node GPU backend.

NVSHMEM comes from its PyPI wheel (``nvidia-nvshmem-cu12`` / ``-cu13``: headers, libnvshmem_host.so.3 and the static
device library libnvshmem_device.a). Device code calls NVSHMEM, so it is compiled relocatable (-rdc=true) and
device-linked against libnvshmem_device.a; the host library is linked by its file name (the wheel ships no
libnvshmem_host.so link) with an rpath to the wheel's lib/ (jodc/ops/_nvshmem.py also preloads it). Like the CUDA
library it needs no GPU and no driver to build, link or load. Used by setup.py (JODC_NVSHMEM=1) and `make cuda-check`.
"""
import glob
import importlib.util
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_compiler  # noqa: E402  (ffi/run_compiler.py)

HERE = os.path.dirname(os.path.abspath(__file__))
ARCHS = ("80", "90")
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


def nvcc_command(out_path: str, include_dir: str, nvshmem_root: str) -> list[str]:
    lib = os.path.join(nvshmem_root, "lib")
    cmd = [shutil.which("nvcc") or "nvcc", "-std=c++17", "-O3", "-shared", "-rdc=true", "-Xcompiler", "-fPIC",
           "-Xcompiler", "-fvisibility=hidden", "-cudart", "static", "-isystem", include_dir,
           "-isystem", os.path.join(nvshmem_root, "include"), "-I", HERE]
    for a in ARCHS:
        cmd += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    return cmd + sources() + ["-L", lib, "-lnvshmem_device", f"-l:{HOST_LIBRARY}", "-Xlinker", f"-rpath,{lib}",
                              "-lrt", "-o", out_path]


def build(out_path: str, include_dir: str, nvshmem_root: str | None = None) -> str:
    """Runs nvcc (output to a file, never a pipe); returns out_path. RuntimeError naming the wheel when NVSHMEM is
    not installed."""
    nvshmem_root = nvshmem_root or find_nvshmem()
    if nvshmem_root is None:
        raise RuntimeError("NVSHMEM is not installed: pip install nvidia-nvshmem-cu12 (CUDA 12) or "
                           "nvidia-nvshmem-cu13 (CUDA 13), matching nvcc")
    return run_compiler.run(nvcc_command(out_path, include_dir, nvshmem_root), out_path, "nvcc")


if __name__ == "__main__":
    args = run_compiler.parse_args(__doc__, lambda p: p.add_argument(
        "--nvshmem-root", help="the NVSHMEM wheel's root (default: the installed nvidia.nvshmem)"))
    print(build(args.out, args.include_dir, args.nvshmem_root))
