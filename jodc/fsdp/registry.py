"""The engines by name: `ENGINES`, the one list of engines, maps each engine class's `name` to the class (each class
states its own facts: `Engine`), and `make_engine` builds one with the constructor shape every engine shares."""
from __future__ import annotations

from typing import Any

from jodc.fsdp.collective_engine import CollectiveEngine
from jodc.fsdp.engine import Engine
from jodc.fsdp.odc_engine import ODCEngine
from jodc.fsdp.reference_engine import ReferenceEngine
from jodc.fsdp.xla_spmd_engine import XlaSpmdEngine

ENGINES: dict[str, type[Engine]] = {cls.name: cls for cls in (ODCEngine, CollectiveEngine, XlaSpmdEngine,
                                                                ReferenceEngine)}


def engine_class(name: str) -> type[Engine]:
    """The engine class registered as `name`; ValueError naming the engines there are."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; engines are {', '.join(ENGINES)}") from None


def make_engine(name: str, model, groups: dict[str, Any], mesh, *, optimizer, compute_dtype, length_buckets=None,
                **options) -> Engine:
    """Engine `name` over `mesh` with the shared arguments and those of `options` the class declares
    (`Engine.options`); the others are dropped (e.g. `deterministic` for an engine that is always, or never, so)."""
    cls = engine_class(name)
    own = {k: v for k, v in options.items() if k in cls.options}
    return cls(model, groups, mesh, optimizer=optimizer, compute_dtype=compute_dtype, length_buckets=length_buckets,
               **own)
