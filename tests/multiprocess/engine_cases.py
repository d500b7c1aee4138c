"""The ODC engine across processes (MPI transport) against the unsharded reference engine. Usage:

    mpirun -np P python engine_cases.py LOCAL_DEVICES OUT_DIR     (multi-process: checks and writes OUT_DIR/mp.npz)

and `single_process_run(mesh)`, which tests/test_multiprocess.py calls in its own process (WORLD of its simulated
devices) for the one-process side: the same model, batches and deterministic engine.

Per-device microbatch counts differ between devices and processes (as LB-Mini plans them). Both forms give the
deterministic engine's parameters after the steps, which the driver compares bit for bit (two independent runs
agreeing to the bit also shows the multi-process run is repeatable).
"""
import os
import sys

import numpy as np  # no JAX: the device count is set first (main)

OPT_SETTINGS = dict(learning_rate=3e-2, max_grad_norm=0.5, weight_decay=0.01)
UNEVEN = {2: [[3, 1], [0, 2], [2, 2]], 4: [[3, 1, 0, 2], [1, 1, 2, 3], [2, 0, 1, 1]]}


def setup(mesh):
    """(model, groups, batches, optimizer config) of a run on `mesh` (2 or 4 devices)."""
    import fsdp_toy
    from jodc.fsdp import OptimizerConfig

    world = mesh.shape["d"]
    model, groups = fsdp_toy.make_model(num_layers=2, tied=world == 4)
    batches = [fsdp_toy.random_minibatch(c, seed=s) for s, c in enumerate(UNEVEN[world])]
    return model, groups, batches, OptimizerConfig(**OPT_SETTINGS)


def run(engine, batches):
    try:
        losses = [engine.step(b).loss for b in batches]
        return losses, engine.flat_params()
    finally:
        close = getattr(engine, "close", None)
        if close:
            close()


def single_process_run(mesh) -> dict:
    """The deterministic ODC engine of one process driving every device of `mesh`: {"losses": ..., group: params}."""
    from jodc.fsdp import ODCEngine

    model, groups, batches, opt = setup(mesh)
    losses, params = run(ODCEngine(model, groups, mesh, optimizer=opt, deterministic=True), batches)
    return {"losses": np.array(losses), **params}


def main():
    import _mp

    L, OUT = int(sys.argv[1]), sys.argv[2]
    jax, comm = _mp.init(L)  # sets this process's device count: before anything imports JAX
    from jodc.fsdp import ODCEngine, ReferenceEngine
    rank = comm.Get_rank()
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    world = mesh.shape["d"]
    model, groups, batches, opt = setup(mesh)
    det_losses, det_params = run(ODCEngine(model, groups, mesh, optimizer=opt, deterministic=True), batches)
    engine = ODCEngine(model, groups, mesh, optimizer=opt)
    assert engine.heap.transport == "mpi", engine.heap.transport
    odc_losses, odc_params = run(engine, batches)
    ref_losses, ref_params = run(ReferenceEngine(model, groups, _mp.local_mesh(jax), optimizer=opt),
                                 batches)
    np.testing.assert_allclose(odc_losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(det_losses, ref_losses, rtol=1e-5)
    for g in ref_params:
        scale = max(np.abs(ref_params[g]).max(), 1e-6)
        np.testing.assert_allclose(odc_params[g], ref_params[g], rtol=1e-5, atol=1e-5 * scale, err_msg=g)
        np.testing.assert_allclose(det_params[g], ref_params[g], rtol=1e-5, atol=1e-5 * scale, err_msg=g)
    moved = max(np.abs(ref_params[g] - v).max() for g, v in model.flatten_groups(groups).items())
    assert moved > 1e-3, moved
    if rank == 0:
        np.savez(os.path.join(OUT, "mp.npz"), losses=np.array(det_losses), **det_params)
    comm.Barrier()
    if rank == 0:
        print(f"PASS engine world={world} max|odc-ref|="
              f"{max(np.abs(odc_params[g] - ref_params[g]).max() for g in ref_params):.3g}", flush=True)


if __name__ == "__main__":
    main()
