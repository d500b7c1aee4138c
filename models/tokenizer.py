"""Tokenizers from a HF directory's `tokenizer.json`, through the `tokenizers` library (no transformers needed),
and a built-in byte-level tokenizer (made offline, nothing downloaded).

`tokenizer_config.json`, when present, supplies the names of the special tokens (bos / eos / pad); the token
strings are resolved to ids through the tokenizer's vocabulary. Chat templates are not rendered here.

The built-in tokenizer maps each UTF-8 byte to one id (id = byte value, 0..255) and adds special tokens for
padding, sequence boundaries and chat roles after them. It needs no training and no files, so every run and test
has a tokenizer; a model trained with it is exported together with its `tokenizer.json` (`save_tokenizer`).
"""
from __future__ import annotations

import json
import os
from typing import Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>", "tool": "<|tool|>"}
SPECIAL_TOKENS = (PAD, BOS, EOS) + tuple(ROLE_TOKENS.values())


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


def byte_level_tokenizer() -> Tokenizer:
    """The built-in tokenizer: 256 byte ids, then the special tokens (see SPECIAL_TOKENS)."""
    # the byte-level pre-tokenizer's alphabet, each byte one visible character: printable bytes stand for
    # themselves, the others are shifted to unused code points from 256 on
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in printable]
    vocab = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    if backend.get_vocab_size(with_added_tokens=True) != 256 + len(SPECIAL_TOKENS):
        raise RuntimeError("the byte-level alphabet does not have 256 symbols: tokenizers changed its ByteLevel map")
    return Tokenizer(backend, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """`path` may be a HF directory (tokenizer.json [+ tokenizer_config.json], see `Tokenizer.from_pretrained`), a
    tokenizer.json file, or None for the built-in byte-level tokenizer. A bare file has no special-token names
    unless they are the built-in ones (<|bos|>, <|eos|>, <|pad|>) present in its vocabulary."""
    if path is None:
        return byte_level_tokenizer()
    if os.path.isdir(path):
        return Tokenizer.from_pretrained(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer {path} does not exist: no {TOKENIZER_FILE} there (give a "
                                f"{TOKENIZER_FILE} file or a HF directory)")
    try:
        backend = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the tokenizers library raises a bare Exception on malformed files
        raise ValueError(f"tokenizer {path} could not be read: {e}") from None
    special = {f"{role}_token": tok for role, tok in (("bos", BOS), ("eos", EOS), ("pad", PAD))
               if backend.token_to_id(tok) is not None}
    return Tokenizer(backend, **special)


def save_tokenizer(tokenizer: Tokenizer, directory: str) -> None:
    """Writes tokenizer.json and tokenizer_config.json (special-token names) so `load_tokenizer(directory)` and
    transformers' fast tokenizers can read it back."""
    os.makedirs(directory, exist_ok=True)
    tokenizer.backend.save(os.path.join(directory, TOKENIZER_FILE))
    names = {f"{role}_token": tokenizer.backend.id_to_token(token_id) for role in ("bos", "eos", "pad")
             if (token_id := getattr(tokenizer, f"{role}_token_id")) is not None}
    names["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(os.path.join(directory, TOKENIZER_CONFIG_FILE), "w") as f:
        json.dump(names, f, indent=2)


def model_vocab_size(tokenizer: Tokenizer, multiple: int = 8) -> int:
    """The embedding rows a fresh model needs for `tokenizer`, rounded up to a multiple (friendlier shapes)."""
    return -(-tokenizer.vocab_size // multiple) * multiple
