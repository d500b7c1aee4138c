"""Continuous batching over a paged KV cache: a fixed number of slots, each running one response; a slot whose
response ends is handed the next prompt at once, and the cache is a pool of fixed-size pages, so memory follows the
tokens generated, not every row's worst case (models/paged_cache.py keeps the pages).

Two compiled programs of fixed shapes do all the work, so nothing recompiles as the stream moves:
* `admit`: prefill up to `prefill_rows` left-padded prompts (the same layer functions as `generate`'s prefill),
  scatter their keys / values into their slots' pages and reset the slots' outputs.
* `decode`: `chunk` decode steps of every slot at once. Each step samples a token per running slot from its
  last logits (row key `fold_in(key_b, t)` for its token t, exactly as `generate` does), records it, and feeds it:
  the new key / value is written to the slot's page, and attention reads the slot's pages in logical order under
  a mask of its valid positions. Idle, finished and held slots write to the scratch page and keep their state.
  A call attends over as many pages as its longest running row holds, rounded up to a power of two (a handful of
  compiled widths); without a paged-attention kernel every slot reads that width, so the attention work of a call
  follows its longest row while the cache's memory follows every row's own length.
Between calls the host (this module's `ContinuousSampler`) collects finished rows, returns their pages, admits
waiting prompts and gives running rows the pages their next chunk needs. A row that cannot get a page waits (it is
held for the chunk: its state does not move); if no running row can move, the youngest is preempted (its pages
returned, its prompt queued again at the front) and restarts from its first token: with the same key and weights
it samples the same tokens, so preemption changes the schedule, never a response.

Exactness: for the same prompt, key and weights a response is the one `generate` samples, up to the rounding of
different batch shapes and key orders in the attention reductions (tests/test_stream.py measures it: tokens equal,
log-probs within 1e-5 on the tiny models). Each token also records the policy version it was sampled under
(`set_params(params, version)` between calls), for rollouts that carry on across weight updates.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .attention import masked_attention
from .config import DecoderConfig
from .decoder import Decoder
from .generate import Generation, SamplingParams, check_sampling, left_pad_prompts, model_and_params, on_device, per_row_keys, prefill, sample_tokens
from .layerwise import EMBED, HEAD, attention_inputs, embed_apply, head_apply, layer_group_name, layer_output
from .paged_cache import SCRATCH_PAGE, PagePool, pages_for


@dataclasses.dataclass(frozen=True)
class StreamShape:
    """The fixed shapes of a continuous-batching sampler.

    slots: rows decoded at once.
    page_size: tokens per cache page.
    pages: pages in the pool, the scratch page included (0: enough for every slot's longest row, i.e. no paging
      pressure). At least one longest row's pages plus the scratch page.
    chunk: decode steps per compiled call; the host visits between calls (a finished row's slot idles for the
      rest of its chunk, so smaller chunks refill sooner and cost more host round trips).
    prefill_rows: prompts prefilled per compiled call.
    """

    slots: int = 16
    page_size: int = 16
    pages: int = 0
    chunk: int = 8
    prefill_rows: int = 4

    def __post_init__(self):
        for name in ("slots", "page_size", "chunk", "prefill_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"StreamShape.{name} must be a positive int, got {value!r}")
        if not isinstance(self.pages, int) or self.pages < 0:
            raise ValueError(f"StreamShape.pages must be an int >= 0 (0: no paging pressure), got {self.pages!r}")

    def cache_tokens(self, row_tokens: int) -> int:
        """Tokens the pool holds (scratch page included) for rows of at most `row_tokens` cache tokens."""
        return self.pool_pages(row_tokens) * self.page_size

    def pool_pages(self, row_tokens: int) -> int:
        """Pages in the pool for rows of at most `row_tokens` cache tokens."""
        return self.pages or self.slots * pages_for(row_tokens, self.page_size) + 1


class StreamState(NamedTuple):
    """The device side of a stream: the paged cache and every slot's running state and outputs (N =
    max_new_tokens, K = top_k_logprobs)."""

    cache: tuple  # per layer (k_pool, v_pool), each [pages * page_size, kv_heads, head_dim]
    logits: jax.Array  # [S, V] the logits the slot samples its next token from
    keys: jax.Array  # [S] (typed) or [S, 2] (raw) per-row PRNG keys
    step: jax.Array  # int32 [S] tokens generated so far
    prompt_len: jax.Array  # int32 [S]
    done: jax.Array  # bool [S] finished (stop token or max_new_tokens), or empty
    tokens: jax.Array  # int32 [S, N]
    logprobs: jax.Array  # fp32 [S, N]
    versions: jax.Array  # int32 [S, N] policy version each token was sampled under
    topk_ids: jax.Array  # int32 [S, N, K]
    topk_logprobs: jax.Array  # fp32 [S, N, K]


class Completion(NamedTuple):
    """One finished response (host arrays; n = its generated tokens, the stop token included)."""

    tokens: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # fp32 [n]
    versions: np.ndarray  # int32 [n]
    topk_ids: np.ndarray | None  # int32 [n, K]
    topk_logprobs: np.ndarray | None  # fp32 [n, K]


@dataclasses.dataclass
class StreamStats:
    """What a stream did: compiled calls, slot-steps decoded and how many produced a token, preemptions and
    waits, and the most pages held at once."""

    decode_calls: int = 0
    admit_calls: int = 0
    slot_steps: int = 0  # slots x decode steps run (the decode programs' work)
    tokens: int = 0  # tokens generated into responses that finished
    preempted: int = 0  # rows restarted because no running row could get a page
    held: int = 0  # row-chunks a row waited for a page
    refills: int = 0  # rows prefilled again to carry on under new weights
    peak_pages: int = 0


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 5))
def _empty_state(config: DecoderConfig, sampling: SamplingParams, shape: StreamShape, pool_pages: int,
                 keys_like: jax.Array, logits_dtype: str) -> StreamState:
    """Every slot empty (done), the pool zero; compiled once per shape."""
    s, n, k = shape.slots, sampling.max_new_tokens, sampling.top_k_logprobs
    kv = (pool_pages * shape.page_size, config.num_kv_heads, config.head_dim)
    cache = tuple((jnp.zeros(kv, config.compute_dtype), jnp.zeros(kv, config.compute_dtype))
                  for _ in range(config.num_layers))
    return StreamState(
        cache=cache, logits=jnp.zeros((s, config.vocab_size), logits_dtype),
        keys=keys_like[jnp.zeros((s,), jnp.int32)], step=jnp.zeros((s,), jnp.int32),
        prompt_len=jnp.ones((s,), jnp.int32), done=jnp.ones((s,), bool),
        tokens=jnp.full((s, n), sampling.pad_token_id, jnp.int32), logprobs=jnp.zeros((s, n), jnp.float32),
        versions=jnp.zeros((s, n), jnp.int32),
        topk_ids=jnp.full((s, n, k), sampling.pad_token_id, jnp.int32), topk_logprobs=jnp.zeros((s, n, k), jnp.float32))


def _prefill_into_pages(config: DecoderConfig, page_size: int, params, state: StreamState, tokens_ap, lengths_a,
                        slots_a, table_am) -> StreamState:
    """Run the left-padded sequences `tokens_ap` (a slot index >= S in `slots_a` marks an unused row), write their
    keys / values into the pages `table_am` and set their slots' logits to the last column's."""
    a, p = tokens_ap.shape
    s = state.step.shape[0]
    logits, kv = prefill(config, params, tokens_ap, lengths_a, p)
    position = jnp.arange(p, dtype=jnp.int32)[None, :] - (p - lengths_a)[:, None]  # < 0: left padding
    real = (position >= 0) & (slots_a < s)[:, None]
    page = jnp.take_along_axis(table_am, jnp.clip(position // page_size, 0, table_am.shape[1] - 1), axis=1)
    offset = jnp.mod(position, page_size)
    where = jnp.where(real, page * page_size + offset, SCRATCH_PAGE * page_size + offset).reshape(-1)
    cache = tuple((kp.at[where].set(k.reshape(a * p, *k.shape[2:]).astype(kp.dtype)),
                   vp.at[where].set(v.reshape(a * p, *v.shape[2:]).astype(vp.dtype)))
                  for (kp, vp), (k, v) in zip(state.cache, kv))
    return state._replace(cache=cache,
                          logits=state.logits.at[slots_a].set(logits.astype(state.logits.dtype), mode="drop"))


def _admit(config: DecoderConfig, sampling: SamplingParams, page_size: int, params, state: StreamState,
           tokens_ap, lengths_a, slots_a, table_am, keys_a) -> StreamState:
    """Prefill new prompts into slots `slots_a` and reset those slots' state and outputs."""
    a = tokens_ap.shape[0]
    state = _prefill_into_pages(config, page_size, params, state, tokens_ap, lengths_a, slots_a, table_am)

    def put(field, value):
        return field.at[slots_a].set(value, mode="drop")

    n, k_top = state.tokens.shape[1], state.topk_ids.shape[2]
    return state._replace(
        keys=put(state.keys, keys_a), step=put(state.step, jnp.zeros((a,), jnp.int32)),
        prompt_len=put(state.prompt_len, lengths_a), done=put(state.done, jnp.zeros((a,), bool)),
        tokens=put(state.tokens, jnp.full((a, n), sampling.pad_token_id, jnp.int32)),
        logprobs=put(state.logprobs, jnp.zeros((a, n), jnp.float32)),
        versions=put(state.versions, jnp.zeros((a, n), jnp.int32)),
        topk_ids=put(state.topk_ids, jnp.full((a, n, k_top), sampling.pad_token_id, jnp.int32)),
        topk_logprobs=put(state.topk_logprobs, jnp.zeros((a, n, k_top), jnp.float32)))


def _paged_decode_step(config: DecoderConfig, page_size: int, params, cache, token_s, position_s, feed_s,
                       table_sm):
    """Feed token `token_s[r]` at logical position `position_s[r]` of every slot; the slots with `feed_s` false
    write to the scratch page. Returns the new logits [S, V] and the cache."""
    s, m = table_sm.shape
    page = jnp.take_along_axis(table_sm, jnp.clip(position_s // page_size, 0, m - 1)[:, None], axis=1)[:, 0]
    offset = position_s % page_size
    where = jnp.where(feed_s, page * page_size + offset, SCRATCH_PAGE * page_size + offset)
    rows = (table_sm[:, :, None] * page_size + jnp.arange(page_size, dtype=jnp.int32)).reshape(s, m * page_size)
    mask = (jnp.arange(m * page_size, dtype=jnp.int32)[None, :] <= position_s[:, None])[:, None, :]
    h = embed_apply(config, params[EMBED], token_s[:, None])
    new_cache = []
    for i, (k_pool, v_pool) in enumerate(cache):
        layer_params = params[layer_group_name(i)]
        q, k, v = attention_inputs(config, layer_params, h, position_s[:, None])
        k_pool = k_pool.at[where].set(k[:, 0].astype(k_pool.dtype))
        v_pool = v_pool.at[where].set(v[:, 0].astype(v_pool.dtype))
        attn = masked_attention(q, k_pool[rows], v_pool[rows], mask)
        h = layer_output(config, layer_params, h, attn)
        new_cache.append((k_pool, v_pool))
    return head_apply(config, params[HEAD], h, params[EMBED])[:, 0], tuple(new_cache)


def _decode(config: DecoderConfig, sampling: SamplingParams, page_size: int, chunk: int, params,
            state: StreamState, table_sm, runnable_s, version) -> tuple[StreamState, jax.Array]:
    """Up to `chunk` decode steps of the slots in `runnable_s` that have not finished (fewer when all have); the
    new state and the steps run."""
    n = sampling.max_new_tokens
    stop_ids = jnp.asarray(sampling.stop_token_ids or (-1,), jnp.int32)
    rows = jnp.arange(state.step.shape[0])

    def cond(carry):
        i, st = carry
        return (i < chunk) & jnp.any(runnable_s & ~st.done)

    def body(carry):
        i, st = carry
        running = runnable_s & ~st.done
        keys_now = jax.vmap(jax.random.fold_in)(st.keys, st.step)
        token, token_logprob, top_ids, top_logprobs = sample_tokens(st.logits, keys_now, sampling)
        column = jnp.where(running, st.step, n)  # column n is out of range: the write is dropped

        def record(field, value):
            return field.at[rows, column].set(value, mode="drop")

        step = st.step + running.astype(jnp.int32)
        done = st.done | (running & ((step >= n) | jnp.any(token[:, None] == stop_ids[None, :], axis=-1)))
        feed = running & ~done
        logits, cache = _paged_decode_step(config, page_size, params, st.cache, jnp.where(feed, token, 0),
                                           st.prompt_len + st.step, feed, table_sm)
        st = st._replace(
            cache=cache, logits=jnp.where(feed[:, None], logits.astype(st.logits.dtype), st.logits), step=step,
            done=done, tokens=record(st.tokens, token), logprobs=record(st.logprobs, token_logprob),
            versions=record(st.versions, jnp.broadcast_to(version, token.shape)))
        if sampling.top_k_logprobs:
            st = st._replace(topk_ids=record(st.topk_ids, top_ids),
                             topk_logprobs=record(st.topk_logprobs, top_logprobs))
        return i + 1, st

    steps, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
    return state, steps


_admit_jit = jax.jit(_admit, static_argnums=(0, 1, 2), donate_argnums=(4,))
_refill_jit = jax.jit(_prefill_into_pages, static_argnums=(0, 1), donate_argnums=(3,))
_decode_jit = jax.jit(_decode, static_argnums=(0, 1, 2, 3), donate_argnums=(5,))


@dataclasses.dataclass
class _Request:
    prompt: np.ndarray  # int32 [L]
    key: jax.Array


class ContinuousSampler:
    """A stream of prompts through `shape.slots` slots over a paged cache (see the module docstring).

    `submit` queues prompts (each with its own key); `run` drives the stream until every queued prompt has
    finished and returns their completions by request id. The weights may change between calls (`set_params`):
    tokens sampled afterwards record the new version.
    """

    def __init__(self, model: Decoder | DecoderConfig, sampling: SamplingParams, shape: StreamShape, *,
                 max_prompt_tokens: int, params=None, version: int = 0, device: jax.Device | None = None):
        config, params = model_and_params(model, params, "ContinuousSampler")
        check_sampling(config, sampling, "ContinuousSampler")
        if not isinstance(shape, StreamShape):
            raise TypeError(f"ContinuousSampler: shape must be a StreamShape, got {type(shape).__name__}")
        self.config, self.sampling, self.shape, self.device = config, sampling, shape, device
        # prompts are prefilled left-padded to this bucketed width, so every shape (prefill, page table, pool) is a
        # function of the bucket: samplers made for prompts of nearby lengths share their compiled programs
        bucket = sampling.prompt_bucket
        self.max_prompt_tokens = -(-int(max_prompt_tokens) // bucket) * bucket
        self.row_tokens = self.max_prompt_tokens + sampling.max_new_tokens - 1  # the last token is never fed
        per_row = pages_for(self.row_tokens, shape.page_size)
        pool_pages = shape.pool_pages(self.row_tokens)
        if pool_pages - 1 < per_row:
            raise ValueError(f"StreamShape.pages={shape.pages} cannot hold one row of {self.row_tokens} tokens: it "
                             f"needs {per_row} pages of {shape.page_size} tokens plus the scratch page")
        self.pool = PagePool(pool_pages, shape.page_size, shape.slots, per_row)
        self.stats = StreamStats()
        self._waiting: collections.deque[int] = collections.deque()
        self._requests: dict[int, _Request] = {}
        self._slot_request = [-1] * shape.slots
        self._admitted_order: list[int] = []  # slots, oldest admission first
        self._state: StreamState | None = None
        self._steps_run = None
        self._host_step = np.zeros(shape.slots, np.int64)  # the slots' `step` as of the last collect
        self._next_id = 0
        self.set_params(params, version)

    def set_params(self, params, version: int = 0) -> None:
        """Sample with `params` ({group: {name: array}}) from now on; tokens record `version`. Rows under way carry
        on under the new weights: each is prefilled again (prompt and the tokens it has so far), so its cache and
        its next token's logits are the new policy's, and a token's log-prob is that of the version it records."""
        self._params = params if self.device is None else on_device(params, self.device)
        self._version = int(version)
        if self._admitted_order:
            self._refill_running()

    def _refill_running(self) -> None:
        step, tokens = self._host_step, jax.device_get(self._state.tokens)
        rows = self.shape.prefill_rows
        slots = list(self._admitted_order)
        for start in range(0, len(slots), rows):
            batch = slots[start:start + rows]
            sequences = [np.concatenate([self._requests[self._slot_request[s]].prompt, tokens[s, :step[s]]])
                         for s in batch]
            self._run_prefill(_refill_jit, (self.config, self.shape.page_size), sequences, batch,
                              self.row_tokens)
        self.stats.refills += len(slots)

    def submit(self, prompts: Sequence[Sequence[int]], key: jax.Array) -> list[int]:
        """Queue `prompts` (token-id lists); `key` is one key (prompt b then samples with `row_keys(key, B)[b]`,
        as `generate` does) or one key per prompt. Returns their request ids, in order."""
        if len(prompts) == 0:
            raise ValueError("ContinuousSampler.submit: no prompts")
        arrays = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
        lengths = np.array([len(a) for a in arrays])
        if (lengths == 0).any() or (lengths > self.max_prompt_tokens).any():
            raise ValueError(f"ContinuousSampler.submit: prompt lengths must be in [1, {self.max_prompt_tokens}] "
                             f"(max_prompt_tokens); got {sorted(set(lengths.tolist()))}")
        bad = np.unique(np.concatenate([a[(a < 0) | (a >= self.config.vocab_size)] for a in arrays]))
        if bad.size:
            raise ValueError(f"ContinuousSampler.submit: prompt token ids {bad.tolist()} are outside "
                             f"[0, {self.config.vocab_size})")
        keys = per_row_keys(key, len(arrays))
        if self._state is None:
            self._state = self._initial_state(keys)
        ids = []
        for i, prompt in enumerate(arrays):
            self._requests[self._next_id] = _Request(prompt, keys[i])
            self._waiting.append(self._next_id)
            ids.append(self._next_id)
            self._next_id += 1
        return ids

    def snapshot(self) -> dict:
        """The stream between calls as JSON-able data: each row under way (its request id, slot, pages held,
        prompt, key, and its tokens, log-probs, versions and top-K so far) in admission order, the waiting prompts
        in queue order, and the next request id. The caches are not kept: `restore` prefills the rows again under
        the weights it is given, as `set_params` does at a weight update, so a stream snapshotted where the weights
        were about to change resumes exactly."""
        rows, waiting = [], []
        if self._state is not None:
            tokens, logprobs, versions, topk_ids, topk_logprobs = jax.device_get(
                (self._state.tokens, self._state.logprobs, self._state.versions, self._state.topk_ids,
                 self._state.topk_logprobs))
            for slot in self._admitted_order:
                n, request_id = int(self._host_step[slot]), self._slot_request[slot]
                rows.append({**self._request_json(request_id), "slot": slot, "pages": self.pool.held(slot),
                             "tokens": tokens[slot, :n].tolist(), "logprobs": logprobs[slot, :n].tolist(),
                             "versions": versions[slot, :n].tolist(), "topk_ids": topk_ids[slot, :n].tolist(),
                             "topk_logprobs": topk_logprobs[slot, :n].tolist()})
            waiting = [self._request_json(r) for r in self._waiting]
        return {"rows": rows, "waiting": waiting, "next_id": self._next_id}

    def _request_json(self, request_id: int) -> dict:
        request = self._requests[request_id]
        typed = jax.dtypes.issubdtype(request.key.dtype, jax.dtypes.prng_key)
        data = jax.random.key_data(request.key) if typed else request.key
        return {"id": request_id, "prompt": request.prompt.tolist(), "key": np.asarray(data).tolist(),
                "typed_key": bool(typed)}

    def restore(self, snapshot: dict, params, version: int) -> None:
        """Continue the stream `snapshot` (from a sampler of the same model, sampling and shape) in this new one,
        under `params` of `version`: the rows under way take their slots and as many pages as they held, and are
        prefilled again (prompt and tokens so far); the waiting prompts queue in order."""
        if self._requests:
            raise RuntimeError("ContinuousSampler.restore: the sampler already holds requests")
        self._params, self._version = (params if self.device is None else on_device(params, self.device),
                                       int(version))
        entries = snapshot["rows"] + snapshot["waiting"]
        if not entries:
            self._next_id = int(snapshot["next_id"])
            return
        keys = [np.asarray(e["key"], np.uint32) for e in entries]
        keys = jnp.asarray(np.stack(keys))
        if entries[0]["typed_key"]:
            keys = jax.random.wrap_key_data(keys)
        if self._state is None:
            self._state = self._initial_state(keys)
        for i, entry in enumerate(entries):
            self._requests[int(entry["id"])] = _Request(np.asarray(entry["prompt"], np.int32), keys[i])
        for row in snapshot["rows"]:
            self._restore_row(row)
        self._waiting.extend(int(e["id"]) for e in snapshot["waiting"])
        self._next_id = int(snapshot["next_id"])
        if self._admitted_order:
            self._refill_running()

    def _restore_row(self, row: dict) -> None:
        request_id, slot, n = int(row["id"]), int(row["slot"]), len(row["tokens"])
        request = self._requests[request_id]
        if self._slot_request[slot] >= 0 or not self.pool.grow(slot, int(row["pages"]) * self.shape.page_size):
            raise ValueError(f"ContinuousSampler.restore: slot {slot} (or its {row['pages']} pages) is not free; "
                             "the snapshot is of another stream shape")
        self._slot_request[slot], self._host_step[slot] = request_id, n
        self._admitted_order.append(slot)
        k_top = self.sampling.top_k_logprobs
        st = self._state
        self._state = st._replace(
            keys=st.keys.at[slot].set(request.key), step=st.step.at[slot].set(n),
            prompt_len=st.prompt_len.at[slot].set(len(request.prompt)), done=st.done.at[slot].set(False),
            tokens=st.tokens.at[slot, :n].set(jnp.asarray(row["tokens"], jnp.int32)),
            logprobs=st.logprobs.at[slot, :n].set(jnp.asarray(row["logprobs"], jnp.float32)),
            versions=st.versions.at[slot, :n].set(jnp.asarray(row["versions"], jnp.int32)))
        if k_top and n:
            self._state = self._state._replace(
                topk_ids=self._state.topk_ids.at[slot, :n].set(jnp.asarray(row["topk_ids"], jnp.int32)),
                topk_logprobs=self._state.topk_logprobs.at[slot, :n].set(jnp.asarray(row["topk_logprobs"],
                                                                                     jnp.float32)))

    def run(self) -> dict[int, Completion]:
        """Drive the stream until every submitted prompt has finished; their completions by request id."""
        finished: dict[int, Completion] = {}
        while self.busy:
            finished.update(self.advance())
        return finished

    @property
    def waiting(self) -> int:
        """Prompts queued and not yet admitted."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Slots holding a response under way."""
        return sum(r >= 0 for r in self._slot_request)

    def advance(self) -> dict[int, Completion]:
        """One round: admit waiting prompts into free slots, give running rows their next chunk's pages (preempting
        if none can move), run one decode chunk, collect the rows that finished."""
        self.dispatch()
        return self.collect()

    def dispatch(self) -> None:
        """The first half of `advance`: admission, pages and the decode call, dispatched without waiting for the
        device (so the streams of several devices driven from one thread run concurrently: `run_streams`)."""
        self._admit_waiting()
        runnable = self._grow_running()
        table = self._put(self.pool.table[:, :self._attended_pages(runnable)])
        self._state, self._steps_run = _decode_jit(self.config, self.sampling, self.shape.page_size,
                                                   self.shape.chunk, self._params, self._state, table,
                                                   self._put(runnable), self._put(np.int32(self._version)))
        self.stats.decode_calls += 1

    def collect(self) -> dict[int, Completion]:
        """The second half of `advance`: wait for the decode call, take the finished rows out, free their slots."""
        steps, done, step = jax.device_get((self._steps_run, self._state.done, self._state.step))
        self._host_step = np.array(step, np.int64)
        self.stats.slot_steps += self.shape.slots * int(steps)
        finished_slots = [s for s in self._admitted_order if done[s]]
        if not finished_slots:
            return {}
        fields = jax.device_get((self._state.tokens, self._state.logprobs, self._state.versions,
                                 self._state.topk_ids, self._state.topk_logprobs))
        tokens, logprobs, versions, topk_ids, topk_logprobs = fields
        out = {}
        k_top = self.sampling.top_k_logprobs
        for slot in finished_slots:
            n = int(self._host_step[slot])
            request_id = self._slot_request[slot]
            out[request_id] = Completion(tokens[slot, :n].copy(), logprobs[slot, :n].copy(), versions[slot, :n].copy(),
                                         topk_ids[slot, :n].copy() if k_top else None,
                                         topk_logprobs[slot, :n].copy() if k_top else None)
            self.stats.tokens += n
            del self._requests[request_id]
            self._release(slot)
        return out

    @property
    def busy(self) -> bool:
        """Whether prompts are waiting or running."""
        return bool(self._waiting) or bool(self._admitted_order)

    def _attended_pages(self, runnable: np.ndarray) -> int:
        """Pages the decode call attends over: the most any runnable row holds, rounded up to a power of two (a
        few compiled shapes), so a call without a long row does not pay for the longest row's width."""
        most = max((self.pool.held(s) for s in np.flatnonzero(runnable)), default=1)
        return min(self.pool.pages_per_row, 1 << max(most - 1, 0).bit_length())

    def _put(self, x):
        return jnp.asarray(x) if self.device is None else jax.device_put(x, self.device)

    def _initial_state(self, keys) -> StreamState:
        logits_dtype = jax.eval_shape(
            lambda p, t: head_apply(self.config, p[HEAD], embed_apply(self.config, p[EMBED], t), p[EMBED]),
            self._params, jax.ShapeDtypeStruct((1, 1), jnp.int32)).dtype
        keys = keys if self.device is None else jax.device_put(keys, self.device)
        return _empty_state(self.config, self.sampling, self.shape, self.pool.pages, keys, jnp.dtype(logits_dtype).name)

    def _admit_waiting(self) -> None:
        free_slots = [s for s, r in enumerate(self._slot_request) if r < 0]
        admitted: list[tuple[int, int]] = []
        for slot in free_slots:
            if not self._waiting:
                break
            request = self._requests[self._waiting[0]]
            reserve = len(self._admitted_order)  # a page of headroom per running row
            if self.pool.free - reserve < pages_for(len(request.prompt), self.shape.page_size):
                break
            self.pool.grow(slot, len(request.prompt))
            request_id = self._waiting.popleft()
            self._slot_request[slot] = request_id
            self._host_step[slot] = 0
            self._admitted_order.append(slot)
            admitted.append((request_id, slot))
        for start in range(0, len(admitted), self.shape.prefill_rows):
            self._prefill(admitted[start:start + self.shape.prefill_rows])

    def _prefill(self, batch: list[tuple[int, int]]) -> None:
        keys = [self._requests[r].key for r, _ in batch]
        keys = jnp.stack(keys + [keys[0]] * (self.shape.prefill_rows - len(batch)))
        self._run_prefill(_admit_jit, (self.config, self.sampling, self.shape.page_size),
                          [self._requests[r].prompt for r, _ in batch], [s for _, s in batch],
                          self.max_prompt_tokens, keys)
        self.stats.admit_calls += 1

    def _run_prefill(self, program, static, sequences, slots, width, *extra) -> None:
        """Run `program` (admit or refill) on `sequences` for `slots`, padded to `prefill_rows` rows (the unused
        ones aimed at slot S, whose writes are dropped) and left-padded to the bucket of `width`."""
        unused = self.shape.prefill_rows - len(sequences)
        tokens, lengths = left_pad_prompts([*sequences, *[np.zeros(1, np.int32)] * unused],
                                           self.sampling.prompt_bucket, self.sampling.pad_token_id, width)
        slots = np.array([*slots, *[self.shape.slots] * unused], np.int32)
        table = self.pool.table[np.minimum(slots, self.shape.slots - 1)]
        self._state = program(*static, self._params, self._state,
                              *(self._put(x) for x in (tokens, lengths, slots, table)), *extra)

    def _grow_running(self) -> np.ndarray:
        """Which slots may decode this chunk: every running row that got the pages for its next `chunk` tokens,
        oldest first; when none could, the youngest running row is preempted and the others tried again."""
        step = self._host_step
        while True:
            runnable = np.zeros(self.shape.slots, bool)
            for slot in self._admitted_order:
                prompt_len = len(self._requests[self._slot_request[slot]].prompt)
                tokens = min(prompt_len + int(step[slot]) + self.shape.chunk,
                             prompt_len + self.sampling.max_new_tokens - 1)
                runnable[slot] = self.pool.grow(slot, tokens)
            self.stats.peak_pages = max(self.stats.peak_pages, self.pool.usable - self.pool.free)
            if runnable.any() or not self._admitted_order:
                self.stats.held += int(len(self._admitted_order) - runnable.sum())
                return runnable
            self._preempt(self._admitted_order[-1])

    def _preempt(self, slot: int) -> None:
        request_id = self._slot_request[slot]
        self._release(slot)
        self._waiting.appendleft(request_id)
        self.stats.preempted += 1
        # the slot's device state is stale, not harmful: its `done` flag is set again at its next admission
        self._state = self._state._replace(done=self._state.done.at[slot].set(True))

    def _release(self, slot: int) -> None:
        self.pool.release(slot)
        self._slot_request[slot] = -1
        self._admitted_order.remove(slot)


def stream_generate(model: Decoder | DecoderConfig, prompts: Sequence[Sequence[int]], *, key: jax.Array,
                    sampling: SamplingParams, shape: StreamShape, params=None,
                    device: jax.Device | None = None) -> tuple[list[Completion], StreamStats]:
    """Sample one response per prompt through a `ContinuousSampler` (see the module docstring); the completions in
    prompt order and what the stream did."""
    if len(prompts) == 0:
        raise ValueError("stream_generate: no prompts")
    sampler = ContinuousSampler(model, sampling, shape, max_prompt_tokens=max(len(p) for p in prompts),
                                params=params, device=device)
    ids = sampler.submit(prompts, key)
    finished = sampler.run()
    return [finished[i] for i in ids], sampler.stats


def run_streams(samplers: Sequence[ContinuousSampler]) -> list[dict[int, Completion]]:
    """Drive several samplers (one per device) from this thread until all are done: each round dispatches every
    busy sampler's decode call before waiting for any, so the devices compute concurrently. Their completions,
    per sampler."""
    finished: list[dict[int, Completion]] = [{} for _ in samplers]
    while any(s.busy for s in samplers):
        busy = [i for i, s in enumerate(samplers) if s.busy]
        for i in busy:
            samplers[i].dispatch()
        for i in busy:
            finished[i].update(samplers[i].collect())
    return finished


def as_generation(completions: Sequence[Completion], sampling: SamplingParams) -> Generation:
    """Completions as `generate`'s padded arrays (host numpy): tokens / log-probs [B, N] (pad_token_id / 0 after
    a row's end), lengths [B] and the top-K arrays or None."""
    n, k_top = sampling.max_new_tokens, sampling.top_k_logprobs
    b = len(completions)
    tokens = np.full((b, n), sampling.pad_token_id, np.int32)
    logprobs = np.zeros((b, n), np.float32)
    topk_ids = np.full((b, n, k_top), sampling.pad_token_id, np.int32) if k_top else None
    topk_logprobs = np.zeros((b, n, k_top), np.float32) if k_top else None
    for row, c in enumerate(completions):
        tokens[row, :len(c.tokens)], logprobs[row, :len(c.tokens)] = c.tokens, c.logprobs
        if k_top:
            topk_ids[row, :len(c.tokens)], topk_logprobs[row, :len(c.tokens)] = c.topk_ids, c.topk_logprobs
    lengths = np.array([len(c.tokens) for c in completions], np.int32)
    return Generation(tokens, logprobs, lengths, topk_ids, topk_logprobs)
