"""Tokenizers, with Megatron-LM's flags (``--tokenizer-type`` and its files). Every one works offline.

* ``ByteLevel`` (default): one token per UTF-8 byte (0-255) plus an end-of-document token; no file.
* ``GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt``: GPT-2's byte-level BPE through the
  ``tokenizers`` package (``pip install tokenizers``). Megatron-Core 0.16.1's own path for this type
  (``MegatronHFTokenizer``) passes the vocabulary file where the merges file belongs and resolves the
  tokenizer by its Hub name ("gpt2"), so it cannot run offline; docs/data.md says more.
* ``HuggingFaceTokenizer --tokenizer-model PATH``: a fast tokenizer's ``tokenizer.json`` (the file, or a
  directory holding it), through ``tokenizers``; the end-of-document token is the ``eos_token`` of a
  ``tokenizer_config.json`` beside it, else the first of the usual names the vocabulary has.
* ``SentencePieceTokenizer --tokenizer-model m.model`` and ``TikTokenizer --tokenizer-model f.json
  [--vocab-size N]``: Megatron-Core's wrappers (``megatron.core.tokenizers``; ``pip install sentencepiece`` /
  ``tiktoken``); TikTokenizer's ids start after 1000 special ids, ``--vocab-size`` (default 131072) cuts it.
* ``NullTokenizer --vocab-size N``: Megatron-Core's; ids written as numbers, ``N`` is the end-of-document
  id (the tokenizer has ``N + 1`` ids, as in Megatron-LM).

Each tokenizer offers ``name``, ``vocab_size``, ``eod``, ``tokenize(text) -> list[int]``,
``detokenize(ids)`` and ``unique_identifiers`` (what Megatron-Core's datasets name their cached indices by).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from collections import OrderedDict
from typing import Any, Callable, Protocol

TOKENIZER_TYPES = ("ByteLevel", "GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer",
                   "TikTokenizer", "NullTokenizer")
SIZED_BY_FLAG = ("NullTokenizer", "TikTokenizer")
"""Tokenizers whose size ``--vocab-size`` sets (Megatron-LM's meaning); for the others it sets the model's."""
TIKTOKEN_SPECIAL_IDS = 1000
"""Megatron-LM's ``--tiktoken-num-special-tokens`` default: ids below it are special, the vocabulary's ranks follow."""
EOD_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")
"""End-of-document tokens looked for in a Hugging Face vocabulary without an ``eos_token`` setting."""


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eod: int

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids) -> str: ...

    @property
    def unique_identifiers(self) -> OrderedDict: ...


class ByteLevelTokenizer:
    """Byte-level tokenizer: needs no vocabulary file and no network."""

    name = "ByteLevel"

    def __init__(self) -> None:
        self.eod = 256
        self.vocab_size = 257

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict({"class": "ByteLevelTokenizer", "vocab_size": 257})

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class FastTokenizer:
    """A ``tokenizers.Tokenizer`` (GPT-2's byte-level BPE, or any fast tokenizer's ``tokenizer.json``)."""

    def __init__(self, name: str, tokenizer: Any, eod: int, source: dict) -> None:
        self.name, self._tokenizer, self.eod = name, tokenizer, eod
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._source = source

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict({"class": self.name, "vocab_size": self.vocab_size, "eod": self.eod, **self._source})

    def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


class LibraryTokenizer:
    """One of Megatron-Core's tokenizer libraries (``megatron.core.tokenizers.text.libraries``)."""

    def __init__(self, name: str, library: Any, source: dict) -> None:
        self.name, self._library, self._source = name, library, source
        self.vocab_size = int(library.vocab_size)
        self.eod = int(library.eod)

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict({"class": self.name, "vocab_size": self.vocab_size, "eod": self.eod, **self._source})

    def tokenize(self, text: str) -> list[int]:
        return [int(i) for i in self._library.text_to_ids(text)]

    def detokenize(self, ids) -> str:
        return self._library.ids_to_text([int(i) for i in ids])


def _package(module: str, tokenizer_type: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs the {module!r} package: "
                         f"pip install {module}") from None


def _existing(path: str | None, flag: str, tokenizer_type: str) -> str:
    if not path:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if not os.path.exists(path):
        raise ValueError(f"{flag} {path}: no such file or directory (--tokenizer-type {tokenizer_type})")
    return path


def _gpt2_bpe(vocab_file: str | None, merge_file: str | None) -> FastTokenizer:
    name = "GPT2BPETokenizer"
    vocab = _existing(vocab_file, "--vocab-file", name)
    merges = _existing(merge_file, "--merge-file", name)
    tokenizers = _package("tokenizers", name)
    bpe = tokenizers.ByteLevelBPETokenizer(vocab, merges)  # GPT-2: byte-level, its regex, no prefix space
    eod = bpe.token_to_id("<|endoftext|>")
    if eod is None:
        raise ValueError(f"--vocab-file {vocab} has no '<|endoftext|>' token, GPT-2's end of document")
    return FastTokenizer(name, bpe, eod, {"vocab_file": os.path.abspath(vocab), "merge_file": os.path.abspath(merges)})


def _hugging_face(model: str | None) -> FastTokenizer:
    name = "HuggingFaceTokenizer"
    path = _existing(model, "--tokenizer-model", name)
    directory, file = (path, os.path.join(path, "tokenizer.json")) if os.path.isdir(path) else \
        (os.path.dirname(path), path)
    if not os.path.isfile(file):
        raise ValueError(f"--tokenizer-model {path}: no tokenizer.json (a fast tokenizer's file, or the directory "
                         "holding it)")
    tokenizers = _package("tokenizers", name)
    tokenizer = _load_model_file(name, file, lambda: tokenizers.Tokenizer.from_file(file))
    eod, candidates = None, list(EOD_NAMES)
    config = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(config):
        try:
            with open(config, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
        except (ValueError, AttributeError) as exc:  # not JSON, or JSON that is no object
            raise ValueError(f"{config}: not a tokenizer_config.json ({exc}); fix or remove it") from None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        candidates = [eos] if eos else candidates
    for token in candidates:
        eod = tokenizer.token_to_id(token)
        if eod is not None:
            break
    if eod is None:
        raise ValueError(f"--tokenizer-model {path}: no end-of-document token (looked for {candidates}); set "
                         "eos_token in a tokenizer_config.json beside tokenizer.json")
    return FastTokenizer(name, tokenizer, eod, {"tokenizer_model": os.path.abspath(file)})


def _load_model_file(tokenizer_type: str, path: str, load: Callable[[], Any]) -> Any:
    """``load()``, the tokenizer library reading the ``--tokenizer-model`` file; a file it cannot read is a
    ``ValueError`` naming the flag, not the library's own exception (sentencepiece raises ``RuntimeError``,
    tiktoken an ``AssertionError``, the tokenizers package its ``Exception``)."""
    try:
        return load()
    except Exception as exc:  # the libraries share no exception type for a file they cannot parse
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ValueError(f"--tokenizer-model {path}: not a {tokenizer_type} model file ({reason}); pass the "
                         "tokenizer's own model file") from None


def _megatron_core(tokenizer_type: str, model: str | None, vocab_size: int | None) -> LibraryTokenizer:
    libraries = "megatron.core.tokenizers.text.libraries"
    if tokenizer_type == "NullTokenizer":
        if not vocab_size or vocab_size <= 0:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size N (ids 0..N-1, N the end of "
                             "document)")
        # start-up time: megatron.core.tokenizers takes ~3 s to import; flag parsing with ByteLevel skips it
        from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

        return LibraryTokenizer(tokenizer_type, NullTokenizer(vocab_size), {"vocab_size_flag": vocab_size})
    path = _existing(model, "--tokenizer-model", tokenizer_type)
    if tokenizer_type == "SentencePieceTokenizer":
        _package("sentencepiece", tokenizer_type)
        load = importlib.import_module(f"{libraries}.sentencepiece_tokenizer").SentencePieceTokenizer
        library = _load_model_file(tokenizer_type, path, lambda: load(path))
    else:  # TikTokenizer: Megatron-LM's defaults (1000 special ids first; --vocab-size cuts the vocabulary)
        _package("tiktoken", tokenizer_type)
        module = importlib.import_module(f"{libraries}.tiktoken_tokenizer")
        size = vocab_size or module.DEFAULT_TIKTOKEN_MAX_VOCAB
        library = _load_model_file(tokenizer_type, path, lambda: module.TikTokenTokenizer(
            path, num_special_tokens=TIKTOKEN_SPECIAL_IDS, vocab_size=size))
    return LibraryTokenizer(tokenizer_type, library, {"tokenizer_model": os.path.abspath(path),
                                                      "vocab_size_flag": vocab_size})


@functools.lru_cache(maxsize=8)
def build_tokenizer(tokenizer_type: str = "ByteLevel", *, vocab_file: str | None = None,
                    merge_file: str | None = None, tokenizer_model: str | None = None,
                    vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer the flags name; ``ValueError`` naming the missing flag, file or package. Built once per
    set of flags in a process (the flag check, the vocabulary size, the data and the model all ask)."""
    if tokenizer_type == "ByteLevel":
        return ByteLevelTokenizer()
    if tokenizer_type == "GPT2BPETokenizer":
        return _gpt2_bpe(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return _hugging_face(tokenizer_model)
    if tokenizer_type in ("SentencePieceTokenizer", "TikTokenizer", "NullTokenizer"):
        return _megatron_core(tokenizer_type, tokenizer_model, vocab_size)
    raise ValueError(f"unknown --tokenizer-type {tokenizer_type!r}; available: {', '.join(TOKENIZER_TYPES)}")


def tokenizer_from_args(data, vocab_size: int | None = None) -> Tokenizer:
    """:func:`build_tokenizer` from the parsed ``DataArgs`` (``vocab_size``: ``--vocab-size``, NullTokenizer's)."""
    return build_tokenizer(data.tokenizer_type, vocab_file=data.vocab_file, merge_file=data.merge_file,
                           tokenizer_model=data.tokenizer_model, vocab_size=vocab_size)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int = 1) -> int:
    """Megatron pads the vocabulary so the embedding splits evenly over tensor-parallel ranks."""
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple
