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
    root allowed (containers), JAX on CPU, unbuffered output (read as it comes), plus `extra`."""
    env = {k: v for k, v in environ.items() if k != "XLA_FLAGS"}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               **extra)
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
