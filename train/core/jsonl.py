"""Reading JSONL files record by record, with errors that name the file, the line and what is wrong: invalid
UTF-8 (byte and column), invalid JSON, and strings holding a lone surrogate (a JSON escape like "\\ud800", which
is valid JSON but not Unicode text, so a tokenizer would fail on it far from the file). Used for SFT data files
(`train/sft/data.py`) and RL prompt files (`train/rl/tasks.py`). Imports no JAX."""
from __future__ import annotations

import json
from typing import Any, Iterator


class JsonlError(ValueError):
    """A line of a JSONL file that is not a usable JSON value; the message names `path:line`."""


def _lone_surrogate(value: Any, at: str = "") -> str | None:
    """Where in `value` (a JSON value) a string holds a lone surrogate, e.g. "'prompt' at character 3"."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"{at or 'a string'} at character {e.start} ({value[e.start]!r})"
        return None
    if isinstance(value, dict):
        items = ((f"{at}.{k}" if at else repr(k), v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{at}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for where, item in items:
        found = _lone_surrogate(item, where)
        if found:
            return found
    return None


def iter_jsonl(path: str, *, missing_hint: str = "") -> Iterator[tuple[str, Any]]:
    """Yields ("path:line", value) for every non-blank line of the JSONL file at `path`. FileNotFoundError (with
    `missing_hint`) when it does not exist, JsonlError naming `path:line` for a line that is not valid UTF-8, not
    valid JSON, or holds a string that is not valid Unicode text."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist{f' ({missing_hint})' if missing_hint else ''}") from None
    except IsADirectoryError:
        raise JsonlError(f"{path} is a directory, not a .jsonl file") from None
    with f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise JsonlError(f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                 "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise JsonlError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            bad = _lone_surrogate(value)
            if bad:
                raise JsonlError(f"{where}: {bad} is a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape without its "
                                 "pair), which is not valid Unicode text")
            yield where, value
