"""``--preload`` refuses to fork workers from a launcher that CUDA cannot survive a fork of
(``moe_ft/drills/prelaunch.py``: :func:`cuda_fork_problem`), with one line and before any server starts."""

from __future__ import annotations

import pytest
import torch

from moe_ft.drills import prelaunch
from moe_ft.launch import cli
from moe_ft.launch.protocol import USAGE_EXIT_CODE


@pytest.fixture
def no_server(monkeypatch):
    """Records any start of the fork server (none may happen once the guard refused)."""
    started: list = []
    monkeypatch.setattr(prelaunch, "_fork_server", lambda *args: started.append(args))
    return started


def test_cuda_initialised_by_the_imports_is_refused_before_the_server_starts(monkeypatch, no_server):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(prelaunch.PreloadError, match="initialised CUDA in the launcher.*drop --preload"):
        prelaunch.use_preloaded_forkserver(modules=())
    assert no_server == []


def test_a_device_query_before_the_fork_counts_only_with_a_gpu(monkeypatch):
    # torch marks a fork bad once the parent asked the CUDA runtime for the device count; the mark is read in a
    # real fork of this process (the patched function is what the child runs)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    problem = prelaunch.cuda_fork_problem()
    assert "queried the CUDA runtime" in problem and "PYTORCH_NVML_BASED_CUDA_CHECK=1" in problem
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # a CPU job's workers never initialise CUDA
    assert prelaunch.cuda_fork_problem() == ""

    def no_query():
        raise AssertionError("the device count is asked only once a fork is known to be marked")

    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", no_query)
    assert prelaunch.cuda_fork_problem() == ""


def test_moe_ft_launch_preload_says_why_in_one_line_and_exits_2(monkeypatch, no_server, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('no worker may start')\n")
    rc = cli.main(["--preload", "--standalone", "--nproc-per-node=1", str(script)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == USAGE_EXIT_CODE and no_server == []
    assert err[-1].startswith("error: importing the training stack initialised CUDA") and "--preload" in err[-1]
