"""tools/gpu_check.py's logic, checked here where there is no GPU: the step runner (budget, limits, dependencies,
the record published whatever happens, interruption), the overlay environment, the build's commands, the real plan
(every file it names exists, every CUDA test belongs to exactly one step, the limits fit the budget), and dry runs of
the whole check (stand-ins for every step, faults injected): at most five files returned, the time accounting, the
log archive's bound, and the second call. tests/test_gpu_check_parts.py checks the pieces one by one."""
import ast
import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import gpu_build  # noqa: E402
import gpu_check  # noqa: E402
import gpu_overlay  # noqa: E402
import gpu_results  # noqa: E402
import step_runner  # noqa: E402
from step_runner import Runner, Step  # noqa: E402

PY = sys.executable


def py(code: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(code)]


def run(steps, tmp_path, budget_s=60.0, **kw):
    out = str(tmp_path / "out")
    summary = Runner(steps, out, budget_s, echo=lambda line: None, **kw).run()
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f) == summary
    return summary, out


def log_text(out, name):
    with open(os.path.join(out, "logs", f"{name}.log")) as f:
        return f.read()


def record_lines(*outcomes) -> str:
    """A per-test record (tools/test_record.py) of tests a, b, ... with these outcomes ('hang': started only)."""
    lines = [{"event": "collected", "nodeids": [f"tests/test_x.py::{chr(97 + i)}" for i in range(len(outcomes))]}]
    for i, outcome in enumerate(outcomes):
        nodeid = f"tests/test_x.py::{chr(97 + i)}"
        lines.append({"event": "start", "nodeid": nodeid})
        if outcome == "hang":
            break
        if outcome == "skipped":
            lines.append({"event": "report", "nodeid": nodeid, "when": "setup", "outcome": "skipped",
                          "message": "needs two GPUs", "duration": 0.0})
        else:
            lines.append({"event": "report", "nodeid": nodeid, "when": "call", "outcome": outcome,
                          "message": "no" if outcome == "failed" else "", "duration": 0.1})
        lines.append({"event": "finish", "nodeid": nodeid})
    return "".join(json.dumps(line) + "\n" for line in lines)


# ---------------------------------------------------------------------------------------------------------------
# the step runner

def test_statuses_dependencies_json_lines_and_junit(tmp_path):
    record = record_lines("passed", "failed", "skipped", "passed")
    steps = [
        Step("ok", py("print('hello'); print('{\"gpu_x\": 1.5, \"nested\": {\"a\": 1}}')"), 30, json_line=True),
        Step("fails", py("import sys; print('boom'); sys.exit(3)"), 30),
        Step("after_fail", py("print('never')"), 30, needs=("fails",)),
        Step("after_ok", py("print('runs')"), 30, needs=("ok",)),
        Step("tests", py(f"open(r'''{{record}}'''.strip(), 'w').write({record!r}); raise SystemExit(1)"), 30,
             tests=True),
        Step("quiet_bench", py("print('no json here')"), 30, json_line=True),
    ]
    summary, out = run(steps, tmp_path)
    st = summary["steps"]
    assert st["ok"]["status"] == "passed" and st["ok"]["json"] == {"gpu_x": 1.5, "nested": {"a": 1}}
    assert st["fails"]["status"] == "failed" and st["fails"]["exit_code"] == 3 and "boom" in st["fails"]["log_tail"]
    assert st["after_fail"] == {"status": "skipped", "reason": "needs fails, which did not pass", "seconds": 0.0}
    assert st["after_ok"]["status"] == "passed"
    assert st["tests"]["tests"] == {"passed": 2, "failed": 1, "errors": 0, "skipped": 1, "not_run": 0, "total": 4}
    assert st["quiet_bench"]["status"] == "failed" and "no JSON line" in st["quiet_bench"]["reason"]
    assert summary["status"] == "failed" and summary["tests"]["passed"] == 2
    assert summary["benchmarks"] == {"ok": {"gpu_x": 1.5, "nested": {"a": 1}}}
    assert "boom" in log_text(out, "fails")
    junit = open(os.path.join(out, "junit", "tests.xml")).read()
    assert junit.count("<testcase") == 4 and "<testsuites" in junit and 'name="tests"' in junit
    table = step_runner.table(summary)
    assert "FAILED" in table and "2 passed, 1 failed, 1 skipped" in table


def test_all_passed_is_passed(tmp_path):
    summary, _ = run([Step("a", py("pass"), 30), Step("b", py("pass"), 30, needs=("a",))], tmp_path)
    assert summary["status"] == "passed"


def test_a_step_is_cut_at_its_limit_and_the_budget_cuts_the_rest(tmp_path, monkeypatch):
    monkeypatch.setattr(step_runner, "MIN_STEP_S", 0.5)
    steps = [Step("hangs", py("import time; print('started', flush=True); time.sleep(60)"), 1.5),
             Step("slow", py("import time; time.sleep(60)"), 60),
             Step("late", py("pass"), 60)]
    began = time.monotonic()
    summary, out = run(steps, tmp_path, budget_s=3.0)
    assert time.monotonic() - began < 15
    st = summary["steps"]
    assert st["hangs"]["status"] == "timeout" and "limit of 2 s" in st["hangs"]["reason"]
    assert "started" in log_text(out, "hangs")
    assert st["slow"]["status"] == "timeout" and st["slow"]["limit_s"] <= 1.6  # what was left of the budget
    assert st["late"]["status"] == "skipped" and "budget spent" in st["late"]["reason"]
    assert summary["status"] == "failed"


def test_an_optional_step_runs_only_if_its_whole_limit_fits(tmp_path):
    steps = [Step("a", py("pass"), 10), Step("extra", py("pass"), 500, optional=True),
             Step("small_extra", py("pass"), 5, optional=True)]
    summary, _ = run(steps, tmp_path, budget_s=60.0)
    assert summary["steps"]["extra"]["status"] == "skipped" and "optional" in summary["steps"]["extra"]["reason"]
    assert summary["steps"]["small_extra"]["status"] == "passed"
    assert summary["status"] == "passed"  # a skipped optional step does not fail the run


def test_a_program_that_does_not_exist_fails_its_step_only(tmp_path):
    summary, _ = run([Step("missing", ["/nonexistent/program"], 10), Step("next", py("pass"), 10)], tmp_path)
    assert summary["steps"]["missing"]["status"] == "failed"
    assert "could not start" in summary["steps"]["missing"]["reason"]
    assert summary["steps"]["next"]["status"] == "passed"


def test_the_environment_reaches_steps(tmp_path):
    steps = [Step("env", py("import os; print('{\"v\": \"%s\"}' % os.environ['JODC_X'])"), 10, json_line=True,
                  env={"JODC_X": "step"})]
    summary, _ = run(steps, tmp_path, env=dict(os.environ, JODC_X="runner"))
    assert summary["steps"]["env"]["json"] == {"v": "step"}


def test_plans_are_checked():
    with pytest.raises(ValueError, match="twice"):
        step_runner.check_plan([Step("a", ["x"], 1), Step("a", ["x"], 1)])
    with pytest.raises(ValueError, match="needs"):
        step_runner.check_plan([Step("a", ["x"], 1, needs=("b",)), Step("b", ["x"], 1)])
    with pytest.raises(ValueError, match="name"):
        Step("a b", ["x"], 1)
    with pytest.raises(ValueError, match="timeout_s"):
        Step("a", ["x"], 0)


def test_select_keeps_plan_order_and_drops_needs_outside_the_selection():
    steps = [Step("a", ["x"], 1), Step("b", ["x"], 1, needs=("a",)), Step("c", ["x"], 1, needs=("a", "b"))]
    chosen = step_runner.select(steps, ["c", "a"])
    assert [s.name for s in chosen] == ["a", "c"] and chosen[1].needs == ("a",)
    assert step_runner.select(steps, None) == steps
    with pytest.raises(ValueError, match=r"unknown step\(s\) \['z'\]; the steps are: a, b, c"):
        step_runner.select(steps, ["z"])


def test_last_json_object():
    assert step_runner.last_json_object('x\n{"a": 1}\n{"b": 2}\ntrailer') == {"b": 2}
    assert step_runner.last_json_object('{"a": 1}\n{broken}\n[1, 2]') == {"a": 1}
    assert step_runner.last_json_object("nothing") is None


def test_sigterm_mid_step_writes_the_summary_and_ends_every_process_the_step_started(tmp_path):
    """The runner is killed while a step runs whose child left its process group (a new session, as the multi-process
    tests do): the summary says interrupted, and the child is gone too."""
    pid_file = tmp_path / "grandchild.pid"
    script = tmp_path / "runner.py"
    script.write_text(textwrap.dedent(f"""
        import subprocess, sys
        from step_runner import Runner, Step
        child = ("import subprocess, sys, time; "
                 "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True); "
                 "open({str(pid_file)!r}, 'w').write(str(p.pid)); print('spawned', flush=True); time.sleep(120)")
        steps = [Step("long", [sys.executable, "-c", child], 100), Step("next", [sys.executable, "-c", "pass"], 10)]
        Runner(steps, {str(tmp_path / 'out')!r}, 200).run()
    """))
    proc = subprocess.Popen([PY, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "tools")})
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the step never started its child"
            time.sleep(0.1)
        grandchild = int(pid_file.read_text())
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert summary["steps"]["long"]["status"] == "interrupted"
    assert summary["steps"]["next"]["status"] == "skipped"
    time.sleep(0.2)
    assert not step_runner.process_alive(grandchild), "the step's child in its own session survived"


def test_descendants_lists_children_and_grandchildren():
    proc = subprocess.Popen([PY, "-c", "import subprocess, sys, time; "
                             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while not step_runner.descendants(proc.pid):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        kids = step_runner.descendants(proc.pid)
        assert len(kids) == 1 and step_runner.descendants(os.getpid()).count(kids[0]) == 1
    finally:
        for pid in step_runner.descendants(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------------------------------------------
# the overlay environment

def test_package_dirs_come_from_pyproject():
    assert gpu_overlay.package_dirs() == {"jodc": "jodc", "jodc.models": "models", "jodc.train": "train"}


def _wheel(folder, dist: str, module: str) -> None:
    """A minimal pure-Python wheel of `dist` holding `module`.py."""
    name = dist.replace("-", "_")
    files = {f"{module}.py": "VALUE = 42\n",
             f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n",
             f"{name}-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                            "Tag: py3-none-any\n"}
    files[f"{name}-1.0.dist-info/RECORD"] = "".join(f"{p},,\n" for p in files) + f"{name}-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(os.path.join(folder, f"{name}-1.0-py3-none-any.whl"), "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


@pytest.mark.parametrize("use_venv", [True, False], ids=["venv", "pythonpath-fallback"])
def test_prepare_makes_jodc_importable_from_the_checkout_and_installs_missing_wheels(tmp_path, monkeypatch, use_venv):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(str(wheels), "jodc-fake-need", "jodc_fake_need")
    monkeypatch.setattr(gpu_overlay, "PURE_PYTHON_NEEDS", {"json": "stdlib", "jodc_fake_need": "jodc-fake-need"})
    env_dir = str(tmp_path / "env")
    python = gpu_overlay.prepare(PY, env_dir, str(wheels), use_venv=use_venv)
    assert python == gpu_overlay.env_python(env_dir)
    assert os.path.exists(os.path.join(env_dir, "pyvenv.cfg")) == use_venv
    probe = subprocess.run(
        [python, "-c", "import jodc.train, jodc.models, jodc.ops, jodc_fake_need, jax; "
                       "print(jodc.train.__file__, jodc.models.__file__, jodc_fake_need.VALUE)"],
        capture_output=True, text=True, cwd=str(tmp_path))
    assert probe.returncode == 0, probe.stderr
    train, models, value = probe.stdout.split()
    assert train == os.path.join(ROOT, "train", "__init__.py")
    assert models == os.path.join(ROOT, "models", "__init__.py") and value == "42"
    # From the checkout's root too, where `python -m` puts the jodc/ folder (without models/ and train/) first.
    probe = subprocess.run([python, "-m", "jodc.train", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert probe.returncode == 0, probe.stderr
    # again: idempotent
    assert gpu_overlay.prepare(PY, env_dir, str(wheels), use_venv=use_venv) == python


def test_the_build_floor_comes_from_pyproject_and_an_older_setuptools_is_refused(tmp_path, monkeypatch):
    """The image's setuptools must read pyproject.toml (the SPDX license needs 77): the overlay checks its version
    against [build-system] requires and installs the carried wheel where it is older, or says what is needed."""
    from test_build_floor import setuptools_floor

    assert gpu_overlay.version_floors() == {"setuptools": setuptools_floor()}
    assert gpu_overlay._version_tuple("77.0.1") > gpu_overlay._version_tuple("76.1.0")
    assert gpu_overlay._installed_version(PY, "setuptools") != "0"
    assert gpu_overlay._installed_version(PY, "jodc-no-such-dist") == "0"
    monkeypatch.setattr(gpu_overlay, "PURE_PYTHON_NEEDS", {})
    monkeypatch.setattr(gpu_overlay, "version_floors", lambda: {"setuptools": "999.0"})
    with pytest.raises(SystemExit, match=r"the build needs \['setuptools>=999.0'\], older here"):
        gpu_overlay.prepare(PY, str(tmp_path / "env"), None)


def test_prepare_names_what_is_missing_without_wheels(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_overlay, "PURE_PYTHON_NEEDS", {"jodc_fake_absent": "jodc-fake-absent"})
    with pytest.raises(SystemExit, match=r"missing Python packages \['jodc-fake-absent'\]: pass --wheels"):
        gpu_overlay.prepare(PY, str(tmp_path / "env"), None)


# ---------------------------------------------------------------------------------------------------------------
# the build (tests/test_gpu_check_parts.py checks the stamps and the reuse)

def test_the_build_runs_the_cpu_and_cuda_builds_concurrently_and_reports_failures(monkeypatch, capsys):
    started = []

    class FakePopen:
        def __init__(self, cmd, **kw):
            started.append((cmd, kw["env"]))
            self.returncode = 1 if "ffi/build_cuda.py" in cmd else 0

        def communicate(self):
            return ("log\n", None)

    monkeypatch.setattr(gpu_build.subprocess, "Popen", FakePopen)
    with pytest.raises(SystemExit, match=r"build failed: \['cuda'\]"):
        gpu_build.compile_all(gpu_build.compile_commands("py", "90", 16, nvshmem=True), 16)
    cmds = [c for c, _ in started]
    assert cmds[0] == ["py", "setup.py", "--quiet", "build_ext", "--inplace"]
    assert started[0][1]["JODC_BUILD_JOBS"] == "16" and started[0][1]["JODC_MPICXX"] == "none"
    assert cmds[1][:2] == ["py", "ffi/build_cuda.py"] and cmds[1][-4:] == ["--archs", "90", "--jobs", "16"]
    assert cmds[2][:2] == ["py", "ffi/build_nvshmem.py"]
    assert started[0][1]["JODC_CUDA"] == "0"  # setup.py must not build the CUDA library a second time, serially
    assert "-- exit 1" in capsys.readouterr().out


def test_the_builders_take_the_options_the_build_passes():
    for script in ("ffi/build_cuda.py", "ffi/build_nvshmem.py"):
        out = subprocess.run([PY, script, "--help"], capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        assert "--archs" in out.stdout and "--jobs" in out.stdout, script


# ---------------------------------------------------------------------------------------------------------------
# the real plan

def _plan(tmp_path, **kw):
    return gpu_check.plan("envpy", PY, str(tmp_path / "work"), str(tmp_path / "env"), None, "90", 16, False, **kw)


def test_the_gpu_plan_is_ordered_by_value_fits_its_budget_and_names_existing_files(tmp_path):
    steps = _plan(tmp_path)
    step_runner.check_plan(steps)
    names = [s.name for s in steps]
    assert names[:3] == list(gpu_check.ALWAYS)
    required = [s.name for s in steps if not s.optional]
    assert required == ["prepare", "env", "build", "heap", "host", "ops", "bench_ops", "bench_model", "memcheck",
                        "sft_smoke", "ipc"]  # the order: the least-known step last
    assert [s.name for s in steps if s.optional] == ["racecheck", "attention", "bench_generate"]
    # every required step gets its whole limit within the budget; ~120 s for the two-process test
    assert step_runner.required_seconds(steps) <= gpu_check.DEFAULT_BUDGET_S
    assert {s.name: s.timeout_s for s in steps}["ipc"] >= 100
    assert gpu_check.DEFAULT_BUDGET_S + 15 <= gpu_check.CALL_TIMEOUT_S <= 600  # the device's 10 minutes a command
    assert gpu_check.SECOND_BUDGET_S + 15 <= gpu_check.SECOND_CALL_TIMEOUT_S <= 240  # ~4 minutes
    reused = {s.name: s.timeout_s for s in _plan(tmp_path, build_reusable=True)}
    assert reused["build"] == gpu_check.BUILD_REUSE_S < gpu_check.BUILD_S
    for step in steps:
        for arg in (step.cmd() if callable(step.cmd) else step.cmd):
            if arg.endswith(".py") and (arg.startswith(("tests/", "bench/", "ffi/", "tools/")) or
                                        arg.startswith(ROOT)):
                assert os.path.exists(os.path.join(ROOT, arg)), (step.name, arg)
    for step in steps:
        if step.tests:  # bounded: a per-test limit under the step's, -v so the log names the running test
            cmd = step.cmd
            assert cmd[1].endswith("bounded_pytest.py") and "-v" in cmd and "{record}" in cmd
            assert float(cmd[cmd.index("--limit-s") + 1]) < step.timeout_s


def test_every_step_runs_without_the_compilation_cache_and_with_short_barriers(tmp_path):
    for step in gpu_check.with_common_env(_plan(tmp_path)):
        assert step.env["JODC_TEST_COMPILATION_CACHE"] == "0" and step.env["JAX_ENABLE_COMPILATION_CACHE"] == "false"
        assert float(step.env["JODC_BARRIER_TIMEOUT_S"]) <= 30
    for name in ("ops", "ipc"):  # launched processes < the test's limit < the step's
        step = {s.name: s for s in _plan(tmp_path)}[name]
        assert float(step.env["JODC_TEST_PROCESS_TIMEOUT_S"]) < gpu_check.TEST_LIMITS_S[name] < step.timeout_s


def test_choose_always_runs_prepare_env_and_build(tmp_path):
    steps = _plan(tmp_path)
    assert [s.name for s in gpu_check.choose(steps, ["ipc", "ops"])] == ["prepare", "env", "build", "ops", "ipc"]
    assert gpu_check.choose(steps, []) == steps
    with pytest.raises(ValueError, match="unknown step"):
        gpu_check.choose(steps, ["nope"])


def test_describe_plan_sums_the_required_limits(tmp_path):
    text = gpu_check.describe_plan(_plan(tmp_path), 480)
    assert "required limits: 480 s of a 480 s budget" in text and "(if time is left)" in text
    assert "OVER" in gpu_check.describe_plan(_plan(tmp_path), 100)


def _cuda_test_markers() -> dict[str, set[str]]:
    """test name -> the pytest marks of tests/test_ops_cuda.py's test functions (read from the source: the module
    skips at import without a GPU, so pytest cannot collect it here)."""
    tree = ast.parse(open(os.path.join(ROOT, "tests", "test_ops_cuda.py")).read())
    marks = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            found = set()
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                text = ast.unparse(target)
                if text.startswith("pytest.mark."):
                    found.add(text.split(".")[2])
            marks[node.name] = found
    return marks


def _matches(expr: str, marks: set[str]) -> bool:
    """Evaluates a pytest -m expression (and / or / not over marker names) against a test's marks."""
    words = {w for w in expr.replace("(", " ").replace(")", " ").split() if w not in ("and", "or", "not")}
    return eval(expr, {}, {w: w in marks for w in words})  # noqa: S307 (our own constant expressions)


def _pyproject_markers():
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    block = text.split("markers = [", 1)[1].split("]", 1)[0]
    return [line.strip().strip(",") for line in block.splitlines() if line.strip().startswith('"')]


def test_every_cuda_test_runs_in_exactly_one_step(tmp_path):
    registered = {line.split(":")[0].strip().strip('"') for line in _pyproject_markers()}
    exprs = {}
    for step in _plan(tmp_path):
        if not callable(step.cmd) and "tests/test_ops_cuda.py" in step.cmd:
            exprs[step.name] = step.cmd[len(step.cmd) - 1 - step.cmd[::-1].index("-m") + 1]  # pytest's -m
    assert set(exprs) == {"ops", "ipc"}
    marks = _cuda_test_markers()
    assert len(marks) > 20
    for expr in exprs.values():
        for word in expr.replace("(", " ").replace(")", " ").split():
            assert word in registered | {"and", "or", "not"}, f"marker {word} is not registered in pyproject.toml"
    for test, found in marks.items():
        steps = [name for name, expr in exprs.items() if _matches(expr, found)]
        if "sanitizer" in found:  # the sanitizer test is what the memcheck / racecheck steps run directly
            assert steps == [], (test, steps)
        else:
            assert len(steps) == 1, f"{test} (marks {sorted(found)}) runs in steps {steps}"
    assert any("raw_handlers" in m for m in marks.values()) and any("processes" in m for m in marks.values())
    order = {s.name: s.cmd for s in _plan(tmp_path)}["ops"]
    assert order[order.index("--order") + 1] == "raw_handlers,*,stress"


def test_environment_report_runs_without_a_gpu():
    out = subprocess.run([PY, os.path.join(ROOT, "tools", "gpu_check.py"), "env"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["bench"] == "gpu_env" and report["python"].count(".") == 2
    assert report["versions"]["jax"] is not None and report["jax_devices"]


# ---------------------------------------------------------------------------------------------------------------
# dry runs of the whole check: stand-ins for every step (tools/gpu_dry_run.py), faults injected

SCALE = 0.1  # every limit and the budget times this: the 480 s plan in 48 s, mostly unused
# with faults: a hung test's restart needs two pytest starts inside what its step's limit leaves after the per-test
# limit (35 s of ops' 80 s, times this): room for a loaded 2-core machine
FAULT_SCALE = 0.2


def dry_run(tmp_path, *args, name="first", scale=SCALE):
    out, work = tmp_path / name / "out", tmp_path / name / "work"
    proc = subprocess.run([PY, os.path.join(ROOT, "tools", "gpu_check.py"), "--out", str(out), "--work-dir",
                           str(work), "--env-dir", str(tmp_path / "env"), "--dry-run", "--time-scale", str(scale),
                           *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    summary = json.loads((out / "summary.json").read_text())
    return proc, summary, out


def test_a_dry_run_returns_at_most_five_files_and_accounts_for_its_time(tmp_path):
    began = time.monotonic()
    proc, summary, out = dry_run(tmp_path, "--dry-faults", "ops=hang_test,bench_model=hang,memcheck=big_log",
                                 scale=FAULT_SCALE)
    wall = time.monotonic() - began
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["junit.xml", "logs.tar.gz", "summary.json"]
    assert len(os.listdir(out)) <= gpu_results.MAX_OUT_FILES
    steps = summary["steps"]
    budget = gpu_check.DEFAULT_BUDGET_S * FAULT_SCALE
    accounting = summary["time_accounting"]
    assert accounting["required_limits_s"] <= accounting["budget_s"] == summary["budget_s"] == pytest.approx(budget)
    assert summary["elapsed_s"] <= budget + 2 and wall < budget + 30
    # a step that hangs is killed at its limit and recorded; the steps after it still run
    model = steps["bench_model"]
    assert model["status"] == "timeout" and model["limit_s"] == pytest.approx(50 * FAULT_SCALE)
    assert model["seconds"] < model["limit_s"] + step_runner.KILL_GRACE_S + 1
    assert [steps[n]["status"] for n in ("memcheck", "sft_smoke", "ipc")] == ["passed"] * 3
    # a test that hangs costs one test: the per-test limit ends it, the rest of the step runs in a fresh pytest
    ops = steps["ops"]
    assert ops["status"] == "failed" and ops["tests"]["passed"] == 3 and ops["tests"]["errors"] == 1
    assert ops["running_when_ended"].endswith("test_case_1")
    junit = (out / "junit.xml").read_text()
    assert "per-test limit" in junit and junit.count("<testcase") == sum(
        r["tests"]["total"] for r in steps.values() if "tests" in r)
    # the sanitizer's counts and every benchmark figure reach the summary
    assert summary["sanitizers"]["memcheck"]["errors"] == 0
    assert summary["headline"]["gpu_dry_bench_ops"] == 1.0 and summary["environment"]["gpu"] == "DRY RUN GPU"
    # the 40 MiB log is cut to keep the archive small; the stack dump of the hung test is in the archive
    archive = summary["logs_archive"]
    assert archive["bytes"] < 16 << 20 and "logs/memcheck.log" in archive["truncated"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
        ops_log = tar.extractfile("logs/logs/ops.log").read().decode()
    assert "logs/records/ops.jsonl" in names and "logs/junit/ops.xml" in names
    assert "ran past its limit" in ops_log and "test_case_1" in ops_log
    # the second call: what did not pass, sized to its budget
    second = summary["second_call"]
    assert second["steps"] == ["ops", "bench_model"] and second["limits_s"] <= gpu_check.SECOND_BUDGET_S
    assert second["command"] == ("python3 tools/gpu_check.py --out $OUT --only ops,bench_model --reuse-build "
                                 f"--budget-s {gpu_check.SECOND_BUDGET_S:.0f}")


def test_the_second_call_runs_only_what_it_names(tmp_path):
    proc, summary, out = dry_run(tmp_path, "--only", "ops,bench_model", "--reuse-build",
                                 "--budget-s", str(gpu_check.SECOND_BUDGET_S), name="second")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(summary["steps"]) == ["prepare", "env", "build", "ops", "bench_model"]
    assert summary["status"] == "passed" and summary["second_call"]["command"] == ""
    assert summary["budget_s"] == pytest.approx(gpu_check.SECOND_BUDGET_S * SCALE)
    assert len(os.listdir(out)) <= gpu_results.MAX_OUT_FILES


def test_second_call_subcommand_prints_the_command(tmp_path):
    summary = {"steps": {"prepare": {"status": "passed"}, "env": {"status": "passed"},
                         "build": {"status": "passed"}, "ops": {"status": "passed"},
                         "memcheck": {"status": "failed"}, "ipc": {"status": "skipped"}}}
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    out = subprocess.run([PY, os.path.join(ROOT, "tools", "gpu_check.py"), "second-call", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == ("python3 tools/gpu_check.py --out $OUT --only memcheck,ipc --reuse-build "
                                          "--budget-s 200")
    assert f"timeout_s={gpu_check.SECOND_CALL_TIMEOUT_S}" in out.stdout


def test_options_that_contradict_are_refused(tmp_path):
    for args, message in ((["--time-scale", "0.5"], "for dry runs"), (["--rebuild", "--reuse-build"], "contradict"),
                          (["--work-dir", str(tmp_path / "o" / "w"), "--out", str(tmp_path / "o")], "separate"),
                          (["--dry-run", "--dry-faults", "nope=hang"], "unknown steps"),
                          (["--dry-run", "--dry-faults", "ops=melt"], "the faults are")):
        out = subprocess.run([PY, os.path.join(ROOT, "tools", "gpu_check.py"), "--list", *args],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)


def test_make_gpu_check_is_a_thin_wrapper(tmp_path):
    """The Makefile's target passes its variables to tools/gpu_check.py (the Python command is the primary one: the
    runner may have no make)."""
    out = subprocess.run(["make", "-n", "-s", "gpu-check", f"GPU_PYTHON={PY}", f"GPU_CHECK_OUT={tmp_path / 'o'}",
                          "ONLY=ops", "REUSE_BUILD=1", "GPU_CHECK_BUDGET=200"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    line = " ".join(out.stdout.replace("\\\n", " ").split())
    assert line.startswith(f"{PY} tools/gpu_check.py --out {tmp_path / 'o'}")
    assert "--only ops" in line and "--reuse-build" in line and "--budget-s 200" in line
