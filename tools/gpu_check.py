"""`python3 tools/gpu_check.py --out $OUT`: what a GPU runner should tell us, in one command, inside one wall-clock
budget, returned in at most five files.

Made for a runner that is lent rarely and briefly (an H200 for 15 minutes in all, machine start included; at most
10 minutes a command; at most 8 files back from ``$OUT``; no network) with a Python that already has a CUDA jax (jax
0.11.2 + the CUDA 13 plugin, flax, optax, orbax, pybind11, torch, transformers, nvcc, compute-sanitizer), but not
every pure-Python package jodc needs, and maybe no GNU make. The steps, by value, each under its own limit (the
required limits add up to the budget, DEFAULT_BUDGET_S; `--list` prints them):

  prepare      the overlay environment (tools/gpu_overlay.py): jodc from the checkout, missing wheels from --wheels
  env          GPU, driver, toolkit, Python and package versions, jax's devices (tools/gpu_environment.py)
  build        CPU extension + CUDA library (tools/gpu_build.py): reused when a build of the same sources exists in
               place or is carried (--prebuilt), else compiled file by file in parallel
  heap         the first heap on the GPU (tools/cuda_report.py)
  host         the host-side CUDA tests against the built library
  ops          the single-GPU op tests (tests/test_ops_cuda.py: raw handlers first, then the mesh, then stress)
  bench_ops    the ops against the copy ceiling, the barrier's round trip (bench/gpu_ops.py)
  bench_model  the bf16 train step against transformers + torch, MFU (bench/model.py, 4 layers)
  memcheck     compute-sanitizer memcheck over every jodc kernel (tests/cuda_sanitize_cases.py --configs quick)
  sft_smoke    jodc-train sft on the GPU, the loss must fall (bench/sft_smoke.py)
  ipc          two processes sharing the GPU through CUDA IPC (tests/test_ops_cuda.py -m processes)
then, if time is left, racecheck, the GPU attention tests and the sampling benchmark.

Every test is bounded: pytest runs ``-v`` through tools/bounded_pytest.py with a per-test limit (a test past it has its
stacks dumped, its process ended and the remaining tests run in a fresh one), barriers time out after
BARRIER_TIMEOUT_S, launched processes after their step's process limit, and each test's outcome is recorded as it
happens (tools/test_record.py), so a step killed at its limit still says which test was running and gives the JUnit
so far. JAX's persistent compilation cache is off in every step (it would serialise executables with jodc's custom
calls). Working files go to --work-dir; ``--out`` receives only summary.json, junit.xml and logs.tar.gz
(tools/gpu_results.py), rewritten before the first step, every heartbeat and after each step, so a call killed at its
limit still returns what was done. The summary names the second call (``--only ... --reuse-build``) for what did not
pass, sized to SECOND_BUDGET_S.

Usage: python3 tools/gpu_check.py [--out DIR] [--work-dir DIR] [--budget-s S] [--only a,b] [--reuse-build]
                                  [--rebuild] [--wheels DIR] [--prebuilt DIR] [--archs 90] [--jobs N] [--nvshmem]
                                  [--list] [--dry-run [--dry-faults step=fault,...] [--time-scale F]]
       python3 tools/gpu_check.py env                    the environment report (a table and one JSON line)
       python3 tools/gpu_check.py prebuild --python PY   a build to carry (build/gpu-prebuilt), made here
       python3 tools/gpu_check.py second-call SUMMARY    the second call's command for a returned summary.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
import gpu_build  # noqa: E402  (tools/gpu_build.py)
import gpu_dry_run  # noqa: E402
import gpu_environment  # noqa: E402
import gpu_overlay  # noqa: E402
import gpu_results  # noqa: E402
import step_runner  # noqa: E402
from step_runner import Step  # noqa: E402

DEFAULT_OUT = os.path.join(ROOT, "build", "gpu-check")
DEFAULT_WORK = os.path.join(ROOT, "build", "gpu-check-work")
DEFAULT_ENV = os.path.join(ROOT, "build", "gpu-env")
DEFAULT_WHEELS = os.path.join(ROOT, "build", "gpu-wheels")
# The first call: 480 s of steps, run as the device call's command with timeout_s=500 (the margin covers the
# interpreter's start and plan, a killed step's grace and the last archive); with a machine start of 1-2 minutes it
# leaves the 15 minutes' rest for the second call.
DEFAULT_BUDGET_S = 480.0
CALL_TIMEOUT_S = 500
# The second call (what the first did not reach or what failed), on a fresh machine or a warm one.
SECOND_BUDGET_S = 200.0
SECOND_CALL_TIMEOUT_S = 230
ALWAYS = ("prepare", "env", "build")
# The build step's limit: a fresh build (CPU extension and CUDA library at once, on 16 cores), or the reuse of a build
# whose stamp matches (in place on a warm machine, or carried: build/gpu-prebuilt), known before the plan is made.
BUILD_S = 60.0
BUILD_REUSE_S = 20.0  # every call runs these first (idempotent; the build is reused when it can be)
BARRIER_TIMEOUT_S = 20.0
HEARTBEAT_S = 20.0
# per-test limits of the test steps (seconds); a step's own limit bounds the whole step
TEST_LIMITS_S = {"host": 20.0, "ops": 45.0, "ipc": 100.0, "attention": 45.0}
# the deadline of processes a test starts (JODC_TEST_PROCESS_TIMEOUT_S), inside its test's limit
PROCESS_TIMEOUT_S = {"ops": 40.0, "ipc": 90.0}
PYTEST_FLAGS = ["-v", "-rs", "-p", "no:cacheprovider", "--tb=short"]
CUDA_TESTS = os.path.join("tests", "test_ops_cuda.py")
# every step: no persistent compilation cache (tests/conftest.py's and jax's), seconds-long barriers, unbuffered output
COMMON_ENV = {"JODC_TEST_COMPILATION_CACHE": "0", "JAX_ENABLE_COMPILATION_CACHE": "false",
              "JODC_BARRIER_TIMEOUT_S": f"{BARRIER_TIMEOUT_S:g}", "PYTHONUNBUFFERED": "1"}
SANITIZE_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # the compute-sanitizer steps'


# ---------------------------------------------------------------------------------------------------------------
# the plan

def plan(python: str, base_python: str, work_dir: str, env_dir: str, wheels: str | None, archs: str, jobs: int,
         nvshmem: bool, prebuilt: str | None = None, rebuild: bool = False, build_reusable: bool = False) -> list[Step]:
    """The GPU runner's steps, by value. `python` is the overlay's interpreter (made by the first step);
    `build_reusable`: a build with a matching stamp exists (gpu_build.find_reusable), so the build step's limit is
    BUILD_REUSE_S instead of BUILD_S."""
    build_args = ["--python", python, "--archs", archs, "--jobs", str(jobs)] + (["--nvshmem"] if nvshmem else []) + (
        ["--prebuilt", prebuilt] if prebuilt else []) + (["--rebuild"] if rebuild else [])
    build_s = BUILD_REUSE_S if build_reusable and not rebuild else BUILD_S
    test_env = _test_env(nvshmem)
    return (_setup_steps(python, base_python, env_dir, wheels, build_args, build_s)
            + _required_checks(python, work_dir, test_env) + _optional_checks(python, work_dir, test_env))


def _test_env(nvshmem: bool) -> dict[str, str]:
    """The environment of the test steps: a GPU required, no preallocation, the built libraries to check."""
    env = {"JODC_REQUIRE_GPU": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
           "JODC_CUDA_CHECK_LIBRARY": os.path.join(ROOT, "jodc", gpu_build.CUDA_LIBRARY)}
    if nvshmem:
        env["JODC_NVSHMEM_CHECK_LIBRARY"] = os.path.join(ROOT, "jodc", gpu_build.NVSHMEM_LIBRARY)
    return env


def _pytest_command(python: str, name: str, args: list[str], order: str = "") -> list[str]:
    """pytest over `args` through tools/bounded_pytest.py, each test under TEST_LIMITS_S[`name`]."""
    return [python, os.path.join(HERE, "bounded_pytest.py"), "--record", "{record}", "--limit-s",
            f"{TEST_LIMITS_S[name]:g}"] + (["--order", order] if order else []) + ["--", *PYTEST_FLAGS, *args]


def _sanitize_command(python: str, tool: str) -> list[str]:
    """compute-sanitizer's `tool` over tests/cuda_sanitize_cases.py (every jodc kernel, the quick configs)."""
    sanitizer = shutil.which("compute-sanitizer") or "compute-sanitizer"
    # --report-api-errors no: XLA provokes (and handles) CUDA API errors itself; kernels are still checked
    return [sanitizer, "--tool", tool, "--error-exitcode", "97", "--kernel-name", "kns=jodc",
            "--report-api-errors", "no", python, os.path.join("tests", "cuda_sanitize_cases.py"), "--configs",
            "quick"]


def _setup_steps(python: str, base_python: str, env_dir: str, wheels: str | None, build_args: list[str],
                 build_s: float) -> list[Step]:
    """prepare, env, build and heap: what every other step needs."""
    me = [base_python, os.path.abspath(__file__)]
    return [
        Step("prepare", me + ["_prepare", "--env-dir", env_dir] + (["--wheels", wheels] if wheels else []), 15,
             "overlay environment on the runner's Python: jodc from the checkout, missing wheels from --wheels"),
        Step("env", [python, os.path.join(HERE, "gpu_environment.py")], 15,
             "GPU, driver, toolkit, Python and package versions, jax devices", needs=("prepare",), json_line=True),
        Step("build", me + ["_build"] + build_args, build_s,
             "CPU extension + CUDA library: reused if its sources match, else compiled in parallel",
             needs=("prepare",)),
        Step("heap", [python, os.path.join(HERE, "cuda_report.py")], 15,
             "first heap on the GPU: versions, GPUs, peer access, transport", needs=("build",)),
    ]


def _required_checks(python: str, work_dir: str, test_env: dict[str, str]) -> list[Step]:
    """The required tests and benchmarks after the setup, by value."""
    bench = os.path.join(work_dir, "bench")
    return [
        Step("host", _pytest_command(python, "host", ["tests/test_cuda_host.py", "tests/test_cuda_hlo.py",
                                                      "tests/test_cuda_build.py"]),
             30, "host-side CUDA tests against the built library", needs=("build",), tests=True, env=test_env),
        Step("ops", _pytest_command(python, "ops", [CUDA_TESTS, "-m", "not (processes or sanitizer)"],
                                    "raw_handlers,*,stress"), 80,
             "single-GPU op tests: raw handlers, then the ops through jax, then issue 15's stress tests",
             needs=("heap",), tests=True,
             env={**test_env, "JODC_TEST_PROCESS_TIMEOUT_S": f"{PROCESS_TIMEOUT_S['ops']:g}"}),
        Step("bench_ops", [python, "-m", "bench.gpu_ops", "--platform", "gpu", "--quick", "--out",
                           os.path.join(bench, "gpu_ops.json")], 35,
             "ODC ops vs the copy ceiling, barrier round trip", needs=("heap",), json_line=True),
        # the flash attention only (the headline; the blockwise comparison costs a second compile): a second call or
        # a later run with the whole benchmark compares them
        Step("bench_model", [python, "-m", "bench.model", "--device", "gpu", "--quick", "--layers", "4",
                             "--attention-impls", "flash", "--worker-timeout", "35", "--out",
                             os.path.join(bench, "model_gpu.json")], 50,
             "bf16 train step (4 layers, flash attention) vs transformers + torch, MFU", needs=("build",),
             json_line=True),
        Step("memcheck", _sanitize_command(python, "memcheck"), 35,
             "compute-sanitizer memcheck over every jodc kernel (2 heaps)",
             needs=("heap",), env=SANITIZE_ENV, facts=gpu_results.sanitizer_facts),
        # a fresh run folder each time (the smoke refuses a used one: a rerun must not pass on old metrics)
        Step("sft_smoke", lambda: [python, "-m", "bench.sft_smoke", "--platform", "gpu", "--out-dir",
                                   os.path.join(work_dir, "sft_smoke", time.strftime("%Y%m%d_%H%M%S")),
                                   "--out", os.path.join(bench, "sft_smoke.json"), "--",
                                   "--engine.barrier_timeout_s", f"{BARRIER_TIMEOUT_S:g}"],
             40, "jodc-train sft on the GPU: ODC, 1 device, bf16, 30 steps, the loss falls", needs=("build",),
             json_line=True),
        Step("ipc", _pytest_command(python, "ipc", [CUDA_TESTS, "-m", "processes"]), 105,
             "two processes sharing the GPU through CUDA IPC (jax.distributed)", needs=("heap",), tests=True,
             env={**test_env, "JODC_TEST_PROCESS_TIMEOUT_S": f"{PROCESS_TIMEOUT_S['ipc']:g}"}),
    ]


def _optional_checks(python: str, work_dir: str, test_env: dict[str, str]) -> list[Step]:
    """The steps run if time is left after the required ones."""
    return [
        Step("racecheck", _sanitize_command(python, "racecheck"), 40, "compute-sanitizer racecheck",
             needs=("heap",), optional=True, env=SANITIZE_ENV, facts=gpu_results.sanitizer_facts),
        Step("attention", _pytest_command(python, "attention", ["tests/test_models_flash_attention.py",
                                                                "tests/test_models_attention.py"]), 90,
             "the Pallas attention compiled for the GPU against the dense reference",
             # fp32 references in fp32 (XLA's GPU dots default to TF32); the Triton kernel's TF32 has its tolerance
             needs=("prepare",), optional=True, tests=True,
             env={**test_env, "JAX_DEFAULT_MATMUL_PRECISION": "highest"}),
        Step("bench_generate", [python, "-m", "bench.generate", "--platform", "gpu", "--quick", "--out",
                                os.path.join(work_dir, "bench", "generate_gpu.json")], 120,
             "sampling tokens/s vs transformers generate and the decode roofline",
             needs=("build",), optional=True, json_line=True),
    ]


def with_common_env(steps: list[Step]) -> list[Step]:
    """`steps` with COMMON_ENV under each step's own environment."""
    return [dataclasses.replace(s, env={**COMMON_ENV, **s.env}) for s in steps]


def choose(steps: list[Step], only: list[str]) -> list[Step]:
    """The steps to run: all, or ALWAYS plus those named in `only` (ValueError for unknown names)."""
    if not only:
        return list(steps)
    return step_runner.select(steps, list(dict.fromkeys([*ALWAYS, *only])))


def dry_plan(steps: list[Step], python: str, work_dir: str, faults: dict[str, str], scale: float) -> list[Step]:
    """`steps` with stand-ins for their commands (tools/gpu_dry_run.py) and every limit times `scale`."""
    unknown = sorted(set(faults) - {s.name for s in steps})
    if unknown:
        raise ValueError(f"dry-run faults name unknown steps {unknown}")
    out = []
    for s in steps:
        fault = faults.get(s.name, "")
        if s.tests:
            cmd = gpu_dry_run.pytest_command(python, work_dir, s.name, fault, TEST_LIMITS_S.get(s.name, 30.0) * scale)
        else:
            kind = "env" if s.name == "env" else "sanitizer" if s.facts else "bench" if s.json_line else "plain"
            cmd = gpu_dry_run.command(python, kind, s.name, fault)
        out.append(dataclasses.replace(s, cmd=cmd, timeout_s=s.timeout_s * scale))
    return out


def describe_plan(steps: list[Step], budget_s: float) -> str:
    """The plan as text: one line per step with its limit, then the sum of the required limits against the budget."""
    lines = [f"{s.name:<15} {s.timeout_s:>6.0f} s  {'(if time is left) ' if s.optional else ''}{s.what}"
             for s in steps]
    required = step_runner.required_seconds(steps)
    lines.append(f"required limits: {required:.0f} s of a {budget_s:.0f} s budget"
                 + ("" if required <= budget_s else "  (OVER: the last required steps get less than their limits)"))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# the command line

def _sub_prepare(argv) -> int:
    p = argparse.ArgumentParser(prog="gpu_check.py _prepare")
    p.add_argument("--env-dir", required=True)
    p.add_argument("--wheels")
    a = p.parse_args(argv)
    gpu_overlay.prepare(sys.executable, a.env_dir, a.wheels)
    return 0


def _sub_build(argv) -> int:
    p = argparse.ArgumentParser(prog="gpu_check.py _build")
    p.add_argument("--python", required=True)
    p.add_argument("--archs", required=True)
    p.add_argument("--jobs", type=int, required=True)
    p.add_argument("--nvshmem", action="store_true")
    p.add_argument("--prebuilt")
    p.add_argument("--rebuild", action="store_true")
    a = p.parse_args(argv)
    print("build:", gpu_build.build(a.python, a.archs, a.jobs, a.nvshmem, a.prebuilt, a.rebuild))
    return 0


def _sub_prebuild(argv) -> int:
    p = argparse.ArgumentParser(prog="gpu_check.py prebuild", description="a build to carry to the runner, made "
                                "here by a Python of the runner's version with its jaxlib (see docs/cuda.md)")
    p.add_argument("--python", required=True, help="a Python 3.12 with jaxlib 0.11.2, pybind11 and setuptools")
    p.add_argument("--out", default=gpu_build.DEFAULT_PREBUILT)
    p.add_argument("--archs", default="90")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    a = p.parse_args(argv)
    print(json.dumps(gpu_build.prebuild(a.python, a.out, a.archs, a.jobs), indent=1, sort_keys=True))
    return 0


def _sub_second_call(argv) -> int:
    p = argparse.ArgumentParser(prog="gpu_check.py second-call")
    p.add_argument("summary", help="a returned summary.json")
    p.add_argument("--budget-s", type=float, default=SECOND_BUDGET_S)
    a = p.parse_args(argv)
    with open(a.summary) as f:
        summary = json.load(f)
    call = second_call(summary, a.budget_s)
    if not call["steps"]:
        print("every step passed: no second call needed" if not call["left_out"] else
              f"nothing fits {a.budget_s:.0f} s; left out: {call['left_out']}")
        return 0
    print(call["command"])
    print(f"# device call: timeout_s={SECOND_CALL_TIMEOUT_S}; limits {call['limits_s']:.0f} s of "
          f"{a.budget_s:.0f} s" + (f"; left out: {', '.join(call['left_out'])}" if call["left_out"] else ""))
    return 0


def second_call(summary: dict, budget_s: float = SECOND_BUDGET_S) -> dict:
    """The second call for a summary: its steps (what did not pass, as many as fit), their limits, its command. It
    counts on reusing the build (in place on the warm machine, or the carried build/gpu-prebuilt)."""
    steps = plan("python3", "python3", DEFAULT_WORK, DEFAULT_ENV, None, "90", 1, False, build_reusable=True)
    limits = {s.name: s.timeout_s for s in steps}
    return gpu_results.second_call(summary, limits, ALWAYS, budget_s, "python3 tools/gpu_check.py --out $OUT")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, help="the few result files (default build/gpu-check)")
    p.add_argument("--work-dir", default=DEFAULT_WORK, help="logs, records, bench JSON (default build/gpu-check-work)")
    p.add_argument("--env-dir", default=DEFAULT_ENV, help="the overlay environment (default build/gpu-env)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="wall-clock budget of the steps")
    p.add_argument("--only", default="", help="comma-separated steps to run after prepare, env and build")
    p.add_argument("--reuse-build", action="store_true",
                   help="reuse the build if its sources match (the default, stated in a second call's command)")
    p.add_argument("--rebuild", action="store_true", help="compile even if a matching build exists")
    p.add_argument("--wheels", default=DEFAULT_WHEELS if os.path.isdir(DEFAULT_WHEELS) else None,
                   help="folder of the pure-Python wheels the runner lacks (default build/gpu-wheels if present)")
    p.add_argument("--prebuilt", default=gpu_build.DEFAULT_PREBUILT if os.path.isdir(gpu_build.DEFAULT_PREBUILT)
                   else None, help="a carried build (default build/gpu-prebuilt if present)")
    p.add_argument("--archs", default="90", help="CUDA architectures, comma-separated (default 90: H100/H200)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    p.add_argument("--nvshmem", action="store_true", help="also build the NVSHMEM library (about 3 minutes)")
    p.add_argument("--list", action="store_true", help="print the plan and exit")
    p.add_argument("--dry-run", action="store_true", help="no GPU: stand-ins for every step (tools/gpu_dry_run.py)")
    p.add_argument("--dry-faults", default="", help="dry run: faults to inject, e.g. ops=hang_test,bench_model=hang")
    p.add_argument("--time-scale", type=float, default=1.0, help="dry run: every limit and the budget times this")
    return p


def _folders(p: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[str, str, str]:
    """--out, --work-dir and --env-dir made absolute, after refusing contradicting flags and nested folders."""
    if a.rebuild and a.reuse_build:
        p.error("--rebuild and --reuse-build contradict each other")
    if a.time_scale != 1.0 and not a.dry_run:
        p.error("--time-scale is for dry runs")
    out_dir, work_dir, env_dir = (os.path.abspath(x) for x in (a.out, a.work_dir, a.env_dir))
    for x, y in ((out_dir, work_dir), (work_dir, out_dir)):
        if x == y or x.startswith(y + os.sep):
            p.error(f"--out and --work-dir must be separate folders ({out_dir}, {work_dir})")
    return out_dir, work_dir, env_dir


def _chosen_steps(p: argparse.ArgumentParser, a: argparse.Namespace, work_dir: str, env_dir: str,
                  only: list[str]) -> tuple[list[Step], str | None]:
    """The steps this call runs (stand-ins under --dry-run), and the reusable build found (None: none)."""
    wheels = os.path.abspath(a.wheels) if a.wheels else None
    prebuilt = os.path.abspath(a.prebuilt) if a.prebuilt else None
    python = gpu_overlay.env_python(env_dir)
    # the overlay's interpreter runs on this one and sees its packages: the same stamp
    reusable = None if a.rebuild or a.dry_run else gpu_build.find_reusable(sys.executable, a.archs, a.nvshmem,
                                                                            prebuilt)
    steps = with_common_env(plan(python, sys.executable, work_dir, env_dir, wheels, a.archs, a.jobs, a.nvshmem,
                                 prebuilt, a.rebuild, build_reusable=reusable is not None))
    try:
        chosen = choose(steps, only)
        if a.dry_run:
            chosen = dry_plan(chosen, sys.executable, work_dir, gpu_dry_run.parse_faults(a.dry_faults), a.time_scale)
    except ValueError as e:
        p.error(str(e))
    return chosen, reusable


def _run(chosen: list[Step], a: argparse.Namespace, argv: list[str], out_dir: str, work_dir: str, budget: float,
         only: list[str], reusable: str | None) -> dict:
    """Runs the steps, publishing summary.json, junit.xml and logs.tar.gz to `out_dir` as it goes; the summary."""
    os.makedirs(work_dir, exist_ok=True)
    limits = {s.name: s.timeout_s for s in chosen}
    optional = {s.name for s in chosen if s.optional}
    meta = {"check": "gpu-check", "root": ROOT, "command": " ".join(["tools/gpu_check.py", *argv]), "only": only,
            "archs": a.archs, "nvshmem": a.nvshmem, "dry_run": a.dry_run, "time_scale": a.time_scale,
            "reusable_build_found": reusable,
            "plan": [{"step": s.name, "limit_s": s.timeout_s, "optional": s.optional, "what": s.what}
                     for s in chosen]}

    def extra(summary: dict) -> dict:
        return {"time_accounting": gpu_results.time_accounting(summary, limits, optional),
                "second_call": second_call(summary)}

    runner = step_runner.Runner(chosen, work_dir, budget, meta=meta, cwd=ROOT, heartbeat_s=HEARTBEAT_S * (
        a.time_scale if a.dry_run else 1.0), min_step_s=step_runner.MIN_STEP_S * (a.time_scale if a.dry_run else 1))
    publisher = gpu_results.Publisher(out_dir, work_dir, runner.junit_files, extra)
    others = publisher.clear()
    if others:
        print(f"note: {out_dir} also holds {others} (not this run's)")
    runner.publish = publisher
    print(describe_plan(chosen, budget), flush=True)
    return runner.run()


def _print_outcome(summary: dict, out_dir: str) -> None:
    """The steps' table, each benchmark's JSON line (cut at 1500 characters), the CUDA tests and the second call."""
    print(step_runner.table(summary))
    with open(os.path.join(out_dir, "summary.json")) as f:
        published = json.load(f)
    for name, line in summary["benchmarks"].items():
        print(f"{name}: {json.dumps(line, sort_keys=True)[:1500]}")
    print(f"cuda tests: {published['cuda_tests']['message']}")
    if published["second_call"]["command"]:
        print(f"second call: {published['second_call']['command']}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    subcommands = {"env": lambda rest: gpu_environment.main(), "_prepare": _sub_prepare, "_build": _sub_build,
                   "prebuild": _sub_prebuild, "second-call": _sub_second_call}
    if argv[:1] and argv[0] in subcommands:
        return subcommands[argv[0]](argv[1:])
    p = _parser()
    a = p.parse_args(argv)
    out_dir, work_dir, env_dir = _folders(p, a)
    only = [s for s in a.only.replace(" ", ",").split(",") if s]
    chosen, reusable = _chosen_steps(p, a, work_dir, env_dir, only)
    budget = a.budget_s * (a.time_scale if a.dry_run else 1.0)
    if a.list:
        print(describe_plan(chosen, budget))
        return 0
    summary = _run(chosen, a, argv, out_dir, work_dir, budget, only, reusable)
    _print_outcome(summary, out_dir)
    return 0 if summary["status"] == "passed" else 1

if __name__ == "__main__":
    sys.exit(main())
