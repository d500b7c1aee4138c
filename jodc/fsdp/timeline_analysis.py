"""Per-device timelines of one step, as data: the bubble rate, an estimate from a plan, and a PNG with one lane per
device. Library code: any engine user who asks `Engine.step(batch, record_timeline=True)` reads its events with
these (the trainer draws them every `logging.timeline_every` steps).

An event is `{"device": int, "start": s, "end": s, "kind": "busy" | "wait", "label": str}` (times in seconds,
any origin); an event of a context-parallel microbatch also has `"group"` (the CP group's id) and `"members"` (its
devices), and the plot draws it in its own colour, outlined, with the group id written on it
(`jodc.sim.context_parallel.timeline_events` makes such events from a predicted step; `label_cp_groups` adds them
to the events an engine recorded for a plan with CP groups). The engines record them when asked
(`Engine.step(batch, record_timeline=True)`); when an engine cannot, `events_from_plan` estimates them from the planner's cost model and the measured step time.

The bubble rate is `1 - sum(busy) / (devices x wall)`, wall = last end - first start over all devices: the
fraction of device time spent not computing (waiting at a barrier or for a collective, or idle at the end).
"""
from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np

from jodc.balance.cp_plan import CPMicrobatch

KINDS = ("busy", "wait")


def check_events(events: Sequence[dict], num_devices: int | None = None) -> None:
    """ValueError naming the first event that is not a well-formed timeline event."""
    for i, e in enumerate(events):
        missing = {"device", "start", "end", "kind"} - set(e)
        if missing:
            raise ValueError(f"timeline event {i} lacks {sorted(missing)}: {e}")
        if e["kind"] not in KINDS:
            raise ValueError(f"timeline event {i} has kind {e['kind']!r}; kinds are {', '.join(KINDS)}")
        if not e["end"] >= e["start"]:
            raise ValueError(f"timeline event {i} ends before it starts: {e}")
        if e["device"] < 0 or (num_devices is not None and e["device"] >= num_devices):
            raise ValueError(f"timeline event {i} is on device {e['device']}, outside 0..{(num_devices or 1) - 1}")


def bubble_rate(events: Sequence[dict], num_devices: int | None = None) -> float:
    """1 - sum(busy) / (devices x wall); `num_devices` counts devices with no event as idle (default: the
    devices that appear). 0 for no events or zero wall time."""
    check_events(events, num_devices)
    if not events:
        return 0.0
    devices = num_devices or len({e["device"] for e in events})
    wall = max(e["end"] for e in events) - min(e["start"] for e in events)
    if wall <= 0:
        return 0.0
    busy = sum(e["end"] - e["start"] for e in events if e["kind"] == "busy")
    return float(min(1.0, max(0.0, 1.0 - busy / (devices * wall))))


def events_from_plan(plan, seconds: float, *, lockstep: bool) -> list[dict]:
    """Estimated events of a step that took `seconds`: each device runs its microbatches back to back with
    durations proportional to their planned costs; the slowest device defines the wall time.

    lockstep=False (ODC): devices run independently and wait once, at the end, for the slowest.
    lockstep=True (collective): round i ends on every device when the slowest device's i-th microbatch ends.
    A context-parallel row (a `jodc.balance.CPPlan`'s `CPMicrobatch`) costs its group's planned time on each member
    (`label_cp_groups` marks its events with the group).
    """
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    counts = plan.microbatch_counts()
    rounds = max(counts, default=0)
    costs = np.zeros((plan.num_devices, rounds))
    for d, device in enumerate(plan.devices):
        for m, mb in enumerate(device):
            costs[d, m] = mb.group.cost if isinstance(mb, CPMicrobatch) else mb.cost
    total = costs.max(axis=0).sum() if lockstep else costs.sum(axis=1).max()
    if total <= 0:
        return [{"device": d, "start": 0.0, "end": seconds, "kind": "wait", "label": "idle"}
                for d in range(plan.num_devices)]
    scale = seconds / total
    events = []
    for d in range(plan.num_devices):
        t = 0.0
        for m in range(rounds):
            duration = costs[d, m] * scale
            if duration > 0:
                events.append({"device": d, "start": t, "end": t + duration, "kind": "busy", "label": f"mb{m}"})
            round_end = t + costs[:, m].max() * scale if lockstep else t + duration
            if round_end > t + duration:
                events.append({"device": d, "start": t + duration, "end": round_end, "kind": "wait",
                               "label": f"wait mb{m}"})
            t = round_end
        if t < seconds * (1 - 1e-9):
            events.append({"device": d, "start": t, "end": seconds, "kind": "wait", "label": "barrier"})
    return events


def label_cp_groups(events: Sequence[dict], plan) -> list[dict]:
    """`events` recorded by an engine for a minibatch planned by `plan` (a `jodc.balance.CPPlan`), with every event
    of a context-parallel microbatch given its `"group"` and `"members"`: an engine's label starts with "mb<i>", the
    device's i-th microbatch in the plan. Other events are returned unchanged (copies)."""
    out = []
    for event in events:
        event = dict(event)
        label = event.get("label", "")
        if label.startswith("mb") and label[2:].split(" ")[0].isdigit():
            items = plan.devices[event["device"]]
            i = int(label[2:].split(" ")[0])
            if i < len(items) and isinstance(items[i], CPMicrobatch):
                event.update(group=items[i].group.group_id, members=list(items[i].group.members))
        out.append(event)
    return out


def plot_timeline(events: Sequence[dict], path: str, *, num_devices: int | None = None, title: str = "step"
                  ) -> float:
    """Draws one lane per device (busy segments coloured by label, waits hatched grey) to a PNG at `path`,
    with the bubble rate in the title; returns the bubble rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rate = bubble_rate(events, num_devices)
    devices = num_devices or (max((e["device"] for e in events), default=-1) + 1) or 1
    t0 = min((e["start"] for e in events), default=0.0)
    labels = sorted({_label_group(e["label"]) for e in events if e["kind"] == "busy"})
    colours = {label: plt.get_cmap("tab10")(i % 10) for i, label in enumerate(labels)}
    fig, ax = plt.subplots(figsize=(10, 0.6 * devices + 2.0))
    for e in events:
        start, width = e["start"] - t0, e["end"] - e["start"]
        if e["kind"] == "busy":
            cp = e.get("group", -1) >= 0
            ax.broken_barh([(start, width)], (e["device"] - 0.4, 0.8), facecolors=colours[_label_group(e["label"])],
                           edgecolor="black" if cp else "white", linewidth=1.0 if cp else 0.3)
            if cp:
                ax.text(start + width / 2, e["device"], f"g{e['group']}", ha="center", va="center", fontsize="x-small")
        else:
            ax.broken_barh([(start, width)], (e["device"] - 0.4, 0.8), facecolors="#dddddd", hatch="//",
                           edgecolor="#999999", linewidth=0.3)
    ax.set_yticks(range(devices), [f"device {d}" for d in range(devices)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"{title} - bubble rate {rate:.1%}")
    handles = [Patch(facecolor=colours[label], label=label) for label in labels]
    handles.append(Patch(facecolor="#dddddd", hatch="//", edgecolor="#999999", label="wait"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.3 if devices < 4 else -0.15),
              fontsize="small", ncol=min(len(handles), 7), frameon=False)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return rate


def _label_group(label: str) -> str:
    """Colour key of a busy label: engine labels 'mb3 layer_1 fwd' -> 'fwd'; plan estimates 'mb3' -> 'compute';
    context-parallel rows 'cp4' -> 'context parallel'."""
    if label.startswith("cp") and label[2:3].isdigit():
        return "context parallel"
    last = label.split()[-1] if label else ""
    return last if last in ("fwd", "bwd", "optimizer", "input", "tail") else "compute"


def save_events(events: Sequence[dict], path: str) -> None:
    """Writes events as JSON (to redraw or compare later)."""
    with open(path, "w") as f:
        json.dump(list(events), f)
