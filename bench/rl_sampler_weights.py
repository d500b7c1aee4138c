"""The RL sampler's weights per policy version: the device reshard (the trainer's sampler) against the sampler
process's host path.

`python -m bench.rl_sampler_weights [--presets small base] [--versions 5]` builds the preset's decoder (random init)
on an ODC engine over 2 CPU devices and, per version, times (medians over the versions after the first):

- `host_gather_s`: `engine.params()`, the fp32 policy gathered to the host (what `rollout.sampler: process` sends);
- `pickle_and_pipe_s`: pickling it and sending it through a pipe to a spawned child (the child's answer awaited);
- `device_reshard_<dtype>_s`: `policy_weights.policy_weights` (the sampler's copies on both devices in `dtype`, and
  for bf16 the fp32 copy of the trainer's passes too), to completion.

Prints one JSON line per preset with `params`, `pickled_bytes` and `bytes_per_param` (docs/rl.md, "The sampler's
weights").
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import pickle
import statistics
import time

import jax


def _child(conn) -> None:
    """Receives pickled weights until it gets None, answering each."""
    while True:
        if conn.recv() is None:
            return
        conn.send(1)


def measure(preset: str, versions: int) -> dict:
    from jodc.models.tokenizer import load_tokenizer
    from jodc.train.core.model import build_decoder, make_engine
    from jodc.train.core.staged_decoder import decoder_staged_model
    from jodc.train.rl.config import load_rl_config
    from jodc.train.rl.policy_weights import policy_weights

    cfg = load_rl_config(None, ["--preset", preset, "--devices", "2"])
    config, source = build_decoder(cfg.model, load_tokenizer(None), max_length=64, compute_dtype="float32", seed=0)
    model, source = decoder_staged_model(config, source, seed=0)
    engine = make_engine(cfg, model, source)
    devices = jax.devices("cpu")[:2]
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    child = context.Process(target=_child, args=(child_conn,), daemon=True)
    child.start()
    conn.send(0)
    conn.recv()
    times: dict[str, list[float]] = {}

    def timed(key, fn):
        started = time.perf_counter()
        out = fn()
        times.setdefault(key, []).append(time.perf_counter() - started)
        return out

    try:
        for _ in range(versions):
            params = timed("host_gather_s", engine.params)
            payload = pickle.dumps(("params", 0, params))
            timed("pickle_and_pipe_s", lambda: (conn.send_bytes(pickle.dumps(("params", 0, params))), conn.recv()))
            for dtype in ("float32", "bfloat16"):
                def reshard(dtype=dtype):
                    w = policy_weights(engine, devices, dtype, devices[0])
                    return jax.block_until_ready((list(w.sampler.copies.values()), w.trainer))
                timed(f"device_reshard_{dtype}_s", reshard)
        conn.send(None)
        child.join(30)
    finally:
        engine.close()
    numel = sum(engine.numels.values())
    return {"preset": preset, "params": numel, "pickled_bytes": len(payload), "bytes_per_param": len(payload) / numel,
            **{k: statistics.median(v[1:] or v) for k, v in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["small", "base"])
    parser.add_argument("--versions", type=int, default=5)
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", 2)
    for preset in args.presets:
        print(json.dumps(measure(preset, args.versions)))


if __name__ == "__main__":
    main()
