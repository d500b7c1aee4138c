"""Tokenizers from a HF directory's `tokenizer.json`, through the `tokenizers` library (no transformers needed).

`tokenizer_config.json`, when present, supplies the names of the special tokens (bos / eos / pad); the token
strings are resolved to ids through the tokenizer's vocabulary. Chat templates are not rendered here.
"""
from __future__ import annotations

import json
import os
from typing import Sequence

import tokenizers

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def _token_content(value) -> str | None:
    """Special tokens appear as plain strings or as {"content": ...} objects in tokenizer_config.json."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Text <-> token ids, plus the special token ids a sampler and a data pipeline need."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None):
        self.backend = backend
        self.bos_token_id = self._special_id("bos", bos_token)
        self.eos_token_id = self._special_id("eos", eos_token)
        self.pad_token_id = self._special_id("pad", pad_token)

    def _special_id(self, role: str, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer: {role} token {token!r} is not in the vocabulary")
        return token_id

    @classmethod
    def from_pretrained(cls, path: str) -> "Tokenizer":
        """Load `path/tokenizer.json` (and special token names from `path/tokenizer_config.json` if present)."""
        file = os.path.join(path, TOKENIZER_FILE)
        if not os.path.exists(file):
            raise FileNotFoundError(f"{path}: no {TOKENIZER_FILE} (only fast-tokenizer files are supported)")
        backend = tokenizers.Tokenizer.from_file(file)
        special: dict[str, str | None] = {}
        config_file = os.path.join(path, TOKENIZER_CONFIG_FILE)
        if os.path.exists(config_file):
            with open(config_file) as f:
                tok_config = json.load(f)
            for role in ("bos", "eos", "pad"):
                special[f"{role}_token"] = _token_content(tok_config.get(f"{role}_token"))
        return cls(backend, **special)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of one text (add_special_tokens applies the tokenizer's post-processor, e.g. a BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of many texts (ragged lists)."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of a list of ids."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string, or None if unknown."""
        return self.backend.token_to_id(token)


def load_tokenizer(path: str) -> Tokenizer:
    """`Tokenizer.from_pretrained(path)`."""
    return Tokenizer.from_pretrained(path)
