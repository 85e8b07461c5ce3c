"""Tokenizers with Megatron-LM's flags, offline (megatron/training/tokenizer.py).

A GPT-2 BPE vocabulary and a SentencePiece model are trained here from the generated corpus (nothing is
downloaded); the corpus is preprocessed with Megatron-LM's flags (``--tokenizer-type GPT2BPETokenizer
--vocab-file --merge-file --append-eod --workers``) and a 4-rank expert-parallel job trains on it.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.training.arguments import ArgumentError, parse_args  # noqa: E402
from megatron.training.tokenizer import build_tokenizer  # noqa: E402
from tools.preprocess_data import preprocess  # noqa: E402

VOCAB = 512  # the conftest `bpe` fixture's vocabulary size


def test_gpt2_bpe_and_hugging_face_tokenizers_round_trip(bpe):
    corpus, vocab, merges, tokenizer_json = bpe
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tokenizer_json)
    text = json.loads(open(corpus).readline())["text"]
    ids = gpt2.tokenize(text)
    assert gpt2.vocab_size == len(json.load(open(vocab))) <= VOCAB and gpt2.eod == 0  # the special token first
    assert len(ids) < len(text.encode()) / 2, "BPE merges: fewer ids than bytes"
    assert gpt2.detokenize(ids) == text and hf.tokenize(text) == ids and hf.eod == gpt2.eod
    assert gpt2.unique_identifiers["class"] == "GPT2BPETokenizer"


def test_null_and_sentencepiece_tokenizers(bpe, tmp_path):
    null = build_tokenizer("NullTokenizer", vocab_size=100)
    assert (null.vocab_size, null.eod, null.tokenize("3 7 99")) == (101, 100, [3, 7, 99])

    spm = pytest.importorskip("sentencepiece")
    corpus = bpe[0]
    lines = tmp_path / "lines.txt"
    lines.write_text("\n".join(json.loads(line)["text"] for line in open(corpus)))
    spm.SentencePieceTrainer.train(input=str(lines), model_prefix=str(tmp_path / "sp"), vocab_size=300,
                                   model_type="bpe", minloglevel=2)
    sp = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "sp.model"))
    assert sp.vocab_size == 300 and 0 <= sp.eod < 300
    ids = sp.tokenize("the model trains")
    assert ids and max(ids) < 300 and sp.detokenize(ids) == "the model trains"


def test_tiktoken_tokenizer_from_a_ranks_file(tmp_path):
    """Megatron-Core's TikToken format: ``[{"rank", "token_bytes" (base64), "token_str"}]``, the 256 bytes
    first; here a few merges on top. Ids start after Megatron-LM's 1000 special ids."""
    import base64

    pytest.importorskip("tiktoken")
    pieces = [bytes([i]) for i in range(256)] + [b"th", b"he", b"the", b" t", b" the"]
    ranks = [{"rank": i, "token_bytes": base64.b64encode(p).decode(), "token_str": p.decode("latin-1")}
             for i, p in enumerate(pieces)]
    (tmp_path / "ranks.json").write_text(json.dumps(ranks))
    tok = build_tokenizer("TikTokenizer", tokenizer_model=str(tmp_path / "ranks.json"), vocab_size=1261)
    assert (tok.vocab_size, tok.eod) == (1261, 2)  # "</s>", the third special token
    ids = tok.tokenize("the theme")
    assert ids == [1000 + 258, 1000 + 260, 1000 + ord("m"), 1000 + ord("e")] and tok.detokenize(ids) == "the theme"


def test_bad_tokenizer_flags_name_the_fix(bpe, tmp_path):
    _, vocab, merges, _ = bpe
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab)
    with pytest.raises(ValueError, match="--vocab-file .*missing.json: no such file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "missing.json"), merge_file=merges)
    with pytest.raises(ValueError, match="NullTokenizer needs --vocab-size"):
        build_tokenizer("NullTokenizer")
    (tmp_path / "tok").mkdir()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tok"))
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--data-path", "x"]
    with pytest.raises(ArgumentError, match="needs --vocab-file"):
        parse_args([*base, "--tokenizer-type", "GPT2BPETokenizer"])
    with pytest.raises(ArgumentError, match="--vocab-size 100 is smaller than"):
        parse_args([*base, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
                    "--vocab-size", "100"])


def test_preprocess_with_megatron_flags_and_workers_gives_the_same_file(bpe, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    corpus, vocab, merges, _ = bpe
    flags = ["--input", corpus, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file",
             merges, "--append-eod"]
    from tools.preprocess_data import main

    assert main([*flags, "--output-prefix", str(tmp_path / "one")]) == 0
    assert main([*flags, "--output-prefix", str(tmp_path / "two"), "--workers", "2"]) == 0
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"one{ext}").read_bytes() == (tmp_path / f"two{ext}").read_bytes()
    ds = IndexedDataset(str(tmp_path / "one"))
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    first = json.loads(open(corpus).readline())["text"]
    assert list(ds[0]) == [*gpt2.tokenize(first), gpt2.eod] and len(ds) == 300
    assert main([*flags[:2], "--output-prefix", str(tmp_path / "x"), "--tokenizer-type", "NullTokenizer"]) == 2


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_four_rank_expert_parallel_job_trains_on_a_gpt2_bpe_corpus(bpe, tmp_path):
    """Preprocessed with GPT-2 BPE; 4 ranks, EP=4, 20 iterations: the loss falls. A ByteLevel run on the
    same files stops at start with one line naming the dataset and the tokenizer."""
    from tests._ft_helpers import torchrun

    corpus, vocab, merges, _ = bpe
    prefix = str(tmp_path / "gpt2")
    preprocess(corpus, prefix, tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges,
               append_eod=True)
    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
             "--seq-length", "32", "--max-position-embeddings", "32", "--num-experts", "4", "--moe-router-topk",
             "2", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "2",
             "--seed", "1234", "--split", "98,2,0", "--log-interval", "1", "--eval-interval", "0",
             "--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "alltoall",
             "--train-iters", "20", "--data-path", prefix]
    out = torchrun("pretrain_gpt_moe.py", [*model, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                                           "--merge-file", merges], nproc=4).stdout
    losses = [float(m) for m in re.findall(r"iteration +\d+/20 \| loss ([0-9.]+)", out)]
    assert len(losses) == 20, out[-3000:]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses
    print(f"GPT-2 BPE, EP=4: loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    proc = torchrun("pretrain_gpt_moe.py", [*model, "--tokenizer-type", "ByteLevel"], nproc=4, check=False)
    bad = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert re.search(rf"dataset {re.escape(prefix)} holds token id \d+, beyond the vocabulary of 384 "
                     r"\(--tokenizer-type ByteLevel\)", bad), bad[-3000:]
