"""``tools/bench/ft_hooks.py``: one short run of the real entry point with the hooks timed on the training
thread (the benchmark's numbers are in docs/benchmarks.md; here: that it measures what it says)."""

from __future__ import annotations

import json

import pytest

from tools.bench import ft_hooks


@pytest.mark.timeout(300)
def test_one_run_times_the_hooks_and_their_steps_on_the_training_thread(corpus, capsys):
    assert ft_hooks.main(["--runs", "1", "--iters", "26", "--warmup", "20", "--window", "4", "--data-path", corpus,
                          "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["ms_per_iteration"]
    assert result["iterations_per_run"] == 6  # iterations 20-25
    for name in ("FTRuntime.on_step_end", "FTRuntime._snapshot", "hooks.capture_step_meta", "SparsePolicy.plan",
                 "SnapshotEngine.submit", "ProgressFile.write", "ExpertPopularity.mark_full"):
        assert rows[name]["wall_ms"] > 0 and rows[name]["cpu_ms"] > 0, name
    assert "components.write_progress" not in rows  # this checkout has no such function: not timed
    # nested calls are inside their caller's time
    assert rows["FTRuntime.on_step_end"]["wall_ms"] >= rows["FTRuntime._snapshot"]["wall_ms"] >= \
        rows["SnapshotEngine.submit"]["wall_ms"]


def test_a_missing_dataset_is_refused_with_the_fix(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ft_hooks.main(["--data-path", str(tmp_path / "none")])
    assert e.value.code == 2
    assert "examples/prepare_data.sh" in capsys.readouterr().err  # and that leaving it out generates one


@pytest.mark.timeout(300)
def test_interleaved_blocks_split_the_hooks_into_taken_and_paused(corpus, capsys):
    # iterations 20-35 in blocks of 4: 20-23 paused, 24-27 taken, 28-31 paused, 32-35 taken; a block's first
    # iteration counts for neither kind
    assert ft_hooks.main(["--runs", "1", "--iters", "36", "--warmup", "20", "--window", "4", "--interleave", "4",
                          "--data-path", corpus, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["iterations_per_run"] == {"taken": 6, "paused": 6}
    taken, paused = result["ms_per_iteration"]["taken"], result["ms_per_iteration"]["paused"]
    for name in ("FTRuntime._snapshot", "SnapshotEngine.submit", "hooks.capture_step_meta"):
        assert taken[name]["cpu_ms"] > 0 and name not in paused, name  # a paused iteration takes no snapshot
    for name in ("FTRuntime.on_step_end", "ExpertPopularity.end_iteration"):
        assert taken[name]["cpu_ms"] > 0 and paused[name]["cpu_ms"] > 0, name


def test_interleave_must_hold_whole_windows(capsys):
    with pytest.raises(SystemExit) as e:
        ft_hooks.main(["--window", "8", "--interleave", "12"])
    assert e.value.code == 2
    assert "not a multiple of --window 8" in capsys.readouterr().err
