"""Write a Megatron indexed dataset (``<prefix>.bin`` / ``<prefix>.idx``) from JSONL or plain text.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus [--json-key text]
    python tools/preprocess_data.py --input book.txt --output-prefix data/book   # one document per blank-line block

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/gpt2 --tokenizer-type \\
        GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt --append-eod --workers 8

Megatron-LM's flags; every tokenizer runs offline (megatron/training/tokenizer.py; byte-level by default).
The files are written with ``megatron.core.datasets``' ``IndexedDatasetBuilder`` (uint16 ids for a
vocabulary of fewer than 65500 tokens, int32 above: Megatron-Core's ``DType.optimal_dtype``) and read back by ``IndexedDataset``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import uuid
from collections.abc import Iterator

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
                if not isinstance(record, dict):
                    raise ValueError(f"{path}:{line_no}: a JSON {type(record).__name__}, not an object; one "
                                     f'{{"{json_key}": "..."}} per line')
                if json_key not in record:
                    raise ValueError(f"{path}:{line_no}: no key {json_key!r}; pass --json-key")
                text = record[json_key]
                if not isinstance(text, str):  # str() would train on "None", "5" or a list's repr
                    raise ValueError(f"{path}:{line_no}: {json_key!r} holds {json.dumps(text)[:40]}, not a string; "
                                     "give the document's text, or drop the line")
                yield text
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


_TOKENIZER = None
"""A worker process's tokenizer (``--workers`` > 1), built once by :func:`_start_worker`."""


def _start_worker(spec: dict) -> None:
    global _TOKENIZER
    # here, not at the top: run as a script, the repository is on sys.path only once __main__ put it there
    from megatron.training.quiet import hold

    hold()  # a spawned process imports Megatron-Core afresh: its fallback warnings again, once per worker
    from megatron.training.tokenizer import build_tokenizer

    _TOKENIZER = build_tokenizer(**spec)


def _encode(text: str) -> list[int]:
    assert _TOKENIZER is not None
    return _TOKENIZER.tokenize(text)


def _replace_pair(staged: dict[str, str], output_prefix: str) -> None:
    """Put the complete ``staged`` files (``.bin`` and ``.idx``: their paths) in place of
    ``<output_prefix>.bin/.idx``. Two renames are not one atomic step, so the old ``.idx`` goes first:
    between the steps, and after a crash between them, a reader finds no ``.idx`` (training stops with "not
    found": run preprocessing again) rather than an old index beside a new ``.bin``, whose offsets point
    past its end or at other documents; the new ``.idx`` comes last, when its ``.bin`` is in place. (A reader
    that opened the old ``.idx`` before this ran can still meet the new ``.bin``: do not rewrite a dataset a
    running job reads.)"""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(output_prefix + ".idx")
    os.replace(staged[".bin"], output_prefix + ".bin")
    os.replace(staged[".idx"], output_prefix + ".idx")


def preprocess(input_path: str, output_prefix: str, json_key: str = "text", tokenizer_type: str = "ByteLevel",
               append_eod: bool = False, *, vocab_file: str | None = None, merge_file: str | None = None,
               tokenizer_model: str | None = None, vocab_size: int | None = None, workers: int = 1) -> int:
    """Tokenize every document of ``input_path`` into ``<output_prefix>.bin/.idx``; ``append_eod`` ends each
    document with the tokenizer's end-of-document token (Megatron-LM's ``--append-eod``: the training data
    then marks where one document stops and the next starts). The tokenizer flags are the training run's
    (megatron/training/tokenizer.py). ``workers`` > 1 tokenizes in that many processes; the output is the
    same file, documents in input order. Returns the number of documents."""
    import multiprocessing

    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from megatron.training.tokenizer import build_tokenizer

    if os.path.isdir(input_path):
        raise ValueError(f"--input {input_path}: is a directory; give the JSONL or text file itself")
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"--input {input_path}: no such file")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    spec = {"tokenizer_type": tokenizer_type, "vocab_file": vocab_file, "merge_file": merge_file,
            "tokenizer_model": tokenizer_model, "vocab_size": vocab_size}
    tokenizer = build_tokenizer(**spec)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:  # a file where a directory of the prefix belongs, no permission
        raise ValueError(f"--output-prefix {output_prefix}: cannot create its directory {out_dir} "
                         f"({exc.strerror}); give a prefix in a directory that can be written") from None
    # written beside the final names (same file system: the renames are atomic), put in place only once
    # both are complete: a run that fails partway leaves an existing pair as it was
    tag = f"{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    staged = {ext: f"{output_prefix}{ext}.{tag}" for ext in (".bin", ".idx")}
    builder: IndexedDatasetBuilder | None = None
    pool: multiprocessing.pool.Pool | None = None
    num_docs = 0
    try:
        builder = IndexedDatasetBuilder(staged[".bin"], dtype=DType.optimal_dtype(tokenizer.vocab_size))
        documents = iter_documents(input_path, json_key)
        encoded: Iterator[list[int]]
        if workers > 1:
            pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_start_worker, initargs=(spec,))
            encoded = pool.imap(_encode, documents, chunksize=64)  # in input order
        else:
            encoded = (tokenizer.tokenize(text) for text in documents)
        for ids in encoded:
            if not ids:
                continue
            if append_eod:
                ids.append(tokenizer.eod)
            builder.add_item(torch.tensor(ids, dtype=torch.int64))
            builder.end_document()
            num_docs += 1
        if num_docs == 0:
            raise ValueError(f"{input_path} holds no non-empty documents")
        builder.finalize(staged[".idx"])
        _replace_pair(staged, output_prefix)
    except BaseException:
        if builder is not None:
            builder.data_file.close()  # finalize closes it; a failure before leaves it open
        for path in staged.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        raise
    finally:
        if pool is not None:
            pool.terminate()
    return num_docs


def generated_dataset(directory: str, num_docs: int = 2000, seed: int = 0) -> str:
    """Prefix of a Megatron indexed dataset of ``num_docs`` generated documents (``tools/make_corpus.py``,
    nothing downloaded), written under ``directory``: what the benchmarks and tests train on."""
    from tools.make_corpus import write_corpus  # start-up time: only the callers that generate data need it

    corpus = os.path.join(directory, "c.jsonl")
    write_corpus(corpus, num_docs=num_docs, seed=seed)
    preprocess(corpus, os.path.join(directory, "corpus"), append_eod=True)
    return os.path.join(directory, "corpus")


def main(argv=None) -> int:
    # here, not at the top: run as a script, the repository is on sys.path only once __main__ put it there
    from megatron.training.quiet import hold

    hold()  # before Megatron-Core's first import: its ~8 lines of fallback warnings buried an error's one line
    from megatron.training.tokenizer import TOKENIZER_TYPES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="JSONL (one {'text': ...} per line) or plain text")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>.bin and <prefix>.idx")
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--tokenizer-type", default="ByteLevel", choices=TOKENIZER_TYPES)
    parser.add_argument("--vocab-file", help="GPT2BPETokenizer's vocab.json")
    parser.add_argument("--merge-file", help="GPT2BPETokenizer's merges.txt")
    parser.add_argument("--tokenizer-model", help="HuggingFaceTokenizer's tokenizer.json (or its directory), "
                        "SentencePieceTokenizer's .model, TikTokenizer's vocabulary file")
    parser.add_argument("--vocab-size", type=int, help="NullTokenizer's ids (N: the end-of-document id)")
    parser.add_argument("--append-eod", action="store_true",
                        help="end every document with the end-of-document token (recommended for training)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (output identical)")
    args = parser.parse_args(argv)
    try:
        n = preprocess(args.input, args.output_prefix, args.json_key, args.tokenizer_type, args.append_eod,
                       vocab_file=args.vocab_file, merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                       vocab_size=args.vocab_size, workers=args.workers)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} documents to {args.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
