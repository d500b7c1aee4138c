"""The compiled loops of the planners: jodc._ffi's ``balance_refine`` / ``balance_search`` / ``balance_descend`` /
``balance_resplit`` / ``balance_fill``, and ``balance_small_stage`` (the small-instance step of the free partition in
one call).

:mod:`jodc.balance.refine`, :mod:`jodc.balance.search`, :func:`jodc.balance.descent.descend` and
:func:`~jodc.balance.descent.resplit_heaviest`, :func:`jodc.balance.fill.fill_parts` and the loop of
:func:`jodc.balance.partition._free_partition` are the reference implementations: the C++ loops visit the same exchanges and nodes in the same order with the same IEEE-754 double
arithmetic and node budgets, so the plans are identical with or without them (``tests/test_balance_native.py``
checks it). Only the pybind11 module is imported here, never jax: the planners stay JAX-free. Without the extension
(or with ``JODC_BALANCE_NATIVE=0``) the planners run the Python loops; ``JODC_BALANCE_NATIVE_DESCENT=0`` turns off
only the compiled descent (and with it ``balance_small_stage``, which calls it: the free partition's small-instance
step then runs as the Python loop over the compiled re-splits and fills).

When ``JODC_FFI_LIBRARY`` names another build of jodc._ffi (``make bazel-test``), this module never imports the
extension itself (that would pin the setuptools build before jodc.ops loads the named one): it uses the named build
once jodc.ops has loaded it, and the Python loops until then.
"""
from __future__ import annotations

import os
import sys

ENV = "JODC_BALANCE_NATIVE"
LIBRARY_ENV = "JODC_FFI_LIBRARY"  # jodc.ops._native.LIBRARY_ENV (not imported: that module imports jax)

_UNRESOLVED = object()
_module = _UNRESOLVED
_enabled = os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _has_loops(lib) -> bool:
    return hasattr(lib, "balance_refine") and hasattr(lib, "balance_search")  # not: a build older than these loops


def module():
    """The extension providing the loops, or None (run the Python loops)."""
    global _module
    if not _enabled:
        return None
    if _module is not _UNRESOLVED:
        return _module
    if os.environ.get(LIBRARY_ENV):
        lib = sys.modules.get("jodc._ffi")
        return lib if lib is not None and _has_loops(lib) else None  # not cached: jodc.ops may load it later
    try:
        from jodc import _ffi
    except ImportError:
        _module = None
    else:
        _module = _ffi if _has_loops(_ffi) else None
    return _module


def set_enabled(enabled: bool) -> bool:
    """Turn the compiled loops on (when built) or off; returns whether they were on. For tests and benchmarks that
    compare the two paths."""
    global _enabled
    was = module() is not None
    _enabled = bool(enabled)
    return was


_descend_enabled = os.environ.get("JODC_BALANCE_NATIVE_DESCENT", "1").strip().lower() not in ("0", "false", "no", "off")


def descend_module():
    """:func:`module` when it also has the compiled descent (``balance_descend``) and that is enabled, else None."""
    lib = module()
    return lib if _descend_enabled and lib is not None and hasattr(lib, "balance_descend") else None


def op(name: str):
    """:func:`module` when it has the compiled op ``name`` (``balance_resplit``, ``balance_fill``,
    ``balance_small_stage``; a build older than it has not), else None (run the Python step)."""
    lib = module()
    return lib if lib is not None and hasattr(lib, name) else None
