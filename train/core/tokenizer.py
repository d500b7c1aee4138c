"""Tokenizers for training: a built-in byte-level tokenizer (made offline, nothing downloaded) or a user's.

The built-in one maps each UTF-8 byte to one id (id = byte value, 0..255) and adds special tokens for padding,
sequence boundaries and chat roles after them. It needs no training and no files, so every run and test has a
tokenizer; a model trained with it is exported together with its `tokenizer.json`.
"""
from __future__ import annotations

import json
import os

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from jodc.models.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Tokenizer

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>", "tool": "<|tool|>"}
SPECIAL_TOKENS = (PAD, BOS, EOS) + tuple(ROLE_TOKENS.values())


def _byte_to_unicode() -> dict[int, str]:
    """The byte-level pre-tokenizer's alphabet: printable bytes stand for themselves, the others are shifted to
    unused code points from 256 on, so every byte is one visible character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping, shift = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def byte_level_tokenizer() -> Tokenizer:
    """The built-in tokenizer: 256 byte ids, then the special tokens (see SPECIAL_TOKENS)."""
    vocab = {char: byte for byte, char in _byte_to_unicode().items()}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    if backend.get_vocab_size(with_added_tokens=True) != 256 + len(SPECIAL_TOKENS):
        raise RuntimeError("the byte-level alphabet does not have 256 symbols: tokenizers changed its ByteLevel map")
    return Tokenizer(backend, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def load_tokenizer(path: str | None) -> Tokenizer:
    """`path` may be a HF directory (tokenizer.json [+ tokenizer_config.json]), a tokenizer.json file, or None
    for the built-in byte-level tokenizer. A bare file has no special-token names unless they are the built-in
    ones (<|bos|>, <|eos|>, <|pad|>) present in its vocabulary."""
    if path is None:
        return byte_level_tokenizer()
    if os.path.isdir(path):
        return Tokenizer.from_pretrained(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer {path} does not exist (give a tokenizer.json file or a HF directory)")
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
    names = {}
    for role in ("bos", "eos", "pad"):
        token_id = getattr(tokenizer, f"{role}_token_id")
        if token_id is not None:
            names[f"{role}_token"] = tokenizer.backend.id_to_token(token_id)
    names["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(os.path.join(directory, TOKENIZER_CONFIG_FILE), "w") as f:
        json.dump(names, f, indent=2)


def model_vocab_size(tokenizer: Tokenizer, multiple: int = 8) -> int:
    """The embedding rows a fresh model needs for `tokenizer`, rounded up to a multiple (friendlier shapes)."""
    return -(-tokenizer.vocab_size // multiple) * multiple
