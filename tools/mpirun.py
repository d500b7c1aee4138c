"""Starting and stopping `mpirun` jobs from Python, for the multi-process tests and benchmarks: the mpirun of the
jodc[mpi] extra (next to this Python), the command line and environment of a CPU job, and killing a whole job on a
timeout. Start the job with `subprocess.Popen(..., start_new_session=True)` so that `kill_session(proc.pid)` can
end it: mpirun puts each worker in a process group of its own, so killing mpirun's group alone would leave them
running."""
from __future__ import annotations

import os
import signal
import sys

MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")


def mpirun_command(nprocs: int, *args: str) -> list[str]:
    """`mpirun -np nprocs` (oversubscribed, unbound: CPU jobs share the host's cores) followed by `args`."""
    return [MPIRUN, "-np", str(nprocs), "--oversubscribe", "--bind-to", "none", *args]


def mpi_env(environ=os.environ, **extra: str) -> dict[str, str]:
    """The environment of a CPU mpirun job: `environ` without XLA_FLAGS (each worker picks its own device count),
    root allowed (containers), JAX on CPU, unbuffered output (read as it comes), Open MPI's UCX one-sided component
    left out where it would only print an error (no RDMA devices:
    `jodc.ops.transports.mpi_library.quiet_one_sided_components`; the
    workers run `python -m mpi4py`, which starts MPI before jodc could), plus `extra`."""
    from jodc.ops.transports.mpi_library import quiet_one_sided_components

    env = {k: v for k, v in environ.items() if k != "XLA_FLAGS"}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               **extra)
    quiet_one_sided_components(env)
    return env


def kill_session(sid: int) -> None:
    """SIGKILLs every process of session `sid` (an mpirun started with start_new_session=True, and its workers)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # after the command: state, ppid, pgrp, session
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass


def stream_session(cmd: list[str], env: dict, timeout: float, on_line=None, cwd: str | None = None
                   ) -> tuple[int, list[str], bool]:
    """Runs `cmd` (an mpirun job, or one process) in a session of its own and reads its output (stderr merged) as it
    comes, calling `on_line(line)` for each line; after `timeout` seconds, or on any exception (Ctrl-C included),
    the whole session is killed, so no worker is left behind. Returns (exit status, the lines, whether it timed
    out)."""
    import subprocess
    import threading

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    expired = threading.Event()

    def expire():
        expired.set()
        kill_session(proc.pid)

    timer = threading.Timer(timeout, expire)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if on_line is not None:
                on_line(line)
        proc.wait()
    except BaseException:
        kill_session(proc.pid)
        raise
    finally:
        timer.cancel()
    return proc.returncode, lines, expired.is_set()
