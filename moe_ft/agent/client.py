"""A trainer's side of the node agent: find it, start it if the node has none, and talk to it.

``moe-ft launch`` starts the node's agent before the workers (``moe_ft/launch/cli.py``). Under plain torchrun,
or when the agent died, every trainer of a node calls :func:`connect`; under an ``flock`` of the agent
directory the first one that finds no live agent (no pid file, or a dead pid) starts ``python -m moe_ft.agent``
detached (its own session, so that it outlives the workers and torchrun's process-group kill), and waits for
its pid file.
A connection that breaks (the agent was killed) is made again on the next call, starting a new agent.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import subprocess
import sys
import time
from multiprocessing.connection import Client, Connection
from pathlib import Path

from moe_ft.agent.server import KEY_FILE, LOG_FILE, PID_FILE, PersistRequest, socket_address
from moe_ft.store.backend import pid_alive

START_TIMEOUT_S = 120.0
"""How long a trainer waits for a started agent to listen (it imports torch first)."""


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed agent whose parent has not reaped it yet)."""
    if not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return pid_alive(pid)


def agent_pid(agent_dir: Path) -> int | None:
    """The pid of the live agent of ``agent_dir``, else ``None``."""
    try:
        pid = int((agent_dir / PID_FILE).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if _running(pid) else None


def _start(agent_dir: Path, idle_exit_s: float, started_by: str) -> None:
    key = agent_dir / KEY_FILE
    if not key.exists():
        tmp = agent_dir / f".{KEY_FILE}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
        os.replace(tmp, key)
    with contextlib.suppress(FileNotFoundError):
        (agent_dir / PID_FILE).unlink()  # a dead agent's
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
    with open(agent_dir / LOG_FILE, "ab") as log:
        starter = subprocess.Popen([sys.executable, "-m", "moe_ft.agent", "--daemonize", "--dir", str(agent_dir),
                                    "--idle-exit", str(idle_exit_s), "--started-by", started_by], stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True, close_fds=True, env=env, cwd=root)
    starter.wait(timeout=60)  # the daemonizing parent leaves at once


def ensure_agent(agent_dir: str | os.PathLike, *, idle_exit_s: float = 600.0, started_by: str = "a trainer") -> int:
    """The pid of the node's agent, started if there is none (see the module docstring)."""
    agent_dir = Path(agent_dir)
    agent_dir.mkdir(parents=True, exist_ok=True)
    with open(agent_dir / "start.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        pid = agent_pid(agent_dir)
        if pid is None:
            _start(agent_dir, idle_exit_s, started_by)
            deadline = time.monotonic() + START_TIMEOUT_S
            while (pid := agent_pid(agent_dir)) is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the node agent did not start within {START_TIMEOUT_S:.0f} s; see "
                                       f"{agent_dir / LOG_FILE}")
                time.sleep(0.05)
        return pid


class AgentCpu:
    """The node agent's CPU per training iteration, from the CPU seconds it answers each request with."""

    def __init__(self) -> None:
        self.samples: list[tuple[int, float]] = []
        """(iteration, the agent's CPU seconds) at the last two answers."""

    def take(self, iteration: int, cpu_s: float) -> None:
        self.samples = [*self.samples[-1:], (iteration, cpu_s)]

    def ms_per_iteration(self) -> float | None:
        """Between the last two answers (``None`` before, or when they came in the same iteration)."""
        if len(self.samples) < 2 or self.samples[1][0] <= self.samples[0][0]:
            return None
        (i0, c0), (i1, c1) = self.samples
        return 1e3 * (c1 - c0) / (i1 - i0)


class AgentClient:
    """One trainer rank's connection to its node's agent."""

    def __init__(self, agent_dir: str | os.PathLike, rank: int, *, idle_exit_s: float = 600.0) -> None:
        self.agent_dir, self.rank, self.idle_exit_s = Path(agent_dir), rank, idle_exit_s
        self._conn: Connection | None = None
        self.pid: int | None = None
        self.restarts = 0
        """Agents this client had to start again after one died."""

    def _connect(self) -> Connection:
        if self._conn is None:
            pid = ensure_agent(self.agent_dir, idle_exit_s=self.idle_exit_s)
            if self.pid is not None and pid != self.pid:
                self.restarts += 1
            self.pid = pid
            key = (self.agent_dir / KEY_FILE).read_bytes()
            self._conn = Client(socket_address(self.agent_dir), family="AF_UNIX", authkey=key)
            self._conn.send(("hello", self.rank))
            self._conn.recv()
        return self._conn

    def call(self, *request):
        """Send ``request``, return the answer; a lost agent is started again and the request resent
        once. An exception the agent answers with is raised here."""
        for attempt in (0, 1):
            conn = self._connect()
            try:
                conn.send(request)
                answer = conn.recv()
                break
            except (EOFError, OSError):
                self._drop()
                if attempt:
                    raise
        if isinstance(answer, BaseException):
            raise RuntimeError(f"node agent {self.pid}: {answer}") from answer
        return answer

    def persist(self, request: PersistRequest) -> dict:
        """Queue a durable copy; returns ``{"records": the rank's finished copies, "cpu_s": the agent's CPU}``."""
        return self.call("persist", request)

    def flush(self) -> dict:
        """Wait for the rank's copies; returns what :meth:`persist` does."""
        return self.call("flush", self.rank)

    def bye(self) -> None:
        with contextlib.suppress(OSError, EOFError, RuntimeError):
            self.call("bye", self.rank)
        self._drop()

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
        self._conn = None
