"""Compiles ffi/cuda/*.cu into one shared library (sm_80 and sm_90). Used by setup.py and by CI's compile check.

The library uses only the CUDA runtime API, linked statically (nvcc's default): it needs no libcudart at run time
and no driver (libcuda.so) to link or even to be loaded, only to run. So CI machines without a GPU build, link and
load it.
"""
import glob
import os
import re
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_compiler  # noqa: E402  (ffi/run_compiler.py)

HERE = os.path.dirname(os.path.abspath(__file__))
ARCHS = ("80", "90")


def nvcc_command(out_path: str, include_dir: str, keep_dir: str | None = None) -> list[str]:
    sources = sorted(glob.glob(os.path.join(HERE, "cuda", "*.cu")))
    if not sources:
        raise RuntimeError(f"no CUDA sources under {os.path.join(HERE, 'cuda')}")
    # -isystem: XLA's FFI headers are not ours; keep their warnings out of the build log.
    cmd = [shutil.which("nvcc") or "nvcc", "-std=c++17", "-O3", "-shared", "-Xcompiler", "-fPIC",
           "-Xcompiler", "-fvisibility=hidden", "-Xcompiler", "-Wall", "-cudart", "static",
           "-isystem", include_dir, "-I", HERE]
    for a in ARCHS:
        cmd += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    if keep_dir is not None:  # keep the intermediate PTX (per source and architecture) for inspection
        cmd += ["--keep", "--keep-dir", keep_dir]
    # -lrt: shm_open for multi-process control blocks (ipc.cu; part of libc since glibc 2.34, librt before)
    return cmd + sources + ["-lrt", "-o", out_path]


def build(out_path: str, include_dir: str, keep_dir: str | None = None) -> str:
    """Runs nvcc (raises RuntimeError with its log on failure); `keep_dir` keeps its intermediate files. Returns
    out_path."""
    if keep_dir is not None:
        os.makedirs(keep_dir, exist_ok=True)
    return run_compiler.run(nvcc_command(out_path, include_dir, keep_dir), out_path, "nvcc")


# The scatter kernel's atomic accumulation must use 16-byte vector reductions where the architecture has them (sm_90)
# and scalar ones elsewhere (issue 15 defect 4); `make cuda-check` verifies this in the PTX nvcc kept.
VECTOR_RED = "red.relaxed.sys.global.add.v4.f32"
# nvcc writes the scalar form as atom.*.add.f32 in PTX (ptxas makes it a RED when the result is unused).
SCALAR_RED = re.compile(r"\b(?:red|atom)(?:\.\w+)*\.add\.f32\b")


def check_reductions(keep_dir: str) -> list[str]:
    """Reads the PTX of scatter_accumulate.cu kept by a build; returns one line per architecture checked. Raises
    RuntimeError when sm_90 lacks the vector reduction or sm_80 has it (ptxas would reject it there)."""
    lines = []
    for arch in ARCHS:
        found = sorted(glob.glob(os.path.join(keep_dir, f"scatter_accumulate*.compute_{arch}.ptx")) +
                       glob.glob(os.path.join(keep_dir, f"scatter_accumulate*sm_{arch}*.ptx")))
        if not found:
            raise RuntimeError(f"no PTX of scatter_accumulate.cu for sm_{arch} under {keep_dir}")
        ptx = open(found[0]).read()
        vector, scalar = ptx.count(VECTOR_RED), len(SCALAR_RED.findall(ptx))
        if arch == "90" and vector == 0:
            raise RuntimeError(f"sm_90 scatter kernel has no {VECTOR_RED} (the vector reduction went missing)")
        if arch != "90" and vector != 0:
            raise RuntimeError(f"sm_{arch} scatter kernel uses {VECTOR_RED}, which needs sm_90")
        if scalar == 0:
            raise RuntimeError(f"sm_{arch} scatter kernel has no scalar f32 reduction for its tails")
        lines.append(f"sm_{arch}: {vector} vector + {scalar} scalar f32 reductions in scatter_accumulate")
    return lines


if __name__ == "__main__":
    args = run_compiler.parse_args(__doc__, lambda p: p.add_argument(
        "--keep-dir", help="keep nvcc's intermediate files (PTX) here and check the reductions"))
    print(build(args.out, args.include_dir, args.keep_dir))
    if args.keep_dir:
        print("\n".join(check_reductions(args.keep_dir)))
