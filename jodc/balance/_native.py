"""The compiled refinement and search loops of the planners (jodc._ffi's ``balance_refine`` / ``balance_search``).

:mod:`jodc.balance.refine` and :mod:`jodc.balance.search` are the reference implementations: the C++ loops visit the
same exchanges and nodes in the same order with the same IEEE-754 double arithmetic and node budgets, so the plans
are identical with or without them (``tests/test_balance_native.py`` checks it). Only the pybind11 module is imported
here, never jax: the planners stay JAX-free. Without the extension (or with ``JODC_BALANCE_NATIVE=0``) the planners
run the Python loops.
"""
from __future__ import annotations

import os

ENV = "JODC_BALANCE_NATIVE"


def _load():
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        from jodc import _ffi
    except ImportError:
        return None
    if not (hasattr(_ffi, "balance_refine") and hasattr(_ffi, "balance_search")):
        return None  # an extension built before these loops existed
    return _ffi


_module = _load()


def module():
    """The extension providing the loops, or None (Python loops)."""
    return _module


def set_enabled(enabled: bool) -> bool:
    """Turn the compiled loops on (when built) or off; returns whether they were on. For tests and benchmarks that
    compare the two paths."""
    global _module
    was = _module is not None
    if enabled:
        saved = os.environ.pop(ENV, None)
        try:
            _module = _load()
        finally:
            if saved is not None:
                os.environ[ENV] = saved
    else:
        _module = None
    return was
