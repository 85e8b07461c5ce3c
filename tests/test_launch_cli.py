"""``moe-ft launch``'s command line (``moe_ft/launch/cli.py``): a mistake in a launcher flag is one line naming
the flag, exit 2, before anything starts; a node the job's rendezvous never needed ends cleanly; a Ctrl-C
reaches the workers as the launcher's SIGTERM only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.rendezvous import RendezvousGracefulExitError

from moe_ft.drills.processes import kill_tree
from moe_ft.launch import cli, protocol
from moe_ft.launch.agent import SpareAgent
from tests._ft_helpers import ROOT, free_port, wait_until

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


_RECORD_STOP = r"""
import signal, sys, time
def record(signum, frame):
    with open(sys.argv[1], "a") as f:
        f.write(signal.Signals(signum).name + "\n")
    if signum == signal.SIGTERM:  # a worker leaves once it wrote its held point (AttemptStop: exit 1)
        sys.exit(1)
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, record)
open(sys.argv[2], "w").close()
time.sleep(120)
"""


@pytest.mark.timeout(180)
def test_ctrl_c_reaches_a_preloaded_worker_only_as_the_launchers_sigterm(tmp_path):
    """A terminal's Ctrl-C sends SIGINT to its foreground process group: here the launcher's (a session of its
    own, as a shell's job). The launcher stops its workers with SIGTERM, on which a worker writes the point
    it holds; a worker forked under ``--preload`` (a real one, from the real fork server) gets that and
    nothing else. Before, the fork server and its workers were in the launcher's group: each worker got the
    SIGINT itself, and a training worker died in a ``KeyboardInterrupt`` with its point."""
    script, got, ready = tmp_path / "worker.py", tmp_path / "got", tmp_path / "ready"
    script.write_text(_RECORD_STOP)
    port = free_port()
    cmd = [sys.executable, "-m", "moe_ft.launch", "--nnodes", "1", "--nproc-per-node", "1", "--preload",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "ctrl_c",
           str(script), str(got), str(ready)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(tmp_path / "launcher.log", "w") as log:
        launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    try:
        wait_until(ready.exists, timeout=120, message="the preloaded worker's start")
        # and the agent holds it: it lists its spares (none) once every worker of the group is started; a
        # signal while a process is still being started reaches no process (torch elastic's start window)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        wait_until(lambda: store.check([protocol.Keys("ctrl_c").node_spares(0)]), timeout=60,
                   message="the agent's worker group")
        os.killpg(launcher.pid, signal.SIGINT)
        launcher.wait(timeout=45)
    finally:
        if launcher.poll() is None:
            kill_tree(launcher.pid)
            launcher.wait()
    assert got.read_text() == "SIGTERM\n", (tmp_path / "launcher.log").read_text()[-3000:]
