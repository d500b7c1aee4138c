"""One normaliser for every dtype argument of jodc's Python API.

JAX users pass dtypes as objects (``jnp.float32``, ``jnp.bfloat16``, ``np.dtype("float32")``, ``ml_dtypes.bfloat16``);
configs and CLIs pass strings ("bfloat16"). :func:`dtype_name` accepts all of them and returns the canonical name,
so a function stores and compares one spelling; anything else is a ValueError that names the argument and the
allowed values (never a silent float64 from ``jnp.dtype(None)`` or ``jnp.dtype(float)``).
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def describe(allowed: tuple[str, ...]) -> str:
    """'float32 or bfloat16' for two names, "one of ('float32', 'bfloat16', 'float16')" for more."""
    return " or ".join(allowed) if len(allowed) <= 2 else f"one of {allowed}"


def dtype_name(dtype: Any, allowed: tuple[str, ...] = FLOAT_DTYPES, what: str = "dtype") -> str:
    """The canonical name (e.g. 'bfloat16') of `dtype`, which may be a string, a numpy or JAX dtype, or a JAX or numpy
    scalar type (``jnp.bfloat16``). Raises ValueError, naming `what` and the `allowed` names, for anything else."""
    name = None
    if dtype is not None and not isinstance(dtype, bool):
        try:
            name = jnp.dtype(dtype).name
        except (TypeError, ValueError, AttributeError):
            name = None
    if name in allowed:
        return name
    got = repr(dtype) if isinstance(dtype, str) or name is None else name
    raise ValueError(f"{what} must be {describe(allowed)}, got {got} (pass a name or a dtype such as jnp.{allowed[0]})")


def as_dtype(dtype: Any, allowed: tuple[str, ...] = FLOAT_DTYPES, what: str = "dtype") -> np.dtype:
    """:func:`dtype_name`'s dtype as a numpy/JAX dtype object (bfloat16 is ml_dtypes')."""
    return jnp.dtype(dtype_name(dtype, allowed, what))
