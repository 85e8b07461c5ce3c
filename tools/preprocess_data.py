"""Write a Megatron indexed dataset (``<prefix>.bin`` / ``<prefix>.idx``) from JSONL or plain text.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus [--json-key text]
    python tools/preprocess_data.py --input book.txt --output-prefix data/book   # one document per blank-line block

Tokenisation is offline (byte-level); the files are written with ``megatron.core.datasets``'
``IndexedDatasetBuilder`` and read back by ``IndexedDataset``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch


def iter_documents(path: str, json_key: str):
    is_jsonl = path.endswith((".jsonl", ".json"))
    with open(path, encoding="utf-8") as f:
        if is_jsonl:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{line_no}: not valid JSON ({e}); one JSON object per line") from e
                if json_key not in record:
                    raise ValueError(f"{path}:{line_no}: no key {json_key!r}; pass --json-key")
                yield str(record[json_key])
        else:
            block: list[str] = []
            for line in f:
                if line.strip():
                    block.append(line)
                elif block:
                    yield "".join(block)
                    block = []
            if block:
                yield "".join(block)


def preprocess(input_path: str, output_prefix: str, json_key: str = "text", tokenizer_type: str = "ByteLevel",
               append_eod: bool = False) -> int:
    """Tokenize every document of ``input_path`` into ``<output_prefix>.bin/.idx``; ``append_eod`` ends each
    document with the tokenizer's end-of-document token (Megatron-LM's ``--append-eod``: the training data
    then marks where one document stops and the next starts). Returns the number of documents."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron.training.tokenizer import build_tokenizer

    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"--input {input_path}: no such file")
    tokenizer = build_tokenizer(tokenizer_type)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(output_prefix + ".bin", dtype=np.uint16)
    num_docs = 0
    for text in iter_documents(input_path, json_key):
        ids = tokenizer.tokenize(text)
        if not ids:
            continue
        if append_eod:
            ids.append(tokenizer.eod)
        builder.add_item(torch.tensor(ids, dtype=torch.int64))
        builder.end_document()
        num_docs += 1
    if num_docs == 0:
        raise ValueError(f"{input_path} holds no non-empty documents")
    builder.finalize(output_prefix + ".idx")
    return num_docs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="JSONL (one {'text': ...} per line) or plain text")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>.bin and <prefix>.idx")
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--tokenizer-type", default="ByteLevel", choices=["ByteLevel"])
    parser.add_argument("--append-eod", action="store_true",
                        help="end every document with the end-of-document token (recommended for training)")
    args = parser.parse_args(argv)
    try:
        n = preprocess(args.input, args.output_prefix, args.json_key, args.tokenizer_type, args.append_eod)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} documents to {args.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
