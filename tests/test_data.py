"""Data that replays exactly: preprocessing and the batch of iteration t as a pure function."""

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.training.data import ReplayableData, TokenSamples, split_ranges  # noqa: E402
from megatron.training.tokenizer import ByteLevelTokenizer  # noqa: E402
from tools.make_corpus import write_corpus  # noqa: E402
from tools.preprocess_data import preprocess  # noqa: E402


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    write_corpus(str(d / "c.jsonl"), num_docs=300, seed=3)
    assert preprocess(str(d / "c.jsonl"), str(d / "corpus")) == 300
    return str(d / "corpus")


def make(prefix, dp=2, mbs=2, gbs=8, seed=11):
    samples = TokenSamples(prefix, seq_length=32, eod=ByteLevelTokenizer().eod)
    return ReplayableData(samples, split=[90, 10, 0], seed=seed, micro_batch_size=mbs, global_batch_size=gbs,
                          data_parallel_size=dp)


def test_preprocess_roundtrip(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    path = tmp_path / "docs.jsonl"
    docs = ["héllo wörld", "second document", "third"]
    path.write_text("\n".join(json.dumps({"text": t}) for t in docs) + "\n")
    preprocess(str(path), str(tmp_path / "out"))
    ds = IndexedDataset(str(tmp_path / "out"))
    tok = ByteLevelTokenizer()
    assert [tok.detokenize(ds[i]) for i in range(len(ds))] == docs


def test_preprocess_plain_text_and_errors(tmp_path):
    (tmp_path / "a.txt").write_text("para one\nline two\n\npara two\n")
    assert preprocess(str(tmp_path / "a.txt"), str(tmp_path / "t")) == 2
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        preprocess(str(tmp_path / "bad.jsonl"), str(tmp_path / "b"))
    (tmp_path / "key.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="--json-key"):
        preprocess(str(tmp_path / "key.jsonl"), str(tmp_path / "k"))
    with pytest.raises(FileNotFoundError):
        preprocess(str(tmp_path / "missing.jsonl"), str(tmp_path / "m"))


def test_batch_is_pure_function_of_seed_iteration_rank(prefix):
    a, b = make(prefix), make(prefix)
    # b computes iteration 37 cold; a walks there through all earlier iterations
    for t in range(37):
        a.batch_for_iteration(t, 0)
    for rank in (0, 1):
        for x, y in zip(a.batch_for_iteration(37, rank), b.batch_for_iteration(37, rank)):
            assert torch.equal(x.tokens, y.tokens) and torch.equal(x.labels, y.labels)
    other_seed = make(prefix, seed=12).batch_for_iteration(37, 0)[0]
    assert not torch.equal(other_seed.tokens, b.batch_for_iteration(37, 0)[0].tokens)


def test_layout_of_global_batch(prefix):
    data = make(prefix, dp=2, mbs=2, gbs=8)
    assert data.num_microbatches == 2
    t = 5
    ids = [data.sample_ids_for(t, m, r) for m in range(2) for r in range(2)]
    flat = [i for chunk in ids for i in chunk]
    assert len(set(flat)) == 8  # the 8 samples of a global batch are distinct
    # Megatron layout: micro-batch m of rank r starts at t*GBS + (m*DP + r)*MBS of the shuffled order
    assert data.sample_ids_for(t, 1, 0) == [data.global_sample_index(t * 8 + 4 + i) for i in range(2)]
    batch = data.microbatch(t, 0, 1)
    assert torch.equal(batch.tokens[:, 1:], batch.labels[:, :-1])  # labels are tokens shifted by one
    train_start, train_end = data.ranges[0]
    assert all(train_start <= i < train_end for i in flat)


def test_epochs_visit_every_train_sample_once(prefix):
    data = make(prefix)
    start, end = data.ranges[0]
    size = end - start
    first = [data.global_sample_index(p) for p in range(size)]
    second = [data.global_sample_index(size + p) for p in range(size)]
    assert sorted(first) == list(range(start, end)) == sorted(second)
    assert first != second  # reshuffled per epoch


def test_validation_split_and_errors(prefix):
    data = make(prefix)
    v0, v1 = data.ranges[1]
    assert all(v0 <= i < v1 for i in data.sample_ids_for(0, 0, 0, split_idx=1))
    with pytest.raises(ValueError, match="dp_rank"):
        data.sample_ids_for(0, 0, 2)
    with pytest.raises(ValueError, match="microbatch"):
        data.sample_ids_for(0, 5, 0)
    assert split_ranges(100, [98, 2, 0]) == [(0, 98), (98, 100), (100, 100)]
