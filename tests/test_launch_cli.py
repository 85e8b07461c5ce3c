"""``moe-ft launch``'s command line (``moe_ft/launch/cli.py``): a mistake in a launcher flag is one line naming
the flag, exit 2, before anything starts; a node the job's rendezvous never needed ends cleanly."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.rendezvous import RendezvousGracefulExitError

from moe_ft.launch import cli
from moe_ft.launch.agent import SpareAgent

BAD_FLAGS = [
    (["--nnodes", "2:1"], "--nnodes MIN:MAX needs 0 < MIN <= MAX (got 2:1)"),
    (["--nnodes", "abc"], "--nnodes must be N or MIN:MAX"),
    (["--nproc-per-node", "x"], "--nproc-per-node must be a number of processes > 0"),
    (["--nproc-per-node", "0"], "--nproc-per-node must be a number of processes > 0"),
    (["--monitor-interval", "-1"], "--monitor-interval must be a finite number of seconds > 0"),
    # the first recovery's timedelta would overflow, long after the launch
    (["--reform-timeout", "1e14"], "--reform-timeout must be a finite number of seconds > 0, at most 604800"),
    (["--node-timeout", "1e9"], "--node-timeout must be a finite number of seconds > 0, at most 604800"),
    (["--rdzv-conf", "join_timeout=abc"], "'join_timeout' does not represent a valid integer value. Fix --rdzv-conf"),
]


@pytest.mark.parametrize("flags, message", BAD_FLAGS, ids=[" ".join(flags) for flags, _ in BAD_FLAGS])
def test_a_bad_launcher_flag_is_one_line_and_exit_2(capsys, monkeypatch, flags, message):
    """Each of these raised from torchrun's own checks (an ``AssertionError`` with no message for
    ``--monitor-interval -1``) or overflowed at the first recovery."""
    monkeypatch.setattr(SpareAgent, "run", lambda self, role="default": RunResult(state=WorkerState.SUCCEEDED))
    try:
        rc = cli.main(["--standalone", *flags, "train.py"])
    except SystemExit as e:
        rc = e.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("moe-ft launch: error: ") and message in lines[0], lines


def test_a_node_the_rendezvous_closed_without_ends_with_exit_0(capsys, monkeypatch):
    """A node beyond ``--nnodes MAX`` waits in reserve; when the job ends, torch elastic tells it to leave
    (``RendezvousGracefulExitError``) and its ``run`` returns ``None``: one line, exit 0 (before, an
    ``AttributeError`` traceback)."""
    def closed(self, role="default"):
        raise RendezvousGracefulExitError("The rendezvous 'x' is closed, terminating pending rendezvous.")

    monkeypatch.setattr(SpareAgent, "_invoke_run", closed)
    assert cli.main(["--standalone", "--nproc-per-node", "1", "train.py"]) == 0
    assert "rendezvous closed without this node" in capsys.readouterr().err
