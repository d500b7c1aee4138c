"""Loads the native libraries and registers their FFI targets with XLA, once per platform, on first use."""
from __future__ import annotations

import importlib.util
import os
import sys
import threading

import jax

from jodc.ops.transports import cuda_library, target_names

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


def register_targets(key: str, library, transport: str, xla_platform: str) -> None:
    """Registers every FFI target of `library` (the handlers of `transport`: 'local', 'mpi' or 'nvshmem') for XLA's
    `xla_platform` ('cpu', 'CUDA'), once per `key` (a transport's registration key: one library's targets must not be
    registered twice).

    The targets are the library's own handler table (generated from ffi/common/ops.h), checked against the names
    jodc.ops calls (jodc/ops/transports/target_names.py) before any is registered."""
    with _lock:
        if key in _registered:
            return
        handlers = library.handlers()
        target_names.check_handlers(handlers, transport, f"jodc's {key} library", xla_platform)
        for name, capsule in handlers.items():
            jax.ffi.register_ffi_target(name, capsule, platform=xla_platform)
        _registered.add(key)


def ensure_registered(platform: str) -> None:
    """Registers the in-process targets of `platform` ('cpu', or 'cuda' / 'gpu': one key), idempotently. The
    multi-process transports register their own (`jodc.ops.transports`)."""
    platform = platform.lower()
    if platform == "cpu":
        register_targets("cpu", cpu_library(), "local", "cpu")
    elif platform in ("cuda", "gpu"):
        register_targets("cuda", cuda_library.library(), "local", "CUDA")
    else:
        raise ValueError(f"jodc ops support the cpu and cuda platforms, not {platform!r}")


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
