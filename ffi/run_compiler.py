"""Runs one compiler command line for the native builds (ffi/build_cuda.py, ffi/build_nvshmem.py, ffi/build_mpi.py): output to a file
(a pipe that closes early breaks nvcc), a RuntimeError carrying the whole log when it fails."""
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
