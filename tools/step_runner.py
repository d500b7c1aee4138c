"""Runs a list of checks (subprocesses) under one wall-clock budget and always leaves a readable record behind.

Made for machines that are lent rarely and briefly (the GPU runner, `tools/gpu_check.py`): every second goes to
running, a failing step never costs the information the other steps would give, and whatever happens (a step fails,
hangs, the budget runs out, the runner itself is interrupted) the output folder holds

    summary.json      one entry per step: status, seconds, exit code, test counts, the step's JSON line, log tail;
                      rewritten after every step, so it is current even if this process is killed
    junit.xml         every pytest step's JUnit XML merged into one <testsuites>
    junit/<step>.xml  the per-step files
    logs/<step>.log.gz  each step's whole output (stdout and stderr interleaved), compressed

Statuses: ``passed``, ``failed`` (non-zero exit), ``timeout`` (killed at its limit), ``skipped`` (with the reason: a
step it needs did not pass, or the budget is spent), ``interrupted`` (the runner got SIGTERM / SIGINT mid-step).
A step's limit is the smaller of its own ``timeout_s`` and the budget left; an ``optional`` step (``if time is
left``) starts only when its whole ``timeout_s`` still fits. Steps run in the order given.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from typing import Callable, Sequence

# Below this many seconds of budget no step is started: it could not do anything useful.
MIN_STEP_S = 5.0
LOG_TAIL_LINES = 40
# After SIGTERM to a step's process group, how long it gets to exit before SIGKILL.
KILL_GRACE_S = 5.0


@dataclasses.dataclass(frozen=True)
class Step:
    """One check. `cmd` is the argv (list of strings), or a callable returning it (evaluated when the step starts,
    so it can read what earlier steps produced). `junit`: the step is pytest and ``{junit}`` in its argv is replaced by
    the path its JUnit XML must go to. `json_line`: the step prints one JSON object line (a benchmark or a report):
    the last such line of its output goes into the summary."""
    name: str
    cmd: Sequence[str] | Callable[[], Sequence[str]]
    timeout_s: float
    what: str = ""
    needs: tuple[str, ...] = ()
    junit: bool = False
    json_line: bool = False
    optional: bool = False
    env: dict[str, str] = dataclasses.field(default_factory=dict)

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


def junit_counts(path: str) -> dict[str, int] | None:
    """passed / failed / errors / skipped / total of a pytest JUnit XML file, or None if it is missing or torn."""
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
    """One <testsuites> holding every <testsuite> of the readable files in `paths` (missing or torn ones are left out)."""
    merged = ElementTree.Element("testsuites")
    for path in paths:
        try:
            root = ElementTree.parse(path).getroot()
        except (OSError, ElementTree.ParseError):
            continue
        merged.extend([root] if root.tag == "testsuite" else list(root.iter("testsuite")))
    ElementTree.ElementTree(merged).write(out_path, encoding="utf-8", xml_declaration=True)


class _Interrupted(Exception):
    pass


class Runner:
    """Runs `steps` (already checked and selected) with a total of `budget_s` seconds, writing into `out_dir`.
    `meta` goes into the summary as is (what ran where). `clock` is injectable for tests."""

    def __init__(self, steps: Sequence[Step], out_dir: str, budget_s: float, meta: dict | None = None,
                 env: dict[str, str] | None = None, cwd: str | None = None, clock: Callable[[], float] = time.monotonic,
                 echo: Callable[[str], None] | None = None):
        check_plan(steps)
        if budget_s <= 0:
            raise ValueError(f"budget_s must be > 0, got {budget_s}")
        self.steps, self.out_dir, self.budget_s = list(steps), out_dir, float(budget_s)
        self.env = dict(os.environ if env is None else env)
        self.cwd, self.clock = cwd, clock
        self.echo = echo or (lambda line: print(line, flush=True))
        self.meta = dict(meta or {})
        self.results: dict[str, dict] = {}
        self._current: subprocess.Popen | None = None
        self._interrupted = False

    # ---- paths
    def _path(self, *parts: str) -> str:
        return os.path.join(self.out_dir, *parts)

    def _junit_path(self, name: str) -> str:
        return self._path("junit", f"{name}.xml")

    # ---- the run
    def run(self) -> dict:
        """Runs every step; returns the summary (also in summary.json). Never raises for a failing step."""
        for sub in ("logs", "junit"):
            os.makedirs(self._path(sub), exist_ok=True)
        self.start = self.clock()
        self.started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        for sig in previous:
            signal.signal(sig, self._on_signal)
        try:
            for step in self.steps:
                self.results[step.name] = self._run_step(step)
                self._write_summary(final=False)
                r = self.results[step.name]
                self.echo(f"[{step.name}] {r['status']} in {r['seconds']:.1f} s"
                          + (f" ({r['reason']})" if r.get("reason") else "")
                          + (f" {r['tests']}" if r.get("tests") else ""))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self._write_summary(final=True)

    def _on_signal(self, signum, _frame):
        self._interrupted = True
        if self._current is not None:
            _kill_group(self._current)
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
        if left < MIN_STEP_S:
            return self._skip(f"budget spent ({left:.0f} s left of {self.budget_s:.0f} s)")
        if step.optional and left < step.timeout_s:
            return self._skip(f"optional and its {step.timeout_s:.0f} s do not fit the {left:.0f} s left")
        limit = min(step.timeout_s, left)
        argv = [str(a) for a in (step.cmd() if callable(step.cmd) else step.cmd)]
        if step.junit:
            argv = [a.replace("{junit}", self._junit_path(step.name)) for a in argv]
        log_path = self._path("logs", f"{step.name}.log")
        result: dict = {"what": step.what, "command": " ".join(argv), "limit_s": round(limit, 1)}
        began = self.clock()
        try:
            with open(log_path, "wb") as log:
                log.write(f"$ {' '.join(argv)}\n".encode())
                log.flush()
                result.update(self._execute(argv, dict(self.env, **step.env), log, limit))
        except _Interrupted as e:
            result.update(status="interrupted", reason=f"the runner got {e}")
        except OSError as e:  # the program does not exist, cannot be executed, ...
            result.update(status="failed", reason=f"could not start: {e}")
        result["seconds"] = round(self.clock() - began, 2)
        text = _read(log_path)
        result["log_tail"] = text.splitlines()[-LOG_TAIL_LINES:]
        _compress(log_path)
        result["log"] = os.path.relpath(log_path + ".gz", self.out_dir)
        if step.junit:
            counts = junit_counts(self._junit_path(step.name))
            if counts is not None:
                result["tests"] = counts
        if step.json_line:
            result["json"] = last_json_object(text)
            if result["json"] is None and result["status"] == "passed":
                result.update(status="failed", reason="passed but printed no JSON line")
        return result

    def _execute(self, argv: list[str], env: dict, log, limit: float) -> dict:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=self.cwd, start_new_session=True)
        self._current = proc
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return {"status": "timeout", "reason": f"killed at its limit of {limit:.0f} s", "exit_code": None}
        finally:
            self._current = None
        return {"status": "passed" if rc == 0 else "failed", "exit_code": rc}

    # ---- the record
    def _write_summary(self, final: bool) -> dict:
        junits = [self._junit_path(s.name) for s in self.steps if s.junit and os.path.exists(self._junit_path(s.name))]
        merge_junit(junits, self._path("junit.xml"))
        totals = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "total": 0}
        for r in self.results.values():
            for k, v in r.get("tests", {}).items():
                totals[k] += v
        steps = {}
        for s in self.steps:
            steps[s.name] = self.results.get(s.name, {"status": "pending" if not final else "skipped",
                                                      "reason": "not reached", "seconds": 0.0})
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
        tmp = self._path("summary.json.tmp")
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")
        os.replace(tmp, self._path("summary.json"))
        return summary


def table(summary: dict) -> str:
    """A short text table of a summary: one row per step, then the totals."""
    rows = [("step", "status", "s", "tests / note")]
    for name, r in summary["steps"].items():
        t = r.get("tests")
        note = (f"{t['passed']} passed, {t['failed'] + t['errors']} failed, {t['skipped']} skipped" if t
                else r.get("reason", ""))
        rows.append((name, r["status"], f"{r.get('seconds', 0):.0f}", note[:90]))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d}" for a, b, c, d in rows]
    t = summary["tests"]
    lines.append(f"{summary['status'].upper()}: {t['passed']} tests passed, {t['failed'] + t['errors']} failed, "
                 f"{t['skipped']} skipped; {summary['elapsed_s']:.0f} s of {summary['budget_s']:.0f} s")
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


def _kill_group(proc: subprocess.Popen) -> None:
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


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _compress(path: str) -> None:
    if not os.path.exists(path):
        return
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)


if __name__ == "__main__":
    sys.exit("tools/step_runner.py is a library: run tools/gpu_check.py")
