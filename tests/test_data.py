"""Data that replays exactly: preprocessing and the batch of iteration t as a pure function."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.training.arguments import ArgumentError, parse_args  # noqa: E402
from megatron.training.data import DataConfig, ReplayableData, build_datasets, check_token_ids, checked_index  # noqa: E402
from megatron.training.pretrain import data_config  # noqa: E402
from megatron.training.tokenizer import ByteLevelTokenizer  # noqa: E402
from megatron.training.validation import data_blend, split_weights  # noqa: E402
from tests._ft_helpers import free_port  # noqa: E402
from tools.make_corpus import write_corpus  # noqa: E402
from tools.preprocess_data import preprocess  # noqa: E402


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    write_corpus(str(d / "c.jsonl"), num_docs=300, seed=3)
    assert preprocess(str(d / "c.jsonl"), str(d / "corpus"), append_eod=True) == 300
    write_corpus(str(d / "d.jsonl"), num_docs=100, seed=4)
    assert preprocess(str(d / "d.jsonl"), str(d / "other"), append_eod=True) == 100
    return str(d / "corpus")


def config(prefix, seed=11, iters=50, gbs=8, blend=None, cache=None, split="90,10,0"):
    return DataConfig(blend=blend or ([prefix], None), split=split, seq_length=32, seed=seed,
                      sizes=(iters * gbs, 2 * gbs, None), cache_path=cache)


def make(prefix, dp=2, mbs=2, gbs=8, seed=11, num_workers=0, **kw):
    datasets = build_datasets(config(prefix, seed=seed, gbs=gbs, **kw), ByteLevelTokenizer())
    return ReplayableData(datasets, micro_batch_size=mbs, global_batch_size=gbs, data_parallel_size=dp,
                          num_workers=num_workers)


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


def test_a_failed_preprocess_leaves_the_previous_dataset_as_it_was(tmp_path):
    """Both files are written under temporary names and renamed into place at the end: a bad line or an
    input without documents stops the run with the old ``.bin``/``.idx`` untouched (an old index beside a
    truncated new ``.bin`` passed the start-up checks and failed in training), and nothing is left behind."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(50)))
    out = str(tmp_path / "out")
    assert preprocess(str(good), out) == 50
    before = {ext: (tmp_path / f"out{ext}").read_bytes() for ext in (".bin", ".idx")}
    (tmp_path / "bad.jsonl").write_text('{"text": "new"}\n' * 30 + "{bad\n")
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match="bad.jsonl:31: not valid JSON"):
        preprocess(str(tmp_path / "bad.jsonl"), out)
    with pytest.raises(ValueError, match="holds no non-empty documents"):
        preprocess(str(tmp_path / "empty.jsonl"), out)
    assert {ext: (tmp_path / f"out{ext}").read_bytes() for ext in (".bin", ".idx")} == before
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "empty.jsonl", "good.jsonl", "out.bin", "out.idx"]
    assert len(IndexedDataset(out)) == 50
    assert preprocess(str(good), out) == 50 and sorted(os.listdir(tmp_path))[-2:] == ["out.bin", "out.idx"]


@pytest.mark.parametrize("line, message", [
    ('{"text": null}', "'text' holds null, not a string"),
    ('{"text": 5}', "'text' holds 5, not a string"),
    ('{"text": ["a"]}', "'text' holds [\"a\"], not a string"),
    ('"some text"', "a JSON str, not an object"),
    ("5", "a JSON int, not an object"),
    ("[1]", "a JSON list, not an object"),
])
def test_preprocess_refuses_a_line_that_is_no_object_with_a_string(tmp_path, capsys, line, message):
    """Every line is an object whose ``--json-key`` holds a string: ``{"text": null}`` became a document
    reading "None", a bare string or number a TypeError traceback. One line naming the place, exit 2."""
    from tools.preprocess_data import main

    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    assert main(["--input", str(path), "--output-prefix", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}:2: {message}"), lines
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


@pytest.mark.timeout(120)  # a subprocess importing Megatron-Core (~4 s)
def test_the_preprocessing_script_prints_an_error_as_its_only_line(tmp_path):
    """Run as a script, ``tools/preprocess_data.py`` holds back Megatron-Core's import warnings (Transformer
    Engine and Apex absent: about 8 lines before the error's one)."""
    (tmp_path / "in.jsonl").write_text("5\n")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input",
                           str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"error: {tmp_path / 'in.jsonl'}:1: a JSON int, not an object; one "
                                        '{"text": "..."} per line'], proc.stderr


def batches_equal(xs, ys):
    return all(torch.equal(getattr(x, k), getattr(y, k)) for x, y in zip(xs, ys, strict=True)
               for k in ("tokens", "labels", "loss_mask", "position_ids", "sample_ids"))


def test_batch_is_pure_function_of_seed_iteration_rank(prefix):
    a, b = make(prefix), make(prefix)
    # b computes iteration 37 cold; a walks there through all earlier iterations
    for t in range(37):
        a.batch_for_iteration(t, 0)
    for rank in (0, 1):
        assert batches_equal(a.batch_for_iteration(37, rank), b.batch_for_iteration(37, rank))
    other_seed = make(prefix, seed=12).batch_for_iteration(37, 0)[0]
    assert not torch.equal(other_seed.tokens, b.batch_for_iteration(37, 0)[0].tokens)


def test_background_workers_give_the_same_batches_in_any_order(prefix):
    plain, ahead = make(prefix), make(prefix, num_workers=2)
    try:
        for t in [0, 1, 2, 3, 1, 2, 3, 4, 9, 10]:  # a replay of 1-3, then a jump
            assert batches_equal(plain.batch_for_iteration(t, 1), ahead.batch_for_iteration(t, 1)), t
    finally:
        ahead.close()


def test_elastic_data_parallel_change_keeps_the_global_batch(prefix):
    """The same global batch whatever the data-parallel size: DP 2 with 2 micro-batches each and DP 4 with
    one hold the same samples, and DP 4's rank r holds what DP 2's micro-batch r // 2 of rank r % 2 held."""
    two, four = make(prefix, dp=2), make(prefix, dp=4)
    t = 7
    by_two = {(m, r): b for r in range(2) for m, b in enumerate(two.batch_for_iteration(t, r))}
    for r in range(4):
        (batch,) = four.batch_for_iteration(t, r)
        assert batches_equal([batch], [by_two[(r // 2, r % 2)]])


def test_layout_of_global_batch(prefix):
    data = make(prefix, dp=2, mbs=2, gbs=8)
    assert data.num_microbatches == 2
    t = 5
    ids = [data.sample_ids_for(t, m, r) for m in range(2) for r in range(2)]
    assert sorted(i for chunk in ids for i in chunk) == list(range(40, 48))
    # Megatron layout: micro-batch m of rank r starts at t*GBS + (m*DP + r)*MBS
    assert data.sample_ids_for(t, 1, 0) == [t * 8 + 4, t * 8 + 5]
    batch = data.microbatch(t, 0, 1)
    assert torch.equal(batch.tokens[:, 1:], batch.labels[:, :-1])  # labels are tokens shifted by one
    assert torch.equal(batch.loss_mask, torch.ones(2, 32)) and torch.equal(batch.position_ids[1], torch.arange(32))
    eod = ByteLevelTokenizer().eod
    stream = torch.cat([data.microbatch(u, 0, 0).tokens.reshape(-1) for u in range(20)])
    assert (stream == eod).any()  # documents end with the end-of-document token (--append-eod)


def test_samples_come_from_megatron_core_gpt_dataset(prefix):
    from megatron.core.datasets.gpt_dataset import GPTDataset

    data = make(prefix)
    train = data.datasets[0]
    assert isinstance(train, GPTDataset) and len(train) >= 50 * 8
    assert torch.equal(data.microbatch(3, 1, 1).tokens[0], train[3 * 8 + 6]["tokens"])


def test_blend_and_cache(prefix, tmp_path):
    other = prefix.replace("corpus", "other")
    blend = ([prefix, other], [0.7, 0.3])
    cache = str(tmp_path / "cache")
    first = make(prefix, blend=blend, cache=cache)
    assert any(f.endswith(".npy") for _, _, files in os.walk(cache) for f in files)  # indices written
    again = make(prefix, blend=blend, cache=cache)  # read back from the cache
    in_memory = make(prefix, blend=blend)
    for t in (0, 13):
        assert batches_equal(first.batch_for_iteration(t, 0), again.batch_for_iteration(t, 0))
        assert batches_equal(first.batch_for_iteration(t, 0), in_memory.batch_for_iteration(t, 0))
    assert not batches_equal(first.batch_for_iteration(0, 0), make(prefix).batch_for_iteration(0, 0))


def test_validation_split_and_errors(prefix):
    data = make(prefix)
    assert data.sample_ids_for(0, 0, 0, split_idx=1) == [0, 1]
    assert not torch.equal(data.microbatch(0, 0, 0, split_idx=1).tokens, data.microbatch(0, 0, 0).tokens)
    with pytest.raises(ValueError, match="dp_rank"):
        data.sample_ids_for(0, 0, 2)
    with pytest.raises(ValueError, match="microbatch"):
        data.sample_ids_for(0, 5, 0)
    with pytest.raises(IndexError, match="--train-iters x --global-batch-size"):
        data.microbatch(10_000, 0, 0)
    no_test = make(prefix)
    with pytest.raises(ValueError, match="test split is empty"):
        no_test.microbatch(0, 0, 0, split_idx=2)


def test_flag_forms(data_prefix):
    assert split_weights(["949,50,1"]) == split_weights(["949", "50", "1"]) == [949, 50, 1]
    # fewer weights are padded with 0, as Megatron-Core's split parser does (two were refused)
    assert split_weights(["99,1"]) == split_weights(["99", "1"]) == [99, 1, 0]
    assert split_weights(["100"]) == [100, 0, 0]
    args = parse_args(["--split", "99,1", "--data-path", data_prefix], world_size=1)
    assert data_config(args).split == "99,1,0"
    for bad in (["1,2,3,4"], ["a,b,c"], ["0,1,1"], ["1,-1"], ["inf"], [""]):
        with pytest.raises(ArgumentError, match="^--split"):
            split_weights(bad)
    assert data_blend(["p"]) == (["p"], None)
    assert data_blend(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    with pytest.raises(ArgumentError, match="odd count"):
        data_blend(["0.3", "a", "b"])
    with pytest.raises(ArgumentError, match="not all numbers"):
        data_blend(["a", "0.3", "b", "0.7"])
    # Megatron-Core's BlendedDataset asserts each weight > 0: refused here with the pair to drop
    for weights in (("0", "1"), ("1", "-0.5"), ("nan", "1")):
        with pytest.raises(ArgumentError, match=r"--data-path weights must be positive and finite, got \S+ for "
                                                r"\w; drop that weight/prefix pair"):
            data_blend([weights[0], "a", weights[1], "b"])


def test_token_ids_beyond_the_vocabulary_are_refused(prefix):
    check_token_ids([prefix], 257, "ByteLevel")
    with pytest.raises(ArgumentError, match=r"holds token id 256, beyond the vocabulary of 200 \(--tokenizer-type "
                       r"ByteLevel\): pass the tokenizer it was preprocessed with .* or --vocab-size 257 or more"):
        check_token_ids([prefix], 200, "ByteLevel")


def _copy(prefix: str, dst: str, *, bin_bytes: int | None = None, idx_bytes: int | None = None) -> str:
    """A copy of the dataset ``prefix`` at ``dst``, its ``.bin`` / ``.idx`` cut to (or padded with zeros to)
    the given sizes: a copy that stopped, or an index beside another corpus's tokens."""
    for suffix, size in ((".bin", bin_bytes), (".idx", idx_bytes)):
        with open(prefix + suffix, "rb") as f:
            data = f.read()
        if size is not None:
            data = data[:size] + bytes(max(0, size - len(data)))
        with open(dst + suffix, "wb") as f:
            f.write(data)
    return dst


def test_a_bin_that_does_not_match_its_index_is_refused(prefix, tmp_path):
    """Megatron-Core 0.16.1 never compares the ``.bin`` with its ``.idx``: a truncated copy failed at whichever
    sample first lands past its end with the memory map, and read uninitialised memory as tokens without it.
    Now one line at start naming both sizes and the fix; the intact copy opens."""
    size = os.path.getsize(prefix + ".bin")
    assert len(checked_index(_copy(prefix, str(tmp_path / "intact")))) == 300
    fix = r"re-create it with `python tools/preprocess_data.py --append-eod --output-prefix \S+/cut \.\.\.` \(or copy"
    with pytest.raises(ArgumentError, match=rf"^dataset \S+/cut: \S+/cut\.bin holds 1000 bytes but \S+/cut\.idx "
                                            rf"describes {size} \(300 sequences, {size // 2} uint16 tokens\): the \.bin is "
                                            rf"truncated; {fix}"):
        checked_index(_copy(prefix, str(tmp_path / "cut"), bin_bytes=1000))
    with pytest.raises(ArgumentError, match=rf"holds {size + 2} bytes but .* describes {size} .*longer than its index"):
        checked_index(_copy(prefix, str(tmp_path / "long"), bin_bytes=size + 2))
    with pytest.raises(ArgumentError, match=r"short\.idx cannot be read \(.+\); re-create it with"):
        checked_index(_copy(prefix, str(tmp_path / "short"), idx_bytes=100))
    with pytest.raises(ArgumentError, match=r"cut\.bin holds 1000 bytes"):  # the start-up scan opens it so
        check_token_ids([prefix, str(tmp_path / "cut")], 257, "ByteLevel")


@pytest.mark.timeout(180)  # subprocesses importing Megatron (~5 s each)
@pytest.mark.parametrize("ft", [[], ["--ft"]])
def test_the_entry_script_refuses_a_truncated_copy_with_one_line_and_trains_on_the_intact_one(prefix, tmp_path, ft):
    """Before, a copy whose ``.bin`` was cut in half started training and stopped in the first iteration's
    sample read with a ``ValueError`` traceback from Megatron-Core's reader, exit 1 (with
    ``--no-mmap-bin-files`` the tokens read past the end were uninitialised memory: an ``IndexError`` in the
    embedding, a device-side assert on a GPU); with ``--ft`` a rank failure. A cut ``.idx`` was a traceback at
    start. Now exit 2 and one line each, as a bad flag (with ``--ft``: inside the guarded attempt, which then
    stops the job instead of handing the rank to a spare); the intact copy of the same corpus trains."""
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--num-experts", "4", "--micro-batch-size", "2",
             "--global-batch-size", "2", "--train-iters", "2", "--ft-store-dir", str(tmp_path / "store"), *ft]

    def run(data: str):
        return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt_moe.py"), *flags, "--data-path", data],
                              capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)

    cut_bin = _copy(prefix, str(tmp_path / "cut_bin"), bin_bytes=os.path.getsize(prefix + ".bin") // 2)
    cut_idx = _copy(prefix, str(tmp_path / "cut_idx"), idx_bytes=100)
    for data, line in ((cut_bin, f"error: dataset {cut_bin}: {cut_bin}.bin holds {os.path.getsize(cut_bin + '.bin')} "
                                 f"bytes but {cut_bin}.idx describes {os.path.getsize(prefix + '.bin')} "),
                       (cut_idx, f"error: dataset {cut_idx}: {cut_idx}.idx cannot be read (")):
        proc = run(data)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (data, proc.returncode, proc.stderr[-3000:])
        assert lines[0].startswith(line) and "; re-create it with `python tools/preprocess_data.py" in lines[0], lines
    intact = run(_copy(prefix, str(tmp_path / "intact")))
    assert intact.returncode == 0 and re.search(r"^iteration +2/2 ", intact.stdout, re.M), intact.stderr[-3000:]


@pytest.mark.timeout(120)  # a subprocess importing Megatron (~5 s each)
@pytest.mark.parametrize("ft", [[], ["--ft"]])
def test_the_entry_script_refuses_token_ids_beyond_the_vocabulary_with_one_line(prefix, ft):
    """The check runs inside ``pretrain`` (and, with ``--ft``, inside the guarded attempt): it was a
    ``ValueError`` traceback, exit 1, which ``moe-ft launch`` treated as a rank's failure to replace. One
    line naming the dataset, the largest id, the vocabulary and the fix; exit 2 (a usage error)."""
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--num-experts", "4", "--micro-batch-size", "2",
             "--global-batch-size", "2", "--train-iters", "2", "--data-path", prefix,
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", *ft]  # ids 0..100, padded to 128
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt_moe.py"), *flags], capture_output=True,
                          text=True, timeout=90, env=env, cwd=ROOT)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert lines[0].startswith(f"error: dataset {prefix} holds token id 256, beyond the vocabulary of 128 "
                               "(--tokenizer-type NullTokenizer): pass the tokenizer"), lines
    assert "--vocab-size 257 or more" in lines[0]


def test_builders_lock_the_cache_they_write_even_without_data_cache_path(prefix, tmp_path):
    """Without --data-cache-path Megatron-Core caches the indices beside each dataset (shared by every job
    that reads it); the build locks that directory as it locks --data-cache-path, so two processes never
    read each other's half-written index (seen: "mmap length is greater than file size")."""
    from megatron.training.data import _cache_dirs

    other = os.path.join(os.path.dirname(prefix), "other")
    assert _cache_dirs(config(prefix, cache=str(tmp_path / "c"))) == [str(tmp_path / "c")]
    blend = config(prefix, blend=([other, prefix], [0.5, 0.5]))
    assert _cache_dirs(blend) == sorted(os.path.join(p, "cache", "GPTDataset_indices") for p in (prefix, other))
    make(prefix)
    assert os.path.exists(os.path.join(prefix, "cache", "GPTDataset_indices", ".moe_ft_build.lock"))
