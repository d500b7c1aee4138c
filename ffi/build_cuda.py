"""Compiles ffi/cuda/*.cu into one shared library (sm_80 and sm_90 by default). Used by setup.py, Bazel and CI.

Each source is compiled to an object by its own nvcc process, `--jobs` of them at a time (default: every CPU this
process may use), into a build directory; one final nvcc call links the objects. This file is the only place that
knows the nvcc command lines (ffi/build_nvshmem.py builds on them).

The library uses only the CUDA runtime API, linked statically (nvcc's default): it needs no libcudart at run time
and no driver (libcuda.so) to link or even to be loaded, only to run. So CI machines without a GPU build, link and
load it.
"""
import concurrent.futures
import glob
import os
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_compiler  # noqa: E402  (ffi/run_compiler.py)

HERE = os.path.dirname(os.path.abspath(__file__))
ARCHS = ("80", "90")


def parse_archs(text: str) -> tuple[str, ...]:
    """'80,90' -> ('80', '90'): the SM architectures to compile for (sorted, each once). ValueError for anything that
    is not a list of compute capabilities like 80, 90 or 90a."""
    archs = sorted({a.strip() for a in str(text).split(",") if a.strip()})
    bad = [a for a in archs if not re.fullmatch(r"\d{2,3}[af]?", a)]
    if not archs or bad:
        raise ValueError(f"--archs takes compute capabilities separated by commas (e.g. 90 or 80,90), got {text!r}")
    return tuple(archs)


def default_jobs() -> int:
    """How many nvcc processes run at once by default: the CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def sources() -> list[str]:
    found = sorted(glob.glob(os.path.join(HERE, "cuda", "*.cu")))
    if not found:
        raise RuntimeError(f"no CUDA sources under {os.path.join(HERE, 'cuda')}")
    return found


def nvcc() -> str:
    return shutil.which("nvcc") or "nvcc"


def gencode_flags(archs=ARCHS) -> list[str]:
    """Real machine code for each architecture (no PTX embedded: every supported GPU is listed)."""
    flags = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    return flags


def compile_command(source: str, obj: str, include_dir: str, archs=ARCHS, keep_dir: str | None = None,
                    extra=()) -> list[str]:
    """nvcc's command line compiling one .cu to an object: C++17, -O3, hidden visibility (exports are marked), the
    XLA FFI headers as system headers (their warnings stay out of the log), and -lineinfo (source lines for
    compute-sanitizer's and ncu's reports; it changes no generated code). `keep_dir` keeps the intermediate files
    (the PTX per source and architecture); `extra` adds flags (the NVSHMEM build: -rdc=true, its headers)."""
    cmd = [nvcc(), "-std=c++17", "-O3", "-lineinfo", "-c", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
           "-Xcompiler", "-Wall", "-isystem", include_dir, "-I", HERE, *extra, *gencode_flags(archs)]
    if keep_dir is not None:
        cmd += ["--keep", "--keep-dir", keep_dir]
    return cmd + [source, "-o", obj]


def link_command(objects, out_path: str, extra=()) -> list[str]:
    """nvcc's command line linking the objects into the shared library, with the CUDA runtime linked statically.
    -lrt: shm_open for multi-process control blocks (ipc.cu; part of libc since glibc 2.34, librt before)."""
    return [nvcc(), "-shared", "-cudart", "static", *extra, *objects, "-lrt", "-o", out_path]


def object_path(build_dir: str, source: str) -> str:
    """Where `source`'s object goes: named after its folder and file (ffi/cuda/errors.cu -> cuda_errors.o), so the
    sources of several folders (the NVSHMEM build) never share an object."""
    folder = os.path.basename(os.path.dirname(os.path.abspath(source)))
    return os.path.join(build_dir, f"{folder}_{os.path.splitext(os.path.basename(source))[0]}.o")


def compile_all(commands, jobs: int) -> None:
    """Runs the (command, output path) pairs, `jobs` at a time. Every source is compiled even when one fails, so one
    run reports every broken file; RuntimeError with each failure's log."""
    failures = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, int(jobs))) as pool:
        futures = {pool.submit(run_compiler.run, cmd, out, "nvcc"): cmd for cmd, out in commands}
        for future in concurrent.futures.as_completed(futures):
            try:
                future.result()
            except RuntimeError as e:
                failures.append(str(e))
    if failures:
        raise RuntimeError(f"{len(failures)} of {len(commands)} CUDA sources failed to compile:\n" +
                           "\n".join(sorted(failures)))


def build_objects(source_list, out_path: str, compile_for, link_for, jobs: int | None = None,
                  build_dir: str | None = None) -> str:
    """Compiles every source to an object in `build_dir` (a temporary directory, removed afterwards, when None),
    `jobs` at a time, then links them into out_path. `compile_for(source, obj)` and `link_for(objects)` give the
    command lines. Returns out_path."""
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    temporary = build_dir is None
    build_dir = tempfile.mkdtemp(prefix="jodc-nvcc-") if temporary else build_dir
    try:
        os.makedirs(build_dir, exist_ok=True)
        objects = [object_path(build_dir, s) for s in source_list]
        compile_all([(compile_for(s, o), o) for s, o in zip(source_list, objects)], jobs)
        return run_compiler.run(link_for(objects), out_path, "nvcc (link)")
    finally:
        if temporary:
            shutil.rmtree(build_dir, ignore_errors=True)


def build(out_path: str, include_dir: str, keep_dir: str | None = None, archs=ARCHS, jobs: int | None = None,
          build_dir: str | None = None) -> str:
    """Builds the library at out_path (RuntimeError with nvcc's logs on failure); `keep_dir` keeps the intermediate
    files, `build_dir` the objects. Returns out_path."""
    archs = tuple(archs)
    if keep_dir is not None:
        os.makedirs(keep_dir, exist_ok=True)
    return build_objects(sources(), out_path, lambda s, o: compile_command(s, o, include_dir, archs, keep_dir),
                         lambda objects: link_command(objects, out_path), jobs, build_dir)


# The scatter kernel's atomic accumulation must use 16-byte vector reductions where the architecture has them (sm_90)
# and scalar ones elsewhere (issue 15 defect 4); `make cuda-check` verifies this in the PTX nvcc kept.
VECTOR_RED = "red.relaxed.sys.global.add.v4.f32"
# nvcc writes the scalar form as atom.*.add.f32 in PTX (ptxas makes it a RED when the result is unused).
SCALAR_RED = re.compile(r"\b(?:red|atom)(?:\.\w+)*\.add\.f32\b")


def kept_ptx(keep_dir: str, stem: str, arch: str, archs=ARCHS) -> list[str]:
    """The PTX files nvcc kept in `keep_dir` for source `stem` (e.g. 'scatter_accumulate') and architecture `arch` of a
    build for `archs`. nvcc names them `<stem>.compute_<arch>.ptx` when it compiles for several architectures, but
    plain `<stem>.ptx` when it compiles for one (a build with --archs 90)."""
    found = sorted(glob.glob(os.path.join(keep_dir, f"{stem}*.compute_{arch}.ptx")) +
                   glob.glob(os.path.join(keep_dir, f"{stem}*sm_{arch}*.ptx")))
    if not found and len(tuple(archs)) == 1:
        found = sorted(glob.glob(os.path.join(keep_dir, f"{stem}.ptx")))
    return found


def check_reductions(keep_dir: str, archs=ARCHS) -> list[str]:
    """Reads the PTX of scatter_accumulate.cu kept by a build for `archs`; returns one line per architecture checked.
    Raises RuntimeError when sm_90 lacks the vector reduction or an older architecture has it (ptxas would reject it
    there)."""
    lines = []
    for arch in archs:
        found = kept_ptx(keep_dir, "scatter_accumulate", arch, archs)
        if not found:
            raise RuntimeError(f"no PTX of scatter_accumulate.cu for sm_{arch} under {keep_dir}")
        ptx = open(found[0]).read()
        vector, scalar = ptx.count(VECTOR_RED), len(SCALAR_RED.findall(ptx))
        has_vector = int(re.match(r"\d+", arch).group()) >= 90
        if has_vector and vector == 0:
            raise RuntimeError(f"sm_{arch} scatter kernel has no {VECTOR_RED} (the vector reduction went missing)")
        if not has_vector and vector != 0:
            raise RuntimeError(f"sm_{arch} scatter kernel uses {VECTOR_RED}, which needs sm_90")
        if scalar == 0:
            raise RuntimeError(f"sm_{arch} scatter kernel has no scalar f32 reduction for its tails")
        lines.append(f"sm_{arch}: {vector} vector + {scalar} scalar f32 reductions in scatter_accumulate")
    return lines


def add_build_arguments(parser) -> None:
    """--archs, --jobs and --build-dir: the options both GPU build scripts take."""
    parser.add_argument("--archs", type=parse_archs, default=ARCHS, metavar="LIST",
                        help=f"compute capabilities to compile for, comma-separated (default: {','.join(ARCHS)})")
    parser.add_argument("--jobs", "-j", type=int, default=None,
                        help=f"nvcc processes at once (default: the usable CPUs, {default_jobs()} here)")
    parser.add_argument("--build-dir", help="keep the objects here (default: a temporary directory, removed)")


def timed_build(build_library, args) -> None:
    """Runs `build_library()` (no arguments; returns the library's path), prints the path, and on stderr the archs,
    nvcc jobs and seconds it took: the command-line end of both GPU build scripts."""
    start = time.perf_counter()
    print(build_library())
    print(f"built for sm_{', sm_'.join(args.archs)} with {args.jobs or default_jobs()} nvcc jobs in "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr)

if __name__ == "__main__":
    def arguments(parser):
        add_build_arguments(parser)
        parser.add_argument("--keep-dir", help="keep nvcc's intermediate files (PTX) here and check the reductions")

    args = run_compiler.parse_args(__doc__, arguments)
    timed_build(lambda: build(args.out, args.include_dir, args.keep_dir, args.archs, args.jobs, args.build_dir), args)
    if args.keep_dir:
        print("\n".join(check_reductions(args.keep_dir, args.archs)))
