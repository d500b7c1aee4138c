"""HSDP across processes against the unsharded reference engine. Usage:

    mpirun -np P python -m mpi4py hsdp_cases.py LOCAL_DEVICES OUT_DIR CASE...

Cases (P processes x LOCAL_DEVICES devices, uneven microbatch counts per device and per replica):
  odc_replicas_across     ODC, one replica group per process (in-process heaps; the cross-replica reduce over gloo);
                          also writes OUT_DIR/hsdp_det.npz, the deterministic engine's losses and parameters, which the
                          driver compares bit for bit with `single_process_run` (one process driving the same mesh)
  odc_shards_across       ODC, every replica group spread over the processes (MPI heaps; replicas inside a process)
  collective_replicas_across  collective FSDP, gathers inside a process, all-reduce over replicas across them
  odc_replica_fails       ODC with a replica group per process whose last process's first device raises before the
                          minibatch barrier: every process's step fails within the barrier timeout (no device waits
                          in the cross-replica psum), then every process frees its heaps
"""
import os
import sys
import time
import warnings

import numpy as np  # no JAX: the device count is set first (main)

OPT_SETTINGS = dict(learning_rate=3e-2, max_grad_norm=0.5, weight_decay=0.01)
COUNTS = [[3, 1, 0, 2], [1, 1, 2, 3], [2, 0, 1, 1]]  # as 2x2: replicas run 4 and 2, 2 and 5, 2 and 2 microbatches


def setup():
    """(model, groups, batches, optimizer config) of the runs (4 devices)."""
    import fsdp_toy
    from jodc.fsdp import OptimizerConfig

    model, groups = fsdp_toy.make_model(num_layers=2, tied=True)
    batches = [fsdp_toy.random_minibatch(c, seed=s) for s, c in enumerate(COUNTS)]
    return model, groups, batches, OptimizerConfig(**OPT_SETTINGS)


def run(engine, batches):
    try:
        return [engine.step(b).loss for b in batches], engine.flat_params()
    finally:
        engine.close()


def single_process_run(mesh) -> dict:
    """The deterministic ODC engine of one process driving every device of the HSDP `mesh`."""
    from jodc.fsdp import ODCEngine

    model, groups, batches, opt = setup()
    losses, params = run(ODCEngine(model, groups, mesh, optimizer=opt, deterministic=True), batches)
    return {"losses": np.array(losses), **params}


def main():
    import _mp

    L, OUT = int(sys.argv[1]), sys.argv[2]
    jax, comm = _mp.init(L)  # sets this process's device count: before anything imports JAX
    from jodc.fsdp import CollectiveEngine, ODCEngine, ReferenceEngine, sharding

    P, rank = comm.Get_size(), comm.Get_rank()
    model, groups, batches, opt = setup()
    ref_losses, ref_params = run(ReferenceEngine(model, groups, _mp.local_mesh(jax), optimizer=opt), batches)
    replicas_across = sharding.hsdp_mesh(jax.devices(), P)  # group r: process r's devices (listed process by process)
    shards_across = jax.sharding.Mesh(np.array(jax.devices()).reshape(P, L).T, ("r", "d"))  # group r: device r of each

    def check(losses, params, what):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=what)
        for g in ref_params:
            scale = max(np.abs(ref_params[g]).max(), 1e-6)
            np.testing.assert_allclose(params[g], ref_params[g], rtol=1e-5, atol=1e-5 * scale, err_msg=f"{what} {g}")
        if rank == 0:
            print(f"{what} max|engine-ref|={max(np.abs(params[g] - ref_params[g]).max() for g in ref_params):.3g}",
                  flush=True)

    def odc_replicas_across():
        engine = ODCEngine(model, groups, replicas_across, optimizer=opt)
        assert engine.heap.transport == "local" and sorted(engine.heap.heaps) == [rank], engine.heap
        check(*run(engine, batches), "odc replicas across processes")
        losses, params = run(ODCEngine(model, groups, replicas_across, optimizer=opt, deterministic=True), batches)
        check(losses, params, "deterministic odc replicas across processes")
        if rank == 0:
            np.savez(os.path.join(OUT, "hsdp_det.npz"), losses=np.array(losses), **params)

    def odc_shards_across():
        engine = ODCEngine(model, groups, shards_across, optimizer=opt)
        assert engine.heap.transport == "mpi" and sorted(engine.heap.heaps) == list(range(L)), engine.heap
        check(*run(engine, batches), "odc shards across processes")

    def collective_replicas_across():
        check(*run(CollectiveEngine(model, groups, replicas_across, optimizer=opt), batches),
              "collective replicas across processes")

    def odc_replica_fails():
        import jax.numpy as jnp

        from jodc.ops.failure import summarize

        class FailingODC(ODCEngine):
            def _barrier(self, token, recorder, every_group=False):
                if every_group:
                    def host(device):
                        if int(device) == P * L - 1:
                            raise ValueError("boom on the last process")
                        return np.int32(0)

                    token = token + jax.pure_callback(host, jax.ShapeDtypeStruct((), jnp.int32),
                                                      sharding.device_position())
                return super()._barrier(token, recorder, every_group)

        timeout_s = 5.0
        engine = FailingODC(model, groups, replicas_across, optimizer=opt, barrier_timeout_s=timeout_s)
        t0 = time.monotonic()
        try:
            engine.step(batches[0])
        except Exception as e:  # noqa: BLE001 - what every process must see
            elapsed = time.monotonic() - t0
            print(f"[rank {rank}] step failed after {elapsed:.1f} s: {summarize(e)[:300]}", flush=True)
            assert elapsed < timeout_s + 20, elapsed
        else:
            raise AssertionError("the step succeeded")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            engine.close()  # collective (the all-groups barrier's MPI heap): every process frees here

    cases = {f.__name__: f for f in (odc_replicas_across, odc_shards_across, collective_replicas_across,
                                     odc_replica_fails)}
    _mp.run_cases(cases, sys.argv[3:], comm)


if __name__ == "__main__":
    main()
