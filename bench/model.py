"""Model benchmark: our decoder's training step against transformers + torch, on the CPU (default) or on one GPU.

--device cpu (the committed bench/results/model.json):
1. train_step_vs_transformers: forward+backward (next-token cross-entropy, gradients of every parameter) of the
   same Llama configuration and the same weights in jodc.models (jax.jit) and in transformers (PyTorch eager,
   default SDPA attention), fp32, same number of threads. Reported as our tokens/s over theirs.
2. packed_short_vs_long_cost: time of the blockwise attention forward+backward on a row of 16 sequences x 64
   tokens over one 1024-token sequence (same tokens, same heads). The same ratio for one whole decoder layer
   and for the whole model is reported too (there the projections, MLP and lm_head cost the same for both
   rows, so the ratio is diluted).

Each timing is the median of repeats, with the two sides interleaved so load changes hit both; the ratio of
process CPU time per step is reported too (train_step_cpu_time_ratio), since wall time on a shared 2-core
machine swings with other people's jobs. Prints a table and one JSON line, and writes the JSON to
bench/results/model.json.

--device gpu (bench/results/model_gpu.json): the same step in bf16 (parameters, activations and gradients; logits
and loss fp32) at ~1B parameters (hidden 2048, 16 layers, SwiGLU 8192, 32 heads / 8 KV heads, vocabulary 32000,
one 4096-token sequence) on one GPU: ours (jax.jit; once per attention implementation of `--attention-impls`: the
fused Pallas flash kernel, the headline, and the blockwise path with `--attention-block-size`) against transformers + torch (eager, SDPA attention, bf16) with the same shapes and the same weights (transformers
initialises them, saves a checkpoint, jodc loads it; both losses are printed and must agree). Reported: tokens/s of
both, their ratio (gpu_train_step_vs_transformers), and the model FLOP utilisation of both against the bf16 matmul
ceiling measured in the same run (gpu_mfu). FLOPs per step are counted as 6 x (matmul parameters: every projection,
the MLP and the lm_head; not the embedding lookup) x tokens, plus causal attention: 6 x T^2 x heads x head_dim per
layer and sequence (the QK^T and PV products over the causal half, forward + backward).
transformers runs in a child process, first and alone on the GPU: each framework gets the whole GPU with its own
allocator (JAX preallocates 75% of it), and torch's CUDA libraries never meet the JAX plugin's in one process.
Wall time up to the device's results (block_until_ready / torch.cuda.synchronize), warm-up excluded, medians.
`--quick` (make gpu-check) takes 8 layers (0.6B parameters: XLA compiles a 16-layer step for most of a minute) and 5
repeats; the JSON's `config`, `params` and `quick` say what ran.
`--platform cpu` runs this GPU benchmark on the CPU at a tiny shape (the test of its code path; figures meaningless).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

# torch and transformers are imported where they are used (the transformers side, in its child process on a GPU), so
# that the tools reusing this module's step (profile_step.py, generate.py) run where torch is not installed.
from bench import harness
from bench.device_timing import interleaved_times, matmul_tflops, print_table
from jodc.models import attention, forward, layer_apply, load_pretrained, split_params

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
RESULTS = os.path.join(RESULTS_DIR, "model.json")
SHAPE_KEYS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "batch", "seq")
QUICK_LAYERS = 8  # --device gpu --quick: half the layers, half the compile time (the step's shapes stay the same)
DEFAULTS = {  # per --device: the model and batch shape, repeats, the blockwise attention's block
    "cpu": dict(layers=4, hidden=256, intermediate=1024, heads=8, kv_heads=2, vocab=32000, batch=4, seq=1024,
                repeats=5, attention_block_size=None),
    "gpu": dict(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, vocab=32000, batch=1, seq=4096,
                repeats=10, attention_block_size=512),
}


def interleaved(fns: dict, repeats: int, warmup: int = 1) -> tuple[dict, dict]:
    """Median wall seconds and median process CPU seconds per call of each fn, calling them round-robin so
    load changes on the shared machine hit all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    wall = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - start_wall)
            cpu[name].append(time.process_time() - start_cpu)
    return ({name: statistics.median(s) for name, s in wall.items()},
            {name: statistics.median(s) for name, s in cpu.items()})


def next_token_loss(logits_btv, tokens_bt):
    """Mean cross-entropy of predicting token t+1 from position t (fp32): logsumexp minus the label's logit,
    with the last position masked out (no [B, T-1, V] slice copy, no materialised log-softmax)."""
    b, t, _ = logits_btv.shape
    logits = logits_btv.astype(jnp.float32)
    labels = jnp.roll(tokens_bt, -1, axis=1)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    has_label = (jnp.arange(t) < t - 1).astype(jnp.float32)[None, :]
    return jnp.sum((jax.nn.logsumexp(logits, axis=-1) - picked) * has_label) / (b * (t - 1))


def hf_config(shape: dict):
    """The transformers Llama configuration of a benchmark shape (untied embeddings, like ours)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=max(4096, shape["seq"]), tie_word_embeddings=False,
    )


def transformers_step(model, tokens):
    """transformers' training step: forward with labels (its own shifted cross-entropy), backward; the loss."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.detach()


def our_step_fn(config):
    """Our training step: loss and gradients of every parameter, jitted."""
    @jax.jit
    def step(params, tokens_bt):
        return jax.value_and_grad(lambda p: next_token_loss(forward(config, p, tokens_bt), tokens_bt))(params)
    return step


def cpu_models(args):
    """transformers' model (seeded, float32, training mode) and ours loaded from its weights: (theirs, ours)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(hf_config(vars(args)), dtype=torch.float32)
    theirs.train()
    with tempfile.TemporaryDirectory() as tmp:
        theirs.save_pretrained(tmp)
        ours = load_pretrained(tmp, dtype="float32")
    return theirs, ours


def packed_costs(args, config, params, tokens_jax, rng) -> tuple[dict, int]:
    """Seconds of attention, one layer and the whole model (forward + backward) over one long sequence and over
    the same tokens packed as short ones; and how many short ones that is."""
    n_short = args.seq // args.short
    seg_long = jnp.ones((1, args.seq), jnp.int32)
    seg_packed = jnp.asarray(np.repeat(np.arange(1, n_short + 1), args.short)[None], jnp.int32)
    q = jnp.asarray(rng.standard_normal((1, args.seq, config.num_heads, config.head_dim)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((1, args.seq, config.num_kv_heads, config.head_dim)), jnp.float32)

    @jax.jit
    def attention_fwd_bwd(q, k, v, seg):
        fn = lambda q, k, v: jnp.sum(jnp.square(attention(q, k, v, seg, impl=config.attention_impl,
                                                          block_size=config.attention_block_size)))
        return jax.grad(fn, argnums=(0, 1, 2))(q, k, v)

    h = jnp.asarray(rng.standard_normal((1, args.seq, config.hidden_size)), jnp.float32)

    @jax.jit
    def layer_fwd_bwd(layer_params, h, seg):
        return jax.grad(lambda p, h: jnp.sum(jnp.square(layer_apply(config, p, h, None, seg))), argnums=(0, 1))(
            layer_params, h)

    one_row = tokens_jax[:1]

    @jax.jit
    def model_fwd_bwd(params, seg):
        return jax.grad(lambda p: next_token_loss(forward(config, p, one_row, None, seg), one_row))(params)

    layer0 = params["layer_0"]
    cost, _ = interleaved({
        "attention_long": lambda: jax.block_until_ready(attention_fwd_bwd(q, kv, kv, seg_long)),
        "attention_packed": lambda: jax.block_until_ready(attention_fwd_bwd(q, kv, kv, seg_packed)),
        "layer_long": lambda: jax.block_until_ready(layer_fwd_bwd(layer0, h, seg_long)),
        "layer_packed": lambda: jax.block_until_ready(layer_fwd_bwd(layer0, h, seg_packed)),
        "model_long": lambda: jax.block_until_ready(model_fwd_bwd(params, seg_long)),
        "model_packed": lambda: jax.block_until_ready(model_fwd_bwd(params, seg_packed)),
    }, args.repeats)

    return cost, n_short


def cpu_benchmark(args):
    import torch

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    theirs, ours = cpu_models(args)
    config = ours.config
    params = split_params(ours)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq)).astype(np.int32)
    tokens_jax, tokens_torch = jnp.asarray(tokens), torch.from_numpy(tokens.astype(np.int64))

    # 1. training step (loss + gradients)
    our_step = our_step_fn(config)

    def run_ours():
        jax.block_until_ready(our_step(params, tokens_jax))

    def run_theirs():
        return transformers_step(theirs, tokens_torch)

    our_loss = float(our_step(params, tokens_jax)[0])
    their_loss = float(run_theirs())
    step, step_cpu = interleaved({"ours": run_ours, "theirs": run_theirs}, args.repeats)
    n_tokens = args.batch * args.seq
    ours_tps, theirs_tps = n_tokens / step["ours"], n_tokens / step["theirs"]
    # 2. packed short sequences vs one long sequence
    cost, n_short = packed_costs(args, config, params, tokens_jax, rng)
    result = {
        "bench": "model",
        "train_step_vs_transformers": round(ours_tps / theirs_tps, 3),
        "packed_short_vs_long_cost": round(cost["attention_packed"] / cost["attention_long"], 3),
        "packed_short_vs_long_layer_cost": round(cost["layer_packed"] / cost["layer_long"], 3),
        "packed_short_vs_long_model_cost": round(cost["model_packed"] / cost["model_long"], 3),
        "train_step_cpu_time_ratio": round(step_cpu["theirs"] / step_cpu["ours"], 3),
        "ours_tokens_per_s": round(ours_tps, 1),
        "transformers_tokens_per_s": round(theirs_tps, 1),
        "loss_ours": round(our_loss, 5),
        "loss_transformers": round(their_loss, 5),
        "config": {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                   "heads": args.heads, "kv_heads": args.kv_heads, "vocab": args.vocab, "batch": args.batch,
                   "seq": args.seq, "short": args.short, "dtype": "float32",
                   "attention_block_size": config.attention_block_size},
        "threads": args.threads,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "repeats": args.repeats,
        "versions": {"jax": jax.__version__, "torch": torch.__version__.split("+")[0],
                     "python": platform.python_version()},
    }
    print_table(None, cpu_rows(args, result, cost, n_short), value_width=15)
    save(result, args)


def cpu_rows(args, result: dict, cost: dict, n_short: int) -> list[tuple[str, str]]:
    """The CPU comparison's table."""
    return [
        ("train step, ours (tokens/s)", f"{result['ours_tokens_per_s']:,.0f}"),
        ("train step, transformers (tokens/s)", f"{result['transformers_tokens_per_s']:,.0f}"),
        ("train_step_vs_transformers (target >= 1.0)", f"{result['train_step_vs_transformers']:.3f}"),
        ("same, by process CPU time (theirs / ours)", f"{result['train_step_cpu_time_ratio']:.3f}"),
        ("loss ours / transformers", f"{result['loss_ours']:.5f} / {result['loss_transformers']:.5f}"),
        (f"attention fwd+bwd, 1 x {args.seq} (ms)", f"{cost['attention_long'] * 1e3:.1f}"),
        (f"attention fwd+bwd, {n_short} x {args.short} packed (ms)", f"{cost['attention_packed'] * 1e3:.1f}"),
        ("packed_short_vs_long_cost (target <= 0.35)", f"{result['packed_short_vs_long_cost']:.3f}"),
        ("same, one decoder layer", f"{result['packed_short_vs_long_layer_cost']:.3f}"),
        ("same, whole model (incl. lm_head)", f"{result['packed_short_vs_long_model_cost']:.3f}"),
    ]


def save(result: dict, args) -> None:
    """Prints the JSON line (the last line of output) and writes it to args.out unless --no-save."""
    harness.report(result, None if args.no_save else args.out, indent=None, sort_keys=True)



# ---------------------------------------------------------------------------------------------------------------
# --device gpu


def step_flops(shape: dict) -> dict:
    """Model FLOPs of one training step (forward + backward) of a benchmark shape: 6 x matmul parameters x tokens
    (q, k, v, o, gate, up, down of every layer and the lm_head; the embedding lookup does no multiply-adds) plus
    causal attention, 6 x T^2 x heads x head_dim per layer and sequence (QK^T and PV over the causal half, the
    backward twice the forward)."""
    d, f, layers, heads, kv = shape["hidden"], shape["intermediate"], shape["layers"], shape["heads"], shape["kv_heads"]
    head_dim = d // heads
    per_layer = d * heads * head_dim + 2 * d * kv * head_dim + heads * head_dim * d + 3 * d * f
    matmul_params = layers * per_layer + d * shape["vocab"]
    tokens = shape["batch"] * shape["seq"]
    dense = 6 * matmul_params * tokens
    attention_flops = 6 * shape["batch"] * shape["seq"] ** 2 * heads * head_dim * layers
    return {"matmul_params": matmul_params, "params": matmul_params + shape["vocab"] * d + (2 * layers + 1) * d,
            "dense": dense, "attention": attention_flops, "total": dense + attention_flops}


last_json_line = harness.last_json_line  # the reader make gpu-check uses on the same output


def run_facts(args, theirs: dict) -> dict:
    """The JSON keys every GPU comparison with transformers reports besides its figures: quick or not, repeats, the
    transformers side's peak memory, and the versions of both sides."""
    return {"quick": bool(args.quick), "repeats": args.repeats, "transformers_peak_gib": theirs["peak_gib"],
            "versions": {"jax": jax.__version__, "torch": theirs["torch"], "transformers": theirs["transformers"],
                         "python": platform.python_version()}}


def run_transformers_worker(spec: dict, timeout_s: float, module: str = "model") -> dict:
    """Runs `python -m bench.<module> --transformers-worker SPEC` (this module's `transformers_worker`, or another
    benchmark's) in a child process (see the module docstring for why); returns its JSON line."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        proc = subprocess.run(harness.module_command(module, "--transformers-worker", f.name), capture_output=True,
                              text=True, timeout=timeout_s, env=harness.child_env())
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        raise RuntimeError(f"the transformers worker failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return last_json_line(proc.stdout)


def transformers_worker(spec_path: str) -> None:
    """The child process: builds the transformers model (seeded, bf16, SDPA) on the device, saves its weights for
    jodc, times its training step on the given tokens, prints one JSON line."""
    import torch
    from transformers import AutoModelForCausalLM

    with open(spec_path) as f:
        spec = json.load(f)
    device = torch.device(spec["device"])
    torch.manual_seed(spec["seed"])
    with device:
        model = AutoModelForCausalLM.from_config(hf_config(spec["shape"]), dtype=getattr(torch, spec["dtype"]),
                                                 attn_implementation="sdpa")
    model.train()
    model.save_pretrained(spec["weights_dir"])
    tokens = torch.from_numpy(np.load(spec["tokens"]).astype(np.int64)).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds, loss = [], None
    for i in range(spec["warmup"] + spec["repeats"]):
        t0 = time.perf_counter()
        loss = transformers_step(model, tokens)
        sync()
        if i >= spec["warmup"]:
            seconds.append(time.perf_counter() - t0)
    print(json.dumps({
        "seconds": seconds, "loss": float(loss), "attention": model.config._attn_implementation,
        "params": sum(p.numel() for p in model.parameters()),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
    }))


def our_steps(config, params, tokens, impls, their_loss: float) -> tuple[dict, dict, dict]:
    """Our compiled step per attention implementation in `impls`, its loss, and why any failed to compile (a first
    GPU run: one failing leaves the others); SystemExit when none compiles or a loss is not transformers' (then the
    two sides do not run the same model and weights)."""
    steps, losses, failures = {}, {}, {}
    for impl in impls:  # one implementation failing to compile (a first GPU run) leaves the others
        try:
            step = our_step_fn(config.replace(attention_impl=impl))
            losses[impl] = float(step(params, tokens)[0])
            steps[impl] = step
        except Exception as e:  # noqa: BLE001 - reported in the JSON and the table, then the others go on
            failures[impl] = f"{type(e).__name__}: {str(e)[:500]}"
            print(f"our step with {impl} attention failed: {failures[impl]}", file=sys.stderr)
    if not steps:
        raise SystemExit(f"our step failed with every attention implementation: {failures}")
    for impl, loss in losses.items():
        if not abs(loss - their_loss) <= 0.02 * abs(their_loss):
            raise SystemExit(f"losses differ: ours ({impl} attention) {loss:.5f}, transformers {their_loss:.5f}: "
                             "not the same model or not the same weights, nothing to compare")
    return steps, losses, failures


def gpu_rows(args, result: dict, flops: dict, by_impl: dict, failures: dict, ceiling: dict) -> list:
    """The GPU comparison's table."""
    n_tokens = args.batch * args.seq
    ours_s, theirs_s = result["ours_step_ms"] / 1e3, result["transformers_step_ms"] / 1e3
    our_loss, their_loss = result["loss_ours"], result["loss_transformers"]
    rows = [
        ("model", f"{flops['params'] / 1e9:.3f}B params, {args.layers} layers, hidden {args.hidden}"),
        ("tokens per step", f"{args.batch} x {args.seq}"),
        *((f"train step, ours, {impl} attention (ms)", f"{t * 1e3:.1f}") for impl, t in by_impl.items()),
        *((f"train step, ours, {impl} attention", "FAILED (see the JSON)") for impl in failures),
        ("train step, transformers + torch SDPA (ms)", f"{theirs_s * 1e3:.1f}"),
        ("ours (tokens/s)", f"{n_tokens / ours_s:,.0f}"),
        ("transformers (tokens/s)", f"{n_tokens / theirs_s:,.0f}"),
        ("gpu_train_step_vs_transformers (target >= 1.0)", f"{result['gpu_train_step_vs_transformers']:.3f}"),
        (f"bf16 matmul ceiling {args.matmul}^3 (TFLOP/s)", f"{ceiling['tflops']:.1f}"),
        ("MFU ours / transformers", f"{result['gpu_mfu']:.3f} / {result['transformers_mfu']:.3f}"),
        ("loss ours / transformers", f"{our_loss:.5f} / {their_loss:.5f}"),
    ]
    return rows


def gpu_benchmark(args) -> dict:
    """Our bf16 training step (per attention implementation) against transformers' on the same GPU and weights."""
    shape = {k: getattr(args, k) for k in SHAPE_KEYS}
    if shape["hidden"] % shape["heads"]:
        raise SystemExit(f"--hidden {shape['hidden']} must be a multiple of --heads {shape['heads']}")
    device = jax.devices(args.platform)[0]
    tokens = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq)).astype(np.int32)
    with tempfile.TemporaryDirectory() as tmp:
        np.save(os.path.join(tmp, "tokens.npy"), tokens)
        theirs = run_transformers_worker({
            "shape": shape, "dtype": "bfloat16", "device": "cuda" if args.platform == "gpu" else "cpu", "seed": 0,
            "weights_dir": tmp, "tokens": os.path.join(tmp, "tokens.npy"), "warmup": 2, "repeats": args.repeats,
        }, args.worker_timeout)
        ours = load_pretrained(tmp, dtype="bfloat16", attention_block_size=args.attention_block_size)
    config, params = ours.config, jax.device_put(split_params(ours), device)
    del ours
    tokens_dev = jax.device_put(jnp.asarray(tokens), device)
    steps, losses, failures = our_steps(config, params, tokens_dev, args.attention_impls, theirs["loss"])
    times = interleaved_times({impl: (lambda step=step: step(params, tokens_dev)) for impl, step in steps.items()},
                              args.repeats, warmup=2)
    by_impl = {impl: harness.median(t) for impl, t in times.items()}
    headline = next(iter(steps))  # the first named that ran: what `auto` picks on this backend by default
    ours_s, our_loss, theirs_s = by_impl[headline], losses[headline], harness.median(theirs["seconds"])
    ceiling = matmul_tflops(args.matmul, 2 if args.quick else 4, args.repeats, device)
    flops = step_flops(shape)
    n_tokens = args.batch * args.seq
    result = {
        **harness.device_block("model_gpu", device),
        "gpu_train_step_vs_transformers": round(theirs_s / ours_s, 4),
        "gpu_mfu": round(flops["total"] / ours_s / (ceiling["tflops"] * 1e12), 4),
        "transformers_mfu": round(flops["total"] / theirs_s / (ceiling["tflops"] * 1e12), 4),
        "ours_tokens_per_s": round(n_tokens / ours_s, 1),
        "transformers_tokens_per_s": round(n_tokens / theirs_s, 1),
        "ours_step_ms": round(ours_s * 1e3, 3),
        "ours_step_ms_by_attention": {impl: round(t * 1e3, 3) for impl, t in by_impl.items()},
        "attention_failures": failures,
        "transformers_step_ms": round(theirs_s * 1e3, 3),
        "loss_ours": round(our_loss, 5),
        "loss_transformers": round(theirs["loss"], 5),
        "matmul_bf16_tflops": float(f"{ceiling['tflops']:.4g}"),
        "matmul_n": ceiling["n"],
        "flops_per_step": flops["total"],
        "attention_flops_per_step": flops["attention"],
        "params": flops["params"],
        "params_transformers": theirs["params"],
        "config": {**shape, "dtype": "bfloat16", "attention_impl": headline,
                   "attention_block_size": config.attention_block_size,
                   "transformers_attention": theirs["attention"], "sequences_per_row": 1},
        "transformers_device": theirs["device"],
        "target": {"gpu_train_step_vs_transformers": 1.0},
        **({"gpu_flash_vs_blockwise": round(by_impl["blockwise"] / by_impl["flash"], 4)}
           if {"flash", "blockwise"} <= set(by_impl) else {}),
        **run_facts(args, theirs),
    }
    print_table(f"training step, bf16, on {device.device_kind}",
                gpu_rows(args, result, flops, by_impl, failures, ceiling))
    save(result, args)
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="cpu: the fp32 CPU benchmark; gpu: the bf16 benchmark at ~1B parameters on one GPU")
    parser.add_argument("--platform", choices=("gpu", "cpu"), default="gpu",
                        help="--device gpu only: where it runs (cpu: tiny smoke test of the code path)")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--intermediate", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--short", type=int, default=64, help="cpu: length of each packed sequence")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--attention-block-size", type=int, help="gpu: the blockwise attention's block (512)")
    parser.add_argument("--attention-impls", type=lambda s: s.split(","), default=None, metavar="LIST",
                        help="gpu: our step with each of these attention implementations, the first as the headline "
                             "(default flash,blockwise on a GPU; blockwise with --platform cpu, where flash runs "
                             "in Pallas' interpret mode)")
    parser.add_argument("--matmul", type=int, help="gpu: n of the bf16 n^3 matmul ceiling (8192; 256 on --platform cpu)")
    parser.add_argument("--quick", action="store_true",
                        help=f"gpu: {QUICK_LAYERS} layers (0.6B parameters) unless --layers, 5 repeats: for make gpu-check")
    parser.add_argument("--worker-timeout", type=float, default=600.0, help="gpu: seconds for the transformers side")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="cpu: threads of both sides")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/model.json or model_gpu.json)")
    parser.add_argument("--no-save", action="store_true", help="do not write the JSON file")
    parser.add_argument("--transformers-worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick and args.device == "gpu" and args.layers is None:
        args.layers = QUICK_LAYERS
    harness.fill_unset(args, DEFAULTS[args.device])
    if args.attention_impls is None:
        args.attention_impls = ["flash", "blockwise"] if args.platform == "gpu" else ["blockwise"]
    unknown = set(args.attention_impls) - {"blockwise", "flash", "dense"}
    if unknown:
        parser.error(f"--attention-impls: unknown {sorted(unknown)}; choose from blockwise, flash, dense")
    if args.matmul is None:
        args.matmul = 8192 if args.platform == "gpu" else 256
    if args.quick and args.device == "gpu":
        args.repeats = min(args.repeats, 5)
    if args.out is None:
        args.out = RESULTS if args.device == "cpu" else os.path.join(RESULTS_DIR, "model_gpu.json")
    if any(getattr(args, k) <= 0 for k in SHAPE_KEYS) or args.repeats < 1:
        parser.error("shapes and --repeats must be positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.transformers_worker:
        return transformers_worker(args.transformers_worker)
    return cpu_benchmark(args) if args.device == "cpu" else gpu_benchmark(args)


if __name__ == "__main__":
    main()
