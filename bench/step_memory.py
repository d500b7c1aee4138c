"""Peak memory of one training step per engine (ODC, collective, XLA-SPMD), as bytes per parameter.

Each (engine, model size) runs in its own process (2 simulated CPU devices by default): it builds the decoder and the
engine, steps the same minibatch twice (compile, then warm), then measures a third step two ways:

- the process's resident high-water mark over the step: `echo 5 > /proc/self/clear_refs` resets the kernel's
  VmHWM to the current RSS just before the step, `/proc/self/status` VmHWM is read right after (every device of the
  process counts, and ODC's symmetric heap, which lives outside XLA, too);
- XLA's own accounting of the compiled step program (`.lower(...).compile().memory_analysis()`, one device's
  program): arguments + outputs - aliased (donated) + temporaries. Deterministic, but blind to memory outside XLA
  (ODC's heap: its parameter shards, accumulators and published copies).

Two model sizes (by default differing only in their number of layers) give the slope, bytes per parameter, in which the
interpreter, the compiled programs and the one gathered layer of an FSDP engine drop out; what is left is what
grows with the model: the state (parameters, Adam moments, accumulators) and whatever the step keeps per layer.
An FSDP engine keeps one layer gathered at a time; an engine that gathers the whole model has a slope larger by the
gathered copies (per device).

Prints a table and one JSON line; `--save LABEL` also writes the run under LABEL in bench/results/step_memory.json
(other labels kept), e.g. `--save before` / `--save after` around an engine change. `--sizes 4x384,4x768` varies the width instead: then
the one gathered layer grows with the model too and counts in the slope.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench import harness

ENGINES = ("odc", "collective", "xla_spmd")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--sizes", default="2x512,6x512",
                   help="two model sizes, LAYERSxHIDDEN: the slope between them (the default varies the layers only)")
    p.add_argument("--hidden", type=int, default=512, help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--token-cap", type=int, default=256)
    p.add_argument("--seqs-per-device", type=int, default=4, help="sequences of token_cap / 2 tokens per device")
    p.add_argument("--save", metavar="LABEL", default=None)
    p.add_argument("--child", nargs=2, metavar=("ENGINE", "LAYERS"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def capture_compiled(engine) -> dict:
    """Makes `engine` record its compiled step and its arguments' shapes (for memory_analysis) in the dict returned,
    each time it runs a step."""
    import jax

    captured = {}
    cached = engine._cached

    def capturing(key, build):  # records the compiled step and its arguments' shapes, for memory_analysis
        fn = cached(key, build)

        def call(*a):
            captured["fn"] = fn
            captured["args"] = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                if isinstance(x, jax.Array) and x.committed else
                (jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x), a)
            return fn(*a)
        return call

    engine._cached = capturing
    return captured


def child(args) -> dict:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}").strip()
    import gc

    import jax
    import numpy as np
    from jax.sharding import Mesh

    from jodc.balance import get_planner
    from jodc.fsdp import ENGINES as REGISTRY, OptimizerConfig
    from jodc.fsdp.batch import minibatch_from_plan
    from jodc.models.config import DecoderConfig
    from jodc.train.core.staged_decoder import decoder_staged_model

    name, layers = args.child[0], int(args.child[1])
    config = DecoderConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                           num_layers=layers, num_heads=4, num_kv_heads=2, attention_block_size=128,
                           max_position_embeddings=args.token_cap)
    model, groups = decoder_staged_model(config, seed=0)
    params = int(sum(model.layouts[g].numel for g in model.group_names))
    mesh = Mesh(np.array(jax.devices("cpu")[: args.devices]), ("d",))
    engine = REGISTRY[name](model, groups, mesh, optimizer=OptimizerConfig(learning_rate=1e-4))
    del groups
    rng = np.random.default_rng(0)
    lengths = np.full(args.devices * args.seqs_per_device, args.token_cap // 2)
    seqs = [rng.integers(0, args.vocab, int(s) + 1) for s in lengths]
    plan = get_planner("lb_micro")(lengths, args.devices, args.token_cap)
    batch = minibatch_from_plan(plan, [s[:-1] for s in seqs], [s[1:] for s in seqs],
                                [np.ones(int(s), np.float32) for s in lengths])

    captured = capture_compiled(engine)
    try:
        engine.step(batch)
        engine.step(batch)
        gc.collect()
        steady = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        engine.step(batch)
        peak = _status("VmHWM")
        compiled = captured["fn"].lower(*captured["args"]).compile()
        stats = compiled.memory_analysis()
        if os.environ.get("STEP_MEMORY_HLO"):  # the compiled step's HLO, for looking at where the gathers sit
            with open(os.environ["STEP_MEMORY_HLO"], "w") as f:
                f.write(compiled.as_text())
    finally:
        engine.close()
    xla = {k: int(getattr(stats, k + "_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
    xla["peak"] = xla["argument"] + xla["output"] - xla["alias"] + xla["temp"]
    return {"engine": name, "layers": layers, "hidden": args.hidden, "params": params, "steady_rss": steady,
            "step_hwm": peak, "xla": xla}


def slope(rows, key):
    (a, b) = (rows[0], rows[-1])
    return (key(b) - key(a)) / (b["params"] - a["params"])


def measure(args, engines: list[str], sizes: list[tuple[int, int]]) -> dict[str, list[dict]]:
    """Per engine, one child process per size: its row (parameters, resident memory, XLA's program memory)."""
    runs = {}
    for name in engines:
        runs[name] = []
        for layers, hidden in sizes:
            cmd = harness.module_command("step_memory", "--child", name, str(layers), "--hidden", str(hidden),
                                         "--vocab", str(args.vocab), "--devices", str(args.devices),
                                         "--token-cap", str(args.token_cap),
                                         "--seqs-per-device", str(args.seqs_per_device))
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=harness.child_env()).stdout
            row = json.loads(out.strip().splitlines()[-1])
            runs[name].append(row)
            print(f"  {name} {layers}x{hidden}: {row['params'] / 1e6:.2f}M params, steady {row['steady_rss'] / 2**20:.0f}"
                  f" MiB, step peak {row['step_hwm'] / 2**20:.0f} MiB, XLA program peak "
                  f"{row['xla']['peak'] / 2**20:.0f} MiB (temp {row['xla']['temp'] / 2**20:.0f})", file=sys.stderr)
    return runs


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Bytes per parameter (the slope between the sizes) per engine, and each engine's step peak over ODC's."""
    summary = {}
    for name, rows in runs.items():
        summary[f"{name}_step_peak_bytes_per_param"] = round(slope(rows, lambda r: r["step_hwm"]), 2)
        summary[f"{name}_steady_bytes_per_param"] = round(slope(rows, lambda r: r["steady_rss"]), 2)
        summary[f"{name}_xla_peak_bytes_per_param"] = round(slope(rows, lambda r: r["xla"]["peak"]), 2)
        summary[f"{name}_xla_temp_bytes_per_param"] = round(slope(rows, lambda r: r["xla"]["temp"]), 2)
    if "odc" in runs:
        for name in runs:
            if name != "odc":
                summary[f"{name}_step_peak_over_odc"] = round(
                    summary[f"{name}_step_peak_bytes_per_param"] / summary["odc_step_peak_bytes_per_param"], 3)
    return summary


def print_table(summary: dict, engines: list[str], args) -> None:
    print(f"Step memory per process ({args.devices} CPU devices), bytes per parameter (slope between the sizes "
          f"{args.sizes}, layers x hidden):")
    print(f"{'engine':<12}{'step peak':>11}{'steady':>9}{'XLA peak':>10}{'XLA temp':>10}{'peak/ODC':>10}")
    for name in engines:
        ratio = summary.get(f"{name}_step_peak_over_odc", 1.0 if name == "odc" else float("nan"))
        print(f"{name:<12}{summary[f'{name}_step_peak_bytes_per_param']:>11.1f}"
              f"{summary[f'{name}_steady_bytes_per_param']:>9.1f}{summary[f'{name}_xla_peak_bytes_per_param']:>10.1f}"
              f"{summary[f'{name}_xla_temp_bytes_per_param']:>10.1f}{ratio:>10.2f}")


def main(args) -> dict:
    engines = args.engines.split(",")
    sizes = [tuple(int(v) for v in x.split("x")) for x in args.sizes.split(",")]
    runs = measure(args, engines, sizes)
    summary = summarize(runs)
    # --save LABEL: the file keeps every label's run, this one's under LABEL
    out = harness.results_path("step_memory.json") if args.save else None
    config = {k: getattr(args, k) for k in ("sizes", "vocab", "devices", "token_cap", "seqs_per_device")}
    saved = {**harness.previous(out), args.save: {"summary": summary, "config": config, "runs": runs}} if out else None
    return harness.report(summary, out, lambda: print_table(summary, list(runs), args), saved=saved)

if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.child:
        print(json.dumps(child(ARGS)))
    else:
        main(ARGS)
