"""What each FSDP engine is, by name: the one table of engine facts.

The engine classes in `jodc.fsdp` take their `name` and facts from here (`Engine.__init_subclass__`), and
`jodc.fsdp.ENGINES` maps the same names to the classes; trainers and the trainer's config read the facts from the
classes (`ENGINES[name].default_planner`, `.supports_deterministic`, ...). A new engine adds one row here and one
class there (a test checks that both agree).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """The capabilities of one engine, read by trainers instead of comparing engine names."""

    name: str  # the registry name (config `engine.name`)
    lockstep: bool  # every device runs max(counts) microbatches (feed it lock-step plans); else its own count, and
    # a plan's empty microbatches are dropped before the step
    supports_timeline: bool  # `step(record_timeline=True)` records per-device busy / wait events
    default_planner: str  # the planner used when the config names none (a `jodc.balance` planner name)
    supports_deterministic: bool  # gradient accumulation can be made (or always is) bit-for-bit reproducible


ENGINE_FACTS: dict[str, EngineFacts] = {f.name: f for f in (
    EngineFacts("odc", lockstep=False, supports_timeline=True, default_planner="lb_mini",
                supports_deterministic=True),
    EngineFacts("collective", lockstep=True, supports_timeline=True, default_planner="lb_micro",
                supports_deterministic=False),
    EngineFacts("xla_spmd", lockstep=True, supports_timeline=False, default_planner="lb_micro",
                supports_deterministic=False),
    EngineFacts("reference", lockstep=False, supports_timeline=False, default_planner="lb_mini",
                supports_deterministic=True),
)}
ENGINE_NAMES = tuple(ENGINE_FACTS)


def engine_facts(name: str) -> EngineFacts:
    """The facts of engine `name`; ValueError naming the engines there are."""
    try:
        return ENGINE_FACTS[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; engines are {', '.join(ENGINE_NAMES)}") from None


def hsdp_shards(devices: int, replicas: int) -> int:
    """Devices per replica group (shards per parameter group) when `devices` data-parallel devices form `replicas`
    HSDP replica groups; ValueError naming `replicas` unless it is a positive integer dividing `devices`. JAX-free so
    that the trainer's config can check it before JAX loads (`jodc.fsdp.sharding.hsdp_mesh` builds the mesh)."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
    if devices % replicas:
        raise ValueError(f"replicas={replicas} does not divide the {devices} devices into equal replica groups "
                         f"(replicas x shards = devices)")
    return devices // replicas
