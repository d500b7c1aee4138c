"""pytest plugin for time-boxed runs: the per-test record (tools/test_record.py), a per-test time limit, and an
optional order of the tests by their marks. Loaded with ``-p pytest_record`` (tools/ on PYTHONPATH; tools/gpu_check.py
and tools/bounded_pytest.py do this); it does nothing unless ``$JODC_TEST_RECORD`` names the record file.

Per-test limit (``$JODC_TEST_LIMIT_S``, seconds; unset or 0: none): a test still running at its limit gets a watchdog
event in the record, every thread's stack on stderr (faulthandler), the processes it started are killed, and its
process ends with exit code WATCHDOG_EXIT. Ending the process is the only bound that always works: a test stuck in native code (a GPU kernel that
never finishes, a barrier waiting on a peer) cannot be interrupted from Python. tools/bounded_pytest.py then runs the
tests not yet run in a fresh process. The watchdog is a Python thread, so it also needs the GIL: if the stuck code
holds it, faulthandler's own timer (GIL-free) dumps the stacks and exits FALLBACK_GRACE_S later.

Order (``$JODC_TEST_ORDER``, e.g. ``raw_handlers,*,stress``): tests carrying the first mark run first, then those with
none of the named marks (``*``), then the rest in the order named; pytest's order is kept within each group. A
time-boxed step thus reaches its most valuable tests first.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time

import test_record
from step_runner import descendants

WATCHDOG_EXIT = 86
FALLBACK_GRACE_S = 10.0
# The process's own stderr, taken when pytest imports this plugin (``-p`` plugins are imported before pytest starts
# capturing output): a stack dump written to fd 2 during a test would land in pytest's capture, which is lost when
# the watchdog ends the process.
_STDERR_FD = os.dup(2)


def parse_order(text: str) -> list[str]:
    """'raw_handlers, *,stress' -> ['raw_handlers', '*', 'stress'] ('*', the tests without any named mark, is added
    last when missing)."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    return names + ([] if "*" in names or not names else ["*"])


def order_key(marks: set[str], order: list[str]) -> int:
    """The group of a test carrying `marks` under `order` (parse_order's list): its first named mark, else '*'."""
    for i, name in enumerate(order):
        if name != "*" and name in marks:
            return i
    return order.index("*") if "*" in order else len(order)


def limit_from_env(environ=None) -> float:
    """$JODC_TEST_LIMIT_S as seconds (0: no limit); ValueError naming the variable for anything else."""
    text = (os.environ if environ is None else environ).get(test_record.LIMIT_ENV, "").strip()
    try:
        value = float(text) if text else 0.0
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{test_record.LIMIT_ENV} must be a number of seconds >= 0, got {text!r}")
    return value


class Watchdog:
    """Ends the process when one test runs past `limit_s` (see the module's docstring). `exit` is injectable for
    tests; it must not return."""

    def __init__(self, writer: test_record.Writer, limit_s: float, exit=os._exit, stderr_fd: int = _STDERR_FD):
        self.writer, self.limit_s, self._exit, self.stderr_fd = writer, float(limit_s), exit, stderr_fd
        self._timer: threading.Timer | None = None

    def arm(self, nodeid: str) -> None:
        self.cancel()
        if self.limit_s <= 0:
            return
        self._timer = threading.Timer(self.limit_s, self.fire, args=(nodeid,))
        self._timer.daemon = True
        self._timer.start()
        faulthandler.dump_traceback_later(self.limit_s + FALLBACK_GRACE_S, exit=True, file=self.stderr_fd)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            faulthandler.cancel_dump_traceback_later()

    def fire(self, nodeid: str) -> None:
        self.writer.write("watchdog", nodeid=nodeid, limit_s=self.limit_s, t=time.time())
        os.write(self.stderr_fd, (f"\n*** {nodeid} ran past its limit of {self.limit_s:g} s: the stacks of every "
                                  f"thread follow, then this process exits with {WATCHDOG_EXIT} ***\n").encode())
        faulthandler.dump_traceback(file=self.stderr_fd, all_threads=True)
        for pid in descendants(os.getpid()):  # what the test started (its own sessions too) ends with it
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._exit(WATCHDOG_EXIT)


def _message(report) -> str:
    if report.skipped:
        if getattr(report, "wasxfail", None) is not None:
            return f"xfail: {report.wasxfail}"
        longrepr = report.longrepr
        if isinstance(longrepr, tuple) and len(longrepr) == 3:
            return str(longrepr[2])
        return str(longrepr or "")
    if report.failed:
        return (report.longreprtext or "")[-test_record.MESSAGE_CHARS:]
    return ""


class RecordPlugin:
    """The hooks: every event goes to the record as it happens."""

    def __init__(self, path: str, limit_s: float, order: list[str]):
        self.writer = test_record.Writer(path)
        self.watchdog = Watchdog(self.writer, limit_s)
        self.order = order
        self.writer.write("session", pid=os.getpid(), t=time.time(), limit_s=limit_s)

    def pytest_collection_modifyitems(self, items):
        if self.order:
            items.sort(key=lambda item: order_key({m.name for m in item.iter_markers()}, self.order))

    def pytest_collection_finish(self, session):
        self.writer.write("collected", nodeids=[item.nodeid for item in session.items])

    def pytest_collectreport(self, report):
        if report.failed:
            self.writer.write("collect", nodeid=report.nodeid or "<collection>", message=_message(report))

    def pytest_runtest_logstart(self, nodeid, location):
        self.writer.write("start", nodeid=nodeid, t=time.time())
        self.watchdog.arm(nodeid)

    def pytest_runtest_logreport(self, report):
        self.writer.write("report", nodeid=report.nodeid, when=report.when, duration=round(report.duration, 3),
                          outcome="skipped" if report.skipped else report.outcome, message=_message(report))

    def pytest_runtest_logfinish(self, nodeid, location):
        self.watchdog.cancel()
        self.writer.write("finish", nodeid=nodeid, t=time.time())

    def pytest_unconfigure(self, config):
        self.watchdog.cancel()
        self.writer.close()


def pytest_configure(config):
    path = os.environ.get(test_record.RECORD_ENV, "").strip()
    if path:
        config.pluginmanager.register(RecordPlugin(path, limit_from_env(),
                                                   parse_order(os.environ.get(test_record.ORDER_ENV, ""))),
                                      "jodc_test_record")
