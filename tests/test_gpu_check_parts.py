"""The pieces of tools/gpu_check.py, one by one, without a GPU: the per-test record and its JUnit (test_record), the
pytest plugin (per-test limit, order by marks) and the restarting runner (bounded_pytest), the log archive's size
bound, the build's stamps and reuse (gpu_build), the environment's headline, the published results (gpu_results) and
the dry run's stand-ins. tests/test_gpu_check.py checks them together."""
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import xml.etree.ElementTree as ElementTree

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import bounded_pytest  # noqa: E402
import gpu_build  # noqa: E402
import gpu_dry_run  # noqa: E402
import gpu_environment  # noqa: E402
import gpu_results  # noqa: E402
import log_archive  # noqa: E402
import pytest_record  # noqa: E402
import test_record  # noqa: E402

PY = sys.executable


def _events(*items):
    return [dict(event=kind, **fields) for kind, fields in items]


# ---------------------------------------------------------------------------------------------------------------
# the per-test record

def test_results_give_one_outcome_per_test_and_name_what_never_finished():
    events = _events(
        ("collected", {"nodeids": ["t.py::a", "t.py::b", "t.py::c", "t.py::d", "t.py::e", "t.py::f"]}),
        ("start", {"nodeid": "t.py::a"}), ("report", {"nodeid": "t.py::a", "when": "call", "outcome": "passed",
                                                       "duration": 0.5}), ("finish", {"nodeid": "t.py::a"}),
        ("start", {"nodeid": "t.py::b"}), ("report", {"nodeid": "t.py::b", "when": "setup", "outcome": "failed",
                                                       "message": "fixture broke"}), ("finish", {"nodeid": "t.py::b"}),
        ("start", {"nodeid": "t.py::c"}), ("report", {"nodeid": "t.py::c", "when": "call", "outcome": "failed",
                                                       "message": "assert 1 == 2"}), ("finish", {"nodeid": "t.py::c"}),
        ("start", {"nodeid": "t.py::d"}), ("report", {"nodeid": "t.py::d", "when": "setup", "outcome": "skipped",
                                                       "message": "needs two GPUs"}), ("finish", {"nodeid": "t.py::d"}),
        ("start", {"nodeid": "t.py::e"}), ("watchdog", {"nodeid": "t.py::e", "limit_s": 40.0}),
        ("collect", {"nodeid": "t2.py", "message": "ImportError: no jax"}))
    got = {r["nodeid"]: r for r in test_record.results(events)}
    assert [got[n]["outcome"] for n in ("t.py::a", "t.py::b", "t.py::c", "t.py::d", "t.py::e", "t2.py", "t.py::f")] \
        == ["passed", "error", "failed", "skipped", "error", "error", "not_run"]
    assert got["t.py::a"]["seconds"] == 0.5 and got["t.py::b"]["message"] == "setup: fixture broke"
    assert "per-test limit of 40 s" in got["t.py::e"]["message"] and "ImportError" in got["t2.py"]["message"]
    assert test_record.running_test(events) == "t.py::e" and test_record.not_run(events) == ["t.py::f"]
    assert test_record.counts(list(got.values())) == {"passed": 1, "failed": 1, "errors": 3, "skipped": 1,
                                                      "not_run": 1, "total": 7}
    killed = {r["nodeid"]: r for r in test_record.results(events[:-2], ended_by="the step was killed at 60 s")}
    assert killed["t.py::e"]["message"] == "did not finish: the step was killed at 60 s"


def test_the_record_survives_a_torn_line_and_becomes_junit(tmp_path):
    path = str(tmp_path / "r" / "record.jsonl")
    writer = test_record.Writer(path)
    writer.write("start", nodeid="tests/test_x.py::test_a[1-2]")
    writer.write("report", nodeid="tests/test_x.py::test_a[1-2]", when="call", outcome="failed", message="boom\nline2")
    writer.write("finish", nodeid="tests/test_x.py::test_a[1-2]")
    writer.close()
    with open(path, "a") as f:
        f.write('{"event": "start", "nodeid": "tor')  # killed mid-write
    assert len(test_record.read_events(path)) == 3 and test_record.read_events(str(tmp_path / "none")) == []
    counts = test_record.write_junit(path, str(tmp_path / "j.xml"), "ops")
    assert counts["failed"] == 1 and counts["total"] == 1
    suite = ElementTree.parse(tmp_path / "j.xml").getroot().find("testsuite")
    case = suite.find("testcase")
    assert suite.get("name") == "ops" and suite.get("failures") == "1"
    assert (case.get("classname"), case.get("name")) == ("tests.test_x", "test_a[1-2]")
    assert case.find("failure").get("message") == "boom" and "line2" in case.find("failure").text
    tree = test_record.junit_tree("s", [{"nodeid": "a.py::n", "outcome": "not_run", "seconds": 0.0, "message": "x"}])
    assert tree.get("skipped") == "1" and tree.find("testcase/skipped") is not None


# ---------------------------------------------------------------------------------------------------------------
# the pytest plugin and the restarting runner

def test_order_and_limit_options():
    assert pytest_record.parse_order(" raw_handlers, ,stress") == ["raw_handlers", "stress", "*"]
    assert pytest_record.parse_order("a,*,b") == ["a", "*", "b"] and pytest_record.parse_order("") == []
    order = ["raw_handlers", "*", "stress"]
    assert [pytest_record.order_key(m, order) for m in ({"raw_handlers"}, set(), {"stress"}, {"cuda"})] == [0, 1, 2, 1]
    assert pytest_record.limit_from_env({}) == 0.0 and pytest_record.limit_from_env({"JODC_TEST_LIMIT_S": "40"}) == 40
    for bad in ("-1", "soon"):
        with pytest.raises(ValueError, match="JODC_TEST_LIMIT_S must be"):
            pytest_record.limit_from_env({"JODC_TEST_LIMIT_S": bad})


def test_the_watchdog_records_dumps_and_exits(tmp_path):
    writer = test_record.Writer(str(tmp_path / "record.jsonl"))
    exits = []
    with open(tmp_path / "stderr.txt", "w+") as err:
        dog = pytest_record.Watchdog(writer, 40.0, exit=exits.append, stderr_fd=err.fileno())
        dog.fire("t.py::stuck")
        err.seek(0)
        text = err.read()
    writer.close()
    assert exits == [pytest_record.WATCHDOG_EXIT]
    assert "t.py::stuck ran past its limit of 40 s" in text and "most recent call first" in text
    assert test_record.read_events(str(tmp_path / "record.jsonl"))[0]["event"] == "watchdog"
    dog = pytest_record.Watchdog(writer, 0.0)
    dog.arm("t.py::x")  # no limit: nothing armed
    assert dog._timer is None


TESTS = """
import time
import pytest

@pytest.mark.late
def test_late():
    pass

def test_hangs():
    time.sleep(600)

@pytest.mark.early
def test_early():
    pass

def test_fails():
    assert False, "wrong"
"""


def test_bounded_pytest_orders_limits_restarts_and_records(tmp_path):
    (tmp_path / "test_mod.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    early: x\n    late: y\n")
    record = str(tmp_path / "record.jsonl")
    code = bounded_pytest.main(["--record", record, "--limit-s", "3", "--order", "early,*,late", "--junit",
                                str(tmp_path / "j.xml"), "--suite", "demo", "--", "-v", "-p", "no:cacheprovider",
                                "--rootdir", str(tmp_path), str(tmp_path / "test_mod.py")])
    assert code == 1
    results = test_record.results(test_record.read_events(record))
    assert [r["nodeid"].split("::")[1] for r in results] == ["test_early", "test_hangs", "test_fails", "test_late"]
    assert [r["outcome"] for r in results] == ["passed", "error", "failed", "passed"]
    assert "per-test limit of 3 s" in results[1]["message"]
    assert ElementTree.parse(tmp_path / "j.xml").getroot().find("testsuite").get("name") == "demo"
    sessions = [e for e in test_record.read_events(record) if e["event"] == "session"]
    assert len(sessions) == 2  # one restart after the hang


def test_bounded_pytest_pieces():
    assert bounded_pytest.pytest_command("py", ["-v", "t.py"], ["t.py::a"]) == [
        "py", "-m", "pytest", "-p", "pytest_record", "-v", "t.py", "--deselect", "t.py::a"]
    env = bounded_pytest.child_environment({"PYTHONPATH": "/site", "JODC_TEST_ORDER": "old"}, "r.jsonl", 5.0, "")
    assert env["PYTHONPATH"].split(os.pathsep) == [bounded_pytest.HERE, "/site"]
    assert env["JODC_TEST_LIMIT_S"] == "5.0" and os.path.isabs(env["JODC_TEST_RECORD"])
    assert "JODC_TEST_ORDER" not in env
    with pytest.raises(SystemExit, match="usage"):
        bounded_pytest.main(["--record", "r"])


def test_bounded_pytest_passes_when_everything_passes(tmp_path):
    (tmp_path / "test_ok.py").write_text("def test_a():\n    pass\n")
    args = ["-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_ok.py")]
    assert bounded_pytest.run(args, str(tmp_path / "r.jsonl"), limit_s=30) == 0
    assert bounded_pytest.run(["-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-k", "nothing",
                               str(tmp_path / "test_ok.py")], str(tmp_path / "r2.jsonl")) == 1  # ran nothing


# ---------------------------------------------------------------------------------------------------------------
# the log archive

def test_truncated_keeps_head_and_tail():
    data = b"H" * 1000 + b"M" * 8000 + b"T" * 1000
    cut = log_archive.truncated(data, 2000)
    assert cut.startswith(b"H" * 500) and cut.endswith(b"T" * 1000) and b"8000 of 10000 bytes cut" in cut
    assert log_archive.truncated(b"small", 2000) == b"small"


def test_the_archive_stays_under_its_limit(tmp_path):
    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    (work / "checkpoints" / "30").mkdir(parents=True)
    (work / "logs" / "a.log").write_text("hello\n")
    (work / "logs" / "noise.log").write_bytes(os.urandom(3 << 20))  # incompressible
    (work / "checkpoints" / "30" / "meta.json").write_text("{}")
    (work / "weights.bin").write_bytes(b"\0" * 100)
    assert [n for n, _ in log_archive.collect(str(work))] == ["logs/a.log", "logs/noise.log"]
    info = log_archive.write_archive(str(work), str(tmp_path / "logs.tar.gz"), max_bytes=1 << 20, cap=4 << 20)
    assert info["bytes"] <= 1 << 20 and info["truncated"] == ["logs/noise.log"] and info["per_file_cap"] < 1 << 20
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        assert tar.extractfile("logs/logs/a.log").read() == b"hello\n"
    assert not (tmp_path / "logs.tar.gz.partial").exists()
    with pytest.raises(ValueError, match="do not fit"):
        log_archive.write_archive(str(work), str(tmp_path / "tiny.tar.gz"), max_bytes=1000)


# ---------------------------------------------------------------------------------------------------------------
# the build's stamps and reuse

def test_inputs_digest_and_toolchain(tmp_path):
    (tmp_path / "ffi" / "cuda" / "__pycache__").mkdir(parents=True)
    (tmp_path / "ffi" / "cuda" / "a.cu").write_text("kernel")
    (tmp_path / "ffi" / "cuda" / "__pycache__" / "x.pyc").write_text("cache")
    (tmp_path / "setup.py").write_text("setup")
    (tmp_path / "pyproject.toml").write_text("[x]")
    assert gpu_build.input_files(str(tmp_path)) == ["ffi/cuda/a.cu", "pyproject.toml", "setup.py"]
    before = gpu_build.source_digest(str(tmp_path))
    (tmp_path / "ffi" / "cuda" / "a.cu").write_text("kernel 2")
    assert gpu_build.source_digest(str(tmp_path)) != before
    assert "ffi/build_cuda.py" in gpu_build.input_files() and "ffi/cuda/gather.cu" in gpu_build.input_files()
    assert gpu_build.nvcc_release("Cuda compilation tools, release 13.0, V13.0.88") == "13.0"
    assert gpu_build.nvcc_release("nothing") is None
    facts = gpu_build.toolchain(PY)
    assert facts["python"] == "%d.%d" % sys.version_info[:2] and facts["ext_suffix"].endswith(".so")
    assert gpu_build.output_names(".cpython-312-x86_64-linux-gnu.so", True) == [
        "_ffi.cpython-312-x86_64-linux-gnu.so", "_ffi_cuda.so", "_ffi_nvshmem.so"]
    stamp = gpu_build.wanted_stamp(PY, "90,80", False)
    assert stamp["archs"] == ["80", "90"] and stamp["sources"] == gpu_build.source_digest()


def test_stamps_round_trip_and_say_what_differs(tmp_path):
    path = str(tmp_path / "s" / "stamp.json")
    gpu_build.write_stamp(path, {"sources": "abc", "nvcc": "13.0"})
    assert gpu_build.read_stamp(path) == {"sources": "abc", "nvcc": "13.0"}
    assert gpu_build.read_stamp(str(tmp_path / "none")) is None
    assert gpu_build.stamp_difference(None, {"a": 1}) == "no stamp"
    assert gpu_build.stamp_difference({"a": 1, "b": 2}, {"a": 1, "b": 3}) == "b: 2 != 3"
    assert gpu_build.stamp_difference({"a": 1}, {"a": 1}) == ""


def test_compile_commands_in_place_or_into_a_folder():
    inplace = gpu_build.compile_commands("py", "90", 4, False)
    assert inplace["cpu"][-1] == "--inplace" and inplace["cuda"][3] == os.path.join(ROOT, "jodc", "_ffi_cuda.so")
    out = gpu_build.compile_commands("py", "90", 4, True, out_dir="/pre")
    assert out["cpu"][-2:] == ["--build-lib", "/pre/lib"] and out["nvshmem"][3] == "/pre/_ffi_nvshmem.so"


@pytest.fixture
def fake_checkout(tmp_path, monkeypatch):
    """gpu_build pointed at a scratch checkout, with a fixed wanted stamp, no compiler and a load check that passes
    unless the test says otherwise; yields (root, state) where state records compiles and sets load errors."""
    root = tmp_path / "checkout"
    (root / "jodc").mkdir(parents=True)
    want = {"sources": "s1", "archs": ["90"], "nvshmem": False, "python": "3.12", "ext_suffix": ".so-312",
            "jaxlib": "0.11.2", "nvcc": "13.0"}
    state = {"compiled": 0, "load_error": None}

    def compile_all(commands, jobs):
        state["compiled"] += 1
        for name in gpu_build.output_names(want["ext_suffix"], False):
            (root / "jodc" / name).write_text("built")

    monkeypatch.setattr(gpu_build, "ROOT", str(root))
    monkeypatch.setattr(gpu_build, "INPLACE_STAMP", str(root / "build" / "gpu-build-stamp.json"))
    monkeypatch.setattr(gpu_build, "wanted_stamp", lambda python, archs, nvshmem, root=None: dict(want))
    monkeypatch.setattr(gpu_build, "compile_all", compile_all)
    monkeypatch.setattr(gpu_build, "load_error", lambda python, folder=None: state["load_error"])
    return root, state, want


def test_build_reuses_in_place_then_carried_and_rebuilds_otherwise(fake_checkout, tmp_path):
    root, state, want = fake_checkout
    assert gpu_build.find_reusable("py", "90", False) is None
    assert gpu_build.build("py", "90", 4, False) == "built" and state["compiled"] == 1
    assert gpu_build.find_reusable("py", "90", False) == "in place"
    assert gpu_build.build("py", "90", 4, False) == "reused in place" and state["compiled"] == 1
    assert gpu_build.build("py", "90", 4, False, rebuild=True) == "built" and state["compiled"] == 2
    # a fresh machine with a carried build: copied into place when its stamp matches
    carried = tmp_path / "prebuilt"
    carried.mkdir()
    for name in gpu_build.output_names(want["ext_suffix"], False):
        (carried / name).write_text("carried")
    gpu_build.write_stamp(str(carried / gpu_build.STAMP_NAME), want)
    os.remove(gpu_build.INPLACE_STAMP)
    assert gpu_build.find_reusable("py", "90", False, str(carried)) == "carried"
    assert gpu_build.build("py", "90", 4, False, str(carried)) == "reused carried"
    assert (root / "jodc" / "_ffi_cuda.so").read_text() == "carried" and state["compiled"] == 2
    # a carried build of other sources, or one that does not load there, is rebuilt
    gpu_build.write_stamp(str(carried / gpu_build.STAMP_NAME), dict(want, sources="other"))
    os.remove(gpu_build.INPLACE_STAMP)
    assert gpu_build.find_reusable("py", "90", False, str(carried)) is None
    assert gpu_build.build("py", "90", 4, False, str(carried)) == "built" and state["compiled"] == 3
    gpu_build.write_stamp(str(carried / gpu_build.STAMP_NAME), want)
    os.remove(gpu_build.INPLACE_STAMP)
    state["load_error"] = "undefined symbol"
    assert gpu_build.build("py", "90", 4, False, str(carried)) == "built" and state["compiled"] == 4


def test_prebuild_makes_a_carryable_folder(fake_checkout, tmp_path, monkeypatch):
    root, state, want = fake_checkout

    def compile_all(commands, jobs):
        lib = commands["cpu"][commands["cpu"].index("--build-lib") + 1]
        os.makedirs(os.path.join(lib, "jodc"))
        open(os.path.join(lib, "jodc", "_ffi" + want["ext_suffix"]), "w").write("cpu")
        open(commands["cuda"][3], "w").write("cuda")

    monkeypatch.setattr(gpu_build, "compile_all", compile_all)
    out = tmp_path / "gpu-prebuilt"
    assert gpu_build.prebuild("py312", str(out), "90", 2) == want
    assert sorted(os.listdir(out)) == sorted(["_ffi" + want["ext_suffix"], "_ffi_cuda.so", "stamp.json"])
    assert gpu_build.find_reusable("py", "90", False, str(out)) == "carried"


def test_load_error_says_why_a_build_does_not_load(tmp_path):
    error = gpu_build.load_error(PY, str(tmp_path))  # no CUDA library there
    assert error and ("_ffi_cuda.so" in error or "Error" in error)


# ---------------------------------------------------------------------------------------------------------------
# the environment, the published results, the dry run's stand-ins

def test_environment_facts():
    report = {"python": "3.12.3", "gpus": ["NVIDIA H200, 580.159.04, 143771 MiB, 9.0"], "nvcc": "Build cuda_13.0",
              "compute_sanitizer": "/usr/local/cuda/bin/compute-sanitizer", "jax_backend": "gpu",
              "versions": {"jax": "0.11.2", "jaxlib": "0.11.2", "jax-cuda13-plugin": "0.11.2"}}
    facts = gpu_environment.facts(report)
    assert facts["gpu"] == "NVIDIA H200" and facts["driver"] == "580.159.04" and facts["gpu_memory"] == "143771 MiB"
    assert facts["cuda_plugin"] == "jax-cuda13-plugin 0.11.2" and facts["gpu_count"] == 1
    assert gpu_environment.facts(None) == {}
    assert gpu_environment.facts({"gpus": ["nvidia-smi: not found"]})["gpu"] is None


def test_sanitizer_facts_read_both_tools():
    memcheck = "ALL CASES PASSED (2 heap configurations)\n========= ERROR SUMMARY: 0 errors\n"
    race = "========= RACECHECK SUMMARY: 3 hazards displayed (1 error, 2 warnings)\n========= ERROR SUMMARY: 1 error"
    assert gpu_results.sanitizer_facts(memcheck) == {"errors": 0, "racecheck_hazards": None, "racecheck_errors": None,
                                                     "racecheck_warnings": None, "cases_passed": True}
    got = gpu_results.sanitizer_facts(race)
    assert (got["errors"], got["racecheck_hazards"], got["racecheck_errors"], got["racecheck_warnings"]) == (1, 3, 1, 2)
    assert gpu_results.sanitizer_facts("killed")["errors"] is None


def test_headline_accounting_and_second_call():
    assert gpu_results.headline({"a": {"gpu_mfu": 0.4, "gpu_nested": {"x": 1}, "other": 2}, "b": None}) == {
        "gpu_mfu": 0.4}
    summary = {"budget_s": 100.0, "elapsed_s": 70.0,
               "steps": {"prepare": {"status": "passed", "seconds": 5}, "ops": {"status": "timeout", "seconds": 40},
                         "bench": {"status": "failed", "seconds": 5}, "ipc": {"status": "skipped", "seconds": 0},
                         "extra": {"status": "skipped", "seconds": 0}}}
    limits = {"prepare": 10.0, "ops": 40.0, "bench": 30.0, "ipc": 50.0, "extra": 20.0}
    acc = gpu_results.time_accounting(summary, limits, {"extra"})
    assert acc == {"budget_s": 100.0, "required_limits_s": 130.0, "optional_limits_s": 20.0, "elapsed_s": 70.0,
                   "step_seconds": 50.0, "unused_s": 30.0}
    assert gpu_results.unfinished_steps(summary) == ["ops", "bench", "ipc", "extra"]
    call = gpu_results.second_call(summary, limits, ("prepare",), 100.0, "gpu_check")
    assert call["steps"] == ["ops", "bench", "extra"] and call["left_out"] == ["ipc"] and call["limits_s"] == 100.0
    assert call["command"] == "gpu_check --only ops,bench,extra --reuse-build --budget-s 100"


def test_software_skips_judges_the_merged_junit(tmp_path):
    assert gpu_results.software_skips(str(tmp_path / "none.xml"))["ok"] is None
    path = tmp_path / "j.xml"
    path.write_text('<testsuites><testsuite><testcase classname="tests.test_ops_cuda" name="t">'
                    '<skipped message="XLA formed no command buffer"/></testcase></testsuite></testsuites>')
    verdict = gpu_results.software_skips(str(path))
    assert verdict["ok"] is False and "command buffer" in verdict["message"]


def test_the_publisher_writes_only_its_files(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    (work / "logs" / "env.log").write_text("hello")
    out.mkdir()
    (out / "summary.json").write_text("old")
    (out / "logs.tar.gz.partial").write_text("torn")
    (out / "mine.txt").write_text("a user's file")
    publisher = gpu_results.Publisher(str(out), str(work), lambda: [], lambda s: {"extra": 1})
    assert publisher.clear() == ["mine.txt"]
    env = {"gpus": ["G, 1, 2 MiB, 9.0"], "versions": {}}
    publisher({"budget_s": 10, "elapsed_s": 1, "benchmarks": {"env": env, "b": {"gpu_x": 2}},
               "steps": {"memcheck": {"status": "passed", "facts": {"errors": 0}}}})
    assert sorted(os.listdir(out)) == ["junit.xml", "logs.tar.gz", "mine.txt", "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["environment"]["gpu"] == "G" and summary["headline"] == {"gpu_x": 2} and summary["extra"] == 1
    assert summary["sanitizers"] == {"memcheck": {"errors": 0}} and summary["logs_archive"]["files"] == 1


def test_dry_run_stand_ins():
    assert gpu_dry_run.parse_faults("ops=hang_test, bench_model=hang") == {"ops": "hang_test", "bench_model": "hang"}
    assert gpu_dry_run.parse_faults("") == {}
    with pytest.raises(ValueError, match="the faults are"):
        gpu_dry_run.parse_faults("ops=explode")
    assert gpu_dry_run.test_module("hang_test").count("def test_case_") == gpu_dry_run.TESTS_PER_STEP
    assert "time.sleep(3600)" in gpu_dry_run.test_module("hang_test") and "assert False" in gpu_dry_run.test_module(
        "fail")
    assert json.loads(gpu_dry_run.fake_output("env", "env"))["bench"] == "gpu_env"
    assert json.loads(gpu_dry_run.fake_output("bench", "x"))["gpu_dry_x"] == 1.0
    assert "ERROR SUMMARY: 0 errors" in gpu_dry_run.fake_output("sanitizer", "memcheck")
    assert gpu_dry_run.command("py", "plain", "heap", "")[-2:] == ["--step", "heap"]
    out = subprocess.run(gpu_dry_run.command(PY, "bench", "bench_ops", "fail"), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and json.loads(out.stdout.strip().splitlines()[-1])["bench"] == "bench_ops"


def test_dry_pytest_command_writes_its_tests(tmp_path):
    cmd = gpu_dry_run.pytest_command(PY, str(tmp_path), "ops", "", 4.0)
    assert cmd[1].endswith("bounded_pytest.py") and "{record}" in cmd and cmd[cmd.index("--limit-s") + 1] == "4"
    assert os.path.exists(cmd[-1]) and textwrap.dedent(open(cmd[-1]).read()).count("def test_case_") == 4
