"""Runs a list of checks (subprocesses) under one wall-clock budget and keeps a current record of them at every moment.

Made for machines that are lent rarely and briefly (the GPU runner, `tools/gpu_check.py`): every second goes to
running, a failing step never costs the information the other steps would give, and whatever happens (a step fails,
hangs, the budget runs out, the runner itself is interrupted or killed) the record says what was done. Working files
go to a work folder:

    logs/<step>.log       each step's whole output (stdout and stderr interleaved), as it is written
    records/<step>.jsonl  a test step's per-test record (tools/test_record.py), as pytest runs
    junit/<step>.xml      a test step's JUnit XML, made from its record when the step ends (whatever ended it)

and the summary (one entry per step: status, seconds, limit, exit code, test counts, the test running when the step
was killed, the step's JSON line, facts read from its log, log tail) goes to ``publish``: before the first step, every
``heartbeat_s`` while a step runs, after every step and at the end. The default publisher writes summary.json in the
work folder; tools/gpu_check.py's writes its few result files.

Statuses: ``passed``, ``failed`` (non-zero exit), ``timeout`` (killed at its limit), ``skipped`` (with the reason: a
step it needs did not pass, or the budget is spent), ``interrupted`` (the runner got SIGTERM / SIGINT mid-step),
``running`` and ``pending`` (in a summary published mid-run). A step's limit is the smaller of its own ``timeout_s``
and the budget left; an ``optional`` step (``if time is left``) starts only when its whole ``timeout_s`` still fits.
Steps run in the order given.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from typing import Callable, Sequence

import test_record  # noqa: E402  (tools/test_record.py)
from json_lines import last_json_object  # noqa: E402, F401  (tools/json_lines.py; step_runner.last_json_object)

# Below this many seconds of budget no step is started: it could not do anything useful.
MIN_STEP_S = 5.0
LOG_TAIL_LINES = 40
LOG_TAIL_LINE_CHARS = 400
# After SIGTERM to a step's process group, how long it gets to exit before SIGKILL.
KILL_GRACE_S = 5.0
NOT_RUN_LISTED = 50


@dataclasses.dataclass(frozen=True)
class Step:
    """One check. `cmd` is the argv (list of strings), or a callable returning it (evaluated when the step starts,
    so it can read what earlier steps produced); ``{record}`` in it becomes the step's record path. `tests`: the step
    runs pytest with tools/pytest_record.py (tools/bounded_pytest.py), whose record ($JODC_TEST_RECORD) gives the
    step's test counts and JUnit XML. `json_line`: the step prints one JSON object line (a benchmark or a report):
    the last such line of its output goes into the summary. `facts(log_text) -> dict` reads figures from the step's
    output (sanitizer error counts) into its summary entry."""
    name: str
    cmd: Sequence[str] | Callable[[], Sequence[str]]
    timeout_s: float
    what: str = ""
    needs: tuple[str, ...] = ()
    tests: bool = False
    json_line: bool = False
    optional: bool = False
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    facts: Callable[[str], dict] | None = None

    def __post_init__(self):
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"step name {self.name!r} must be letters, digits, '-' or '_'")
        if self.timeout_s <= 0:
            raise ValueError(f"step {self.name}: timeout_s must be > 0, got {self.timeout_s}")


def check_plan(steps: Sequence[Step]) -> None:
    """Raises ValueError unless names are unique and every step needs only steps that come before it."""
    seen: set[str] = set()
    for step in steps:
        if step.name in seen:
            raise ValueError(f"step {step.name!r} appears twice")
        missing = [n for n in step.needs if n not in seen]
        if missing:
            raise ValueError(f"step {step.name!r} needs {missing}, which are not earlier steps")
        seen.add(step.name)


def required_seconds(steps: Sequence[Step]) -> float:
    """The sum of the required (not optional) steps' limits: what a budget must cover for every one of them to get
    its whole limit."""
    return sum(s.timeout_s for s in steps if not s.optional)


def select(steps: Sequence[Step], only: Sequence[str] | None) -> list[Step]:
    """The steps named in `only` (all when None or empty), in plan order; unknown names are a ValueError naming the
    known ones. Needs outside the selection are taken as met (a rerun of chosen steps on a warm machine)."""
    if not only:
        return list(steps)
    names = {s.name for s in steps}
    unknown = [n for n in only if n not in names]
    if unknown:
        raise ValueError(f"unknown step(s) {unknown}; the steps are: {', '.join(s.name for s in steps)}")
    chosen = set(only)
    return [dataclasses.replace(s, needs=tuple(n for n in s.needs if n in chosen)) for s in steps if s.name in chosen]


def junit_counts(path: str) -> dict[str, int] | None:
    """passed / failed / errors / skipped / total of a JUnit XML file, or None if it is missing or torn."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for case in root.iter("testcase"):
        if case.find("failure") is not None:
            counts["failed"] += 1
        elif case.find("error") is not None:
            counts["errors"] += 1
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    counts["total"] = sum(counts.values())
    return counts


def merge_junit(paths: Sequence[str], out_path: str) -> None:
    """One <testsuites> holding every <testsuite> of the readable files in `paths` (missing or torn ones are left out),
    written atomically (a reader never sees half a file)."""
    merged = ElementTree.Element("testsuites")
    for path in paths:
        try:
            root = ElementTree.parse(path).getroot()
        except (OSError, ElementTree.ParseError):
            continue
        merged.extend([root] if root.tag == "testsuite" else list(root.iter("testsuite")))
    tmp = out_path + ".tmp"
    ElementTree.ElementTree(merged).write(tmp, encoding="utf-8", xml_declaration=True)
    os.replace(tmp, out_path)


class _Interrupted(Exception):
    pass


def write_json(path: str, value) -> None:
    """`value` as indented JSON at `path`, atomically (written beside it, then renamed over it)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


class Runner:
    """Runs `steps` (already checked and selected) with a total of `budget_s` seconds, working in `work_dir`.
    `meta` goes into the summary as is (what ran where). `publish(summary)` receives every summary (default: written
    to work_dir/summary.json). No step starts with less than `min_step_s` of budget left (default MIN_STEP_S).
    `clock` is injectable for tests."""

    def __init__(self, steps: Sequence[Step], work_dir: str, budget_s: float, meta: dict | None = None,
                 env: dict[str, str] | None = None, cwd: str | None = None, clock: Callable[[], float] = time.monotonic,
                 echo: Callable[[str], None] | None = None, publish: Callable[[dict], None] | None = None,
                 heartbeat_s: float = 20.0, min_step_s: float | None = None):
        check_plan(steps)
        if budget_s <= 0:
            raise ValueError(f"budget_s must be > 0, got {budget_s}")
        self.steps, self.work_dir, self.budget_s = list(steps), work_dir, float(budget_s)
        self.env = dict(os.environ if env is None else env)
        self.cwd, self.clock = cwd, clock
        self.echo = echo or (lambda line: print(line, flush=True))
        self.publish = publish or (lambda summary: write_json(self.path("summary.json"), summary))
        self.heartbeat_s = float(heartbeat_s)
        self.min_step_s = MIN_STEP_S if min_step_s is None else float(min_step_s)
        self.meta = dict(meta or {})
        self.results: dict[str, dict] = {}
        self._current: subprocess.Popen | None = None
        self._running: tuple[str, float] | None = None  # (step, its start on self.clock)
        self._interrupted = False

    # ---- paths
    def path(self, *parts: str) -> str:
        return os.path.join(self.work_dir, *parts)

    def log_path(self, name: str) -> str:
        return self.path("logs", f"{name}.log")

    def record_path(self, name: str) -> str:
        return self.path("records", f"{name}.jsonl")

    def junit_path(self, name: str) -> str:
        return self.path("junit", f"{name}.xml")

    # ---- the run
    def run(self) -> dict:
        """Runs every step; returns the final summary (also published). Never raises for a failing step."""
        for sub in ("logs", "junit", "records"):
            os.makedirs(self.path(sub), exist_ok=True)
        self.start = self.clock()
        self.started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        for sig in previous:
            signal.signal(sig, self._on_signal)
        try:
            self.summary(final=False, publish=True)
            for step in self.steps:
                self.results[step.name] = self._run_step(step)
                self.summary(final=False, publish=True)
                r = self.results[step.name]
                self.echo(f"[{step.name}] {r['status']} in {r['seconds']:.1f} s"
                          + (f" ({r['reason']})" if r.get("reason") else "")
                          + (f" {r['tests']}" if r.get("tests") else ""))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self.summary(final=True, publish=True)

    def _on_signal(self, signum, _frame):
        self._interrupted = True
        if self._current is not None:
            kill_tree(self._current)
        raise _Interrupted(signal.Signals(signum).name)

    def remaining_s(self) -> float:
        return self.budget_s - (self.clock() - self.start)

    def _skip(self, reason: str) -> dict:
        return {"status": "skipped", "reason": reason, "seconds": 0.0}

    def _run_step(self, step: Step) -> dict:
        if self._interrupted:
            return self._skip("the runner was interrupted")
        unmet = [n for n in step.needs if self.results.get(n, {}).get("status") != "passed"]
        if unmet:
            return self._skip(f"needs {', '.join(unmet)}, which did not pass")
        left = self.remaining_s()
        if left < self.min_step_s:
            return self._skip(f"budget spent ({left:.0f} s left of {self.budget_s:.0f} s)")
        if step.optional and left < step.timeout_s:
            return self._skip(f"optional and its {step.timeout_s:.0f} s do not fit the {left:.0f} s left")
        limit = min(step.timeout_s, left)
        record = self.record_path(step.name)
        for stale in (record, self.junit_path(step.name)):  # a rerun in the same work folder starts afresh
            if os.path.exists(stale):
                os.remove(stale)
        argv = [str(a).replace("{record}", record) for a in (step.cmd() if callable(step.cmd) else step.cmd)]
        env = dict(self.env, **step.env)
        if step.tests:
            env[test_record.RECORD_ENV] = record
        log_path = self.log_path(step.name)
        result: dict = {"what": step.what, "command": " ".join(argv), "limit_s": round(limit, 1)}
        began = self.clock()
        self._running = (step.name, began)
        try:
            with open(log_path, "wb") as log:
                log.write(f"$ {' '.join(argv)}\n".encode())
                log.flush()
                result.update(self._execute(argv, env, log, limit))
        except _Interrupted as e:
            result.update(status="interrupted", reason=f"the runner got {e}")
        except OSError as e:  # the program does not exist, cannot be executed, ...
            result.update(status="failed", reason=f"could not start: {e}")
        finally:
            self._running = None
        result["seconds"] = round(self.clock() - began, 2)
        text = _read(log_path)
        result["log_tail"] = [line[:LOG_TAIL_LINE_CHARS] for line in text.splitlines()[-LOG_TAIL_LINES:]]
        result["log"] = os.path.relpath(log_path, self.work_dir)
        if step.tests:
            result.update(self._test_outcome(step.name, result))
        if step.json_line:
            result["json"] = last_json_object(text)
            if result["json"] is None and result["status"] == "passed":
                result.update(status="failed", reason="passed but printed no JSON line")
        if step.facts is not None:
            try:
                result["facts"] = step.facts(text)
            except Exception as e:  # noqa: BLE001  (a parser's bug must not lose the step's record)
                result["facts"] = {"error": f"{type(e).__name__}: {e}"}
        return result

    def _test_outcome(self, name: str, result: dict) -> dict:
        """The test step's counts, JUnit file and unfinished business, from its record."""
        ended_by = {"timeout": f"the step was killed at its limit of {result['limit_s']:.0f} s",
                    "interrupted": "the runner was interrupted"}.get(result.get("status"), "")
        events = test_record.read_events(self.record_path(name))
        out: dict = {"tests": test_record.write_junit(self.record_path(name), self.junit_path(name), name, ended_by)}
        running = test_record.running_test(events)
        if running is not None:
            out["running_when_ended"] = running
        not_run = test_record.not_run(events)
        if not_run:
            out["not_run"] = not_run[:NOT_RUN_LISTED] + ([f"... {len(not_run) - NOT_RUN_LISTED} more"]
                                                         if len(not_run) > NOT_RUN_LISTED else [])
        if not events:
            out["tests_note"] = "no record: pytest never started its session"
        return out

    def _execute(self, argv: list[str], env: dict, log, limit: float) -> dict:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=self.cwd, start_new_session=True)
        self._current = proc
        deadline = self.clock() + limit
        try:
            while True:
                try:
                    rc = proc.wait(timeout=max(0.0, min(self.heartbeat_s, deadline - self.clock())))
                    break
                except subprocess.TimeoutExpired:
                    if self.clock() >= deadline:
                        kill_tree(proc)
                        return {"status": "timeout", "reason": f"killed at its limit of {limit:.0f} s",
                                "exit_code": None}
                    self.summary(final=False, publish=True)  # a heartbeat: the record stays current mid-step
        finally:
            self._current = None
        return {"status": "passed" if rc == 0 else "failed", "exit_code": rc}

    # ---- the record
    def _running_entry(self, name: str, began: float) -> dict:
        entry = {"status": "running", "seconds": round(self.clock() - began, 1)}
        step = next(s for s in self.steps if s.name == name)
        if step.tests:
            events = test_record.read_events(self.record_path(name))
            entry["tests"] = test_record.counts(test_record.results(events))
            running = test_record.running_test(events)
            if running:
                entry["running_test"] = running
        return entry

    def summary(self, final: bool, publish: bool = False) -> dict:
        """The summary as of now (`final`: the run is over, unreached steps are skipped); published if asked."""
        totals = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "not_run": 0, "total": 0}
        for r in self.results.values():
            for k, v in r.get("tests", {}).items():
                totals[k] = totals.get(k, 0) + v
        steps = {}
        for s in self.steps:
            if s.name in self.results:
                steps[s.name] = self.results[s.name]
            elif self._running and self._running[0] == s.name:
                steps[s.name] = self._running_entry(*self._running)
            else:
                steps[s.name] = ({"status": "skipped", "reason": "not reached", "seconds": 0.0} if final
                                 else {"status": "pending", "limit_s": s.timeout_s, "seconds": 0.0})
        required_ok = all(steps[s.name]["status"] == "passed" for s in self.steps if not s.optional)
        optional_ok = all(steps[s.name]["status"] in ("passed", "skipped") for s in self.steps if s.optional)
        summary = {
            **self.meta,
            "status": ("interrupted" if self._interrupted else "passed" if required_ok and optional_ok
                       else "failed") if final else "running",
            "started": self.started_at,
            "elapsed_s": round(self.clock() - self.start, 1),
            "budget_s": self.budget_s,
            "tests": totals,
            "benchmarks": {n: r["json"] for n, r in self.results.items() if r.get("json") is not None},
            "steps": steps,
        }
        if publish:
            self.publish(summary)
        return summary

    def junit_files(self) -> list[str]:
        """The JUnit files of the test steps that have one, in plan order."""
        return [self.junit_path(s.name) for s in self.steps if s.tests and os.path.exists(self.junit_path(s.name))]


def table(summary: dict) -> str:
    """A short text table of a summary: one row per step, then the totals."""
    rows = [("step", "status", "s", "tests / note")]
    for name, r in summary["steps"].items():
        t = r.get("tests")
        note = (f"{t['passed']} passed, {t['failed'] + t['errors']} failed, {t['skipped']} skipped"
                + (f", {t['not_run']} not run" if t.get("not_run") else "") if t else r.get("reason", ""))
        if r.get("running_when_ended"):
            note += f"; ended during {r['running_when_ended']}"
        rows.append((name, r["status"], f"{r.get('seconds', 0):.0f}", note[:140]))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d}" for a, b, c, d in rows]
    t = summary["tests"]
    lines.append(f"{summary['status'].upper()}: {t['passed']} tests passed, {t['failed'] + t['errors']} failed, "
                 f"{t['skipped']} skipped, {t.get('not_run', 0)} not run; {summary['elapsed_s']:.0f} s of "
                 f"{summary['budget_s']:.0f} s")
    return "\n".join(lines)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, grandchildren, ...), read from /proc (empty where there is none).
    Steps' tests start helpers in sessions of their own (multi-process tests), which a process-group kill misses."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def process_alive(pid: int) -> bool:
    """Whether `pid` is a live process (not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_tree(proc: subprocess.Popen) -> None:
    """Ends a step: SIGTERM to its process group and to every descendant (all of them started by the step; listed
    before the first signal, since orphans are re-parented), SIGKILL to whatever is left after a grace period."""
    targets = descendants(proc.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in targets:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + KILL_GRACE_S
        while time.monotonic() < deadline and (proc.poll() is None or any(process_alive(p) for p in targets)):
            time.sleep(0.05)
        if proc.poll() is not None and not any(process_alive(p) for p in targets):
            return


def _read(path: str, max_bytes: int = 8 << 20) -> str:
    """The last `max_bytes` of the file at `path` as text ('' if unreadable): what the summary reads from a log (its
    tail, its last JSON line, a sanitizer's closing summary) is at its end."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit("tools/step_runner.py is a library: run tools/gpu_check.py")
