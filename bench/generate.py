"""Sampling benchmark: `jodc.models.generate` (KV cache, batched, top-k log-probs for DPPO) in tokens per second on one
GPU, against transformers' `generate` on the same GPU with the same weights (a floor, not a goal) and against the
memory roofline of decoding measured in the same run.

Shape (--platform gpu): the ~1B Llama of bench/model.py (hidden 2048, 16 layers, SwiGLU 8192, 32 heads / 8 KV heads,
vocabulary 32000), bf16, 64 prompts of 128 tokens, 512 new tokens each (no stop token: every row generates all of
them), temperature 1, top-8 log-probs returned (what a DPPO Top-K rollout asks for). `--quick` (make gpu-check): 8
layers, 128 new tokens, 3 repeats.

Roofline: a decode step must read every weight the step multiplies by (all but the embedding table, whose B rows
are gathered) and the KV cache up to the current position, once per step for the whole batch. At the HBM bandwidth
measured here (a device-to-device copy, bench/device_timing.py) that bounds decoding at
    batch / ((weight bytes + mean KV bytes over the steps) / bandwidth)  tokens per second;
the prefill (one forward over the prompts, compute-bound) is left out of the bound, so the fraction reported,
`gpu_generate_vs_roofline`, is a lower bound on the decode loop's efficiency.
transformers runs in a child process, first and alone on the GPU (as in bench/model.py); both sides time whole
`generate` calls up to the device's results, warm-up excluded, medians. Prints a table and one JSON line
(bench/results/generate_gpu.json). `--platform cpu`: a tiny shape, the test of this code path (figures meaningless).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax
import numpy as np

from bench import harness
from bench.device_timing import copy_contender, median_seconds, print_table
from bench.model import hf_config, run_facts, run_transformers_worker

from jodc.models import SamplingParams, generate, load_pretrained, split_params  # noqa: E402

RESULTS = harness.results_path("generate_gpu.json")
SHAPE_KEYS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")
DEFAULTS = {
    "gpu": dict(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, vocab=32000, batch=64, prompt=128,
                new_tokens=512, top_k=8, repeats=5),
    "cpu": dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=512, batch=4, prompt=16,
                new_tokens=16, top_k=4, repeats=2),
}


def decode_bytes(shape: dict, prompt: int, new_tokens: int, batch: int, dtype_bytes: int = 2) -> dict:
    """Bytes a decode step must read: the weights it multiplies by (every projection, the MLP, the norms and the
    lm_head; not the embedding table) and the KV cache up to the current position, averaged over the steps."""
    hidden, layers, heads, kv = shape["hidden"], shape["layers"], shape["heads"], shape["kv_heads"]
    head_dim = hidden // heads
    per_layer = hidden * (heads + 2 * kv) * head_dim + heads * head_dim * hidden + 3 * hidden * shape["intermediate"]
    per_layer += 2 * hidden  # the two norms
    weights = (layers * per_layer + hidden + hidden * shape["vocab"]) * dtype_bytes
    mean_context = prompt + (new_tokens - 1) / 2
    kv_cache = 2 * layers * kv * head_dim * mean_context * batch * dtype_bytes
    return {"weights": weights, "kv_cache_mean": kv_cache, "total": weights + kv_cache}


def transformers_worker(spec_path: str) -> None:
    """The child process: builds the transformers model (seeded, bf16, SDPA), saves its weights for jodc, times its
    `generate` on the given prompts (sampling, every row to max_new_tokens), prints one JSON line."""
    import torch
    from transformers import AutoModelForCausalLM

    with open(spec_path) as f:
        spec = json.load(f)
    device = torch.device(spec["device"])
    torch.manual_seed(spec["seed"])
    with device:
        model = AutoModelForCausalLM.from_config(hf_config({**spec["shape"], "seq": spec["context"]}),
                                                 dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    model.save_pretrained(spec["weights_dir"])
    prompts = torch.from_numpy(np.load(spec["prompts"]).astype(np.int64)).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds, generated = [], 0
    with torch.no_grad():
        for i in range(spec["warmup"] + spec["repeats"]):
            t0 = time.perf_counter()
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=spec["new_tokens"],
                                 min_new_tokens=spec["new_tokens"], pad_token_id=0)
            sync()
            if i >= spec["warmup"]:
                seconds.append(time.perf_counter() - t0)
            generated = out.shape[1] - prompts.shape[1]
    print(json.dumps({
        "seconds": seconds, "generated_per_row": int(generated),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
    }))


def both_models(args, shape: dict, prompts, device):
    """transformers' side run in its worker on `prompts` (its timings), and our model loaded from the same weights
    onto `device`: (theirs, our config, our params)."""
    with tempfile.TemporaryDirectory() as tmp:
        np.save(os.path.join(tmp, "prompts.npy"), prompts)
        theirs = run_transformers_worker({
            "shape": shape, "device": "cuda" if args.platform == "gpu" else "cpu", "seed": 0, "weights_dir": tmp,
            "prompts": os.path.join(tmp, "prompts.npy"), "new_tokens": args.new_tokens,
            "context": args.prompt + args.new_tokens, "warmup": 1, "repeats": args.repeats,
        }, args.worker_timeout, module="generate")
        ours = load_pretrained(tmp, dtype="bfloat16")
    return theirs, ours.config, jax.device_put(split_params(ours), device)


def generate_rows(args, result: dict) -> list:
    """The comparison's table."""
    n_tokens = args.batch * args.new_tokens
    ours_s, theirs_s = result["ours_seconds"], result["transformers_seconds"]
    roofline_tokens_per_s, bandwidth = result["roofline_tokens_per_s"], result["hbm_copy_gb_per_s"] * 1e9
    rows = [
        ("model", f"{args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab}, bf16"),
        ("batch x new tokens (prompt)", f"{args.batch} x {args.new_tokens} ({args.prompt})"),
        ("jodc generate (tokens/s)", f"{n_tokens / ours_s:,.0f}"),
        ("transformers generate (tokens/s)", f"{n_tokens / theirs_s:,.0f}"),
        ("decode roofline at the measured bandwidth (tokens/s)", f"{roofline_tokens_per_s:,.0f}"),
        ("HBM copy bandwidth (GB/s)", f"{bandwidth / 1e9:,.0f}"),
        ("gpu_generate_vs_transformers (floor 1.0)", f"{result['gpu_generate_vs_transformers']:.3f}"),
        ("gpu_generate_vs_roofline", f"{result['gpu_generate_vs_roofline']:.3f}"),
    ]
    return rows


def run(args) -> dict:
    """Our sampling against transformers' generate on the same device and weights, and the decode roofline."""
    shape = {k: getattr(args, k) for k in SHAPE_KEYS}
    if shape["hidden"] % shape["heads"] or shape["heads"] % shape["kv_heads"]:
        raise SystemExit("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    device = jax.devices(args.platform)[0]
    prompts = np.random.default_rng(0).integers(1, args.vocab, (args.batch, args.prompt)).astype(np.int32)
    theirs, config, params = both_models(args, shape, prompts, device)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, top_k_logprobs=args.top_k,
                              prompt_bucket=args.prompt)
    key = jax.random.PRNGKey(0)
    prompt_lists = prompts.tolist()

    def sample():
        return generate(config, prompt_lists, key=key, sampling=sampling, params=params)

    first = jax.block_until_ready(sample())
    if int(np.min(np.asarray(first.lengths))) != args.new_tokens:
        raise SystemExit(f"our rows generated {np.asarray(first.lengths).tolist()} tokens, not {args.new_tokens} each: "
                         "nothing comparable to time")
    if theirs["generated_per_row"] != args.new_tokens:
        raise SystemExit(f"transformers generated {theirs['generated_per_row']} tokens per row, not {args.new_tokens}")
    # The memory ceiling: a copy large enough to leave the caches (256 MiB of fp32 on a GPU), two per program.
    copy, copy_bytes = copy_contender((1 << 26) if args.platform == "gpu" else (1 << 20), 2, device)
    timed = median_seconds({"ours": sample, "copy": copy}, args.repeats, warmup=1)
    ours_s, theirs_s = timed["ours"], float(np.median(theirs["seconds"]))
    bandwidth = 2 * copy_bytes / timed["copy"]
    need = decode_bytes(shape, args.prompt, args.new_tokens, args.batch)
    roofline_tokens_per_s = args.batch / (need["total"] / bandwidth)
    n_tokens = args.batch * args.new_tokens
    result = {
        **harness.device_block("generate_gpu", device),
        "gpu_generate_tokens_per_s": round(n_tokens / ours_s, 1),
        "gpu_generate_vs_transformers": round(theirs_s / ours_s, 4),
        "gpu_generate_vs_roofline": round((n_tokens / ours_s) / roofline_tokens_per_s, 4),
        "transformers_tokens_per_s": round(n_tokens / theirs_s, 1),
        "roofline_tokens_per_s": round(roofline_tokens_per_s, 1),
        "hbm_copy_gb_per_s": round(bandwidth / 1e9, 1),
        "ours_seconds": round(ours_s, 4),
        "transformers_seconds": round(theirs_s, 4),
        "decode_bytes_per_step": need,
        "config": {**shape, "batch": args.batch, "prompt": args.prompt, "new_tokens": args.new_tokens,
                   "top_k_logprobs": args.top_k, "temperature": 1.0, "dtype": "bfloat16",
                   "attention_impl": config.attention_impl},
        **run_facts(args, theirs),
    }
    return harness.report(result, args.out, lambda: print_table(f"sampling, bf16, on {device.device_kind}",
                                                                 generate_rows(args, result)), sort_keys=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platform", choices=("gpu", "cpu"), default="gpu",
                        help="gpu: the ~1B model on one GPU; cpu: a tiny smoke test of the code path")
    for key in (*SHAPE_KEYS, "batch", "prompt", "new_tokens", "top_k", "repeats"):
        parser.add_argument(f"--{key.replace('_', '-')}", type=int)
    parser.add_argument("--quick", action="store_true", help="gpu: 8 layers, 128 new tokens, 3 repeats (gpu-check)")
    parser.add_argument("--worker-timeout", type=float, default=900.0, help="seconds for the transformers side")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/generate_gpu.json on a GPU)")
    parser.add_argument("--transformers-worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = {"layers": 8, "new_tokens": 128, "repeats": 3} if args.quick else {}
    harness.fill_unset(args, quick, DEFAULTS[args.platform])
    if args.out is None and args.platform == "gpu" and not args.transformers_worker:
        args.out = RESULTS
    if any(getattr(args, k) <= 0 for k in (*SHAPE_KEYS, "batch", "prompt", "new_tokens", "repeats")) \
            or args.top_k < 0:
        parser.error("shapes, --new-tokens and --repeats must be positive, --top-k >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    return transformers_worker(args.transformers_worker) if args.transformers_worker else run(args)


if __name__ == "__main__":
    main()
