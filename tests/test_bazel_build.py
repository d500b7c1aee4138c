"""The Bazel build compiles the same sources as setup.py (the reference build), and the ops loader can be pointed
at another build of jodc._ffi (JODC_FFI_LIBRARY, how `make bazel-test` runs tests/test_ops.py on Bazel's output).

The source-list check parses BUILD and needs no Bazel; the `bazel query` check runs when JODC_BAZEL names a Bazel
binary (`make bazel-test` sets it), since starting Bazel's server takes seconds.
"""
import ast
import glob
import os
import re
import subprocess
import sys
import textwrap

import pytest

from jodc.ops.transports import registration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import sources  # noqa: E402  (ffi/sources.py: setup.py's source list)


def build_file_list(name: str) -> list:
    """The literal list assigned to `name` at the top level of the BUILD file."""
    text = open(os.path.join(ROOT, "BUILD")).read()
    match = re.search(rf"^{name} = (\[.*?\])$", text, re.M | re.S)
    assert match, f"BUILD no longer assigns {name} = [...] at the top level"
    return ast.literal_eval(match.group(1))


def expand(patterns) -> list[str]:
    found = set()
    for pattern in patterns:
        found.update(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))
    return sorted(found)


def test_bazel_and_setup_py_compile_the_same_sources():
    bazel = expand(build_file_list("CPU_SOURCE_GLOBS"))
    setup_py = sources.cpu_sources(ROOT)
    assert bazel == setup_py, f"BUILD compiles {bazel}, setup.py compiles {setup_py}"
    assert "ffi/module.cc" in setup_py and "ffi/cpu/gather.cc" in setup_py and "ffi/cpu/heap.cc" in setup_py
    # A new op file is picked up by both without an edit: both are globs over the same directories.
    assert list(sources.CPU_SOURCE_GLOBS) == build_file_list("CPU_SOURCE_GLOBS")


def test_bazel_compiles_with_setup_py_flags():
    setup_text = open(os.path.join(ROOT, "setup.py")).read()
    match = re.search(r"extra_compile_args=\[(.*?)\]", setup_text, re.S)
    assert match, "setup.py no longer passes extra_compile_args"
    flags = re.findall(r'"(-[^"]+)"', match.group(1))
    flags = [f for f in flags if f != "-isystem"]  # its include dir: a dependency in Bazel
    assert flags, "found no flags in setup.py"
    bazel_copts = build_file_list("JODC_COPTS")
    assert set(flags) <= set(bazel_copts), f"setup.py flags {flags} missing from BUILD's JODC_COPTS {bazel_copts}"
    assert "-std=c++17" in bazel_copts  # Pybind11Extension(cxx_std=17)


@pytest.mark.skipif(not os.environ.get("JODC_BAZEL"), reason="JODC_BAZEL (a bazel binary) not set")
def test_bazel_query_lists_the_setup_py_sources():
    out = subprocess.run(
        [os.environ["JODC_BAZEL"], "query", "--noshow_progress", "labels(srcs, //:jodc_ffi_srcs)"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    labels = sorted(line.strip() for line in out.stdout.splitlines() if line.strip())
    paths = sorted(label.split(":", 1)[1] for label in labels)
    assert paths == sources.cpu_sources(ROOT)


def _run_loader(env_value, code):
    env = dict(os.environ)
    env.pop("JODC_FFI_LIBRARY", None)
    if env_value is not None:
        env["JODC_FFI_LIBRARY"] = env_value
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_loader_uses_the_library_named_by_the_environment(tmp_path):
    # A copy at a path of our own: the loader must import that file, and `from jodc import _ffi` must agree.
    original = registration.cpu_library().__file__
    copy = tmp_path / "_ffi.so"
    copy.write_bytes(open(original, "rb").read())
    out = _run_loader(str(copy), """
        from jodc.ops.transports import registration
        lib = registration.cpu_library()
        from jodc import _ffi
        assert _ffi is lib, (_ffi, lib)
        assert registration.cpu_library() is lib
        print(lib.__file__)
        print(lib.shard_numel(100, 4, 2))
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split()
    assert os.path.realpath(lines[0]) == os.path.realpath(copy)
    assert lines[1] == "32"


def test_loader_names_a_missing_library():
    out = _run_loader("/nonexistent/_ffi.so", """
        from jodc.ops.transports import registration
        registration.cpu_library()
    """)
    assert out.returncode != 0
    assert "JODC_FFI_LIBRARY='/nonexistent/_ffi.so' does not name a file" in out.stderr


@pytest.mark.skipif(not glob.glob(os.path.join(ROOT, "jodc", "_ffi.*so")), reason="no setuptools build of jodc._ffi")
def test_loader_refuses_a_second_library_after_import(tmp_path):
    copy = tmp_path / "_ffi.so"
    copy.write_bytes(open(registration.cpu_library().__file__, "rb").read())
    out = _run_loader(None, f"""
        import os
        from jodc import _ffi  # the setuptools build, imported first
        os.environ["JODC_FFI_LIBRARY"] = {str(copy)!r}
        from jodc.ops.transports import registration
        registration.cpu_library()
    """)
    assert out.returncode != 0
    assert "was already imported from" in out.stderr


@pytest.mark.skipif(not os.environ.get("JODC_FFI_LIBRARY"), reason="JODC_FFI_LIBRARY not set")
def test_this_run_uses_the_library_named_by_the_environment():
    """Under `make bazel-test`: the ops tests of this pytest run exercised Bazel's build, not setup.py's."""
    lib = registration.cpu_library()
    assert os.path.realpath(lib.__file__) == os.path.realpath(os.environ["JODC_FFI_LIBRARY"])


def test_configure_writes_the_venv_header_dirs(tmp_path):
    out = tmp_path / "python_paths.bzl"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "third_party", "bazel", "configure.py"), "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    values = {}
    for line in out.read_text().splitlines():
        if " = " in line:
            key, value = line.split(" = ", 1)
            values[key] = ast.literal_eval(value)
    assert os.path.isfile(os.path.join(values["XLA_FFI_INCLUDE"], "xla", "ffi", "api", "ffi.h"))
    assert os.path.isfile(os.path.join(values["PYBIND11_INCLUDE"], "pybind11", "pybind11.h"))
    assert os.path.isfile(os.path.join(values["PYTHON_INCLUDE"], "Python.h"))
    # Rerunning with the same environment leaves the file alone (Bazel keeps its cached repositories).
    mtime = out.stat().st_mtime_ns
    again = subprocess.run([sys.executable, os.path.join(ROOT, "third_party", "bazel", "configure.py"), "--out",
                            str(out)], capture_output=True, text=True, timeout=120)
    assert "is up to date" in again.stdout and out.stat().st_mtime_ns == mtime
