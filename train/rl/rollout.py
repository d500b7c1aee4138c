"""Rollouts: sample `group_size` responses per prompt from the current policy with `jodc.models.generate` (one
compiled sampler with a KV cache), keeping what the losses need: each response token's log-prob under the
sampling distribution (the behaviour policy) and, for DPPO Top-K, the behaviour's top-k ids and log-probs.

Prompts are encoded as `[bos] prompt` (the SFT trainer's prompt/completion layout, so a warm-started policy
sees what it was trained on) and a response ends at the tokenizer's eos, which is part of the response (trained
on, scored as text without it). Compiled shapes stay few: the batch is always prompts x group_size rows, the
prompt width is rounded up to `prompt_bucket`, the response budget is fixed.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import numpy as np

from jodc.models import DecoderConfig, Generation, SamplingParams, generate
from jodc.models.stream import ContinuousSampler, StreamShape, as_generation, run_streams
from jodc.models.tokenizer import Tokenizer

from .policy_weights import DeviceWeights


@dataclasses.dataclass
class Rollout:
    """N = prompts x group_size responses, group after group (responses of prompt i are rows i*G .. i*G+G-1)."""

    prompts: list[str]                 # per response: its prompt's text
    prompt_ids: list[np.ndarray]       # per response: int32 [p_i] the encoded prompt
    response_ids: list[np.ndarray]     # per response: int32 [n_i] sampled tokens (stop token included)
    logprobs: list[np.ndarray]         # per response: fp32 [n_i] behaviour log-probs of those tokens
    topk_ids: list[np.ndarray] | None  # per response: int32 [n_i, K] behaviour top-k (sampled token forced in)
    topk_logprobs: list[np.ndarray] | None  # per response: fp32 [n_i, K]
    responses: list[str]               # per response: decoded text (special tokens removed)
    finished: np.ndarray               # bool [N]: the response ended with a stop token (else it hit the budget)
    group_size: int
    seconds: float                     # wall time of sampling and decoding
    # per response: int32 [n_i] the policy version each token was sampled under (partial rollouts, whose responses
    # may span a weight update); None: every token of a response has the response's version
    token_versions: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def response_lengths(self) -> np.ndarray:
        """Tokens per response (stop token included)."""
        return np.array([len(r) for r in self.response_ids], np.int64)

    def select(self, rows: range) -> "Rollout":
        """The responses `rows` (consecutive) as a rollout of their own."""
        def part(values):
            return None if values is None else values[rows.start:rows.stop]

        return dataclasses.replace(self, prompts=part(self.prompts), prompt_ids=part(self.prompt_ids),
                                   response_ids=part(self.response_ids), logprobs=part(self.logprobs),
                                   topk_ids=part(self.topk_ids), topk_logprobs=part(self.topk_logprobs),
                                   responses=part(self.responses), finished=part(self.finished),
                                   token_versions=part(self.token_versions))

    def width(self, bucket: int) -> int:
        """The longest prompt + response, rounded up to `bucket`: the row width of a forward pass over it."""
        return -(-max(len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)) // bucket) * bucket

    @classmethod
    def concat(cls, parts: Sequence["Rollout"]) -> "Rollout":
        """The parts' responses in order (shares of one step sampled apart); `seconds` is the slowest part's."""
        if not parts:
            raise ValueError("Rollout.concat: no parts")
        if len({p.group_size for p in parts}) != 1:
            raise ValueError(f"Rollout.concat: parts of group sizes {[p.group_size for p in parts]}")
        if len({p.topk_ids is None for p in parts if len(p)}) > 1:
            raise ValueError("Rollout.concat: some parts hold the behaviour top-k and some do not")

        def joined(field):
            values = [getattr(p, field) for p in parts]
            return None if all(v is None for v in values) else [x for v in values if v is not None for x in v]

        return cls(prompts=joined("prompts"), prompt_ids=joined("prompt_ids"), response_ids=joined("response_ids"),
                   logprobs=joined("logprobs"), topk_ids=joined("topk_ids"), topk_logprobs=joined("topk_logprobs"),
                   responses=joined("responses"), finished=np.concatenate([p.finished for p in parts]).astype(bool),
                   group_size=parts[0].group_size, seconds=max(p.seconds for p in parts),
                   token_versions=joined("token_versions"))


def encode_prompts(tokenizer: Tokenizer, prompts: Sequence[str]) -> list[np.ndarray]:
    """`[bos] prompt` token ids of each prompt (no bos when the tokenizer has none)."""
    start = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    encoded = tokenizer.encode_batch(list(prompts), add_special_tokens=False)
    out = [np.asarray(start + ids, np.int32) for ids in encoded]
    empty = [i for i, ids in enumerate(out) if ids.size == 0]
    if empty:
        raise ValueError(f"prompts {empty[:5]} encode to no tokens")
    return out


def stop_token_ids(tokenizer: Tokenizer, config: DecoderConfig) -> tuple[int, ...]:
    """The tokens that end a response: the tokenizer's eos and the model's eos ids."""
    ids = set(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("neither the tokenizer nor the model defines an eos token: responses could never end")
    return tuple(sorted(ids))


def sampling_params(tokenizer: Tokenizer, config: DecoderConfig, *, max_new_tokens: int, temperature: float,
                    top_k: int = 0, prompt_bucket: int = 16) -> SamplingParams:
    """SamplingParams of a rollout (temperature 0: greedy, for evaluation); full-vocabulary sampling (top_p 1),
    so the stored log-probs are those of softmax(logits / temperature), which the losses recompute."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=1.0,
                          stop_token_ids=stop_token_ids(tokenizer, config), top_k_logprobs=top_k, pad_token_id=pad,
                          prompt_bucket=prompt_bucket)


def device_shares(num_prompts: int, num_devices: int) -> list[range]:
    """The prompts each of `num_devices` devices samples: contiguous ranges of whole prompts (so a group's responses
    stay on one device), sizes differing by at most one, device order (empty ranges when prompts are fewer)."""
    if num_devices < 1:
        raise ValueError(f"device_shares: need at least one device, got {num_devices}")
    bounds = np.cumsum([0] + [num_prompts // num_devices + (d < num_prompts % num_devices)
                              for d in range(num_devices)])
    return [range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def response_keys(key: jax.Array, prompt_indices: Sequence[int], group_size: int) -> jax.Array:
    """One sampling key per response: response j of prompt i samples with fold_in(fold_in(key, i), j), so a
    response's key depends on (key, its prompt's index in the step, j) only, never on which device or process
    samples it. Returns keys [len(prompt_indices) * group_size], group after group."""
    indices = np.repeat(np.asarray(prompt_indices, np.uint32), group_size)
    members = np.tile(np.arange(group_size, dtype=np.uint32), len(prompt_indices))
    return _response_keys(key, indices, members)


@jax.jit
def _response_keys(key, indices, members):
    return jax.vmap(lambda i, j: jax.random.fold_in(jax.random.fold_in(key, i), j))(indices, members)


def sample_rollout(config: DecoderConfig, params, tokenizer: Tokenizer, prompts: Sequence[str], *, group_size: int,
                   sampling: SamplingParams, key: jax.Array, prompt_indices: Sequence[int] | None = None,
                   prompt_width: int = 0, devices: Sequence[jax.Device] | None = None,
                   stream: StreamShape | None = None) -> Rollout:
    """Samples `group_size` responses to each prompt with `params`: group pytrees (host or on a device), or a
    `policy_weights.DeviceWeights` holding a copy on each of `devices` (each device samples with its own copy).

    key: the rollout's key; response j of prompt `prompt_indices[i]` (default i) samples with
      `response_keys(key, ...)`, so a subset of a step's prompts sampled elsewhere gets the same keys.
    prompt_width: pad prompts to at least this width (the whole step's, so that every share of it compiles and
      computes the same shape).
    devices: split the prompts in whole groups over these devices (`device_shares`), each sampling its share
      concurrently; default: JAX's default device.
    stream: sample each device's share as a stream through this many slots over a paged cache
      (`models.stream.ContinuousSampler`, the devices' streams driven together) instead of one static batch; the
      same responses (log-probs to rounding)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    prompt_indices = range(len(prompts)) if prompt_indices is None else list(prompt_indices)
    if len(prompt_indices) != len(prompts):
        raise ValueError(f"sample_rollout: {len(prompt_indices)} prompt indices for {len(prompts)} prompts")
    started = time.perf_counter()
    if not prompts:  # a process whose devices got no prompt of the step
        return Rollout(prompts=[], prompt_ids=[], response_ids=[], logprobs=[],
                       topk_ids=[] if sampling.top_k_logprobs else None,
                       topk_logprobs=[] if sampling.top_k_logprobs else None, responses=[],
                       finished=np.zeros(0, bool), group_size=group_size, seconds=0.0)
    repeated = [p for p in prompts for _ in range(group_size)]
    prompt_ids = [ids for ids in encode_prompts(tokenizer, prompts) for _ in range(group_size)]
    keys = response_keys(key, prompt_indices, group_size)
    devices = [None] if not devices else list(devices)
    calls = [(share, device) for share, device in zip(device_shares(len(prompts), len(devices)), devices) if share]
    shares = [(slice(s.start * group_size, s.stop * group_size), device,
               params.on(device) if isinstance(params, DeviceWeights) else params) for s, device in calls]
    if stream is None:
        outs = jax.device_get([generate(config, prompt_ids[rows], sampling=sampling, params=weights, key=keys[rows],
                                        prompt_width=prompt_width, device=device)
                               for rows, device, weights in shares])  # dispatched without waiting: concurrent
    else:
        outs = _streamed(config, shares, prompt_ids, keys, sampling, stream, prompt_width)
    return rollout_of(tokenizer, sampling, repeated, prompt_ids, outs, group_size=group_size,
                      seconds=time.perf_counter() - started)


def rollout_of(tokenizer: Tokenizer, sampling: SamplingParams, prompts: list[str], prompt_ids: list[np.ndarray],
               outs: Sequence[Generation], *, group_size: int, seconds: float,
               token_versions: list[np.ndarray] | None = None) -> Rollout:
    """The `Rollout` of sampled rows: `outs` (host `Generation`s, rows in order) of the responses to `prompts`
    (per response: its text and `prompt_ids`), decoded; `token_versions` per response, when they vary."""
    def rows(field):
        return np.concatenate([np.asarray(getattr(o, field)) for o in outs])

    lengths = rows("lengths")
    tokens, logprobs = rows("tokens"), rows("logprobs").astype(np.float32)
    stops = np.asarray(sampling.stop_token_ids, np.int32)
    response_ids = [tokens[i, :n].astype(np.int32) for i, n in enumerate(lengths)]
    finished = np.array([n > 0 and np.isin(r[-1], stops) for r, n in zip(response_ids, lengths)], bool)
    texts = tokenizer.backend.decode_batch([(r[:-1] if f else r).tolist() for r, f in zip(response_ids, finished)],
                                           skip_special_tokens=True)
    topk_ids = topk_logprobs = None
    if sampling.top_k_logprobs:
        ids, lps = rows("topk_ids"), rows("topk_logprobs").astype(np.float32)
        topk_ids = [ids[i, :n].astype(np.int32) for i, n in enumerate(lengths)]
        topk_logprobs = [lps[i, :n] for i, n in enumerate(lengths)]
    return Rollout(prompts=list(prompts), prompt_ids=prompt_ids, response_ids=response_ids,
                   logprobs=[logprobs[i, :n] for i, n in enumerate(lengths)], topk_ids=topk_ids,
                   topk_logprobs=topk_logprobs, responses=list(texts), finished=finished, group_size=group_size,
                   seconds=seconds, token_versions=token_versions)


def _streamed(config: DecoderConfig, shares, prompt_ids, keys, sampling: SamplingParams, stream: StreamShape,
              prompt_width: int) -> list[Generation]:
    """Each share (rows, device, weights) sampled by a continuous sampler on its device, all driven together;
    as `generate`'s arrays, per share."""
    samplers, ids = [], []
    for rows, device, weights in shares:
        prompts = prompt_ids[rows]
        sampler = ContinuousSampler(config, sampling, stream, params=weights, device=device,
                                    max_prompt_tokens=max(prompt_width, max(map(len, prompts))))
        ids.append(sampler.submit(prompts, keys[rows]))
        samplers.append(sampler)
    return [as_generation([done[i] for i in share_ids], sampling)
            for share_ids, done in zip(ids, run_streams(samplers))]
