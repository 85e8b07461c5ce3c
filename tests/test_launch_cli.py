"""``moe-ft launch``'s command line (``moe_ft/launch/cli.py``): a mistake in a launcher flag is one line naming
the flag, exit 2, before anything starts; a node the job's rendezvous never needed ends cleanly; a Ctrl-C
reaches the workers as the launcher's SIGTERM only, also when it comes while a worker starts."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from datetime import timedelta

import psutil
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
        # and the whole group is started: the agent lists its spares (none) once every worker of it is
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


_STOP_THE_LAUNCHER = r"""
import os, signal, sys, time
got, sent = sys.argv[1], sys.argv[2]
def record(signum, frame):
    with open(got, "a") as f:
        f.write(signal.Signals(signum).name + "\n")
    sys.exit(1)
signal.signal(signal.SIGTERM, record)
# the launcher: this worker's grandparent under --preload (the fork server between), else its parent
os.kill(int(os.environ.get("MOE_FT_AGENT_PID") or os.getppid()), signal.SIGTERM)
open(sent, "w").close()
time.sleep(120)
"""

_LATE_START = r"""
import os, sys, time
from moe_ft.launch import cli, processes
start_processes = processes.start_processes
sent = sys.argv[-1]
def late(*args, **kwargs):
    # a loaded machine: start_processes returns after the process it started already runs; here only once
    # that process has stopped the launcher (and the signal's handler had time to run in the main thread)
    context = start_processes(*args, **kwargs)
    deadline = time.monotonic() + 60
    while not os.path.exists(sent) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    return context
processes.start_processes = late
sys.exit(cli.main(sys.argv[1:]))
"""


def _marked(mark: str) -> list[psutil.Process]:
    """The live processes whose environment holds ``MOE_FT_TEST_MARK=mark``: a launcher and everything it
    started (forks and spawned interpreters alike keep the launcher's environment)."""
    out = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get("MOE_FT_TEST_MARK") == mark:
                out.append(proc)
        except psutil.Error:  # gone, or not ours to read
            continue
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("preload", [True, False], ids=["preload", "script"])
def test_a_stop_signal_while_a_worker_starts_stops_that_worker_too(tmp_path, preload):
    """The launcher gets SIGTERM while torch elastic's ``start_processes`` is still starting a worker (the
    worker exists, its context has not come back): here the worker itself sends it, and ``start_processes``
    returns late, as on a loaded machine. The worker gets the launcher's SIGTERM (it writes its held point on
    it) and nothing the launcher started outlives it. Before, the signal's ``SignalException`` was raised
    inside ``start_processes`` and the worker was held by nobody: it ran on without a signal, and under
    ``--preload`` it kept the fork server alive and the launcher never exited (multiprocessing joins its
    children at exit, and the worker waited for the launcher to collect its return value)."""
    script, got, sent = tmp_path / "worker.py", tmp_path / "got", tmp_path / "sent"
    script.write_text(_STOP_THE_LAUNCHER)
    mark = f"{os.getpid()}.{tmp_path.name}"
    port = free_port()
    cmd = [sys.executable, "-c", _LATE_START, "--nnodes", "1", "--nproc-per-node", "1",
           *(["--preload"] if preload else []), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "late", "--log-dir", str(tmp_path / "logs"), str(script), str(got), str(sent)]
    env = dict(os.environ, MOE_FT_TEST_MARK=mark,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(tmp_path / "launcher.log", "w") as log:
        launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    try:
        wait_until(sent.exists, timeout=150, message="the worker's start")
        launcher.wait(timeout=60)
        wait_until(lambda: not _marked(mark), timeout=30, message="every process the launcher started gone")
    finally:
        if launcher.poll() is None:
            kill_tree(launcher.pid)
            launcher.wait()
        for proc in _marked(mark):
            with contextlib.suppress(psutil.Error):
                proc.kill()
    assert got.exists() and got.read_text() == "SIGTERM\n", (tmp_path / "launcher.log").read_text()[-3000:]
