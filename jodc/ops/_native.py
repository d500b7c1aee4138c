"""Loads the native libraries and registers their FFI targets with XLA, once per platform, on first use."""
from __future__ import annotations

import importlib.util
import os
import sys
import threading

import jax

from jodc.ops import _targets

_lock = threading.Lock()
_registered: set[str] = set()


LIBRARY_ENV = "JODC_FFI_LIBRARY"


def _load_from_path(path: str):
    """Imports the extension built elsewhere (e.g. by Bazel: bazel-bin/jodc/_ffi.so) as jodc._ffi."""
    if not os.path.isfile(path):
        raise ImportError(f"{LIBRARY_ENV}={path!r} does not name a file (build it, or unset {LIBRARY_ENV})")
    spec = importlib.util.spec_from_file_location("jodc._ffi", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{LIBRARY_ENV}={path!r} is not a loadable Python extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # an ImportError here names the file and what is wrong with it
    sys.modules["jodc._ffi"] = module  # later `from jodc import _ffi` gets this one, not the setuptools build
    import jodc

    jodc._ffi = module
    return module


def cpu_library():
    """The pybind11 extension jodc._ffi (always built): the setuptools build next to the package, or the file that
    the environment variable JODC_FFI_LIBRARY names (how `make bazel-test` runs the ops tests on Bazel's build)."""
    override = os.environ.get(LIBRARY_ENV)
    if override:
        loaded = sys.modules.get("jodc._ffi")
        if loaded is not None and os.path.realpath(getattr(loaded, "__file__", "")) == os.path.realpath(override):
            return loaded
        if loaded is not None:
            raise ImportError(
                f"{LIBRARY_ENV}={override!r} but jodc._ffi was already imported from {loaded.__file__!r}: "
                "set the variable before anything imports jodc's native ops"
            )
        return _load_from_path(override)
    try:
        from jodc import _ffi
    except ImportError as e:  # pragma: no cover - only on a broken install
        raise ImportError(
            "jodc's native extension jodc._ffi is not built: run `make native` (or `pip install -e .`)"
        ) from e
    return _ffi


def _library(platform: str):
    """(library, transport, XLA platform) of a registration key: 'cpu', 'cuda', 'mpi' (the MPI transport, whose
    handlers run on CPU devices as jodc_mpi_<op>) or 'nvshmem' (the NVSHMEM backend, whose handlers run on CUDA devices
    as jodc_nvshmem_<op>)."""
    if platform == "cpu":
        return cpu_library(), "local", "cpu"
    if platform == "mpi":
        from jodc.ops import _mpi

        return _mpi.library(), "mpi", "cpu"
    if platform == "cuda":
        from jodc.ops import _cuda

        return _cuda.library(), "local", "CUDA"
    if platform == "nvshmem":
        from jodc.ops import _nvshmem

        return _nvshmem.library(), "nvshmem", "CUDA"
    raise ValueError(f"jodc ops support the cpu and cuda platforms, not {platform!r}")


def ensure_registered(platform: str) -> None:
    """Registers every jodc FFI target for `platform` ('cpu', 'cuda', 'mpi': the MPI transport, or 'nvshmem': the
    multi-node GPU transport), idempotently.

    The targets are the library's own handler table (generated from ffi/common/ops.h), checked against the names
    jodc.ops calls (jodc/ops/_targets.py) before any is registered."""
    platform = platform.lower()
    if platform == "gpu":
        platform = "cuda"  # one key: the same targets must not be registered twice
    with _lock:
        if platform in _registered:
            return
        lib, transport, xla_platform = _library(platform)
        handlers = lib.handlers()
        _targets.check_handlers(handlers, transport, f"jodc's {platform} library")
        for name, capsule in handlers.items():
            jax.ffi.register_ffi_target(name, capsule, platform=xla_platform)
        _registered.add(platform)


def ensure_token_ops() -> None:
    """Registers the token ops (after, depend_on) for the CPU, and for CUDA when its library is built: they are
    used without a heap too (e.g. by timeline probes)."""
    ensure_registered("cpu")
    if "cuda" in _registered:
        return
    try:
        ensure_registered("cuda")
    except (ImportError, OSError):
        pass  # no CUDA build: CPU only
