"""The GPU check's build: jodc's CPU extension and CUDA library in place (next to the jodc package), and never twice.

A build is described by its *stamp*: a digest of every build input (ffi/, setup.py, pyproject.toml) plus the
toolchain that compiled it (Python's version and extension suffix, jaxlib's version (the XLA FFI headers), nvcc's
release, the architectures, NVSHMEM or not). ``build`` reuses, in this order:

1. the build in place when its stamp (build/gpu-build-stamp.json) matches: a warm machine's second call;
2. a carried build (``--prebuilt DIR``: the libraries and their stamp.json, made here by ``gpu_check.py prebuild``
   and sent along with the call) when its stamp matches, copied into place;

each only if it loads (a library built on another image can fail to load: then it is rebuilt). Otherwise it builds:
the CPU extension (setuptools, its sources compiled in parallel) and the CUDA library (ffi/build_cuda.py, per-file
nvcc in parallel) at once.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_INPUTS = ("ffi", "setup.py", "pyproject.toml")
INPLACE_STAMP = os.path.join(ROOT, "build", "gpu-build-stamp.json")
STAMP_NAME = "stamp.json"
DEFAULT_PREBUILT = os.path.join(ROOT, "build", "gpu-prebuilt")
CUDA_LIBRARY = "_ffi_cuda.so"
NVSHMEM_LIBRARY = "_ffi_nvshmem.so"


def input_files(root: str = ROOT) -> list[str]:
    """The build's inputs, relative to `root`, sorted: every file under ffi/ (no caches) and the two build files."""
    found = []
    for item in BUILD_INPUTS:
        path = os.path.join(root, item)
        if os.path.isfile(path):
            found.append(item)
            continue
        for folder, dirs, files in os.walk(path):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            found += [os.path.relpath(os.path.join(folder, f), root) for f in files if not f.endswith(".pyc")]
    return sorted(found)


def source_digest(root: str = ROOT) -> str:
    """sha256 over the inputs' names and contents."""
    h = hashlib.sha256()
    for rel in input_files(root):
        h.update(rel.encode() + b"\0")
        with open(os.path.join(root, rel), "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def nvcc_release(text: str | None = None) -> str | None:
    """'13.0' from `nvcc --version`'s text (run when not given); None without nvcc."""
    if text is None:
        try:
            text = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.TimeoutExpired):
            return None
    m = re.search(r"release (\d+\.\d+)", text or "")
    return m.group(1) if m else None


_PYTHON_FACTS = ("import json, sys, sysconfig, importlib.metadata as m\n"
                 "try:\n    jaxlib = m.version('jaxlib')\nexcept Exception:\n    jaxlib = None\n"
                 "print(json.dumps({'python': '%d.%d' % sys.version_info[:2], "
                 "'ext_suffix': sysconfig.get_config_var('EXT_SUFFIX'), 'jaxlib': jaxlib}))")


def toolchain(python: str) -> dict:
    """What compiles the build, read from `python` (the interpreter that builds and loads it) and nvcc."""
    out = subprocess.run([python, "-c", _PYTHON_FACTS], capture_output=True, text=True, check=True, timeout=120)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]), nvcc=nvcc_release())


def wanted_stamp(python: str, archs: str, nvshmem: bool, root: str = ROOT) -> dict:
    """The stamp a build of this checkout by `python` for `archs` must carry to be reused."""
    return {"sources": source_digest(root), "archs": sorted(a.strip() for a in archs.split(",") if a.strip()),
            "nvshmem": bool(nvshmem), **toolchain(python)}


def output_names(ext_suffix: str, nvshmem: bool) -> list[str]:
    """The build's files (names in jodc/)."""
    return ["_ffi" + (ext_suffix or ".so"), CUDA_LIBRARY] + ([NVSHMEM_LIBRARY] if nvshmem else [])


def read_stamp(path: str) -> dict | None:
    try:
        with open(path) as f:
            value = json.load(f)
        return value if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None


def write_stamp(path: str, stamp: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(stamp, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def stamp_difference(have: dict | None, want: dict) -> str:
    """'' when `have` matches `want`, else which fields differ (for the log)."""
    if have is None:
        return "no stamp"
    return ", ".join(f"{k}: {have.get(k)!r} != {v!r}" for k, v in want.items() if have.get(k) != v)


def find_reusable(python: str, archs: str, nvshmem: bool, prebuilt: str | None = None) -> str | None:
    """Which build `build` would reuse, judged by stamps and files alone (no load check): 'in place', 'carried' or
    None. tools/gpu_check.py sizes its build step's limit by it. Never raises (None when it cannot tell)."""
    try:
        want = wanted_stamp(python, archs, nvshmem)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    names = output_names(want["ext_suffix"], nvshmem)
    if not stamp_difference(read_stamp(INPLACE_STAMP), want) and all(
            os.path.exists(os.path.join(ROOT, "jodc", n)) for n in names):
        return "in place"
    if prebuilt and not stamp_difference(read_stamp(os.path.join(prebuilt, STAMP_NAME)), want) and all(
            os.path.exists(os.path.join(prebuilt, n)) for n in names):
        return "carried"
    return None


def load_error(python: str, folder: str = os.path.join(ROOT, "jodc")) -> str | None:
    """None if the build in place loads in `python` (the CPU extension imports, the CUDA library opens), else why."""
    code = ("import jodc._ffi; from jodc.ops import _cuda; cuda_library.CudaLibrary("
            f"{os.path.join(folder, CUDA_LIBRARY)!r}); print('loaded')")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=180, cwd="/")
    except subprocess.TimeoutExpired:
        return "loading the build took more than 180 s"
    return None if out.returncode == 0 and "loaded" in out.stdout else (out.stdout + out.stderr).strip()[-2000:]


def compile_commands(python: str, archs: str, jobs: int, nvshmem: bool, out_dir: str | None = None) -> dict:
    """name -> argv of the build's compilers: in place (jodc/), or into `out_dir` (a prebuilt folder)."""
    cpu = [python, "setup.py", "--quiet", "build_ext"] + (["--inplace"] if out_dir is None else
                                                           ["--build-lib", os.path.join(out_dir, "lib")])
    target = os.path.join(ROOT, "jodc") if out_dir is None else out_dir
    commands = {"cpu": cpu, "cuda": [python, "ffi/build_cuda.py", "--out", os.path.join(target, CUDA_LIBRARY),
                                     "--archs", archs, "--jobs", str(jobs)]}
    if nvshmem:
        commands["nvshmem"] = [python, "ffi/build_nvshmem.py", "--out", os.path.join(target, NVSHMEM_LIBRARY),
                               "--archs", archs, "--jobs", str(jobs)]
    return commands


def compile_all(commands: dict, jobs: int) -> None:
    """Runs the compilers at once (each compiles its files in parallel); SystemExit naming the ones that failed."""
    # setup.py builds only the CPU extension here (its sources compiled JODC_BUILD_JOBS at a time), not the CUDA
    # library a second time, serially, and not the MPI transport (no GPU check uses it)
    env = dict(os.environ, JODC_CUDA="0", JODC_NVSHMEM="0", JODC_MPICXX="none", JODC_BUILD_JOBS=str(jobs))
    began = time.monotonic()
    procs = {name: subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True) for name, cmd in commands.items()}
    failed = []
    for name, proc in procs.items():
        out = proc.communicate()[0]
        print(f"== {name}: {' '.join(commands[name])}\n{out}-- exit {proc.returncode}, "
              f"{time.monotonic() - began:.1f} s since the build began", flush=True)
        if proc.returncode != 0:
            failed.append(name)
    if failed:
        raise SystemExit(f"build failed: {failed}")


def build(python: str, archs: str, jobs: int, nvshmem: bool, prebuilt: str | None = None,
          rebuild: bool = False) -> str:
    """Makes the build in place usable by `python` (see the module's docstring); returns how: 'reused in place',
    'reused carried' or 'built'."""
    want = wanted_stamp(python, archs, nvshmem)
    names = output_names(want["ext_suffix"], nvshmem)
    inplace = [os.path.join(ROOT, "jodc", n) for n in names]
    print("wanted stamp:", json.dumps(want, sort_keys=True), flush=True)
    if not rebuild:
        why = stamp_difference(read_stamp(INPLACE_STAMP), want)
        if not why and all(os.path.exists(p) for p in inplace):
            error = load_error(python)
            if error is None:
                print("reusing the build in place (its stamp matches and it loads)")
                return "reused in place"
            print(f"the build in place does not load, rebuilding:\n{error}")
        elif why:
            print(f"the build in place is not reusable ({why})")
        if prebuilt:
            carried = [os.path.join(prebuilt, n) for n in names]
            why = stamp_difference(read_stamp(os.path.join(prebuilt, STAMP_NAME)), want)
            if not why and all(os.path.exists(p) for p in carried):
                for src, dst in zip(carried, inplace):
                    shutil.copy2(src, dst)
                error = load_error(python)
                if error is None:
                    write_stamp(INPLACE_STAMP, want)
                    print(f"reusing the carried build from {prebuilt} (its stamp matches and it loads)")
                    return "reused carried"
                print(f"the carried build does not load here, rebuilding:\n{error}")
            else:
                print(f"the carried build in {prebuilt} is not reusable ({why or 'files missing'})")
    if os.path.exists(INPLACE_STAMP):
        os.remove(INPLACE_STAMP)  # a half-made build must never look reusable
    compile_all(compile_commands(python, archs, jobs, nvshmem), jobs)
    write_stamp(INPLACE_STAMP, want)
    return "built"


def prebuild(python: str, out_dir: str, archs: str, jobs: int, nvshmem: bool = False) -> dict:
    """Builds into `out_dir` (not in place) what a runner whose interpreter matches `python` can reuse: the
    libraries and their stamp. Run here, with a Python of the runner's version (3.12) and its jaxlib; carried with
    the call. Returns the stamp."""
    want = wanted_stamp(python, archs, nvshmem)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    compile_all(compile_commands(python, archs, jobs, nvshmem, out_dir), jobs)
    cpu_name = output_names(want["ext_suffix"], False)[0]
    shutil.move(os.path.join(out_dir, "lib", "jodc", cpu_name), os.path.join(out_dir, cpu_name))
    shutil.rmtree(os.path.join(out_dir, "lib"))
    write_stamp(os.path.join(out_dir, STAMP_NAME), want)
    return want


if __name__ == "__main__":
    sys.exit("tools/gpu_build.py is a library: run tools/gpu_check.py")
