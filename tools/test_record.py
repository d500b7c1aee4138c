"""The per-test record of a bounded pytest run: written test by test while pytest runs, read into results and JUnit XML
afterwards, whatever became of the process.

pytest's own ``--junitxml`` is written only when the session ends, so a pytest killed at a step's limit (or by its
per-test watchdog) leaves no JUnit at all, and ``-q`` dots do not say which test hung. This record is a JSON-lines
file appended to (and flushed) at every test's start and at each of its phases' reports (tools/pytest_record.py
writes it), so after any ending it says which tests passed, failed or skipped, and which one was running when the
process died. ``results`` turns it into one result per test, ``write_junit`` into a JUnit file.

Events (one JSON object per line, ``event`` says which):
  session   {"pid", "t", "limit_s"}                       a pytest session began (several after restarts)
  collected {"nodeids"}                                   the tests this session will run, in its order
  start     {"nodeid", "t"}                               a test began
  report    {"nodeid", "when", "outcome", "duration", "message"}   one phase (setup / call / teardown) ended
  finish    {"nodeid", "t"}                               the test ended (every phase reported)
  collect   {"nodeid", "message"}                         a module could not be collected (an error)
  watchdog  {"nodeid", "limit_s"}                         the per-test limit ended the process during nodeid
"""
from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ElementTree

# the longest failure text kept per test (the whole traceback stays in the step's log)
MESSAGE_CHARS = 4000
RECORD_ENV = "JODC_TEST_RECORD"
LIMIT_ENV = "JODC_TEST_LIMIT_S"
ORDER_ENV = "JODC_TEST_ORDER"


class Writer:
    """Appends events to the record at `path` (created with its folder), one flushed line each: a process killed at
    any moment leaves every event before that moment readable."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")

    def write(self, event: str, **fields) -> None:
        self._file.write(json.dumps({"event": event, **fields}, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_events(path: str) -> list[dict]:
    """Every complete event of the record (a torn last line, from a process killed mid-write, is left out); [] when
    there is no record."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and "event" in value:
            events.append(value)
    return events


def results(events: list[dict], ended_by: str = "") -> list[dict]:
    """One result per test, in the order the tests started: {"nodeid", "outcome", "seconds", "message", "finished"};
    outcome is passed, failed (the test itself), error (setup or teardown failed, the module did not import, or the
    test never finished), skipped, or not_run (collected, never started: its process ended first; listed last). A
    test that started and never finished gets an error saying so, with `ended_by` (why its process ended, e.g. "the
    step was killed at its limit of 60 s") or, where a watchdog event names it, the limit."""
    order: list[str] = []
    by_id: dict[str, dict] = {}
    collected = [n for e in events if e["event"] == "collected" for n in e.get("nodeids", ())]
    watchdog = {e.get("nodeid"): e.get("limit_s") for e in events if e["event"] == "watchdog"}

    def entry(nodeid: str) -> dict:
        if nodeid not in by_id:
            order.append(nodeid)
            by_id[nodeid] = {"nodeid": nodeid, "outcome": None, "seconds": 0.0, "message": "", "finished": False}
        return by_id[nodeid]

    for e in events:
        kind, nodeid = e["event"], e.get("nodeid", "")
        if kind == "start":
            r = entry(nodeid)
            r.update(finished=False, outcome=None, message="", seconds=0.0)
        elif kind == "report":
            r = entry(nodeid)
            r["seconds"] = round(r["seconds"] + float(e.get("duration") or 0.0), 3)
            outcome, when = e.get("outcome"), e.get("when")
            if outcome == "failed":
                if r["outcome"] not in ("failed", "error"):
                    r["outcome"] = "failed" if when == "call" else "error"
                    r["message"] = (f"{when}: " if when != "call" else "") + (e.get("message") or "")
            elif outcome == "skipped" and r["outcome"] is None:
                r["outcome"], r["message"] = "skipped", e.get("message") or ""
        elif kind == "finish":
            r = entry(nodeid)
            r["finished"] = True
            if r["outcome"] is None:
                r["outcome"] = "passed"
        elif kind == "collect":
            r = entry(nodeid)
            r.update(outcome="error", finished=True, message=f"collection failed: {e.get('message') or ''}")
    out = []
    for nodeid in order:
        r = by_id[nodeid]
        if not r["finished"]:
            if nodeid in watchdog:
                why = f"its per-test limit of {watchdog[nodeid]:g} s ended the process (stacks in the log)"
            else:
                why = ended_by or "its process ended (crashed, or was killed) while it ran"
            r["outcome"] = "error"
            r["message"] = f"did not finish: {why}" + (f"; {r['message']}" if r["message"] else "")
        out.append({k: r[k] for k in ("nodeid", "outcome", "seconds", "message")} | {"finished": r["finished"]})
    for nodeid in dict.fromkeys(collected):
        if nodeid not in by_id:
            out.append({"nodeid": nodeid, "outcome": "not_run", "seconds": 0.0, "finished": False,
                        "message": f"not run: {ended_by or 'its session ended'} before it started"})
    return out


def not_run(events: list[dict]) -> list[str]:
    """The collected tests that never started, in their order (what a restart or a second call still has to run)."""
    return [r["nodeid"] for r in results(events) if r["outcome"] == "not_run"]


def running_test(events: list[dict]) -> str | None:
    """The test that started last and has not finished (the one running, or running when the process died)."""
    open_tests: dict[str, bool] = {}
    for e in events:
        if e["event"] == "start":
            open_tests.pop(e["nodeid"], None)
            open_tests[e["nodeid"]] = True
        elif e["event"] == "finish":
            open_tests.pop(e.get("nodeid"), None)
    return next(reversed(open_tests), None) if open_tests else None


def counts(test_results: list[dict]) -> dict[str, int]:
    """passed / failed / errors / skipped / not_run / total of `results`."""
    c = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "not_run": 0}
    for r in test_results:
        c["errors" if r["outcome"] == "error" else r["outcome"]] += 1
    c["total"] = len(test_results)
    return c


def _split(nodeid: str) -> tuple[str, str]:
    """pytest's node id -> JUnit (classname, name), as pytest's own junitxml writes them: the module's path with dots,
    then the test's name with its parameters."""
    path, _, name = nodeid.partition("::")
    module = path[:-3] if path.endswith(".py") else path
    return module.replace("/", ".").replace("\\", "."), name or path


def junit_tree(suite: str, test_results: list[dict]) -> ElementTree.Element:
    """A <testsuite> of `test_results`, named `suite`."""
    c = counts(test_results)
    root = ElementTree.Element("testsuite", name=suite, tests=str(c["total"]), failures=str(c["failed"]),
                               errors=str(c["errors"]), skipped=str(c["skipped"] + c["not_run"]),
                               time=f"{sum(r['seconds'] for r in test_results):.3f}")
    for r in test_results:
        classname, name = _split(r["nodeid"])
        case = ElementTree.SubElement(root, "testcase", classname=classname, name=name, time=f"{r['seconds']:.3f}")
        message = (r["message"] or "")[:MESSAGE_CHARS]
        if r["outcome"] in ("failed", "error", "skipped", "not_run"):
            tag = {"failed": "failure", "error": "error", "skipped": "skipped", "not_run": "skipped"}[r["outcome"]]
            child = ElementTree.SubElement(case, tag, message=message.splitlines()[0][:500] if message else "")
            child.text = message
    return root


def write_junit(record_path: str, junit_path: str, suite: str, ended_by: str = "") -> dict[str, int]:
    """Writes the JUnit XML of the record at `record_path` (a <testsuites> with one <testsuite> named `suite`) to
    `junit_path`; returns its counts."""
    test_results = results(read_events(record_path), ended_by)
    suites = ElementTree.Element("testsuites")
    suites.append(junit_tree(suite, test_results))
    os.makedirs(os.path.dirname(os.path.abspath(junit_path)), exist_ok=True)
    ElementTree.ElementTree(suites).write(junit_path, encoding="utf-8", xml_declaration=True)
    return counts(test_results)
