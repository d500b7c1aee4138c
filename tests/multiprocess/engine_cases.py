"""The ODC engine across processes (MPI transport) against the unsharded reference engine. Usage:

    mpirun -np P python engine_cases.py LOCAL_DEVICES OUT_DIR     (multi-process: checks and writes OUT_DIR/mp.npz)
    python engine_cases.py single WORLD OUT_DIR                   (one process, WORLD devices: OUT_DIR/single.npz)

Per-device microbatch counts differ between devices and processes (as LB-Mini plans them). Both forms write the
deterministic engine's parameters after the steps, which the driver compares bit for bit (two independent runs
agreeing to the bit also shows the multi-process run is repeatable).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests/: fsdp_toy

SINGLE = sys.argv[1] == "single"
if SINGLE:
    WORLD, OUT = int(sys.argv[2]), sys.argv[3]
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={WORLD}"
    import jax

    comm = None
    RANK = 0
else:
    import _mp

    L, OUT = int(sys.argv[1]), sys.argv[2]
    jax, comm = _mp.init(L)
    RANK = comm.Get_rank()
import numpy as np  # noqa: E402

import fsdp_toy  # noqa: E402
from jodc.fsdp import ODCEngine, OptimizerConfig, ReferenceEngine  # noqa: E402

OPT = OptimizerConfig(learning_rate=3e-2, max_grad_norm=0.5, weight_decay=0.01)
UNEVEN = {2: [[3, 1], [0, 2], [2, 2]], 4: [[3, 1, 0, 2], [1, 1, 2, 3], [2, 0, 1, 1]]}

mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
world = mesh.shape["d"]
model, groups = fsdp_toy.make_model(num_layers=2, tied=world == 4)
batches = [fsdp_toy.random_minibatch(c, seed=s) for s, c in enumerate(UNEVEN[world])]


def run(engine):
    try:
        losses = [engine.step(b).loss for b in batches]
        return losses, engine.flat_params()
    finally:
        close = getattr(engine, "close", None)
        if close:
            close()


det_losses, det_params = run(ODCEngine(model, groups, mesh, optimizer=OPT, deterministic=True))
if SINGLE:
    np.savez(os.path.join(OUT, "single.npz"), losses=np.array(det_losses), **det_params)
    print("single-process deterministic run written", flush=True)
    sys.exit(0)

engine = ODCEngine(model, groups, mesh, optimizer=OPT)
assert engine.heap.transport == "mpi", engine.heap.transport
odc_losses, odc_params = run(engine)
ref_losses, ref_params = run(ReferenceEngine(model, groups, optimizer=OPT, device=jax.local_devices()[0]))
np.testing.assert_allclose(odc_losses, ref_losses, rtol=1e-5)
np.testing.assert_allclose(det_losses, ref_losses, rtol=1e-5)
for g in ref_params:
    scale = max(np.abs(ref_params[g]).max(), 1e-6)
    np.testing.assert_allclose(odc_params[g], ref_params[g], rtol=1e-5, atol=1e-5 * scale, err_msg=g)
    np.testing.assert_allclose(det_params[g], ref_params[g], rtol=1e-5, atol=1e-5 * scale, err_msg=g)
moved = max(np.abs(ref_params[g] - v).max() for g, v in model.flatten_groups(groups).items())
assert moved > 1e-3, moved
if RANK == 0:
    np.savez(os.path.join(OUT, "mp.npz"), losses=np.array(det_losses), **det_params)
comm.Barrier()
if RANK == 0:
    print(f"PASS engine world={world} max|odc-ref|="
          f"{max(np.abs(odc_params[g] - ref_params[g]).max() for g in ref_params):.3g}", flush=True)
