"""The GPU check without a GPU: every step of the real plan replaced by a stand-in that behaves like it (takes time,
prints a benchmark's JSON line or a sanitizer's summary, runs pytest on generated tests through the same bounded
runner and per-test record), with faults injected on demand. tools/gpu_check.py's ``--dry-run`` uses it and
tests/test_gpu_check.py drives it: the file count of the output folder, the time accounting (limits within the
budget, a step killed at its limit and recorded, what runs after it), the log archive's bound and the second call
are checked here, where no GPU is.

Faults (``--dry-faults step=kind,...``): ``fail`` (exits 1), ``hang`` (never ends: killed at the step's limit),
``hang_test`` (a test step: its second test never ends, the per-test limit ends it, the rest run in a fresh process),
``big_log`` (writes 40 MiB of incompressible output: the archive must cut it to stay under its limit).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FAULTS = ("fail", "hang", "hang_test", "big_log")
TESTS_PER_STEP = 4
BIG_LOG_BYTES = 40 << 20


def parse_faults(text: str) -> dict[str, str]:
    """'ops=hang_test, bench_model=hang' -> {'ops': 'hang_test', 'bench_model': 'hang'}; ValueError for an unknown
    fault."""
    faults = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, _, kind = item.partition("=")
        if kind.strip() not in FAULTS:
            raise ValueError(f"dry-run fault {item.strip()!r}: the faults are {', '.join(FAULTS)} (step=fault)")
        faults[name.strip()] = kind.strip()
    return faults


def test_module(fault: str) -> str:
    """A test file of TESTS_PER_STEP tests; with `hang_test` the second one never ends, with `fail` the third fails."""
    tests = []
    for i in range(TESTS_PER_STEP):
        body = "time.sleep(0.01)"
        if fault == "hang_test" and i == 1:
            body = "time.sleep(3600)"
        elif fault == "fail" and i == 2:
            body = "assert False, 'a simulated failure'"
        tests.append(f"def test_case_{i}():\n    {body}\n")
    return "import time\n\n\n" + "\n\n".join(tests)


def pytest_command(python: str, work_dir: str, step: str, fault: str, limit_s: float) -> list[str]:
    """The stand-in of a test step: bounded_pytest on a generated test file (written now), recording into the
    step's record like the real step."""
    folder = os.path.join(work_dir, "dry_tests")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"test_dry_{step}.py")
    with open(path, "w") as f:
        f.write(test_module(fault))
    return [python, os.path.join(HERE, "bounded_pytest.py"), "--record", "{record}", "--limit-s", f"{limit_s:g}",
            "--", "-v", "-p", "no:cacheprovider", "--rootdir", folder, path]


def command(python: str, kind: str, step: str, fault: str) -> list[str]:
    """The stand-in of a step that is not pytest: this script as `kind` (env, bench, sanitizer, plain)."""
    return [python, os.path.abspath(__file__), kind, "--step", step] + (["--fault", fault] if fault else [])


def fake_output(kind: str, step: str) -> str:
    """What the real step prints last: an environment report, a benchmark's JSON line, a sanitizer's summary."""
    if kind == "env":
        return json.dumps({"bench": "gpu_env", "python": "3.12.3", "gpus": ["DRY RUN GPU, 0.0, 0 MiB, 9.0"],
                           "versions": {"jax": "dry", "jaxlib": "dry"}, "nvcc": "dry run", "dry_run": True})
    if kind == "bench":
        return json.dumps({"bench": step, "dry_run": True, f"gpu_dry_{step}": 1.0})
    if kind == "sanitizer":
        return ("ALL CASES PASSED (dry run)\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
                "========= ERROR SUMMARY: 0 errors")
    return f"{step}: done (dry run)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=("env", "bench", "sanitizer", "plain"))
    p.add_argument("--step", required=True)
    p.add_argument("--fault", default="", choices=("",) + FAULTS)
    a = p.parse_args(argv)
    print(f"dry run of step {a.step} ({a.kind})", flush=True)
    if a.fault == "hang":
        print("hanging (a simulated hang: the runner must kill this at the step's limit)", flush=True)
        time.sleep(3600)
    if a.fault == "big_log":
        chunk = 1 << 20
        for _ in range(BIG_LOG_BYTES // chunk):
            sys.stdout.write(os.urandom(chunk // 2).hex())
        sys.stdout.write("\n")
    time.sleep(0.05)
    print(textwrap.dedent(fake_output(a.kind, a.step)), flush=True)
    return 1 if a.fault == "fail" else 0


if __name__ == "__main__":
    sys.exit(main())
