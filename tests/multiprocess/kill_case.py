"""A process killed mid-step: the survivors' barrier fails within the timeout (+ slack), naming the dead process's
devices, and every survivor exits non-zero. Usage, under mpirun: python kill_case.py LOCAL_DEVICES TIMEOUT_S"""
import os
import signal
import sys
import time

import _mp  # noqa: E402

L, TIMEOUT_S = int(sys.argv[1]), float(sys.argv[2])
jax, comm = _mp.init(L)
import numpy as np  # noqa: E402

from jodc import ops  # noqa: E402

RANK, NPROCS = comm.Get_rank(), comm.Get_size()
VICTIM = NPROCS - 1
mesh = _mp.global_mesh(jax)
WORLD = mesh.shape["d"]
heap = ops.SymmetricHeap(mesh, barrier_timeout_s=TIMEOUT_S)
b = heap.register(4096, name="w")


def step(g):
    full, tok = ops.gather(b, ops.new_token())
    tok = ops.scatter_accumulate(b, g + full, tok)
    return ops.barrier(heap, tok)


grads = np.ones((WORLD, 4096), np.float32)
_mp.spmd(jax, mesh, step, grads)  # one healthy step everywhere
comm.Barrier()
if RANK == VICTIM:
    print(f"[rank {RANK}] killing myself mid-step", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(0.5)  # the victim is gone before the survivors' next step
t0 = time.monotonic()
try:
    _mp.spmd(jax, mesh, step, grads)
except Exception as e:  # noqa: BLE001
    elapsed = time.monotonic() - t0
    print(f"[rank {RANK}] step failed after {elapsed:.2f} s: {str(e).splitlines()[0]}", flush=True)
    sys.exit(3)
print(f"[rank {RANK}] step unexpectedly succeeded", flush=True)
sys.exit(0)
