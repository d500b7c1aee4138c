"""Where a training step's time goes: the decoder's fwd+bwd step of bench/model.py traced with `jax.profiler`, its
XLA operations' device time summed per operation and per kind, the top consumers printed with their share.

For issue work on GPU speed ("report the top consumers before and after"): run it once per attention
implementation (`--attention-impl`) or before and after a change, on the same machine. Each XLA operation of the
trace is labelled with the JAX operation that produced it (the `op_name` metadata of the compiled HLO, e.g.
`jvp(step)/dot_general`), so a fusion reads as what it computes. Prints a table and one JSON line.

`--platform cpu` (the default here: CPU runs fill the host plane, GPU runs the device plane's "XLA Ops" line)
profiles a small model; `--platform gpu --quick` the 8-layer bf16 model of `bench/model.py --device gpu --quick`.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness  # noqa: E402
from bench.model import next_token_loss  # noqa: E402  (the same step)

from jodc.models import DecoderConfig, forward, init_params  # noqa: E402

SHAPES = {
    "cpu": dict(layers=2, hidden=256, intermediate=1024, heads=8, kv_heads=2, vocab=8192, batch=1, seq=512,
                dtype="float32"),
    "gpu": dict(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, vocab=32000, batch=1, seq=4096,
                dtype="bfloat16"),
}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]+)"')
_SOURCE = re.compile(r'source_file="([^"]+)"\s+source_line=(\d+)')
#: Host-side events of control flow: their time is their bodies', which the trace reports op by op as well.
CONTROL_FLOW = ("while", "cond", "conditional", "call")


def hlo_op_names(hlo_text: str) -> dict[str, str]:
    """Instruction name -> the JAX `op_name` that produced it and its source line ('file:line' of the Python that
    traced it, shortened to the last two path parts), from a compiled module's HLO text."""
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        op, source = _OP_NAME.search(m.group(2)), _SOURCE.search(m.group(2))
        label = op.group(1) if op else ""
        if source:
            label += f" @ {'/'.join(source.group(1).split('/')[-2:])}:{source.group(2)}"
        if label:
            out[m.group(1)] = label
    return out


def op_kind(name: str) -> str:
    """An HLO instruction name without its numeric suffix: 'fusion.12' -> 'fusion'."""
    return re.sub(r"(\.\d+)+$", "", name)


def op_times(xplane_path: str) -> dict[str, float]:
    """Seconds per XLA operation summed over the trace: the GPU planes' "XLA Ops" line when there is one, else the
    host's events that carry an `hlo_op` statistic (the CPU runtime's thunks; control flow left out, its bodies'
    operations are counted)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(xplane_path)
    device, host = collections.Counter(), collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                if plane.name.startswith("/device:") and line.name == "XLA Ops":
                    device[event.name] += event.duration_ns * 1e-9
                else:
                    stats = dict(event.stats)
                    name = str(stats.get("hlo_op", ""))
                    if name and not event.name.startswith("end:") and op_kind(name) not in CONTROL_FLOW:
                        host[name] += event.duration_ns * 1e-9
    return dict(device or host)


def profile(args) -> dict:
    shape = SHAPES[args.platform]
    if args.quick and args.platform == "gpu":
        shape = {**shape, "layers": 8}
    config = DecoderConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                           intermediate_size=shape["intermediate"], num_layers=shape["layers"],
                           num_heads=shape["heads"], num_kv_heads=shape["kv_heads"],
                           head_dim=shape["hidden"] // shape["heads"], param_dtype=shape["dtype"],
                           compute_dtype=shape["dtype"], attention_impl=args.attention_impl)
    device = jax.devices(args.platform)[0]
    params = jax.device_put(init_params(config, jax.random.PRNGKey(0)), device)
    tokens = jax.device_put(jnp.asarray(np.random.default_rng(0).integers(0, shape["vocab"],
                                                                          (shape["batch"], shape["seq"])),
                                        jnp.int32), device)
    step = jax.jit(lambda p, t: jax.value_and_grad(lambda p: next_token_loss(forward(config, p, t), t))(p))
    compiled = step.lower(params, tokens).compile()
    names = hlo_op_names(compiled.as_text())
    jax.block_until_ready(compiled(params, tokens))  # warm: allocations and first-touch out of the trace
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(args.steps):
                jax.block_until_ready(compiled(params, tokens))
        (xplane,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        times = op_times(xplane)
    if not times:
        raise SystemExit("the trace holds no XLA operation: nothing to report")
    total = sum(times.values())
    by_kind = collections.Counter()
    for name, seconds in times.items():
        by_kind[op_kind(name)] += seconds
    top = sorted(times.items(), key=lambda kv: -kv[1])[:args.top]
    result = {
        "bench": "profile_step", "platform": device.platform, "device": device.device_kind,
        "attention_impl": args.attention_impl, "steps": args.steps, "shape": shape,
        "op_ms_per_step_total": round(total * 1e3 / args.steps, 3),
        "top_ops": [{"op": name, "jax_op": names.get(name, ""), "ms_per_step": round(s * 1e3 / args.steps, 3),
                     "share": round(s / total, 4)} for name, s in top],
        "by_kind": {kind: round(s / total, 4) for kind, s in by_kind.most_common(args.top)},
    }
    return harness.report(result, None, lambda: print_table(result), sort_keys=True)  # printed only: no file


def print_table(result: dict) -> None:
    print(f"top XLA operations of a training step ({result['attention_impl']} attention, {result['device']}), "
          f"{result['op_ms_per_step_total']:.1f} ms of operations per step")
    for row in result["top_ops"]:
        print(f"{row['share']:7.1%}  {row['ms_per_step']:9.3f} ms  {row['op'][:28]:<28}  {row['jax_op'][-110:]}")
    print("by kind: " + ", ".join(f"{k} {v:.1%}" for k, v in result["by_kind"].items()))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--attention-impl", choices=("auto", "blockwise", "flash", "dense"), default="auto")
    parser.add_argument("--quick", action="store_true", help="gpu: 8 layers (bench/model.py --quick's model)")
    parser.add_argument("--steps", type=int, default=3, help="steps traced")
    parser.add_argument("--top", type=int, default=15, help="operations listed")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.top < 1:
        parser.error("--steps and --top must be positive")
    return args


if __name__ == "__main__":
    profile(parse_args())
