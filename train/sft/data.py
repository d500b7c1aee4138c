"""SFT examples: records -> token sequences with a mask of the tokens the loss trains on.

Two record shapes are accepted, one JSON object per line of a `.jsonl` file:

* `{"prompt": str, "completion": str}`: tokens are `[bos] prompt completion [eos]`; the loss covers the
  completion and the closing eos.
* `{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]}`: each message becomes
  `<|role|>\\n content [eos]` (a plain role-tag template; model-specific chat templates are not rendered); the loss
  covers every assistant message's content and its eos. At least one assistant message is required.

`Example.loss_mask[i]` says whether token `i` is *predicted* by the loss (it is the target of position `i - 1`);
the first token never is. Sequences longer than `max_length` are truncated or dropped (`overlong`), and examples
left without a trained token are dropped; `LoadReport` counts both so the trainer can say what happened. With
context parallelism (`engine.context_parallel`) `max_length` may exceed the engine's token cap, up to the world's
capacity (devices x cap); `LoadReport.context_parallel` counts the kept sequences longer than the cap, which the
planner splits over groups of devices.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Iterable, Sequence

import numpy as np

from jodc.models.tokenizer import ROLE_TOKENS, Tokenizer

from ..core.jsonl import JsonlError, iter_jsonl

ROLES = tuple(ROLE_TOKENS)


@dataclasses.dataclass(frozen=True)
class Example:
    """One tokenised training sequence."""

    tokens: np.ndarray     # int32 [s]
    loss_mask: np.ndarray  # bool [s]: token i is a trained target (of position i - 1)

    def __post_init__(self):
        if self.tokens.ndim != 1 or self.tokens.shape != self.loss_mask.shape:
            raise ValueError(f"an example needs 1-D tokens and loss_mask of one shape, got {self.tokens.shape} "
                             f"and {self.loss_mask.shape}")
        if self.tokens.size and self.loss_mask[0]:
            raise ValueError("the first token of a sequence cannot be a loss target (nothing precedes it)")

    @property
    def length(self) -> int:
        return int(self.tokens.size)

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclasses.dataclass
class LoadReport:
    """What loading did: examples kept, truncated to max_length, dropped for length or for having no loss token."""

    source: str
    kept: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_no_loss_tokens: int = 0
    context_parallel: int = 0  # kept sequences longer than the token cap: the planner splits them over groups

    def summary(self) -> str:
        parts = [f"{self.kept} examples from {self.source}"]
        if self.truncated:
            parts.append(f"{self.truncated} truncated to max_length")
        if self.dropped_overlong:
            parts.append(f"{self.dropped_overlong} dropped as longer than max_length")
        if self.dropped_no_loss_tokens:
            parts.append(f"{self.dropped_no_loss_tokens} dropped with no completion token left")
        if self.context_parallel:
            parts.append(f"{self.context_parallel} longer than engine.token_cap, split over context-parallel groups")
        return "; ".join(parts)


class RecordError(ValueError):
    """A malformed record; the message names the file and line."""


# ---------------------------------------------------------------------------------------------------------------
# records -> tokens
# ---------------------------------------------------------------------------------------------------------------


def _concat(pieces: Sequence[tuple[list[int], bool]]) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.array([t for ids, _ in pieces for t in ids], dtype=np.int32)
    mask = np.array([trained for ids, trained in pieces for _ in ids], dtype=bool)
    return tokens, mask


def _start(tokenizer: Tokenizer) -> list[int]:
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def _end(tokenizer: Tokenizer) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def encode_prompt_completion(tokenizer: Tokenizer, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, loss_mask) of `[bos] prompt completion [eos]`, loss on completion and eos."""
    pieces = [(_start(tokenizer), False), (tokenizer.encode(prompt, add_special_tokens=False), False),
              (tokenizer.encode(completion, add_special_tokens=False) + _end(tokenizer), True)]
    return _concat(pieces)


def encode_messages(tokenizer: Tokenizer, messages: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, loss_mask) of a conversation, loss on assistant contents and their eos (see module docstring)."""
    pieces = [(_start(tokenizer), False)]
    for message in messages:
        role = message["role"]
        header = tokenizer.encode(f"{ROLE_TOKENS[role]}\n", add_special_tokens=False)
        content = tokenizer.encode(message["content"], add_special_tokens=False)
        ending = _end(tokenizer) or tokenizer.encode("\n", add_special_tokens=False)
        pieces += [(header, False), (content + ending, role == "assistant")]
    return _concat(pieces)


def check_record(record, where: str) -> dict:
    """Returns `record` if it is a well-formed prompt/completion or messages record, else RecordError."""
    if not isinstance(record, dict):
        raise RecordError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise RecordError(f"{where}: 'messages' must be a non-empty list")
        for k, message in enumerate(messages):
            if not isinstance(message, dict) or not {"role", "content"} <= set(message):
                raise RecordError(f"{where}: messages[{k}] must be an object with 'role' and 'content'")
            if message["role"] not in ROLES:
                raise RecordError(f"{where}: messages[{k}] has role {message['role']!r}; roles are "
                                  f"{', '.join(ROLES)}")
            if not isinstance(message["content"], str):
                raise RecordError(f"{where}: messages[{k}].content must be a string")
        if not any(m["role"] == "assistant" for m in messages):
            raise RecordError(f"{where}: no assistant message, so nothing to train on")
        return record
    if "prompt" in record or "completion" in record:
        for key in ("prompt", "completion"):
            if not isinstance(record.get(key), str):
                raise RecordError(f"{where}: '{key}' must be a string, got {type(record.get(key)).__name__}")
        if not record["completion"]:
            raise RecordError(f"{where}: empty completion, so nothing to train on")
        return record
    raise RecordError(f"{where}: a record needs 'prompt' and 'completion', or 'messages'; got keys "
                      f"{sorted(record)}")


def encode_record(tokenizer: Tokenizer, record: dict) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, loss_mask) of a checked record."""
    if "messages" in record:
        return encode_messages(tokenizer, record["messages"])
    return encode_prompt_completion(tokenizer, record["prompt"], record["completion"])


# ---------------------------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------------------------


def read_jsonl(path: str) -> list[dict]:
    """The checked records of a JSONL file (blank lines skipped); RecordError naming `path:line` otherwise."""
    records = []
    try:
        for where, record in iter_jsonl(path, missing_hint="data.path: a .jsonl file or 'embedded'"):
            records.append(check_record(record, where))
    except FileNotFoundError as e:
        raise FileNotFoundError(f"data file {e}") from None
    except JsonlError as e:
        raise RecordError(str(e)) from None
    if not records:
        raise RecordError(f"{path}: no records")
    return records


def fit_to_length(encoded: Iterable[tuple[np.ndarray, np.ndarray]], max_length: int, overlong: str,
                  report: LoadReport, token_cap: int | None = None) -> list[Example]:
    """Applies the length policy ('truncate' keeps the first max_length tokens, 'drop' drops the sequence) and
    drops sequences with no loss token left; counts what happened in `report`, including (given the engine's
    `token_cap`) the kept sequences longer than it, which context parallelism splits over groups of devices."""
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be 'truncate' or 'drop', got {overlong!r}")
    examples = []
    for tokens, mask in encoded:
        if tokens.size > max_length:
            if overlong == "drop":
                report.dropped_overlong += 1
                continue
            tokens, mask = tokens[:max_length], mask[:max_length]
            report.truncated += 1
        if not mask.any():
            report.dropped_no_loss_tokens += 1
            continue
        examples.append(Example(tokens, mask))
        report.context_parallel += token_cap is not None and tokens.size > token_cap
    report.kept = len(examples)
    return examples


def load_records(records: Sequence[dict], tokenizer: Tokenizer, *, max_length: int, overlong: str,
                 source: str, token_cap: int | None = None) -> tuple[list[Example], LoadReport]:
    """Tokenises checked records and applies the length policy (`token_cap`: count the context-parallel ones)."""
    report = LoadReport(source)
    examples = fit_to_length((encode_record(tokenizer, r) for r in records), max_length, overlong, report,
                             token_cap)
    if not examples:
        raise ValueError(f"{source}: no usable example ({report.summary()})")
    return examples, report


def load_jsonl(path: str, tokenizer: Tokenizer, *, max_length: int, overlong: str = "truncate",
               token_cap: int | None = None) -> tuple[list[Example], LoadReport]:
    """Examples of a JSONL file (see the module docstring for the record shapes)."""
    return load_records(read_jsonl(path), tokenizer, max_length=max_length, overlong=overlong, source=path,
                        token_cap=token_cap)


def fingerprint_examples(examples: Sequence[Example]) -> dict:
    """{"examples": count, "sha256": hash of every example's tokens and loss mask, in order}: what a checkpoint
    records of its data, so that a resume on data edited in place (same path, same count) is noticed."""
    digest = hashlib.sha256()
    for e in examples:
        digest.update(np.int64(e.length).tobytes())
        digest.update(np.ascontiguousarray(e.tokens, np.int32).tobytes())
        digest.update(np.packbits(e.loss_mask).tobytes())
    return {"examples": len(examples), "sha256": digest.hexdigest()}
