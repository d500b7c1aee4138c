"""The MPI library built on first use (jodc/ops/transports/mpi_build.py), for installs whose wheel has none."""
import os
import subprocess
import sys
import zipfile

import pytest

from mpirun import MPIRUN, mpi_env, mpirun_command  # tools/mpirun.py (tests/conftest.py puts tools/ on the path)
from jodc.ops.transports import mpi_library, mpi_build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Runs tests/multiprocess/ops_cases.py's named cases (2 devices per process) with the wheel's jodc, checked first.
WHEEL_WORKER = """
import os, runpy, sys
import jodc
assert jodc.__file__.startswith(os.environ["PYTHONPATH"].split(os.pathsep)[0]), jodc.__file__
print("PASS the wheel's jodc", flush=True)
sys.argv = ["ops_cases.py", "2", *sys.argv[1:]]
runpy.run_path(os.path.join(os.environ["PYTHONPATH"].split(os.pathsep)[1], "ops_cases.py"), run_name="__main__")
"""


def test_sources_are_found_in_the_checkout():
    folder = mpi_build.source_dir()
    assert folder is not None and os.path.isfile(os.path.join(folder, "build_mpi.py"))
    shipped = mpi_build.build_script(folder).shipped_files(folder)
    assert "build_mpi.py" in shipped and "run_compiler.py" in shipped
    assert any(f.startswith("mpi/") and f.endswith(".cc") for f in shipped)


def test_cache_entry_depends_on_jax_and_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("JODC_CACHE_DIR", str(tmp_path))
    folder = mpi_build.source_dir()
    a = mpi_build.cached_path(folder, "/usr/bin/mpicxx", "0.10.2")
    assert a.startswith(str(tmp_path)) and a.endswith(mpi_library.LIBRARY_NAME)
    assert a == mpi_build.cached_path(folder, "/usr/bin/mpicxx", "0.10.2")
    assert a != mpi_build.cached_path(folder, "/usr/bin/mpicxx", "0.11.2")
    assert a != mpi_build.cached_path(folder, "/opt/mpi/bin/mpicxx", "0.10.2")


def test_without_a_compiler_it_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("JODC_MPICXX", "/nonexistent/mpicxx")
    monkeypatch.setenv("JODC_CACHE_DIR", str(tmp_path))
    assert "no MPI C++ compiler" in mpi_build.why_not_buildable()
    with pytest.raises(RuntimeError, match="cannot be built here: no MPI C\\+\\+ compiler"):
        mpi_build.ensure_built()
    monkeypatch.setattr(mpi_library, "default_path", lambda: str(tmp_path / "absent.so"))
    assert "is not built and no MPI C++ compiler" in mpi_library.why_missing()
    assert not mpi_library.available()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not (os.access(MPIRUN, os.X_OK) and mpi_build.why_not_buildable() is None),
                    reason="needs the jodc[mpi] extra (mpirun and mpicxx in the venv)")
def test_a_wheel_without_the_library_builds_it_on_first_use(tmp_path):
    """What `pip install 'jodc[mpi]'` gives: a wheel built where no mpicxx was (pip's isolated build) ships the
    sources, and the first MPI heap builds the library, once for the processes of an mpirun that start together."""
    wheel_dir, unpacked, cache = tmp_path / "wheel", tmp_path / "site", tmp_path / "cache"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheel_dir), ROOT], check=True, env={**os.environ, "JODC_MPICXX": "/nonexistent/mpicxx"},
                   cwd=ROOT, timeout=600)
    (wheel,) = wheel_dir.iterdir()
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(unpacked)
    assert not any(n.endswith(mpi_library.LIBRARY_NAME) for n in names), names
    assert {f"jodc/_ffi_src/{rel}" for rel in mpi_build.build_script(
        mpi_build.source_dir()).shipped_files(mpi_build.source_dir())} <= set(names)

    env = mpi_env(PYTHONPATH=f"{unpacked}{os.pathsep}{os.path.join(ROOT, 'tests', 'multiprocess')}",
                  JODC_CACHE_DIR=str(cache))
    cases = ["transport_is_mpi", "gather_is_exact", "scatter_accumulate_matches_numpy_sum"]
    cmd = mpirun_command(2, sys.executable, "-m", "mpi4py", "-c", WHEEL_WORKER, *cases)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for case in ["the wheel's jodc", *cases]:
        assert f"PASS {case}" in out, out[-6000:]
    assert out.count("building the MPI library") == 1, out[-6000:]
    (built,) = cache.glob(f"mpi-*/{mpi_library.LIBRARY_NAME}")
    assert sorted(p.name for p in built.parent.iterdir()) == [mpi_library.LIBRARY_NAME, mpi_library.LIBRARY_NAME + ".lock"]
