"""Compiles ffi/cuda/*.cu into one shared library (sm_80 and sm_90). Used by setup.py and by CI's compile check.

The library uses only the CUDA runtime API, linked statically (nvcc's default): it needs no libcudart at run time
and no driver (libcuda.so) to link or even to be loaded, only to run. So CI machines without a GPU build, link and
load it.
"""
import argparse
import glob
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_compiler  # noqa: E402  (ffi/run_compiler.py)

HERE = os.path.dirname(os.path.abspath(__file__))
ARCHS = ("80", "90")


def nvcc_command(out_path: str, include_dir: str) -> list[str]:
    sources = sorted(glob.glob(os.path.join(HERE, "cuda", "*.cu")))
    if not sources:
        raise RuntimeError(f"no CUDA sources under {os.path.join(HERE, 'cuda')}")
    # -isystem: XLA's FFI headers are not ours; keep their warnings out of the build log.
    cmd = [shutil.which("nvcc") or "nvcc", "-std=c++17", "-O3", "-shared", "-Xcompiler", "-fPIC",
           "-Xcompiler", "-fvisibility=hidden", "-Xcompiler", "-Wall", "-cudart", "static",
           "-isystem", include_dir, "-I", HERE]
    for a in ARCHS:
        cmd += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    return cmd + sources + ["-o", out_path]


def build(out_path: str, include_dir: str) -> str:
    """Runs nvcc (raises RuntimeError with its log on failure). Returns out_path."""
    return run_compiler.run(nvcc_command(out_path, include_dir), out_path, "nvcc")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--include-dir", help="XLA FFI headers (default: jax.ffi.include_dir(); Bazel passes its own)")
    args = parser.parse_args()
    if args.include_dir is None:
        import jax

        args.include_dir = jax.ffi.include_dir()
    print(build(args.out, args.include_dir))
