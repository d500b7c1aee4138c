"""Runs pytest with a per-test limit, and goes on past a test that hangs: what a time-boxed GPU step runs.

    python tools/bounded_pytest.py --record R [--limit-s S] [--order MARKS] [--restarts N] [--junit J] -- PYTEST_ARGS

pytest runs in a child process with tools/pytest_record.py loaded (``-p pytest_record``), which records every test as
it runs into R (tools/test_record.py) and ends the process when one test runs longer than S seconds. Then, if a test
started and never finished (the watchdog ended it, or it crashed the interpreter) and tests remain that never started,
pytest runs again on the same arguments without every test that already has a result, that one included
(``--deselect``), up to N times: one hang costs one test and a restart, not the rest of the step. The record
accumulates across the runs; --junit writes its JUnit XML at the end (tools/gpu_check.py writes it from the record
itself, also when this wrapper is killed).

Exit code: 0 when the last pytest exited 0 and every recorded test passed or skipped; else 1 (a run that collected
nothing is 1 too).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
import test_record  # noqa: E402  (tools/test_record.py)


def pytest_command(python: str, pytest_args: list[str], skip: list[str]) -> list[str]:
    """The pytest command line of one run: the plugin loaded, `skip` (node ids) deselected."""
    cmd = [python, "-m", "pytest", "-p", "pytest_record", *pytest_args]
    for nodeid in skip:
        cmd += ["--deselect", nodeid]
    return cmd


def child_environment(base: dict, record: str, limit_s: float, order: str) -> dict:
    """`base` plus what the plugin reads, with tools/ first on PYTHONPATH (where ``-p pytest_record`` is found)."""
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join([HERE] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p])
    env[test_record.RECORD_ENV] = os.path.abspath(record)
    env[test_record.LIMIT_ENV] = str(limit_s)
    if order:
        env[test_record.ORDER_ENV] = order
    else:
        env.pop(test_record.ORDER_ENV, None)
    return env


def run(pytest_args: list[str], record: str, limit_s: float = 0.0, order: str = "", restarts: int = 2,
        python: str = sys.executable, environ=None) -> int:
    """Runs pytest (restarting after a test that never finished, at most `restarts` times); returns the exit code
    described in the module's docstring. pytest's output goes to this process's stdout / stderr."""
    env = child_environment(os.environ if environ is None else environ, record, limit_s, order)
    skip: list[str] = []
    code = 0
    for attempt in range(restarts + 1):
        code = subprocess.run(pytest_command(python, pytest_args, skip), env=env).returncode
        events = test_record.read_events(record)
        hung = test_record.running_test(events)
        if hung is None or not test_record.not_run(events):
            break  # every test ended, or the one that hung was the last
        skip = [r["nodeid"] for r in test_record.results(events) if r["outcome"] != "not_run"]  # the hung one too
        if attempt < restarts:
            print(f"\n*** bounded_pytest: {hung} did not finish (exit {code}); running the remaining tests in a fresh "
                  f"process ({restarts - attempt} restart(s) left) ***\n", flush=True)
    outcomes = test_record.counts(test_record.results(test_record.read_events(record)))
    bad = outcomes["failed"] + outcomes["errors"] + outcomes["not_run"]
    return 0 if code == 0 and bad == 0 and outcomes["total"] > 0 else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        sys.exit("usage: bounded_pytest.py --record R [--limit-s S] [--order MARKS] [--restarts N] [--junit J] "
                 "-- PYTEST_ARGS")
    split = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--record", required=True, help="the per-test record (JSON lines; appended to)")
    p.add_argument("--limit-s", type=float, default=0.0, help="per-test limit in seconds (0: none)")
    p.add_argument("--order", default="", help="marks to run first, e.g. raw_handlers,*,stress")
    p.add_argument("--restarts", type=int, default=2, help="fresh pytest processes after hung tests")
    p.add_argument("--junit", help="write the record's JUnit XML here at the end")
    p.add_argument("--suite", default="pytest", help="the JUnit testsuite's name")
    a = p.parse_args(argv[:split])
    code = run(argv[split + 1:], a.record, a.limit_s, a.order, a.restarts)
    if a.junit:
        test_record.write_junit(a.record, a.junit, a.suite)
    return code


if __name__ == "__main__":
    sys.exit(main())
