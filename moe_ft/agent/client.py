"""A trainer's side of the node agent: find it, start it if the node has none, and talk to it.

``moe-ft launch`` starts the node's agent before the workers (``moe_ft/launch/cli.py``). Under plain torchrun,
or when the agent died, every trainer of a node calls :func:`connect`; under an ``flock`` of the agent
directory the first one that finds no live agent (no pid file, or one naming no running agent:
:func:`agent_pid`) starts ``python -m moe_ft.agent`` detached (its own session, so that it outlives the workers
and torchrun's process-group kill), and waits for its pid file.
A connection that cannot be made or breaks (the agent was killed, or is leaving) is made again, starting a new
agent, and the request resent once. An agent that does not answer (stopped, stuck) is an error after a bound,
never a hang of the trainer's thread: neither while the trainer waits for the answer nor while it sends a
request larger than the socket's buffer (a first publish order carries every entry layout), which a stopped
agent never reads.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import socket
import struct
import subprocess
import sys
import time
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path

from moe_ft.agent.server import KEY_FILE, LOG_FILE, PID_FILE, PersistRequest, proc_stat, socket_address

logger = logging.getLogger("moe_ft.agent")

START_TIMEOUT_S = 120.0
"""How long a trainer waits for a started agent to listen (it imports torch first)."""
REQUEST_TIMEOUT_S = 120.0
"""How long a trainer waits for the answer to a request that only queues work or reads the agent's state."""
DRAIN_TIMEOUT_S = 3600.0
"""How long it waits for the answer to a request that waits for the rank's queued work (:data:`DRAINS`:
durable copies and sends of whole points)."""
WAIT_NOTICE_S = 60.0
"""While a trainer waits longer for an answer, it says so every this many seconds (what it waits for, and the
agent's state: a stopped agent waits for ``kill -CONT``)."""
AWAIT_GONE_S = 2.0
"""How long a client whose connection broke waits for that agent to be gone before it connects again."""
DRAINS = frozenset({"flush", "bye", "replica_flush", "replica_close"})


def agent_pid(agent_dir: Path) -> int | None:
    """The pid of the live agent of ``agent_dir``, else ``None``. The process the pid file names must run, not
    be a zombie (a killed agent whose parent has not reaped it yet), and have started when the agent that
    wrote the file did: a SIGKILLed agent's pid may be an unrelated process's by now, and trusting it would
    refuse every trainer's connection until someone deletes the file."""
    try:
        pid, started = (int(v) for v in (agent_dir / PID_FILE).read_text().split())
    except (FileNotFoundError, ValueError):
        return None
    stat = proc_stat(pid)
    return pid if stat is not None and stat[0] != "Z" and stat[1] == started else None


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

    def __init__(self, agent_dir: str | os.PathLike, rank: int, *, idle_exit_s: float = 600.0,
                 timeout_s: float = REQUEST_TIMEOUT_S, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        self.agent_dir, self.rank, self.idle_exit_s = Path(agent_dir), rank, idle_exit_s
        self.timeout_s, self.drain_timeout_s = timeout_s, drain_timeout_s
        """The bounds on an answer (:data:`REQUEST_TIMEOUT_S`, :data:`DRAIN_TIMEOUT_S`)."""
        self.notice_s = WAIT_NOTICE_S
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
            self._conn = self._open((self.agent_dir / KEY_FILE).read_bytes())
            self._conn.send(("hello", self.rank))
            self._answer(self._conn, "hello")
        return self._conn

    def _open(self, key: bytes) -> Connection:
        """The authenticated connection (what ``multiprocessing.connection.Client`` makes), its handshake
        bounded: the kernel completes the connection to a stopped agent, whose challenge then never comes."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(self.timeout_s))
            # kept for the connection's life: a send the agent does not read for this long fails (call())
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.timeout_s))
            sock.connect(socket_address(self.agent_dir, key))
            conn = Connection(os.dup(sock.fileno()))
            try:
                answer_challenge(conn, key)
                deliver_challenge(conn, key)
            except BlockingIOError:  # the receive timeout: the agent runs no code
                conn.close()
                raise self._not_answering("the connection's authentication", self.timeout_s) from None
            except BaseException:
                conn.close()
                raise
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(0))  # answers: waited for in _answer
        return conn

    def _answer(self, conn: Connection, kind: str):
        """The answer to request ``kind``, waited for at most its bound; a wait longer than
        :data:`WAIT_NOTICE_S` is logged (the trainer's exit may wait here for the rank's durable copies)."""
        timeout = self.drain_timeout_s if kind in DRAINS else self.timeout_s
        start = time.monotonic()
        while not conn.poll(min(self.notice_s, max(0.0, start + timeout - time.monotonic()))):
            waited = time.monotonic() - start
            if waited >= timeout:
                self._drop()  # its late answer would be taken for the next request's
                raise self._not_answering(repr(kind), timeout)
            logger.warning("moe-ft: waiting %.0f s (of at most %g) for node agent %s to answer %r; it is %s",
                           waited, timeout, self.pid, kind, self._state())
        return conn.recv()

    def _state(self) -> str:
        """The agent's process state, in words, with what to do where it cannot answer."""
        stat = proc_stat(self.pid) if self.pid is not None else None
        if stat is None:
            return "gone"
        if stat[0] in "Tt":
            return f"stopped (`kill -CONT {self.pid}`)"
        return f"running (`kill -USR1 {self.pid}` writes its threads' stacks to {self.agent_dir / LOG_FILE})"

    def _not_answering(self, what: str, timeout: float) -> RuntimeError:
        return RuntimeError(
            f"the node agent {self.pid} of {self.agent_dir} did not answer {what} within {timeout:g} s: it is "
            f"stopped or stuck (`kill -USR1 {self.pid}` writes its threads' stacks to "
            f"{self.agent_dir / LOG_FILE}); `kill -CONT {self.pid}` if it was stopped, else `kill -9 {self.pid}`: "
            "the next request starts another agent")

    def call(self, *request):
        """Send ``request``, return the answer. A connection that cannot be made or breaks (no agent, one
        that is leaving or was killed) is made again, starting a new agent, and the request (with the
        connection's hello) resent, once. An agent that does not answer within the request's bound raises
        ``RuntimeError``, as does an exception the agent answers with, a request the agent does not read
        within :attr:`timeout_s` (not resent: it is not running, and a new connection would wait as long), or a
        connection that broke again after it was made again (the error naming the agent and its log)."""
        for attempt in (0, 1):
            try:
                conn = self._connect()
                conn.send(request)
                answer = self._answer(conn, request[0])
                break
            except BlockingIOError:  # the send timeout (SO_SNDTIMEO): part of the request may be in the socket
                self._drop()  # the torn message must not be followed by another one on this connection
                raise self._not_answering(f"{request[0]!r} (its request was not read)", self.timeout_s) from None
            except (EOFError, OSError) as exc:
                self._drop()
                if attempt:
                    raise RuntimeError(
                        f"the node agent of {self.agent_dir} (pid {self.pid}) could not be reached for {request[0]!r}: "
                        f"{type(exc).__name__}: {exc}, twice, the second time with an agent started again; its log "
                        f"is {self.agent_dir / LOG_FILE}") from exc
                self._await_gone(self.pid)
        if isinstance(answer, BaseException):
            raise RuntimeError(f"node agent {self.pid}: {answer}") from answer
        return answer

    def _await_gone(self, pid: int | None, timeout_s: float = AWAIT_GONE_S) -> None:
        """A broken connection to agent ``pid``: wait (bounded) until it is no longer the node's live agent. A
        SIGKILLed agent is still listed as running for a moment after the kernel reset its connections; the
        connection made again in that moment would reach it, and break once more."""
        deadline = time.monotonic() + timeout_s
        while pid is not None and agent_pid(self.agent_dir) == pid and time.monotonic() < deadline:
            time.sleep(0.01)

    def persist(self, request: PersistRequest) -> dict:
        """Queue a durable copy; returns ``{"records": the rank's finished copies, "cpu_s": the agent's CPU}``."""
        return self.call("persist", request)

    def flush(self) -> dict:
        """Wait for the rank's copies; returns what :meth:`persist` does."""
        return self.call("flush", self.rank)

    def bye(self) -> None:
        """This rank is done with the agent (once its queued work is done). Where no agent runs there is
        nobody to tell: none is started for it."""
        if self._conn is not None or agent_pid(self.agent_dir) is not None:
            with contextlib.suppress(OSError, EOFError, RuntimeError):
                self.call("bye", self.rank)
        self._drop()

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
        self._conn = None


def _timeval(seconds: float) -> bytes:
    """``struct timeval`` for ``SO_RCVTIMEO`` and ``SO_SNDTIMEO`` (0: no timeout)."""
    return struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
