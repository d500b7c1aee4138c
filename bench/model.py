"""Model benchmark (CPU): our decoder's training step against transformers, and the cost of packed attention.

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
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from jodc.models import attention, forward, layer_apply, load_pretrained, split_params

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "model.json")


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--short", type=int, default=64, help="length of each packed sequence")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)

    hf_config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(4096, args.seq), tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    theirs.train()
    with tempfile.TemporaryDirectory() as tmp:
        theirs.save_pretrained(tmp)
        ours = load_pretrained(tmp, dtype="float32")
    config = ours.config
    params = split_params(ours)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq)).astype(np.int32)
    tokens_jax, tokens_torch = jnp.asarray(tokens), torch.from_numpy(tokens.astype(np.int64))

    # 1. training step (loss + gradients)
    @jax.jit
    def our_step(params, tokens_bt):
        return jax.value_and_grad(lambda p: next_token_loss(forward(config, p, tokens_bt), tokens_bt))(params)

    def run_ours():
        jax.block_until_ready(our_step(params, tokens_jax))

    def run_theirs():
        theirs.zero_grad(set_to_none=True)
        loss = theirs(input_ids=tokens_torch, labels=tokens_torch).loss
        loss.backward()
        return loss.detach()

    our_loss = float(our_step(params, tokens_jax)[0])
    their_loss = float(run_theirs())
    step, step_cpu = interleaved({"ours": run_ours, "theirs": run_theirs}, args.repeats)
    n_tokens = args.batch * args.seq
    ours_tps, theirs_tps = n_tokens / step["ours"], n_tokens / step["theirs"]

    # 2. packed short sequences vs one long sequence
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
    rows = [
        ("train step, ours (tokens/s)", f"{ours_tps:,.0f}"),
        ("train step, transformers (tokens/s)", f"{theirs_tps:,.0f}"),
        ("train_step_vs_transformers (target >= 1.0)", f"{result['train_step_vs_transformers']:.3f}"),
        ("same, by process CPU time (theirs / ours)", f"{result['train_step_cpu_time_ratio']:.3f}"),
        ("loss ours / transformers", f"{our_loss:.5f} / {their_loss:.5f}"),
        (f"attention fwd+bwd, 1 x {args.seq} (ms)", f"{cost['attention_long'] * 1e3:.1f}"),
        (f"attention fwd+bwd, {n_short} x {args.short} packed (ms)", f"{cost['attention_packed'] * 1e3:.1f}"),
        ("packed_short_vs_long_cost (target <= 0.35)", f"{result['packed_short_vs_long_cost']:.3f}"),
        ("same, one decoder layer", f"{result['packed_short_vs_long_layer_cost']:.3f}"),
        ("same, whole model (incl. lm_head)", f"{result['packed_short_vs_long_model_cost']:.3f}"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value:>15}")
    line = json.dumps(result, sort_keys=True)
    print(line)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    main()
