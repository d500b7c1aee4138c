"""Partial rollouts (`rollout.partial_rollouts: true`): generation that carries on across policy updates.

Without them the sampler thread samples step s's rollout from first token to last under policy version s - k, so
every step waits for its longest response, and a slot that finished early idles until the step's batch is done.
Here each sampling device keeps one `ContinuousSampler` (models/stream.py) alive for the whole run, and the stream
moves in *phases*: phase p takes the weights of version max(0, p - k), carries the rows under way on under them
(each is prefilled again: `ContinuousSampler.set_params`), queues step p's prompts behind the rows under way, and
runs until every response of step p - 1 has finished; then step p - 1's rollout is complete and scored. A response
thus holds tokens of at most two versions (it starts in phase s under s - k and may end in phase s + 1 under
s + 1 - k), every token records its version and the log-prob it was sampled with, and the staleness bound holds per
token by construction: the oldest token of step s's rollout is k versions old when step s trains, like every token
of a rollout without partial rollouts. The slots freed by step s - 1's short responses start step s's prompts at
once, while its long responses finish.

The schedule is deterministic (phases end at a point of the stream's own progress, never of the trainer's timing),
so a run is reproducible; but the streams then idle while the thread waits for the next version. Without
`engine.deterministic` they keep generating meanwhile (`keep_generating`: the rows under way carry on under the
weights of their phase, which keeps the bound), so a response's split between its two versions depends on timing.

The thread delivers rollout s at the end of phase s + 1, one phase later than without partial rollouts (`lag = 1`:
it needs version s + 1 - k, so k >= 1). A checkpoint after step d holds the complete rollouts d .. d + k - 2 and the
stream as phase d + k - 1 left it (`state`: the rows under way and waiting, the responses of later steps already
finished); a resumed run restores it under version d, where the uninterrupted run carries its rows on under the same
version, so it continues bit for bit (with `engine.deterministic`). Across processes every process's streams go into
the checkpoint and each resumed process takes its own.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from jodc.models.stream import Completion, ContinuousSampler, StreamShape, as_generation

from .policy_weights import DeviceWeights
from .rollout import device_shares, encode_prompts, response_keys, rollout_of
from .sampler import RolloutSampler
from .scored import StepRollout


class PartialRollouts:
    """`produce(step, params, version)` for the sampler thread (async_rollouts.py) with partial rollouts: runs
    phase step + 1 under `params` (of `version`) and returns step `step`'s rollout (see the module docstring)."""

    lag = 1  # rollout s is complete at the end of phase s + 1, under version s + 1 - k

    def __init__(self, sampler: RolloutSampler, shape: StreamShape, *, keep_generating: bool = False):
        self.sampler, self.shape = sampler, shape
        if keep_generating:  # the sampler thread calls it while it waits for the next version
            self.idle_round = self._idle_round
        self._lock = threading.Lock()  # the streams: the sampler thread's rounds vs a checkpoint's snapshot
        self.streams: list[ContinuousSampler] | None = None  # one per sampling device, made at the first call
        self.submitted: int | None = None  # the last step whose prompts were queued
        self.owner: dict[tuple[int, int], tuple[int, int]] = {}  # (device, request id) -> (step, row of the share)
        self.finished: dict[int, dict[int, Completion]] = {}  # step -> row -> its completion
        self.expected: dict[int, int] = {}  # step -> responses of this process's share
        self._restored: dict[str, Any] | None = None

    def __call__(self, step: int, params, version: int) -> StepRollout:
        started = time.perf_counter()
        config, weights, fp32 = self.sampler.weights(params)
        with self._lock:
            self._carry_on(config, weights, version)
            if self.submitted is None:  # a fresh run: step `step`'s own prompts first (phase `step` merged in)
                self._submit(step)
            for later in range(self.submitted + 1, step + 2):
                self._submit(later)
            while len(self.finished[step]) < self.expected[step]:
                if not self._round():
                    raise RuntimeError(f"partial rollouts: step {step + 1}'s responses are missing from the streams")
            rows = self.finished.pop(step)
            self.expected.pop(step)
        share = self._share(step, [rows[i] for i in range(len(rows))], fp32, time.perf_counter() - started)
        return self.sampler.layout.step_rollout(step, lambda: share)

    # -- the phase ---------------------------------------------------------------------------------------------
    def _carry_on(self, config, weights, version: int) -> None:
        """The streams under this phase's weights: made (or restored from a checkpoint) at the first call, the rows
        under way prefilled again under them afterwards."""
        devices = self.sampler.local_devices()[1]
        on = [weights.on(d) if isinstance(weights, DeviceWeights) else weights for d in devices]
        if self.streams is None:
            self.streams = [ContinuousSampler(config, self.sampler.sampling, self.shape, params=w, device=d,
                                              version=version, max_prompt_tokens=self._max_prompt_tokens())
                            for w, d in zip(on, devices)]
            if self._restored is not None:
                for stream, snapshot, w in zip(self.streams, self._restored["streams"], on):
                    stream.restore(snapshot, w, version)
                self._restored = None
            return
        for stream, w in zip(self.streams, on):
            stream.set_params(w, version)

    def _max_prompt_tokens(self) -> int:
        """The widest prompt any step may bring, the streams' prefill width: the training pool's longest, else the
        task's longest in characters (a byte-level or BPE tokenizer makes at most one token per ASCII character)
        and a bos; a longer prompt is refused by the stream, naming the bound."""
        s = self.sampler
        if s.pool is not None:
            return max(len(ids) for ids in encode_prompts(s.tokenizer, [p.prompt for p in s.pool]))
        return s.task.max_prompt_chars + 1

    def _submit(self, step: int) -> None:
        """Queue this process's share of step `step`'s prompts, each device its own part, with their keys."""
        prompts, mine, devices, _ = self.sampler.step_prompts(step)
        g = self.sampler.rollout.group_size
        prompt_ids = [ids for ids in encode_prompts(self.sampler.tokenizer, prompts[mine.start:mine.stop])
                      for _ in range(g)]
        keys = response_keys(self.sampler.rollout_key(step), mine, g)
        self.finished[step], self.expected[step] = {}, len(prompt_ids)
        for device, share in enumerate(device_shares(len(mine), len(devices))):
            rows = range(share.start * g, share.stop * g)
            if rows:
                ids = self.streams[device].submit([prompt_ids[i] for i in rows], keys[rows.start:rows.stop])
                self.owner.update({(device, rid): (step, row) for rid, row in zip(ids, rows)})
        self.submitted = step

    def _round(self) -> bool:
        """One round of every busy stream (each decode call dispatched before any is waited for), its finished
        responses filed under their steps; False when no stream has work."""
        busy = [i for i, s in enumerate(self.streams or []) if s.busy]
        for i in busy:
            self.streams[i].dispatch()
        for i in busy:
            for request_id, completion in self.streams[i].collect().items():
                owner_step, row = self.owner.pop((i, request_id))
                self.finished[owner_step][row] = completion
        return bool(busy)

    def _idle_round(self) -> bool:
        """While the next version is awaited (`keep_generating`): the rows under way (and the next step's waiting
        prompts) carry on under the weights they have, one round; within the staleness bound, since those are the
        weights of their own phase. How far they get depends on the trainer's timing, so runs are not bit-exact."""
        with self._lock:
            return self._round()

    def _share(self, step: int, completions: list[Completion], fp32, seconds: float):
        """This process's share of step `step`'s rollout from its completions (rows in order), scored."""
        s = self.sampler
        prompts, mine, _, _ = s.step_prompts(step)
        g = s.rollout.group_size
        texts = [p for p in prompts[mine.start:mine.stop] for _ in range(g)]
        prompt_ids = [ids for ids in encode_prompts(s.tokenizer, prompts[mine.start:mine.stop]) for _ in range(g)]
        outs = [as_generation(completions, s.sampling)] if completions else []
        versions = [c.versions.astype(np.int32) for c in completions]
        rollout = rollout_of(s.tokenizer, s.sampling, texts, prompt_ids, outs, group_size=g, seconds=seconds,
                             token_versions=versions)
        oldest = np.array([int(v.min()) for v in versions], np.int64)
        return s.scored(step, rollout, oldest, fp32)

    # -- checkpoints -------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The streams as the last phase left them (between phases: the thread waits for the next version; with
        `keep_generating`, between two of its rounds), JSON."""
        with self._lock:
            return self._state()

    def _state(self) -> dict[str, Any]:
        if self.streams is None:
            return dict(self._restored or {})
        return {"streams": [s.snapshot() for s in self.streams], "submitted": self.submitted,
                "owner": [[d, rid, st, row] for (d, rid), (st, row) in self.owner.items()],
                "finished": [[st, row, _completion_json(c)] for st, rows in self.finished.items()
                             for row, c in rows.items()],
                "expected": [[st, n] for st, n in self.expected.items()]}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state` (a checkpoint's): the streams are restored at the next call, under its weights."""
        self._restored = state
        self.submitted = state["submitted"]
        self.owner = {(d, rid): (st, row) for d, rid, st, row in state["owner"]}
        self.expected = {st: n for st, n in state["expected"]}
        self.finished = {st: {} for st in self.expected}
        for st, row, c in state["finished"]:
            self.finished[st][row] = _completion_from_json(c)


def _completion_json(c: Completion) -> dict[str, Any]:
    return {"tokens": c.tokens.tolist(), "logprobs": c.logprobs.tolist(), "versions": c.versions.tolist(),
            "topk_ids": None if c.topk_ids is None else c.topk_ids.tolist(),
            "topk_logprobs": None if c.topk_logprobs is None else c.topk_logprobs.tolist()}


def _completion_from_json(data: dict[str, Any]) -> Completion:
    n = len(data["tokens"])

    def array(values, dtype):
        return None if values is None else np.asarray(values, dtype).reshape(n, -1)

    return Completion(np.asarray(data["tokens"], np.int32), np.asarray(data["logprobs"], np.float32),
                      np.asarray(data["versions"], np.int32), array(data["topk_ids"], np.int32),
                      array(data["topk_logprobs"], np.float32))
