"""`make gpu-check`'s logic, checked here where there is no GPU: the step runner (budget, limits, dependencies,
outputs written whatever happens, interruption), the overlay environment, the build's commands and the real plan
(every file it names exists, every CUDA test belongs to exactly one step)."""
import ast
import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import gpu_check  # noqa: E402
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
    with gzip.open(os.path.join(out, "logs", f"{name}.log.gz"), "rt") as f:
        return f.read()


JUNIT = """<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_x" name="a"/><testcase classname="tests.test_x" name="b"><failure message="no"/></testcase>
<testcase classname="tests.test_x" name="c"><skipped message="needs two GPUs"/></testcase>
<testcase classname="tests.test_x" name="d"/></testsuite></testsuites>"""


# ---------------------------------------------------------------------------------------------------------------
# the step runner

def test_statuses_dependencies_json_lines_and_junit(tmp_path):
    steps = [
        Step("ok", py("print('hello'); print('{\"gpu_x\": 1.5, \"nested\": {\"a\": 1}}')"), 30, json_line=True),
        Step("fails", py("import sys; print('boom'); sys.exit(3)"), 30),
        Step("after_fail", py("print('never')"), 30, needs=("fails",)),
        Step("after_ok", py("print('runs')"), 30, needs=("ok",)),
        Step("tests", py(f"open(r'''{{junit}}'''.strip(), 'w').write({JUNIT!r}); raise SystemExit(1)"), 30,
             junit=True),
        Step("quiet_bench", py("print('no json here')"), 30, json_line=True),
    ]
    summary, out = run(steps, tmp_path)
    st = summary["steps"]
    assert st["ok"]["status"] == "passed" and st["ok"]["json"] == {"gpu_x": 1.5, "nested": {"a": 1}}
    assert st["fails"]["status"] == "failed" and st["fails"]["exit_code"] == 3 and "boom" in st["fails"]["log_tail"]
    assert st["after_fail"] == {"status": "skipped", "reason": "needs fails, which did not pass", "seconds": 0.0}
    assert st["after_ok"]["status"] == "passed"
    assert st["tests"]["tests"] == {"passed": 2, "failed": 1, "errors": 0, "skipped": 1, "total": 4}
    assert st["quiet_bench"]["status"] == "failed" and "no JSON line" in st["quiet_bench"]["reason"]
    assert summary["status"] == "failed" and summary["tests"]["passed"] == 2
    assert summary["benchmarks"] == {"ok": {"gpu_x": 1.5, "nested": {"a": 1}}}
    assert "boom" in log_text(out, "fails") and not os.path.exists(os.path.join(out, "logs", "fails.log"))
    merged = open(os.path.join(out, "junit.xml")).read()
    assert merged.count("<testcase") == 4 and "<testsuites" in merged
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
        sys.path.insert(0, {os.path.join(ROOT, 'tools')!r})
        from step_runner import Runner, Step
        child = ("import subprocess, sys, time; "
                 "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True); "
                 "open({str(pid_file)!r}, 'w').write(str(p.pid)); print('spawned', flush=True); time.sleep(120)")
        steps = [Step("long", [sys.executable, "-c", child], 100), Step("next", [sys.executable, "-c", "pass"], 10)]
        Runner(steps, {str(tmp_path / 'out')!r}, 200).run()
    """))
    proc = subprocess.Popen([PY, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
    assert gpu_check.package_dirs() == {"jodc": "jodc", "jodc.models": "models", "jodc.train": "train"}


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
    monkeypatch.setattr(gpu_check, "PURE_PYTHON_NEEDS", {"json": "stdlib", "jodc_fake_need": "jodc-fake-need"})
    env_dir = str(tmp_path / "env")
    python = gpu_check.prepare(PY, env_dir, str(wheels), use_venv=use_venv)
    assert python == gpu_check.env_python(env_dir)
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
    assert gpu_check.prepare(PY, env_dir, str(wheels), use_venv=use_venv) == python


def test_prepare_names_what_is_missing_without_wheels(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "PURE_PYTHON_NEEDS", {"jodc_fake_absent": "jodc-fake-absent"})
    with pytest.raises(SystemExit, match=r"missing Python packages \['jodc-fake-absent'\]: pass GPU_WHEELS"):
        gpu_check.prepare(PY, str(tmp_path / "env"), None)


# ---------------------------------------------------------------------------------------------------------------
# the build

def test_build_runs_the_cpu_and_cuda_builds_concurrently_and_reports_failures(monkeypatch, capsys):
    started = []

    class FakePopen:
        def __init__(self, cmd, **kw):
            started.append((cmd, kw["env"]))
            self.returncode = 1 if "ffi/build_cuda.py" in cmd else 0

        def communicate(self):
            return ("log\n", None)

    monkeypatch.setattr(gpu_check.subprocess, "Popen", FakePopen)
    with pytest.raises(SystemExit, match=r"build failed: \['cuda'\]"):
        gpu_check.build("py", "90", 16, nvshmem=True, reuse=False)
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


def test_reuse_build_keeps_existing_outputs(monkeypatch, tmp_path):
    outs = [tmp_path / "a.so", tmp_path / "b.so"]
    for p in outs:
        p.write_text("")
    monkeypatch.setattr(gpu_check, "build_outputs", lambda nvshmem: [str(p) for p in outs])
    monkeypatch.setattr(gpu_check.subprocess, "Popen", lambda *a, **k: pytest.fail("rebuilt"))
    gpu_check.build("py", "90", 4, nvshmem=False, reuse=True)


# ---------------------------------------------------------------------------------------------------------------
# the real plan

def _plan(tmp_path):
    return gpu_check.plan("envpy", PY, str(tmp_path / "out"), str(tmp_path / "env"), None, "90", 16, False, False)


def test_the_gpu_plan_is_ordered_cheapest_first_and_names_existing_files(tmp_path):
    steps = _plan(tmp_path)
    step_runner.check_plan(steps)
    names = [s.name for s in steps]
    for earlier, later in [("env", "build"), ("heap", "host"), ("host", "raw"), ("raw", "mesh"), ("mesh", "stress"),
                           ("stress", "memcheck"), ("memcheck", "bench_ops"), ("bench_ops", "sft_smoke")]:
        assert names.index(earlier) < names.index(later), (earlier, later)
    assert [s.name for s in steps if s.optional] == ["bench_generate", "profile_flash", "profile_blockwise", "racecheck"]
    for step in steps:
        for arg in (step.cmd() if callable(step.cmd) else step.cmd):
            if arg.startswith(("tests/", "bench/", "ffi/", "tools/")) and arg.endswith(".py"):
                assert os.path.exists(os.path.join(ROOT, arg)), (step.name, arg)
    assert sum(s.timeout_s for s in steps if not s.optional) > gpu_check.DEFAULT_BUDGET_S  # the budget decides


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


def test_every_cuda_test_runs_in_exactly_one_step(tmp_path):
    registered = {line.split(":")[0].strip().strip('"') for line in _pyproject_markers()}
    exprs = {}
    for step in _plan(tmp_path):
        if not callable(step.cmd) and "tests/test_ops_cuda.py" in step.cmd:
            exprs[step.name] = step.cmd[len(step.cmd) - 1 - step.cmd[::-1].index("-m") + 1]  # pytest's -m
    assert set(exprs) == {"raw", "mesh", "stress", "ipc"}
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


def _pyproject_markers():
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    block = text.split("markers = [", 1)[1].split("]", 1)[0]
    return [line.strip().strip(",") for line in block.splitlines() if line.strip().startswith('"')]


def test_environment_report_runs_without_a_gpu():
    out = subprocess.run([PY, os.path.join(ROOT, "tools", "gpu_check.py"), "env"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["bench"] == "gpu_env" and report["python"].count(".") == 2
    assert report["versions"]["jax"] is not None and report["jax_devices"]


def test_make_gpu_check_runs_chosen_steps_and_writes_the_summary(tmp_path):
    """The Makefile's wiring, end to end, with this machine's Python as the 'GPU' one: the overlay and the environment
    report pass; the summary, the merged junit and the logs are where GPU_CHECK_OUT says."""
    out = tmp_path / "gpu-check"
    proc = subprocess.run(["make", "-s", "gpu-check", f"GPU_PYTHON={PY}", f"GPU_CHECK_OUT={out}", "ONLY=env",
                           f"GPU_WHEELS={tmp_path / 'none'}", f"GPU_ENV={tmp_path / 'env'}", "GPU_CHECK_BUDGET=200"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["steps"]) == ["prepare", "env"] and summary["status"] == "passed"
    assert summary["versions"]["jax"] and "env" in summary["benchmarks"]
    assert (out / "logs" / "env.log.gz").exists() and (out / "junit.xml").exists()
    assert "PASSED" in proc.stdout
