"""`make gpu-check`: everything a GPU runner should tell us, in one command, inside one wall-clock budget.

Made for a runner that is lent rarely and briefly and has no network: one H100, a Python that already has a CUDA
jax (jax 0.11.2 + the CUDA 13 plugin, flax, optax, orbax, pybind11, torch, transformers, nvcc, compute-sanitizer),
but not every pure-Python package jodc needs. So: no venv with installs from an index. Instead

1. ``prepare``: an *overlay* environment ``build/gpu-env``: a venv with the runner's site-packages visible (the
   runner's own installs are used as they are), jodc importable from this checkout without an editable install (a
   path finder for the package roots that pyproject.toml's ``package-dir`` declares), and the missing pure-Python
   wheels installed from a local folder (``GPU_WHEELS``; ``make gpu-wheels`` downloads them where an index exists);
2. ``build``: the CPU extension (setuptools ``build_ext -j``) and the CUDA library (per-file nvcc, in parallel,
   for the chosen architectures) at once; NVSHMEM only when asked;
3. the checks, cheapest first, each under its own limit: environment report, first heap on the GPU, host-side CUDA
   tests, raw-handler tests, mesh tests, stress tests, two processes on one GPU (CUDA IPC), compute-sanitizer memcheck,
   the GPU benchmarks, an SFT smoke run, then (if time is left) the sampling
   benchmark, profiles of the step and racecheck.

It writes summary.json, a merged junit.xml and compressed logs to ``--out`` always (tools/step_runner.py), prints a
table at the end and exits 0 only if every required step passed. ``--only a,b`` reruns chosen steps; with
``--reuse-build`` an existing build is kept (a warm machine). ``--list`` prints the plan.

Usage: python tools/gpu_check.py [--out DIR] [--budget-s S] [--only a,b] [--reuse-build] [--wheels DIR]
                                 [--archs 90] [--jobs N] [--nvshmem] [--list]
       python tools/gpu_check.py env      (the environment report: a table and one JSON line)
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_runner  # noqa: E402  (tools/step_runner.py)
from step_runner import Step  # noqa: E402

DEFAULT_OUT = os.path.join(ROOT, "build", "gpu-check")
DEFAULT_ENV = os.path.join(ROOT, "build", "gpu-env")
# "well inside 8 minutes" of runner wall time, machine start excluded
DEFAULT_BUDGET_S = 450.0
# What jodc imports (directly or through draccus / tensorboardX) that a CUDA jax image may lack: import name ->
# distribution. All pure Python but protobuf; `make gpu-wheels` fetches them; only the missing ones are installed.
PURE_PYTHON_NEEDS = {"draccus": "draccus", "mergedeep": "mergedeep", "toml": "toml", "tensorboardX": "tensorboardX",
                     "typing_inspect": "typing-inspect", "mypy_extensions": "mypy-extensions",
                     "google.protobuf": "protobuf"}
FINDER_MODULE = "_jodc_checkout_finder"


# ---------------------------------------------------------------------------------------------------------------
# the overlay environment

def package_dirs(pyproject: str = os.path.join(ROOT, "pyproject.toml")) -> dict[str, str]:
    """pyproject's ``[tool.setuptools.package-dir]`` (package -> folder relative to the checkout): the one
    declaration of which folder is which package, read here too."""
    with open(pyproject, "rb") as f:
        mapping = tomllib.load(f).get("tool", {}).get("setuptools", {}).get("package-dir")
    if not isinstance(mapping, dict) or not mapping:
        raise RuntimeError(f"no [tool.setuptools.package-dir] table in {pyproject}")
    return mapping


def finder_source(root: str, mapping: dict[str, str]) -> str:
    """A module that, imported from a .pth file, puts a finder first on sys.meta_path resolving each package root
    of `mapping` to its folder in the checkout at `root` (what an editable install would do, without building)."""
    locations = {pkg: os.path.join(root, folder) for pkg, folder in mapping.items()}
    return f'''"""Written by tools/gpu_check.py: imports {sorted(locations)} from the checkout {root}."""
import importlib.machinery
import importlib.util
import os
import sys

LOCATIONS = {locations!r}


class CheckoutFinder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        folder = LOCATIONS.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(fullname, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


if not any(getattr(f, "__name__", "") == "CheckoutFinder" for f in sys.meta_path):
    sys.meta_path.insert(0, CheckoutFinder)
'''


def base_site_dirs(python: str) -> list[str]:
    """The package folders `python` imports from (site-packages, dist-packages, the user site): the overlay makes
    all of them visible, wherever the runner's image installed its packages."""
    out = subprocess.run([python, "-c", "import json, sys; print(json.dumps(sys.path))"], capture_output=True,
                         text=True, check=True).stdout
    return [p for p in json.loads(out) if p and os.path.isdir(p) and
            ("site-packages" in p or "dist-packages" in p)]


def env_python(env_dir: str) -> str:
    return os.path.join(env_dir, "bin", "python")


def _venv_overlay(base_python: str, env_dir: str) -> str:
    """A venv on `base_python` with its site-packages visible; returns the folder our files go to (its purelib).
    A .pth file there adds every package folder of the base interpreter (user site included, which venvs hide) and
    starts the finder."""
    py = env_python(env_dir)
    subprocess.run([base_python, "-m", "venv", "--system-site-packages", "--without-pip", env_dir], check=True,
                   capture_output=True, text=True)
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "jodc_checkout.pth"), "w") as f:
        # plain lines are appended to sys.path; an `import` line runs at start-up
        f.write("".join(d + "\n" for d in base_site_dirs(base_python)) + f"import {FINDER_MODULE}\n")
    return site


def _path_overlay(base_python: str, env_dir: str) -> str:
    """The fallback where `base_python` cannot make a venv: bin/python is a script that runs `base_python` with a
    folder of ours first on PYTHONPATH (inherited by every subprocess), whose sitecustomize starts the finder and then
    runs the sitecustomize it shadows, if any."""
    site = os.path.join(env_dir, "site")
    os.makedirs(site, exist_ok=True)
    os.makedirs(os.path.dirname(env_python(env_dir)), exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(f"""import importlib.machinery, os, sys
import {FINDER_MODULE}
_here = os.path.dirname(os.path.abspath(__file__))
_next = importlib.machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path if p and p != _here])
if _next is not None and _next.loader is not None:
    _next.loader.exec_module(type(sys)("sitecustomize"))
""")
    with open(env_python(env_dir), "w") as f:
        f.write(f'#!/bin/sh\nexport PYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}"\nexec "{base_python}" "$@"\n')
    os.chmod(env_python(env_dir), 0o755)
    return site


def prepare(base_python: str, env_dir: str, wheels: str | None, use_venv: bool = True) -> str:
    """Creates (or refreshes) the overlay environment and returns its python. Idempotent and quick (no index).
    `use_venv=False`, or a base interpreter that cannot make a venv, takes the PYTHONPATH fallback."""
    py = env_python(env_dir)
    stamp = os.path.join(env_dir, ".jodc-overlay")
    base = os.path.realpath(base_python)
    if os.path.exists(env_dir) and (not os.path.exists(stamp) or open(stamp).read().split("\n")[0] != base):
        shutil.rmtree(env_dir)  # made from another interpreter, or half made: start again
    if not os.path.exists(stamp):
        site = None
        if use_venv:
            try:
                site = _venv_overlay(base_python, env_dir)
            except subprocess.CalledProcessError as e:
                print(f"no venv from {base_python} ({(e.stderr or '').strip()[-300:]}): using the PYTHONPATH overlay")
                shutil.rmtree(env_dir, ignore_errors=True)
        site = site or _path_overlay(base_python, env_dir)
        with open(stamp, "w") as f:
            f.write(f"{base}\n{site}\n")
    site = open(stamp).read().split("\n")[1]
    with open(os.path.join(site, FINDER_MODULE + ".py"), "w") as f:
        f.write(finder_source(ROOT, package_dirs()))
    missing = [dist for mod, dist in PURE_PYTHON_NEEDS.items() if not _importable(py, mod)]
    if missing and wheels:
        # exactly the missing ones, no dependency resolution (it would look for what the runner has, in `wheels`)
        subprocess.run([py, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--find-links", wheels,
                        "--target", site, "--disable-pip-version-check", *missing], check=True)
        missing = [dist for mod, dist in PURE_PYTHON_NEEDS.items() if not _importable(py, mod)]
    if missing:
        raise SystemExit(f"missing Python packages {missing}: pass GPU_WHEELS=<folder of their wheels> "
                         "(make gpu-wheels fetches them where a package index is reachable)")
    probe = subprocess.run([py, "-c", "import jodc, jodc.models, jodc.train, jodc.ops; print(jodc.__file__)"],
                           capture_output=True, text=True, cwd="/")
    if probe.returncode != 0 or not probe.stdout.strip().startswith(ROOT):
        raise SystemExit(f"jodc is not importable from the checkout in the overlay:\n{probe.stdout}{probe.stderr}")
    print(f"overlay {env_dir}: python {py}, jodc from {ROOT}")
    return py


def _importable(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


# ---------------------------------------------------------------------------------------------------------------
# the build

def build_outputs(nvshmem: bool) -> list[str]:
    """The files the build step makes (in place, next to the jodc package)."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    outs = [os.path.join(ROOT, "jodc", "_ffi" + suffix), os.path.join(ROOT, "jodc", "_ffi_cuda.so")]
    return outs + ([os.path.join(ROOT, "jodc", "_ffi_nvshmem.so")] if nvshmem else [])


def build(python: str, archs: str, jobs: int, nvshmem: bool, reuse: bool) -> None:
    """The CPU extension and the CUDA (and NVSHMEM) libraries, concurrently, each compiled file by file in parallel."""
    if reuse and all(os.path.exists(p) for p in build_outputs(nvshmem)):
        print("reusing the existing build:", *build_outputs(nvshmem), sep="\n  ")
        return
    # setup.py builds only the CPU extension here (its sources compiled JODC_BUILD_JOBS at a time), not the CUDA
    # library a second time, serially, and not the MPI transport (no GPU check uses it)
    env = dict(os.environ, JODC_CUDA="0", JODC_NVSHMEM="0", JODC_MPICXX="none", JODC_BUILD_JOBS=str(jobs))
    commands = {
        "cpu": [python, "setup.py", "--quiet", "build_ext", "--inplace"],
        "cuda": [python, "ffi/build_cuda.py", "--out", "jodc/_ffi_cuda.so", "--archs", archs, "--jobs", str(jobs)],
    }
    if nvshmem:
        commands["nvshmem"] = [python, "ffi/build_nvshmem.py", "--out", "jodc/_ffi_nvshmem.so", "--archs", archs,
                               "--jobs", str(jobs)]
    began = time.monotonic()
    procs = {name: subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True) for name, cmd in commands.items()}
    failed = []
    for name, proc in procs.items():
        out = proc.communicate()[0]
        print(f"== {name}: {' '.join(commands[name])}\n{out}-- exit {proc.returncode}, "
              f"{time.monotonic() - began:.1f} s since the build began")
        if proc.returncode != 0:
            failed.append(name)
    if failed:
        raise SystemExit(f"build failed: {failed}")


# ---------------------------------------------------------------------------------------------------------------
# the environment report

def environment_report() -> dict:
    """What the runner is: GPU(s), driver, toolkit, Python and package versions, jax's devices. Never raises: a part
    that cannot be read says why."""
    report: dict = {"bench": "gpu_env", "python": platform.python_version(), "host": platform.node(),
                    "cpus": os.cpu_count()}
    report["gpus"] = _run_text(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap",
                                "--format=csv,noheader"]).splitlines()
    report["nvcc"] = (_run_text(["nvcc", "--version"]).strip().splitlines() or ["not found"])[-1]
    report["compute_sanitizer"] = shutil.which("compute-sanitizer") or "not found"
    versions = {}
    for dist in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax", "orbax-checkpoint",
                 "numpy", "torch", "transformers", "pybind11", "setuptools", "mpi4py", "nvidia-nvshmem-cu13",
                 *PURE_PYTHON_NEEDS.values()):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except Exception:  # noqa: BLE001  (not installed, or a broken distribution: say so, do not stop)
            versions[dist] = None
    report["versions"] = versions
    try:
        import jax
        report["jax_backend"] = jax.default_backend()
        report["jax_devices"] = [f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices()]
    except Exception as e:  # noqa: BLE001
        report["jax_devices"] = f"jax failed: {type(e).__name__}: {e}"
    return report


def _run_text(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{argv[0]}: {e}"


# ---------------------------------------------------------------------------------------------------------------
# the plan

def plan(python: str, base_python: str, out_dir: str, env_dir: str, wheels: str | None, archs: str, jobs: int,
         nvshmem: bool, reuse_build: bool) -> list[Step]:
    """The GPU runner's steps, cheapest first. `python` is the overlay's interpreter (made by the first step)."""
    me = [base_python, os.path.abspath(__file__)]
    sanitizer = shutil.which("compute-sanitizer") or "compute-sanitizer"
    cuda_lib = os.path.join(ROOT, "jodc", "_ffi_cuda.so")
    test_env = {"JODC_REQUIRE_GPU": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                "JODC_CUDA_CHECK_LIBRARY": cuda_lib}
    if nvshmem:
        test_env["JODC_NVSHMEM_CHECK_LIBRARY"] = os.path.join(ROOT, "jodc", "_ffi_nvshmem.so")
    pytest = [python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--junitxml={junit}"]
    cuda_tests = os.path.join("tests", "test_ops_cuda.py")

    def sanitize(tool):
        # --report-api-errors no: XLA provokes (and handles) CUDA API errors itself; kernels are still checked
        return [sanitizer, "--tool", tool, "--error-exitcode", "97", "--kernel-name", "kns=jodc",
                "--report-api-errors", "no", python,
                os.path.join("tests", "cuda_sanitize_cases.py")]

    build_args = ["--archs", archs, "--jobs", str(jobs)] + (["--nvshmem"] if nvshmem else []) + (
        ["--reuse-build"] if reuse_build else [])
    sanitize_env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    return [
        Step("prepare", me + ["_prepare", "--env-dir", env_dir] + (["--wheels", wheels] if wheels else []), 60,
             "overlay environment on the runner's Python: jodc from the checkout, missing wheels from GPU_WHEELS"),
        Step("env", [python, os.path.abspath(__file__), "env"], 60,
             "GPU, driver, toolkit, Python and package versions, jax devices", needs=("prepare",), json_line=True),
        Step("build", me + ["_build", "--python", python] + build_args, 240,
             "CPU extension + CUDA library, file by file in parallel", needs=("prepare",)),
        Step("heap", [python, os.path.join(ROOT, "tools", "cuda_report.py")], 60,
             "first heap on the GPU: versions, GPUs, peer access, transport", needs=("build",)),
        Step("host", pytest + ["tests/test_cuda_host.py", "tests/test_cuda_hlo.py", "tests/test_cuda_build.py"],
             120, "host-side CUDA tests against the built library", needs=("build",), junit=True, env=test_env),
        Step("raw", pytest + [cuda_tests, "-m", "raw_handlers"], 120,
             "the handlers driven directly, several positions simulated on one GPU", needs=("heap",), junit=True,
             env=test_env),
        Step("mesh", pytest + [cuda_tests, "-m", "not (raw_handlers or stress or processes or sanitizer)"], 180,
             "the ops through jax on the GPU mesh", needs=("heap",), junit=True, env=test_env),
        Step("stress", pytest + [cuda_tests, "-m", "stress"], 180,
             "issue 15's stress tests (a)-(e)", needs=("heap",), junit=True, env=test_env),
        Step("ipc", pytest + [cuda_tests, "-m", "processes"], 180,
             "several processes: CUDA IPC, two processes on one GPU", needs=("heap",), junit=True, env=test_env),
        Step("memcheck", sanitize("memcheck"), 240, "compute-sanitizer memcheck over every jodc kernel",
             needs=("raw",), env=sanitize_env),
        Step("attention", pytest + ["tests/test_models_flash_attention.py", "tests/test_models_attention.py"], 150,
             "the fused Pallas attention compiled for the GPU against the dense reference (values, gradients, bf16)",
             # fp32 references in fp32 (XLA's GPU dots default to TF32); the Triton kernel's TF32 has its tolerance
             needs=("prepare",), junit=True, env={**test_env, "JAX_DEFAULT_MATMUL_PRECISION": "highest"}),
        Step("bench_ops", [python, "bench/gpu_ops.py", "--platform", "gpu", "--quick", "--out",
                           os.path.join(out_dir, "bench", "gpu_ops.json")], 90,
             "ODC ops vs the copy ceiling, barrier round trip", needs=("heap",), json_line=True),
        Step("bench_model", [python, "bench/model.py", "--device", "gpu", "--quick", "--out",
                             os.path.join(out_dir, "bench", "model_gpu.json")], 210,
             "decoder fwd+bwd step in bf16 (flash and blockwise attention) vs transformers + torch, MFU",
             needs=("build",), json_line=True),
        Step("bench_losses", [python, "bench/losses.py", "--repeats", "10", "--out",
                              os.path.join(out_dir, "bench", "losses_gpu.json")], 90,
             "loss family wall time on the GPU", needs=("prepare",), json_line=True),
        # a fresh run folder each time (the smoke refuses a used one: a rerun must not pass on old metrics)
        Step("sft_smoke", lambda: [python, "bench/sft_smoke.py", "--platform", "gpu", "--out-dir",
                                   os.path.join(out_dir, "sft_smoke", time.strftime("%Y%m%d_%H%M%S")),
                                   "--out", os.path.join(out_dir, "bench", "sft_smoke.json")],
             150, "jodc-train sft on the GPU: ODC, 1 device, bf16, 30 steps, the loss falls", needs=("build",),
             json_line=True),
        Step("bench_generate", [python, "bench/generate.py", "--platform", "gpu", "--quick", "--out",
                                os.path.join(out_dir, "bench", "generate_gpu.json")], 180,
             "sampling tokens/s vs transformers generate and the decode roofline (if time is left)",
             needs=("prepare",), optional=True, json_line=True),
        *(Step(f"profile_{impl}", [python, "bench/profile_step.py", "--platform", "gpu", "--quick",
                                   "--attention-impl", impl], 120,
               f"top XLA operations of the bf16 step with {impl} attention (if time is left)", needs=("prepare",),
               optional=True, json_line=True) for impl in ("flash", "blockwise")),
        Step("racecheck", sanitize("racecheck"), 240, "compute-sanitizer racecheck (if time is left)",
             needs=("raw",), optional=True, env=sanitize_env),
        Step("skips", [python, os.path.join(ROOT, "tools", "cuda_report.py"), "--check-junit", os.path.join(out_dir, "junit.xml")],
             30, "no CUDA test skipped for a software reason", needs=("raw", "mesh")),
    ]


# ---------------------------------------------------------------------------------------------------------------
# the command line

def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["env"]:
        report = environment_report()
        for k, v in report.items():
            print(f"{k:>18}: {v}")
        print(json.dumps(report, sort_keys=True))
        return 0
    if argv[:1] == ["_prepare"]:
        p = argparse.ArgumentParser(prog="gpu_check.py _prepare")
        p.add_argument("--env-dir", required=True)
        p.add_argument("--wheels")
        a = p.parse_args(argv[1:])
        prepare(sys.executable, a.env_dir, a.wheels)
        return 0
    if argv[:1] == ["_build"]:
        p = argparse.ArgumentParser(prog="gpu_check.py _build")
        p.add_argument("--python", required=True)
        p.add_argument("--archs", required=True)
        p.add_argument("--jobs", type=int, required=True)
        p.add_argument("--nvshmem", action="store_true")
        p.add_argument("--reuse-build", action="store_true")
        a = p.parse_args(argv[1:])
        build(a.python, a.archs, a.jobs, a.nvshmem, a.reuse_build)
        return 0

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, help="summary.json, junit.xml, logs/ (default build/gpu-check)")
    p.add_argument("--env-dir", default=DEFAULT_ENV, help="the overlay environment (default build/gpu-env)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="wall-clock budget of the whole run")
    p.add_argument("--only", default="", help="comma-separated steps to run (the others are left out)")
    p.add_argument("--reuse-build", action="store_true", help="keep an existing build (a warm machine)")
    p.add_argument("--wheels", default=None, help="folder of the pure-Python wheels the runner lacks")
    p.add_argument("--archs", default="90", help="CUDA architectures, comma-separated (default 90: H100/H200)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    p.add_argument("--nvshmem", action="store_true", help="also build the NVSHMEM library (about 3 minutes)")
    p.add_argument("--list", action="store_true", help="print the plan and exit")
    a = p.parse_args(argv)
    out_dir, env_dir = os.path.abspath(a.out), os.path.abspath(a.env_dir)
    wheels = os.path.abspath(a.wheels) if a.wheels else None
    steps = plan(env_python(env_dir), sys.executable, out_dir, env_dir, wheels, a.archs, a.jobs, a.nvshmem,
                 a.reuse_build)
    only = [s for s in a.only.replace(" ", ",").split(",") if s]
    if only and "prepare" not in only:
        only = ["prepare"] + only  # cheap and idempotent: every rerun needs the overlay
    try:
        chosen = step_runner.select(steps, only)
    except ValueError as e:
        p.error(str(e))
    if a.list:
        for s in chosen:
            print(f"{s.name:<13} {s.timeout_s:>5.0f} s  {'(optional) ' if s.optional else ''}{s.what}")
        return 0
    os.makedirs(out_dir, exist_ok=True)
    meta = {"check": "gpu-check", "root": ROOT, "only": only, "archs": a.archs, "nvshmem": a.nvshmem,
            "reuse_build": a.reuse_build}
    runner = step_runner.Runner(chosen, out_dir, a.budget_s, meta=meta, cwd=ROOT)
    summary = runner.run()
    _add_gpu_facts(summary, out_dir)
    print(step_runner.table(summary))
    for name, line in summary["benchmarks"].items():
        print(f"{name}: {json.dumps(line, sort_keys=True)[:1500]}")
    return 0 if summary["status"] == "passed" else 1


def _add_gpu_facts(summary: dict, out_dir: str) -> None:
    """Lifts the GPU's name and the headline benchmark figures to the summary's top level (bench/results/gpu_check.json
    is this file: readers should not dig through steps)."""
    env = summary["benchmarks"].get("env") or {}
    summary["gpu"] = env.get("gpus")
    summary["versions"] = env.get("versions")
    headline = {}
    for line in summary["benchmarks"].values():
        for key, value in line.items():
            if key.startswith("gpu_") and not isinstance(value, (dict, list)):
                headline[key] = value
    summary["headline"] = headline
    path = os.path.join(out_dir, "summary.json")
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
