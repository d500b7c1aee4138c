"""The engines by name: `ENGINES` maps each name of `jodc.engine_facts.ENGINE_FACTS` to its class, and
`make_engine` builds one with the constructor shape every engine shares."""
from __future__ import annotations

from typing import Any

from jodc.engine_facts import engine_facts
from jodc.fsdp.collective_engine import CollectiveEngine
from jodc.fsdp.engine import Engine
from jodc.fsdp.odc_engine import ODCEngine
from jodc.fsdp.reference_engine import ReferenceEngine
from jodc.fsdp.xla_spmd_engine import XlaSpmdEngine

ENGINES: dict[str, type[Engine]] = {cls.name: cls for cls in (ODCEngine, CollectiveEngine, XlaSpmdEngine,
                                                                ReferenceEngine)}


def engine_class(name: str) -> type[Engine]:
    """The engine class registered as `name`; ValueError naming the engines there are."""
    engine_facts(name)  # the clear error for an unknown name
    return ENGINES[name]


def make_engine(name: str, model, groups: dict[str, Any], mesh, *, optimizer, compute_dtype, length_buckets=None,
                **options) -> Engine:
    """Engine `name` over `mesh` with the shared arguments and those of `options` the class declares
    (`Engine.options`); the others are dropped (e.g. `deterministic` for an engine that is always, or never, so)."""
    cls = engine_class(name)
    own = {k: v for k, v in options.items() if k in cls.options}
    return cls(model, groups, mesh, optimizer=optimizer, compute_dtype=compute_dtype, length_buckets=length_buckets,
               **own)
