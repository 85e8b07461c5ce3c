"""Offline tokenizers. ``ByteLevel``: one token per UTF-8 byte (0-255) plus an end-of-document token."""

from __future__ import annotations


class ByteLevelTokenizer:
    """Byte-level tokenizer: needs no vocabulary file and no network."""

    name = "ByteLevel"

    def __init__(self) -> None:
        self.eod = 256
        self.vocab_size = 257
        self.unique_identifiers = {"class": "ByteLevelTokenizer", "vocab_size": 257}
        """What Megatron-Core's datasets name their cached indices by."""

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def build_tokenizer(tokenizer_type: str) -> ByteLevelTokenizer:
    if tokenizer_type == "ByteLevel":
        return ByteLevelTokenizer()
    raise ValueError(f"unknown --tokenizer-type {tokenizer_type!r}; available: ByteLevel")


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int = 1) -> int:
    """Megatron pads the vocabulary so the embedding splits evenly over tensor-parallel ranks."""
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple
