"""Per-device timelines of a minibatch step, recorded from inside the compiled program.

Probes are identity functions placed between stages: in the forward pass a probe fires (a host callback with the
device index and the microbatch index) when its stage's output exists; in the backward pass it fires when the
cotangent reaching that point exists, i.e. when the later stage's backward finished. Consecutive probe times of a
device delimit its work segments. Around the ODC barrier the segment is waiting; everything else is labelled
busy (for the collective engine a segment includes whatever time its all_gather spent waiting for peers: the
collective engine cannot be split further from inside, which is why benchmarks calibrate busy time separately).
"""
from __future__ import annotations

import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

from jodc.fsdp.sharding import device_position
from jodc.ops.token import depend_on

# event codes
MICROBATCH_START, STAGE_FORWARD, STAGE_BACKWARD, MICROBATCH_END, BARRIER_ENTER, BARRIER_EXIT, STEP_START = range(7)


@dataclasses.dataclass
class Mark:
    device: int
    microbatch: int
    code: int
    stage: int
    time: float


def _first(x):
    """One element of (the first leaf of) `x`: makes a callback wait for it without copying it all to the host."""
    return jnp.ravel(jax.tree.leaves(x)[0])[:1]


class TimelineRecorder:
    """Collects marks from device threads (thread-safe) and turns them into busy / wait events."""

    def __init__(self, stage_names):
        self.stage_names = tuple(stage_names)
        self._marks: list[Mark] = []
        self._lock = threading.Lock()

    # -- host side ---------------------------------------------------------------------------------------------
    def _record(self, device, microbatch, code, stage, _dependency=None):
        t = time.perf_counter()
        with self._lock:
            self._marks.append(Mark(int(device), int(microbatch), int(code), int(stage), t))
        return np.zeros((), np.int32)

    def reset(self) -> None:
        with self._lock:
            self._marks = []

    # -- inside the program ------------------------------------------------------------------------------------
    def mark(self, value, microbatch, code: int, stage: int = -1):
        """Records a mark once `value` exists; returns `value` made to depend on the mark (use the result: the mark
        then sits exactly between what produced `value` and what consumes it)."""
        done = io_callback(self._record, jax.ShapeDtypeStruct((), jnp.int32), device_position(), microbatch,
                           code, stage, lax.stop_gradient(_first(value)))
        return depend_on(value, done)

    def probe(self, h, microbatch, stage: int):
        """Identity with a forward mark (stage done) and a backward mark (cotangent reached this point)."""
        stamp = self.mark

        @jax.custom_vjp
        def identity(h, mb):
            return h

        def fwd(h, mb):
            return stamp(h, mb, STAGE_FORWARD, stage), mb

        def bwd(mb, dh):
            return stamp(dh, mb, STAGE_BACKWARD, stage), None

        identity.defvjp(fwd, bwd)
        return identity(h, microbatch)

    # -- results -----------------------------------------------------------------------------------------------
    def events(self) -> list[dict]:
        """Busy / wait segments per device: {"device", "start", "end", "kind", "label"}, times in seconds from the
        first mark of the step."""
        with self._lock:
            marks = sorted(self._marks, key=lambda m: (m.device, m.time))
        if not marks:
            return []
        t0 = min(m.time for m in marks)
        out = []
        by_device: dict[int, list[Mark]] = {}
        for m in marks:
            by_device.setdefault(m.device, []).append(m)
        for device, ms in by_device.items():
            for prev, cur in zip(ms, ms[1:]):
                if cur.code == BARRIER_EXIT:
                    kind, label = "wait", "barrier"
                elif cur.code == STAGE_FORWARD and cur.stage < 0:
                    kind, label = "busy", "input"
                elif cur.code == STAGE_FORWARD:
                    kind, label = "busy", f"mb{cur.microbatch} {self._stage(cur.stage)} fwd"
                elif cur.code == STAGE_BACKWARD:
                    # the cotangent at stage s exists once stage s+1's backward is done
                    kind, label = "busy", f"mb{cur.microbatch} {self._stage(cur.stage + 1)} bwd"
                elif cur.code == MICROBATCH_END:
                    # XLA may rotate the loop so this mark's own index reads one ahead; the previous mark's is right
                    kind, label = "busy", f"mb{prev.microbatch} {self._stage(0)} bwd"
                elif cur.code == BARRIER_ENTER:
                    kind, label = "busy", "optimizer" if prev.code == BARRIER_EXIT else "tail"
                else:
                    kind, label = "busy", "input"
                out.append({"device": device, "start": prev.time - t0, "end": cur.time - t0, "kind": kind,
                            "label": label})
        return out

    def _stage(self, index: int) -> str:
        return self.stage_names[index] if 0 <= index < len(self.stage_names) else f"stage{index}"


__all__ = ["TimelineRecorder"]  # bubble rates, plan estimates and plots: jodc.fsdp.timeline_analysis
