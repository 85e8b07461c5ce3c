"""``moe-ft`` user errors: one line ``moe-ft <subcommand>: error: ...`` on stderr, exit 2, no traceback, for
representative mistakes of every subcommand (bad flag values, missing or invalid files, combinations that
cannot work). The drill's checks run before anything is launched."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from moe_ft.cli.main import main
from tools.preprocess_data import main as preprocess_main


def _error(capsys, argv: list[str]) -> str:
    """Run the CLI; assert exit 2 and a single ``moe-ft <sub>: error:`` line on stderr; return its message."""
    rc = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2, (rc, captured.out, captured.err)
    assert len(lines) == 1 and lines[0].startswith(f"moe-ft {argv[0]}: error: "), captured.err
    return lines[0].split(": error: ", 1)[1]


@pytest.mark.parametrize("argv, message", [
    (["--fail", "1:6:persist"], "multiple of --persist-interval (4), e.g. t = 7"),
    (["--fail", "1:7:persist", "--persist-interval", "0"], "drop --persist-interval 0"),
    (["--nodes", "2", "--fail-node", "1:6:persist"], "multiple of --persist-interval (4)"),
    (["--fail", "1"], "bad fault '1': expected RANK:ITER[:PHASE[:KIND]]"),
    (["--fail", "1:3:bogus"], "fault phase must be one of"),
    (["--fail", "7:3"], "rank 7 does not exist (the job has ranks 0..3)"),
    (["--fail", "1:12"], "iteration 12 is never reached"),
    (["--fail", "1:3:forward:node"], "--fail-node NODE:ITER[:PHASE]"),
    (["--fail-node", "1:3"], "--fail-node needs --nodes N"),
    (["--nodes", "2", "--fail-node", "2:3"], "node 2 does not exist"),
    (["--nodes", "2", "--fail-node", "0:9", "--fail-node", "1:9", "--persist-interval", "0"], "durable tier"),
    (["--nodes", "3"], "--nodes 3 must divide the job's 4 ranks"),
    (["--replicas", "1"], "needs --nodes N"),
    (["--iters", "0"], "--iters must be >= 1"),
    (["--layout", "nope"], "invalid choice: 'nope'"),
    (["--timeout", "nan"], "--timeout must be a finite number of seconds > 0, got nan"),
])
def test_drill_flag_errors(capsys, argv, message):
    assert message in _error(capsys, ["drill", *argv])


@pytest.mark.timeout(120)  # the corpus fixture and the job's argument groups (Megatron import): ~10 s when idle
def test_drill_job_flag_errors_before_any_launch(capsys, corpus, tmp_path, monkeypatch):
    """Flags of the job itself (``--data``, ``--extra``) are parsed and validated here as each rank would;
    a temporary workdir the drill made is removed again."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    missing = str(tmp_path / "nodata")
    assert f"{missing}.bin not found" in _error(capsys, ["drill", "--data", missing])
    assert "unrecognized arguments: --ft-bogus 3" in _error(capsys, ["drill", "--data", corpus, "--extra", "--ft-bogus", "3"])
    assert "--train-samples (Megatron-LM) is not supported here: pass --train-iters" in _error(
        capsys, ["drill", "--data", corpus, "--extra", "--train-samples", "48"])
    assert "--ft-pec-k must be >= 1" in _error(capsys, ["drill", "--data", corpus, "--extra", "--ft-pec-k", "0"])
    assert "--pipeline-model-parallel-size" in _error(
        capsys, ["drill", "--data", corpus, "--extra", "--pipeline-model-parallel-size", "3"])
    assert not [p for p in os.listdir(tmp_path) if p.startswith("moe_ft_drill_")]  # nothing left behind
    assert "--workdir /proc/none: cannot create it" in _error(capsys, ["drill", "--workdir", "/proc/none"])


def test_digest_errors(capsys, tmp_path):
    assert "no such file or directory" in _error(capsys, ["digest", str(tmp_path / "none.json")])
    (tmp_path / "other.json").write_text(json.dumps({"iteration": 3}))
    assert "no 'digest' field" in _error(capsys, ["digest", str(tmp_path / "other.json")])
    (tmp_path / "text.json").write_text("not json")
    assert "not a digest file" in _error(capsys, ["digest", str(tmp_path / "text.json")])
    (tmp_path / "empty").mkdir()
    assert "a directory without *.json digest files" in _error(capsys, ["digest", str(tmp_path / "empty")])


def test_drill_refuses_a_store_dir_that_holds_something(capsys, tmp_path):
    """The drill removes its ``--store-dir`` when it ends and its jobs would recover from points already in
    it: a directory that holds something (or a file) is refused before anything runs, and left as it was."""
    (tmp_path / "mine.txt").write_text("keep")
    assert "exists and is not an empty directory" in _error(capsys, ["drill", "--store-dir", str(tmp_path)])
    assert "exists and is not an empty directory" in _error(capsys, ["drill", "--store-dir", str(tmp_path / "mine.txt")])
    assert (tmp_path / "mine.txt").read_text() == "keep"


def test_digest_whose_per_rank_is_no_list_is_one_line(capsys, tmp_path):
    """Two digest files that differ, one with ``per_rank`` not a list, were a ``TypeError`` traceback
    ('int' object is not iterable) while naming the differing ranks."""
    (tmp_path / "a.json").write_text(json.dumps({"digest": "x1", "per_rank": 5}))
    (tmp_path / "b.json").write_text(json.dumps({"digest": "x2", "per_rank": ["x2"]}))
    message = _error(capsys, ["digest", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert message.startswith(f"{tmp_path / 'a.json'}: 'per_rank' is not a list of digests"), message


def test_digest_compare_still_works(capsys, tmp_path):
    for name, digest in (("a", "x1"), ("b", "x1"), ("c", "x2")):
        (tmp_path / f"{name}.json").write_text(json.dumps({"digest": digest, "iteration": 4, "per_rank": [digest]}))
    assert main(["digest", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "EQUAL"
    assert main(["digest", str(tmp_path / "a.json"), str(tmp_path / "c.json")]) == 1


def test_inspect_errors(capsys, tmp_path):
    (tmp_path / "afile").write_text("x")  # was '[Errno 20] Not a directory: .../afile/FORMAT.json'
    assert f"{tmp_path / 'afile'} is a file, not a store directory; pass the per-rank directory" in _error(
        capsys, ["inspect", str(tmp_path / "afile")])
    assert (tmp_path / "afile").read_text() == "x"
    assert "is not a moe-ft store (no FORMAT.json)" in _error(capsys, ["inspect", str(tmp_path)])
    assert "--validate needs --num-layers and --num-experts" in _error(capsys, ["inspect", str(tmp_path), "--validate"])
    assert "not a durable tier" in _error(
        capsys, ["inspect", str(tmp_path), "--validate", "--num-layers", "1", "--num-experts", "2"])


@pytest.mark.parametrize("content, kind", [('"x"', "str"), ("[1]", "list"), ("3", "int"), ("{", None)])
def test_a_format_file_that_is_no_json_object_is_one_line(capsys, tmp_path, content, kind):
    """``FORMAT.json`` holding valid JSON of another type than an object was an ``AttributeError`` traceback
    ('str' object has no attribute 'get') in ``inspect`` and when a run opened the store; now a
    ``StoreError`` naming the file, also for a backend opened directly (the durable tier's)."""
    from moe_ft.store import StoreError
    from moe_ft.store.local import LocalFSBackend

    (tmp_path / "FORMAT.json").write_text(content)
    message = _error(capsys, ["inspect", str(tmp_path)])
    expected = f"holds a JSON {kind}, not the store's format object" if kind else "is unreadable"
    assert message.startswith(f"{tmp_path / 'FORMAT.json'} {expected}"), message
    with pytest.raises(StoreError, match=expected):
        LocalFSBackend(tmp_path, create=False)


def test_simulate_and_plan_errors(capsys, tmp_path):
    assert "cannot read config" in _error(capsys, ["simulate", "--config", str(tmp_path / "none.json")])
    (tmp_path / "bad.json").write_text("{")
    assert "is not valid JSON" in _error(capsys, ["simulate", "--config", str(tmp_path / "bad.json")])
    assert "cannot parse duration 'soon'" in _error(capsys, ["simulate", "--preset", "deepseek-moe-16b", "--mtbf", "soon"])
    assert "--seed must be >= 0" in _error(capsys, ["simulate", "--preset", "deepseek-moe-16b", "--seed", "-1"])
    assert "--spot-prob" in _error(capsys, ["simulate", "--preset", "deepseek-moe-16b", "--spot-prob", "2"])
    assert "unknown policy 'nope'" in _error(capsys, ["simulate", "--preset", "deepseek-moe-16b", "--policies", "nope"])
    assert "No such file or directory" in _error(capsys, ["simulate", "--preset", "deepseek-moe-16b", "--mtbf", "1h",
                                                          "--analytic-only", "--csv", str(tmp_path / "no" / "o.csv")])
    assert "give --config FILE or --preset NAME" in _error(capsys, ["plan"])
    assert "unknown preset 'nope'" in _error(capsys, ["plan", "--preset", "nope"])
    plan = ["plan", "--preset", "deepseek-moe-16b", "--mtbf", "30m", "--set"]
    assert "hardware has no field 'nope'; its fields: collective_latency_s," in _error(capsys, plan + ["hardware.nope=1"])
    assert "SECTION one of model, parallel" in _error(capsys, plan + ["hw.mfu=0.5"])
    assert "SECTION one of model, parallel" in _error(capsys, plan + ["hardware.mfu"])
    assert "the value must be JSON" in _error(capsys, plan + ["hardware.mfu=fast"])
    assert "hardware.mfu must be in (0, 1], got 2" in _error(capsys, plan + ["hardware.mfu=2"])
    assert "parallel.pp=99 exceeds model.num_layers" in _error(capsys, plan + ["parallel.pp=99"])
    assert "host_s_per_snapshot must be >= 0" in _error(capsys, plan + ["hardware.host_s_per_snapshot=-1"])


PRESET = ["--preset", "deepseek-moe-16b"]


@pytest.mark.parametrize("argv, message", [
    # NaN and infinity passed the "> 0" checks: a NaN message about integers, or an OverflowError traceback
    (["simulate", *PRESET, "--mtbf", "inf", "--analytic-only"], "duration must be a finite number > 0, got 'inf'"),
    (["simulate", *PRESET, "--mtbf", "1e400"], "duration must be a finite number > 0, got '1e400'"),
    (["plan", *PRESET, "--mtbf", "nan"], "duration must be a finite number > 0, got 'nan'"),
    (["simulate", *PRESET, "--mtbf", "1h", "--hours", "inf"], "--hours must be a finite number of hours > 0, got inf"),
    (["simulate", *PRESET, "--mtbf", "1h", "--hours", "nan"], "--hours must be a finite number of hours > 0, got nan"),
    # a failure process of 1e13 events: a numpy MemoryError traceback (314 TiB) instead of a message
    (["simulate", *PRESET, "--mtbf", "1e-9"], "failures expected in 43200 s at an MTBF of 1e-09 s; at most 1000000"),
    (["simulate", *PRESET, "--mtbf", "1h", "--hours", "1e12"], "raise the MTBF or shorten the run (--hours)"),
    (["simulate", *PRESET, "--mtbf", "1h", "--hours", "1e12", "--spot-prob", "0.1"], "node-hours of spot preemptions"),
    # an empty policy list printed an empty table and exit 0
    (["simulate", *PRESET, "--mtbf", "1h", "--policies", ","], "--policies names no policy"),
])
def test_simulate_non_finite_huge_and_empty_inputs(capsys, argv, message):
    assert message in _error(capsys, argv)


def test_simulate_checks_its_output_files_before_the_simulation(capsys, tmp_path, monkeypatch):
    """``--plot DIR`` wrote ``DIR.png`` beside it and exit 0; ``--csv DIR`` failed only after the whole
    simulation with '[Errno 21] Is a directory'. Both are refused before anything is simulated."""
    def must_not_run(*args, **kwargs):
        raise AssertionError("simulated before checking the output files")

    monkeypatch.setattr("moe_ft.sim.analytic.evaluate", must_not_run)
    (tmp_path / "out").mkdir()
    base = ["simulate", *PRESET, "--mtbf", "1h", "--analytic-only"]
    assert f"--plot {tmp_path / 'out'}: is a directory; give a file name" in _error(
        capsys, base + ["--plot", str(tmp_path / "out")])
    assert f"--csv {tmp_path / 'out'}: is a directory" in _error(capsys, base + ["--csv", str(tmp_path / "out")])
    assert os.listdir(tmp_path) == ["out"]


@pytest.mark.parametrize("item, message", [
    ('model.num_experts="x"', "model.num_experts must be an integer, got 'x'"),
    ("model.num_experts=1.5", "model.num_experts must be an integer, got 1.5"),
    ("model.num_experts=null", "model.num_experts must be an integer, got None"),
    ("parallel.global_batch_size=1e30", "parallel.global_batch_size must be an integer, got 1e+30"),
    ("parallel.global_batch_size=" + "1" * 31, "must be an integer of at most 2**53"),
    ("hardware.d2h_bandwidth=NaN", "hardware.d2h_bandwidth must be a finite number, got nan"),
    ("hardware.peak_flops_bf16=1e400", "hardware.peak_flops_bf16 must be a finite number, got inf"),
    ("recovery.restart_s=NaN", "recovery.restart_s must be a finite number, got nan"),
    ("model.name=3", "model.name must be a string, got 3"),
    ("parallel.distributed_optimizer=1", "parallel.distributed_optimizer must be true or false, got 1"),
])
def test_config_values_of_the_wrong_type_are_one_line(capsys, tmp_path, item, message):
    """Values of the wrong type passed the range checks (NaN compares false) and ran to a silent NaN, a
    plan (exit 0), an OverflowError traceback or a message about the wrong field (``num_experts=1.5``: 'top_k
    must be in [1, num_experts=1.5]'). The same from a config file."""
    assert message in _error(capsys, ["plan", *PRESET, "--mtbf", "30m", "--set", item])
    from moe_ft.sim.presets import get_preset

    section, _, rest = item.partition(".")
    key, _, value = rest.partition("=")
    cfg = dataclasses.asdict(get_preset("deepseek-moe-16b"))
    cfg[section][key] = json.loads(value)
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    assert message in _error(capsys, ["simulate", "--config", str(tmp_path / "c.json"), "--mtbf", "1h"])


def _preprocess_error(capsys, argv: list[str]) -> str:
    rc = preprocess_main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, lines)
    return lines[0]


def test_preprocess_data_errors(capsys, tmp_path):
    """``tools/preprocess_data.py``: an output prefix under a file was a ``FileExistsError`` traceback, a
    tokenizer model file the library cannot read a ``RuntimeError`` (sentencepiece) or ``AssertionError``
    (tiktoken) traceback, a directory as ``--input`` 'no such file'."""
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    (tmp_path / "afile").write_text("x")
    base = ["--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "out")]
    assert "is a directory; give the JSONL or text file itself" in _preprocess_error(
        capsys, ["--input", str(tmp_path), "--output-prefix", str(tmp_path / "out")])
    assert f"--output-prefix {tmp_path / 'afile' / 'o'}: cannot create its directory" in _preprocess_error(
        capsys, ["--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "afile" / "o")])
    for kind in ("SentencePieceTokenizer", "TikTokenizer"):
        assert f"--tokenizer-model {tmp_path / 'afile'}: not a {kind} model file" in _preprocess_error(
            capsys, base + ["--tokenizer-type", kind, "--tokenizer-model", str(tmp_path / "afile")])
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_text("garbage")
    assert "not a HuggingFaceTokenizer model file" in _preprocess_error(
        capsys, base + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "hf")])
    assert sorted(os.listdir(tmp_path)) == ["afile", "c.jsonl", "hf"]  # nothing written


def test_placement_errors(capsys):
    base = ["--nodes", "2", "--slots", "2"]
    assert "comma-separated numbers" in _error(capsys, ["placement", "--loads", "1,x", *base])
    assert "finite numbers" in _error(capsys, ["placement", "--loads", "inf,1", *base])
    assert "non-negative" in _error(capsys, ["placement", "--loads=-1,2", *base])
    assert "unknown placement strategy 'nope'" in _error(capsys, ["placement", "--loads", "1,2", *base, "--strategy", "nope"])
    assert "the following arguments are required: --loads" in _error(capsys, ["placement", *base])


def test_env_refuses_an_unsupported_megatron_core(capsys, monkeypatch):
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", "0.99.0")
    assert "written for megatron-core 0.16.1 but 0.99.0" in _error(capsys, ["env", "--activate"])
