"""What every benchmark shares: the output flags, presets that fill the flags a user left unset, repeat-and-median
timing, the environment block, and the report (a table, then one JSON line, written to bench/results/ unless
--no-save: `output` names the file, `report(saved=...)` lets it hold more than the line, `previous` reads what it held).
A benchmark's `main` is: parse its arguments -> measure rows -> `report`.

The benchmarks run as modules from the repository root (``python -m bench.<name>``); the children they start (their
own workers, under mpirun or not) run the same way, with the root on PYTHONPATH (`module_command`, `child_env`)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Iterable, Mapping

from tools.json_lines import last_json_object

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "bench", "results")


def results_path(name: str) -> str:
    """bench/results/`name` (the file a benchmark keeps its latest JSON in)."""
    return os.path.join(RESULTS_DIR, name)


def output(args: argparse.Namespace, name: str) -> str | None:
    """Where `report` writes: None under --no-save, else --out where the benchmark has that flag and it is set, else
    bench/results/`name`."""
    if getattr(args, "no_save", False):
        return None
    return getattr(args, "out", None) or results_path(name)


def previous(path: str) -> dict:
    """The JSON object the results file at `path` holds now ({} when there is none): for a benchmark whose file keeps
    records from earlier runs beside the new one."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def fill_unset(args: argparse.Namespace, *presets: Mapping) -> argparse.Namespace:
    """`args` with every option still None taken from the first of `presets` that names it: flags given on the
    command line win over a preset (--quick's, a device's), a preset over the defaults after it."""
    values = vars(args)
    for preset in presets:
        for key, value in preset.items():
            if values.get(key) is None:
                values[key] = value
    return args


def add_run_flags(parser: argparse.ArgumentParser, quick: str) -> argparse.ArgumentParser:
    """The flags every benchmark has: --quick (a smaller run; `quick` says what it changes) and --no-save."""
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--no-save", action="store_true", help="print only: write no results file")
    return parser


def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def repeat_median(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of `fn()` over `repeats` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


def environment() -> dict:
    """The results' environment block: jax's version, the machine, its cores."""
    import jax

    return {"jax": jax.__version__, "platform": platform.platform(), "cpu_count": os.cpu_count()}


def device_block(bench: str, device) -> dict:
    """The first fields of a device benchmark's result: its name, the device's kind and platform."""
    return {"bench": bench, "device": device.device_kind, "platform": device.platform}


def report(result: dict, out: str | None, table: Callable[[], None] | None = None, *, saved: object = None,
           indent: int | None = 1, sort_keys: bool = False) -> dict:
    """Prints the table (`table()`; one function that prints them all where there are several), then `result` as
    one JSON line (the last line of the output, which make gpu-check and the tests read), and writes the results
    file `out` unless it is None (--no-save; see `output`). The file holds `saved` where that is given (the line
    with its details, say ``{"summary": result, "rows": rows}``), else `result`; `indent`: None for one line.
    Returns `result`."""
    if table is not None:
        table()
    print(json.dumps(result, sort_keys=sort_keys))
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(json.dumps(result if saved is None else saved, indent=indent, sort_keys=sort_keys) + "\n")
    return result


def last_json_line(text: str) -> dict:
    """The last line of `text` that is a JSON object (how every benchmark here reports); ValueError when none is."""
    value = last_json_object(text)
    if value is None:
        raise ValueError("no JSON object line in the output")
    return value


def module_command(module: str, *args: str, python: str = sys.executable) -> list[str]:
    """The command that runs bench/`module`.py (e.g. a benchmark's own worker) as ``python -m bench.<module>``."""
    return [python, "-m", f"bench.{module}", *args]


def child_env(environ: Mapping[str, str] = os.environ, **extra: str) -> dict[str, str]:
    """`environ` with the repository root first on PYTHONPATH (children import `bench` and `tools` wherever their
    working directory is), plus `extra`."""
    paths = [ROOT] + [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT]
    return {**environ, "PYTHONPATH": os.pathsep.join(paths), **extra}
