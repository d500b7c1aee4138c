"""What a GPU check returns: at most a handful of files in its output folder, current at every moment.

A GPU runner returns at most 8 files from ``$OUT`` (16 MiB each), so tools/gpu_check.py keeps its working files
elsewhere and publishes exactly these (``OUT_FILES``), each written beside its final name and renamed over it:

    summary.json   the run: environment (GPU, driver, versions), per-step status / seconds / limit / test counts /
                   the test running when a step was killed / benchmark JSON / sanitizer counts, the headline figures
                   (every ``gpu_*`` benchmark value), the time accounting, the CUDA tests skipped for a software
                   reason, and the second call's command for what did not pass
    junit.xml      every test step's JUnit XML merged (made from the per-test records: present for killed steps too)
    logs.tar.gz    the work folder's text files (logs, records, JUnit, benchmark JSON), under 15 MiB

``Publisher`` is the step runner's publish callback: called before the first step, at every heartbeat, after each
step and at the end, so a call killed at the runner's limit still returns what was done up to the last heartbeat.
"""
from __future__ import annotations

import os
import re

import cuda_report  # noqa: E402  (tools/cuda_report.py)
import gpu_environment  # noqa: E402
import log_archive  # noqa: E402
import step_runner  # noqa: E402

OUT_FILES = ("summary.json", "junit.xml", "logs.tar.gz")
MAX_OUT_FILES = 5  # what the device's 8-file limit leaves for our files and one temporary file at a time


def sanitizer_facts(text: str) -> dict:
    """compute-sanitizer's verdicts in a log: {"errors": N (its last ERROR SUMMARY), "racecheck_hazards",
    "racecheck_errors", "racecheck_warnings" (racecheck's RACECHECK SUMMARY), "cases_passed" (the case script
    finished)}; a count the log lacks is None (the tool never got to its summary)."""
    out: dict = {"errors": None, "racecheck_hazards": None, "racecheck_errors": None, "racecheck_warnings": None}
    errors = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    if errors:
        out["errors"] = int(errors[-1])
    race = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text)
    if race:
        out["racecheck_hazards"], out["racecheck_errors"], out["racecheck_warnings"] = (int(x) for x in race[-1])
    out["cases_passed"] = "ALL CASES PASSED" in text
    return out


def headline(benchmarks: dict) -> dict:
    """Every scalar ``gpu_*`` figure of the benchmark JSON lines, lifted to one flat table."""
    out = {}
    for line in benchmarks.values():
        for key, value in (line or {}).items():
            if key.startswith("gpu_") and not isinstance(value, (dict, list)):
                out[key] = value
    return out


def time_accounting(summary: dict, plan_limits: dict[str, float], optional: set[str]) -> dict:
    """Limits against the budget and what the steps used: {"budget_s", "required_limits_s" (the sum that must fit
    the budget), "optional_limits_s", "elapsed_s", "step_seconds" (used), "unused_s"}."""
    used = {n: r.get("seconds", 0.0) for n, r in summary["steps"].items()}
    return {"budget_s": summary["budget_s"],
            "required_limits_s": round(sum(v for n, v in plan_limits.items() if n not in optional), 1),
            "optional_limits_s": round(sum(v for n, v in plan_limits.items() if n in optional), 1),
            "elapsed_s": summary["elapsed_s"], "step_seconds": round(sum(used.values()), 1),
            "unused_s": round(max(0.0, summary["budget_s"] - summary["elapsed_s"]), 1)}


def unfinished_steps(summary: dict) -> list[str]:
    """The steps that did not pass (failed, killed, skipped, not reached, still pending), in plan order."""
    return [n for n, r in summary["steps"].items() if r.get("status") != "passed"]


def second_call(summary: dict, plan_limits: dict[str, float], always: tuple[str, ...], budget_s: float,
                base_command: str) -> dict:
    """The steps a second call should run (those that did not pass, in plan order, as many as fit `budget_s` with
    the `always` steps that every call runs first) and its command line."""
    chosen, total = [], sum(plan_limits.get(n, 0.0) for n in always)
    left_out = []
    for name in unfinished_steps(summary):
        if name in always:
            continue
        if total + plan_limits.get(name, 0.0) <= budget_s:
            chosen.append(name)
            total += plan_limits.get(name, 0.0)
        else:
            left_out.append(name)
    command = f"{base_command} --only {','.join(chosen)} --reuse-build --budget-s {budget_s:.0f}" if chosen else ""
    return {"steps": chosen, "limits_s": round(total, 1), "left_out": left_out, "command": command}


def software_skips(junit_path: str) -> dict:
    """tools/cuda_report.py's verdict on the merged JUnit: did the CUDA tests run, and did any skip for a reason
    other than missing hardware."""
    try:
        ok, message = cuda_report.check_junit(junit_path)
    except Exception as e:  # noqa: BLE001  (no JUnit yet: nothing to judge)
        return {"ok": None, "message": f"{type(e).__name__}: {e}"}
    return {"ok": ok, "message": message}


class Publisher:
    """Writes OUT_FILES into `out_dir` from the runner's summary (see the module's docstring). `runner` gives the
    JUnit files; `extra(summary) -> dict` adds the caller's facts (the second call, the plan)."""

    def __init__(self, out_dir: str, work_dir: str, junit_files, extra=None):
        self.out_dir, self.work_dir = out_dir, work_dir
        self.junit_files, self.extra = junit_files, extra
        self.archive: dict = {}

    def clear(self) -> list[str]:
        """Removes this publisher's files (and their temporaries) from an earlier run; returns the other files found
        there (left alone: a reader should know the folder holds more than this run's files)."""
        os.makedirs(self.out_dir, exist_ok=True)
        others = []
        for name in sorted(os.listdir(self.out_dir)):
            temporary = name.endswith((".tmp", ".partial")) and name.split(".")[0] in ("summary", "junit", "logs")
            if name in OUT_FILES or temporary:
                os.remove(os.path.join(self.out_dir, name))
            else:
                others.append(name)
        return others

    def __call__(self, summary: dict) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        junit = os.path.join(self.out_dir, "junit.xml")
        step_runner.merge_junit(self.junit_files(), junit)
        summary = dict(summary)
        env_json = summary.get("benchmarks", {}).get("env")
        summary["environment"] = gpu_environment.facts(env_json)
        summary["headline"] = headline(summary.get("benchmarks", {}))
        summary["sanitizers"] = {n: r["facts"] for n, r in summary["steps"].items() if "facts" in r}
        summary["cuda_tests"] = software_skips(junit)
        if self.extra is not None:
            summary.update(self.extra(summary))
        try:
            self.archive = log_archive.write_archive(self.work_dir, os.path.join(self.out_dir, "logs.tar.gz"))
        except (OSError, ValueError) as e:
            self.archive = {"error": f"{type(e).__name__}: {e}"}
        summary["logs_archive"] = self.archive
        step_runner.write_json(os.path.join(self.out_dir, "summary.json"), summary)
