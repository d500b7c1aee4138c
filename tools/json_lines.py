"""The report line of a program's output: the last line that is a JSON object, which is how every benchmark and
GPU check step here reports (read by make gpu-check's step runner and by the benchmarks' own drivers)."""
from __future__ import annotations

import json


def last_json_object(text: str) -> dict | None:
    """The last line of `text` that parses as a JSON object, or None."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None
