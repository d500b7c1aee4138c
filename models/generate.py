"""Batched sampling with a KV cache, compiled as one `jax.jit` program, for RL rollouts.

Layout: prompts of different lengths are left-padded to a common width P (rounded up to `prompt_bucket` so
few widths get compiled), so every row's last prompt token sits in column P - 1 and new token t of every row is
written to column P + t of the cache. Each row's positions start at 0 at its first real token. The prompt is
run once (prefill) through the same layer functions as training (`attention_inputs` / `layer_output`, with the
configured attention; left padding is segment 0), then one token per step attends to the cache under a mask
of that row's valid columns.

Sampling distribution: logits / temperature, restricted to the top-p nucleus (the smallest set of most likely
tokens whose probability reaches top_p; ties at the boundary are kept), renormalised. temperature == 0 means
greedy (argmax); its reported log-probs are then those of the untempered model distribution. Tokens outside
the nucleus have log-prob -inf. The optional top-K list (for DPPO Top-K) holds the K most likely token ids
under the sampling distribution and their log-probs, with the sampled token forced in: if it is not among the
K, it replaces the K-th entry.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .attention import attention, masked_attention
from .config import DecoderConfig
from .decoder import Decoder, split_params
from .layerwise import EMBED, HEAD, attention_inputs, embed_apply, head_apply, layer_group_name, layer_output


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample. Hashable: it is a static argument of the compiled sampler.

    max_new_tokens: tokens generated per row (fewer when a stop token ends the row, or all rows stop).
    temperature: softmax temperature; 0 = greedy.
    top_p: nucleus size in (0, 1]; 1 = no truncation.
    stop_token_ids: a row stops after sampling one of these (the stop token is returned and counted).
    top_k_logprobs: K for the returned top-K ids / log-probs (0 = do not return them).
    pad_token_id: fills token slots after a row stopped.
    prompt_bucket: prompt width is rounded up to a multiple of this.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    top_k_logprobs: int = 0
    pad_token_id: int = 0
    prompt_bucket: int = 16

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k_logprobs, int) or self.top_k_logprobs < 0:
            raise ValueError(f"top_k_logprobs must be an int >= 0, got {self.top_k_logprobs!r}")
        if not isinstance(self.prompt_bucket, int) or self.prompt_bucket <= 0:
            raise ValueError(f"prompt_bucket must be a positive int, got {self.prompt_bucket!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


class Generation(NamedTuple):
    """Sampler output. N = max_new_tokens; entries after a row's stop hold pad_token_id and log-prob 0."""

    tokens: jax.Array  # int32 [B, N]
    logprobs: jax.Array  # fp32 [B, N], log-prob of each token under the sampling distribution
    lengths: jax.Array  # int32 [B], generated tokens per row (including the stop token)
    topk_ids: jax.Array | None  # int32 [B, N, K] or None
    topk_logprobs: jax.Array | None  # fp32 [B, N, K] or None


def sampling_logprobs(logits_bv: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """Log-probs [B, V] of the sampling distribution (see the module docstring); -inf outside the nucleus."""
    logits = logits_bv.astype(jnp.float32)
    if temperature == 0:
        return jax.nn.log_softmax(logits, axis=-1)
    scaled = logits / temperature
    logprobs = jax.nn.log_softmax(scaled, axis=-1)
    if top_p >= 1:
        return logprobs
    sorted_logprobs = -jnp.sort(-logprobs, axis=-1)  # descending
    sorted_probs = jnp.exp(sorted_logprobs)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    n_keep = jnp.maximum(jnp.sum(mass_before < top_p, axis=-1), 1)
    cutoff = jnp.take_along_axis(sorted_logprobs, (n_keep - 1)[:, None], axis=-1)
    return jax.nn.log_softmax(jnp.where(logprobs >= cutoff, scaled, -jnp.inf), axis=-1)


def sample_tokens(logits_bv, keys_b, sampling: SamplingParams):
    """One sampling step: token [B], its log-prob [B], and (top-K ids, log-probs) or (None, None). Row b draws
    with its own key `keys_b[b]`, so its token does not depend on which other rows share the batch."""
    logprobs = sampling_logprobs(logits_bv, sampling.temperature, sampling.top_p)
    if sampling.temperature == 0:
        token = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    else:
        token = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys_b, logprobs).astype(jnp.int32)
    token_logprob = jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
    if sampling.top_k_logprobs == 0:
        return token, token_logprob, None, None
    top_logprobs, top_ids = jax.lax.top_k(logprobs, sampling.top_k_logprobs)
    top_ids = top_ids.astype(jnp.int32)
    present = jnp.any(top_ids == token[:, None], axis=-1)
    top_ids = top_ids.at[:, -1].set(jnp.where(present, top_ids[:, -1], token))
    top_logprobs = top_logprobs.at[:, -1].set(jnp.where(present, top_logprobs[:, -1], token_logprob))
    return token, token_logprob, top_ids, top_logprobs


def prefill(config, params, tokens_bp, lengths_b, cache_len):
    """Run the left-padded prompts; return last-column logits [B, V] and the KV cache (per-layer (k, v))."""
    b, p = tokens_bp.shape
    column = jnp.arange(p, dtype=jnp.int32)[None, :]
    first_real = (p - lengths_b)[:, None]
    segment_ids = (column >= first_real).astype(jnp.int32)
    positions = jnp.maximum(column - first_real, 0)
    h = embed_apply(config, params[EMBED], tokens_bp)
    cache = []
    for i in range(config.num_layers):
        layer_params = params[layer_group_name(i)]
        q, k, v = attention_inputs(config, layer_params, h, positions)
        attn = attention(q, k, v, segment_ids, impl=config.attention_impl, block_size=config.attention_block_size)
        h = layer_output(config, layer_params, h, attn)
        pad = ((0, 0), (0, cache_len - p), (0, 0), (0, 0))
        cache.append((jnp.pad(k, pad), jnp.pad(v, pad)))
    logits = head_apply(config, params[HEAD], h[:, -1:], params[EMBED])[:, 0]
    return logits, tuple(cache)


def _decode_step(config, params, token_b, step, lengths_b, prompt_width, cache):
    """Feed one new token per row (column prompt_width + step); return its logits [B, V] and the cache."""
    column = prompt_width + step
    positions = (lengths_b + step)[:, None]
    cache_len = cache[0][0].shape[1]
    key_column = jnp.arange(cache_len, dtype=jnp.int32)[None, :]
    mask = ((key_column >= (prompt_width - lengths_b)[:, None]) & (key_column <= column))[:, None, :]
    h = embed_apply(config, params[EMBED], token_b[:, None])
    new_cache = []
    for i in range(config.num_layers):
        layer_params = params[layer_group_name(i)]
        q, k, v = attention_inputs(config, layer_params, h, positions)
        k_cache = jax.lax.dynamic_update_slice(cache[i][0], k.astype(cache[i][0].dtype), (0, column, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(cache[i][1], v.astype(cache[i][1].dtype), (0, column, 0, 0))
        attn = masked_attention(q, k_cache, v_cache, mask)
        h = layer_output(config, layer_params, h, attn)
        new_cache.append((k_cache, v_cache))
    logits = head_apply(config, params[HEAD], h, params[EMBED])[:, 0]
    return logits, tuple(new_cache)


def _generate_padded(config: DecoderConfig, sampling: SamplingParams, params, tokens_bp, lengths_b, keys_b):
    """The compiled sampler on left-padded prompts; `keys_b` one PRNG key per row (new token t of row b is drawn
    with fold_in(keys_b[b], t))."""
    b, p = tokens_bp.shape
    n = sampling.max_new_tokens
    k_top = sampling.top_k_logprobs
    logits, cache = prefill(config, params, tokens_bp, lengths_b, p + n)
    stop_ids = jnp.asarray(sampling.stop_token_ids or (-1,), jnp.int32)

    def cond(carry):
        step, _, _, done = carry[:4]
        return (step < n) & ~jnp.all(done)

    def body(carry):
        step, logits, cache, done, tokens, logprobs, lengths, top_ids, top_logprobs = carry
        token, token_logprob, step_top_ids, step_top_logprobs = sample_tokens(
            logits, jax.vmap(lambda key: jax.random.fold_in(key, step))(keys_b), sampling)
        active = ~done
        tokens = tokens.at[:, step].set(jnp.where(active, token, sampling.pad_token_id))
        logprobs = logprobs.at[:, step].set(jnp.where(active, token_logprob, 0.0))
        lengths = lengths + active.astype(jnp.int32)
        if k_top:
            top_ids = top_ids.at[:, step].set(jnp.where(active[:, None], step_top_ids, sampling.pad_token_id))
            top_logprobs = top_logprobs.at[:, step].set(jnp.where(active[:, None], step_top_logprobs, 0.0))
        done = done | (active & jnp.any(token[:, None] == stop_ids[None, :], axis=-1))
        logits, cache = _decode_step(config, params, jnp.where(active, token, sampling.pad_token_id), step,
                                     lengths_b, p, cache)
        return step + 1, logits, cache, done, tokens, logprobs, lengths, top_ids, top_logprobs

    init = (
        jnp.int32(0), logits, cache, jnp.zeros((b,), bool),
        jnp.full((b, n), sampling.pad_token_id, jnp.int32), jnp.zeros((b, n), jnp.float32),
        jnp.zeros((b,), jnp.int32),
        jnp.full((b, n, k_top), sampling.pad_token_id, jnp.int32), jnp.zeros((b, n, k_top), jnp.float32),
    )
    _, _, _, _, tokens, logprobs, lengths, top_ids, top_logprobs = jax.lax.while_loop(cond, body, init)
    if not k_top:
        return Generation(tokens, logprobs, lengths, None, None)
    return Generation(tokens, logprobs, lengths, top_ids, top_logprobs)


_generate_jit = jax.jit(_generate_padded, static_argnums=(0, 1))


def left_pad_prompts(prompts: Sequence[Sequence[int]], bucket: int, pad_token_id: int,
                     min_width: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad ragged prompts to a width that is a multiple of `bucket` (and at least `min_width`):
    (tokens [B, P] int32, lengths [B])."""
    if len(prompts) == 0:
        raise ValueError("generate: no prompts")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if (lengths == 0).any():
        raise ValueError(f"generate: prompts {np.flatnonzero(lengths == 0).tolist()} are empty")
    width = int(-(-max(int(lengths.max()), min_width) // bucket) * bucket)
    tokens = np.full((len(prompts), width), pad_token_id, np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt):] = np.asarray(prompt, np.int32)
    return tokens, lengths


def generate(
    model: Decoder | DecoderConfig,
    prompts: Sequence[Sequence[int]] | np.ndarray,
    *,
    key: jax.Array,
    sampling: SamplingParams,
    prompt_lengths: Sequence[int] | np.ndarray | None = None,
    params=None,
    prompt_width: int = 0,
    device: jax.Device | None = None,
) -> Generation:
    """Sample continuations of a batch of prompts.

    model: a `Decoder`, or a `DecoderConfig` together with `params` ({group: {name: array}}, e.g. gathered
      FSDP shards).
    prompts: a list of token-id lists (ragged), or a right-padded int array [B, P] with `prompt_lengths`.
    key: one PRNG key (row b then samples with `row_keys(key, B)[b]`), or one key per row (a batch of B keys:
      row b's tokens depend only on its prompt, its key and the parameters, not on the other rows). Unused for
      greedy sampling.
    prompt_width: pad the prompts to at least this width (so batches sampled apart share one compiled shape).
    device: where to run (default: JAX's default device); `params` already on it are used there without a copy.
      The call returns without waiting (async dispatch), so calls on several devices run concurrently.
    """
    config, params = model_and_params(model, params, "generate")
    check_sampling(config, sampling, "generate")
    if prompt_lengths is not None:
        array = np.asarray(prompts)
        lengths = np.asarray(prompt_lengths)
        if array.ndim != 2 or lengths.shape != (array.shape[0],):
            raise ValueError(f"generate: padded prompts must be [B, P] with prompt_lengths [B]; got "
                             f"{array.shape} and {lengths.shape}")
        if (lengths < 1).any() or (lengths > array.shape[1]).any():
            raise ValueError(f"generate: prompt_lengths must be in [1, {array.shape[1]}], got {lengths.tolist()}")
        prompts = [array[row, :n].tolist() for row, n in enumerate(lengths)]
    tokens, lengths = left_pad_prompts(prompts, sampling.prompt_bucket, sampling.pad_token_id, prompt_width)
    real = np.arange(tokens.shape[1])[None, :] >= (tokens.shape[1] - lengths)[:, None]
    bad = np.unique(tokens[real & ((tokens < 0) | (tokens >= config.vocab_size))])
    if bad.size:
        raise ValueError(f"generate: prompt token ids {bad.tolist()} are outside [0, {config.vocab_size})")
    keys = per_row_keys(key, len(tokens))
    if device is None:
        return _generate_jit(config, sampling, params, jnp.asarray(tokens), jnp.asarray(lengths), keys)
    placed = jax.device_put((tokens, lengths, keys), device)
    return _generate_jit(config, sampling, on_device(params, device), *placed)


def model_and_params(model, params, where: str):
    """(config, group params) of a `Decoder`, or of a `DecoderConfig` with `params`; `where` names the caller."""
    if isinstance(model, Decoder):
        if params is not None:
            raise ValueError(f"{where}: pass params only together with a DecoderConfig, not with a Decoder")
        return model.config, split_params(model)
    if isinstance(model, DecoderConfig):
        if params is None:
            raise ValueError(f"{where}: a DecoderConfig needs params= (the group arrays)")
        return model, params
    raise TypeError(f"{where}: model must be a Decoder or DecoderConfig, got {type(model).__name__}")


def check_sampling(config: DecoderConfig, sampling, where: str) -> None:
    """TypeError / ValueError for `sampling` that is not `SamplingParams` or names ids outside the vocabulary."""
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"{where}: sampling must be SamplingParams, got {type(sampling).__name__}")
    if not 0 <= sampling.pad_token_id < config.vocab_size:
        raise ValueError(f"{where}: pad_token_id {sampling.pad_token_id} is outside [0, {config.vocab_size})")
    if sampling.top_k_logprobs > config.vocab_size:
        raise ValueError(f"{where}: top_k_logprobs={sampling.top_k_logprobs} exceeds vocab_size {config.vocab_size}")


def on_device(params, device: jax.Device):
    """`params` on `device`: leaves already committed there as they are (a sampler's copy resharded onto its
    device is used where it lies, never transferred again), the others put there."""
    leaves, treedef = jax.tree.flatten(params)
    missing = [i for i, x in enumerate(leaves)
               if not (isinstance(x, jax.Array) and x.committed and x.sharding.device_set == {device})]
    if missing:
        moved = jax.device_put([leaves[i] for i in missing], device)
        for i, x in zip(missing, moved):
            leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def _is_key_batch(key) -> bool:
    """Whether `key` holds one PRNG key per row (typed keys [B], raw uint32 keys [B, 2]) rather than one key."""
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key.ndim == 1
    return key.ndim == 2


@functools.partial(jax.jit, static_argnums=1)
def row_keys(key: jax.Array, rows: int) -> jax.Array:
    """The per-row keys a single `key` stands for: fold_in(key, b) for b in 0..rows-1."""
    return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(rows, dtype=jnp.uint32))


def per_row_keys(key: jax.Array, rows: int) -> jax.Array:
    """`key` as `rows` per-row keys: a single key through `row_keys`, a batch of keys as it is (its length checked)."""
    if not _is_key_batch(key):
        return row_keys(key, rows)
    if len(key) != rows:
        raise ValueError(f"generate: {len(key)} keys for {rows} prompts (pass one key, or one per prompt)")
    return key
