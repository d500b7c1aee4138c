"""The built-in SFT dataset: generated locally from a seed, no files, no network.

Lengths follow a long-tailed post-training shape scaled to CPU sizes: a log-normal restricted to 32..2048
tokens with mean 110 (`jodc.sim.lengths.LengthDistribution`, the generator behind the simulator's LongAlign-like
presets): about 90% of sequences are 32-200 tokens, 1% are longer than 570, a few reach 1-2K. That is the
imbalance ODC is for, at a size a CPU trains in minutes.

Content is learnable: the prompt is `"<task>: <words>\\n"` over a small fixed vocabulary of made-up words, and the
completion is a deterministic function of the words: `copy`, `reverse` (word order), `sort` (alphabetical) or
`upper` (upper case). A tiny model first learns the words' spelling (the loss falls fast), then the tasks.
Lengths are counted for the built-in byte-level tokenizer (one token per character); another tokenizer gives
other lengths for the same text.
"""
from __future__ import annotations

import numpy as np

from jodc.sim.lengths import LengthDistribution

_SOLVERS = {"copy": " ".join, "reverse": lambda words: " ".join(reversed(words)),
            "sort": lambda words: " ".join(sorted(words)), "upper": lambda words: " ".join(words).upper()}
TASKS = tuple(_SOLVERS)
MIN_TOKENS, MAX_TOKENS, MEAN_TOKENS, SIGMA = 32, 2048, 110.0, 1.0
_SYLLABLES = ("ka", "lo", "mi", "nu", "re", "sa", "to", "vi", "ze", "po", "da", "fe", "gu", "hi", "ja", "wo")
_VOCAB_SEED = 20240601  # fixed: the made-up language is the same whatever the dataset seed


def length_distribution() -> LengthDistribution:
    """The embedded dataset's length distribution (lengths longer than data.max_length are then truncated or
    dropped like any other data's)."""
    return LengthDistribution(name="embedded_sft", min_len=MIN_TOKENS, max_len=MAX_TOKENS, mean=MEAN_TOKENS,
                              sigma=SIGMA, tail="truncate",
                              source="CPU-scale long tail: 32-2048 tokens, mean 110 (jodc.train.sft.embedded)")


def vocabulary(size: int = 64) -> list[str]:
    """`size` distinct made-up words of 2-4 syllables, always the same."""
    rng = np.random.default_rng(_VOCAB_SEED)
    words: list[str] = []
    while len(words) < size:
        word = "".join(rng.choice(_SYLLABLES, size=int(rng.integers(2, 5))))
        if word not in words:
            words.append(word)
    return words


def solve(task: str, words: list[str]) -> str:
    """The completion of `task` on `words`."""
    if task not in _SOLVERS:
        raise ValueError(f"unknown task {task!r}; tasks are {', '.join(TASKS)}")
    return _SOLVERS[task](words)


def _words_of_length(rng: np.random.Generator, vocab: list[str], chars: int) -> list[str]:
    """Random words whose space-joined text nearly fills `chars` characters (at least one word): words are drawn
    at random, and once the room left is short, from the words that still fit."""
    longest, shortest = max(map(len, vocab)), min(map(len, vocab))
    words = [vocab[int(rng.integers(len(vocab)))]]
    length = len(words[0])
    while True:
        room = chars - length - 1
        if room < shortest:
            return words
        word = vocab[int(rng.integers(len(vocab)))]
        if room < longest and len(word) > room:
            fitting = [w for w in vocab if len(w) <= room]
            word = fitting[int(rng.integers(len(fitting)))]
        words.append(word)
        length += 1 + len(word)


def generate_records(num_examples: int, seed: int = 0) -> list[dict]:
    """`num_examples` prompt/completion records, a pure function of (num_examples, seed)."""
    if num_examples < 1:
        raise ValueError(f"the embedded dataset needs at least one example, got {num_examples}")
    lengths = length_distribution().sample(num_examples, seed=seed)
    rng = np.random.default_rng([seed, 1])
    vocab = vocabulary()
    records = []
    for total in lengths:
        task = TASKS[int(rng.integers(len(TASKS)))]
        # tokens: bos + "task: " + text + "\n" + text + eos, with len(task) + 2 + 1 + 2 overhead
        chars = max(2, (int(total) - len(task) - 5) // 2)
        words = _words_of_length(rng, vocab, chars)
        records.append({"prompt": f"{task}: {' '.join(words)}\n", "completion": solve(task, words)})
    return records
