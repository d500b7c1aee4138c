"""Per-step training metrics, written three ways: JSON lines (`metrics.jsonl`, one object per logged step, the
record to analyse), TensorBoard scalars (`tb/`, tensorboardX) and a tqdm progress bar (loss, tokens/s, ETA).

On resume, records of steps after the restored checkpoint are removed from `metrics.jsonl` (the resumed run
logs them again), so the file always holds one curve; the file is rewritten atomically.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any, Sequence

from tensorboardX import SummaryWriter
from tqdm import tqdm

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tb"


def step_metrics(*, step: int, loss: float, grad_norm: float, seconds: float, tokens: int, loss_tokens: int,
                 sequences: int, microbatches: list[int], learning_rate: float, **extra: Any) -> dict[str, Any]:
    """One step's record: the inputs plus throughput (tokens/s and samples/s over the step's wall time)."""
    record = {"step": int(step), "loss": float(loss), "grad_norm": float(grad_norm),
              "learning_rate": float(learning_rate), "step_seconds": float(seconds), "tokens": int(tokens),
              "loss_tokens": int(loss_tokens), "sequences": int(sequences),
              "tokens_per_s": tokens / seconds if seconds > 0 else math.inf,
              "samples_per_s": sequences / seconds if seconds > 0 else math.inf,
              "microbatches": [int(m) for m in microbatches]}
    record.update(extra)
    return record


def _read_records(path: str) -> tuple[list[dict[str, Any]], bool]:
    """(records, torn): the records of a metrics.jsonl file, and whether its last line was torn (a crash while it
    was written: no newline at the end and not valid JSON), which is dropped with a warning. Any other line that
    is not a JSON object is an error naming the file and the line."""
    if not os.path.exists(path):
        return [], False
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    records, torn = [], False
    for line_no, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        last = line_no == len(lines)  # no newline after it: possibly cut short
        try:
            record = json.loads(raw.decode("utf-8"))
            if not isinstance(record, dict):
                raise ValueError(f"expected a JSON object, got {type(record).__name__}")
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if last:
                warnings.warn(f"{path}:{line_no}: dropping a torn last line (the run stopped while writing it): "
                              f"{raw[:80]!r}", stacklevel=3)
                torn = True
                continue
            raise ValueError(f"{path}:{line_no}: not a metrics record ({e}); fix or remove that line (the file "
                             "holds one JSON object per line)") from None
        records.append(record)
    return records, torn


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file ([] when it does not exist); a torn last line is dropped with a
    warning, any other bad line is a ValueError naming the file and line."""
    return _read_records(path)[0]


def truncate_metrics(path: str, last_step: int) -> int:
    """Drops records with step > last_step, and a torn last line (atomically); returns how many records were
    dropped."""
    records, torn = _read_records(path)
    kept = [r for r in records if r.get("step", 0) <= last_step]
    if len(kept) == len(records) and not torn:
        return 0
    staging = path + ".tmp"
    with open(staging, "w") as f:
        for r in kept:
            f.write(json.dumps(r) + "\n")
    os.replace(staging, path)
    return len(records) - len(kept)


#: The record fields the progress bar shows by default: (record key, label, format).
BAR_FIELDS = (("loss", "loss", ".4f"), ("tokens_per_s", "tok_s", ".0f"))


class MetricsLogger:
    """Writes step records to out_dir/metrics.jsonl and out_dir/tb/, and drives the progress bar.

    start_step: steps already done (a resumed run); total_steps: the run's length (for the bar's ETA);
    bar_fields: what the bar shows of each logged record, (key, label, format) for the keys it has.
    """

    def __init__(self, out_dir: str, *, total_steps: int, start_step: int = 0, progress: bool = True,
                 bar_fields: Sequence[tuple[str, str, str]] = BAR_FIELDS):
        self.bar_fields = bar_fields
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, METRICS_FILE)
        self.dropped_on_resume = truncate_metrics(self.path, start_step)
        self._file = open(self.path, "a")
        self._tb = SummaryWriter(os.path.join(out_dir, TENSORBOARD_DIR))
        self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                         disable=not progress)

    def log(self, record: dict[str, Any]) -> None:
        """Appends one record (flushed, so a crash loses nothing logged) and adds its numbers to TensorBoard."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(f"train/{key}", value, step)
        self._bar.set_postfix({label: f"{record[key]:{spec}}" for key, label, spec in self.bar_fields if key in record},
                              refresh=False)

    def advance(self, steps: int = 1) -> None:
        """Moves the progress bar (called every step, logged or not)."""
        self._bar.update(steps)

    def write(self, message: str) -> None:
        """Prints a line without breaking the progress bar."""
        self._bar.write(message)

    def close(self) -> None:
        self._bar.close()
        self._tb.close()
        self._file.close()
