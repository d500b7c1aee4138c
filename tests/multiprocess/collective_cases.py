"""The lock-step engines across processes (XLA's collectives over gloo) against the unsharded reference engine.
Usage:

    mpirun -np P python -m mpi4py collective_cases.py LOCAL_DEVICES CASE...

Cases: `collective` (all_gather / psum_scatter inside shard_map) and `xla_spmd` (one jit program, XLA's SPMD
partitioner). Each runs uneven per-device microbatch counts (the engines run in lock-step over the largest) with
length buckets, then checks losses and parameters against the reference engine (1e-5), and that a state dict saved
across processes loads back into a fresh engine and gives the same next step.
"""
import sys


import _mp  # noqa: E402

L = int(sys.argv[1])
jax, comm = _mp.init(L)
import numpy as np  # noqa: E402

import fsdp_toy  # noqa: E402
from jodc.fsdp import CollectiveEngine, OptimizerConfig, ReferenceEngine, XlaSpmdEngine  # noqa: E402

OPT = OptimizerConfig(learning_rate=3e-2, max_grad_norm=0.5, weight_decay=0.01)
UNEVEN = {2: [[3, 1], [0, 2], [2, 2]], 3: [[3, 1, 0], [1, 2, 2], [2, 0, 1]],
          4: [[3, 1, 0, 2], [1, 1, 2, 3], [2, 0, 1, 1]]}

mesh = _mp.global_mesh(jax)
world = mesh.shape["d"]
model, groups = fsdp_toy.make_model(num_layers=2, tied=world == 4)
batches = [fsdp_toy.random_minibatch(c, seed=s) for s, c in enumerate(UNEVEN[world])]
extra = fsdp_toy.random_minibatch(UNEVEN[world][0], seed=99)
ref = ReferenceEngine(model, groups, _mp.local_mesh(jax), optimizer=OPT)
REF_LOSSES = [ref.step(b).loss for b in batches]
REF_PARAMS = ref.flat_params()
REF_STATE = ref.state_dict()
REF_NEXT = ref.step(extra).loss


def check(cls, **options):
    engine = cls(model, groups, mesh, optimizer=OPT, length_buckets=(4, 8), **options)
    losses = [engine.step(b).loss for b in batches]
    params = engine.flat_params()
    np.testing.assert_allclose(losses, REF_LOSSES, rtol=1e-5)
    for g in REF_PARAMS:
        scale = max(np.abs(REF_PARAMS[g]).max(), 1e-6)
        np.testing.assert_allclose(params[g], REF_PARAMS[g], rtol=1e-5, atol=1e-5 * scale, err_msg=g)
    moved = max(np.abs(REF_PARAMS[g] - v).max() for g, v in model.flatten_groups(groups).items())
    assert moved > 1e-3, moved
    state = engine.state_dict()  # gathered over processes: every process holds the whole canonical state
    fresh = cls(model, groups, mesh, optimizer=OPT, length_buckets=(4, 8), **options)
    fresh.load_state_dict(state)
    np.testing.assert_allclose(fresh.step(extra).loss, REF_NEXT, rtol=1e-5)
    np.testing.assert_allclose(engine.step(extra).loss, REF_NEXT, rtol=1e-5)
    assert state["step"] == REF_STATE["step"] == len(batches)
    if comm.Get_rank() == 0:
        print(f"{cls.name} world={world} max|engine-ref|="
              f"{max(np.abs(params[g] - REF_PARAMS[g]).max() for g in REF_PARAMS):.3g}", flush=True)


CASES = {"collective": lambda: check(CollectiveEngine), "xla_spmd": lambda: check(XlaSpmdEngine)}
_mp.run_cases(CASES, sys.argv[2:], comm)
