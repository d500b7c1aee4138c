"""Runs one compiler command line for the native builds (ffi/build_cuda.py, ffi/build_nvshmem.py, ffi/build_mpi.py): output to a file
(a pipe that closes early breaks nvcc), a RuntimeError carrying the whole log when it fails."""
import argparse
import os
import subprocess
import tempfile


def run(cmd: list[str], out_path: str, name: str) -> str:
    """Creates out_path's directory, runs `cmd`; raises RuntimeError("<name> failed ...: <log>"). Returns out_path."""
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.seek(0)
        text = log.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{text}")
    return out_path


def parse_args(description: str, add_arguments=None) -> argparse.Namespace:
    """The build scripts' command line: --out, --include-dir (XLA's FFI headers; default: jax.ffi.include_dir(), Bazel
    passes its own) and what `add_arguments(parser)` adds."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", required=True)
    parser.add_argument("--include-dir", help="XLA FFI headers (default: jax.ffi.include_dir(); Bazel passes its own)")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    if args.include_dir is None:
        import jax

        args.include_dir = jax.ffi.include_dir()
    return args
