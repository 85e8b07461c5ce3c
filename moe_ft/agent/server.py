"""The node agent process (``python -m moe_ft.agent --dir <agent dir>``; see ``moe_ft/agent/__init__.py``).

It listens on an abstract Unix socket named after its directory (``multiprocessing.connection``, with a
key only the job's files hold), writes its pid file (its pid and start time: :func:`proc_stat`) once it
listens, and serves each connected trainer on a thread of its own. Requests are tuples:

* ``("verify", VerifyRequest)``: queue the hashing of rank ``r``'s published point (its operator entries were
  written with their digests deferred, ``--ft-checksum-by agent``); the digests are recorded beside the
  point (``SnapshotStore.record_verified``). A rank's requests run in order, so a durable copy requested after
  a verification copies verified entries; answers the rank's state;
* ``("persist", PersistRequest)``: queue a durable copy of rank ``r``'s point (``moe_ft.persist.writer``,
  run here over a *reader* of the rank's store, pinning what it reads against the trainer's garbage
  collection; the trainer sends only published iterations, so nothing waits for a publish); answers the
  rank's state (:meth:`NodeAgent._state`: its finished copies and the agent's CPU seconds so far);
* ``("replicate", ReplicateRequest)``: send rank ``r``'s published point to its replica peers' agents
  (``moe_ft/agent/replicas.py``: a ``ReplicaSender`` per rank, here, over sockets); answers the rank's
  replication state. The first replication request starts the listener that receives the peers' replicas
  (on a port derived from the agent directory, or its crashed predecessor's port); ``("replica_listen",)`` answers its ``(host, port)``; ``("replica_open", rank)`` starts the rank's streams afresh, in and out
  (a new run, or a new attempt of the trainer: its sender is dropped, see :meth:`NodeAgent._replica`);
  ``("replica_state", holder)`` answers what arrived for it; ``("replica_flush" | "replica_abandon", rank)``
  waits for the rank's sends / drops its sender without ending its streams (a failed attempt);
  ``("replica_close", rank, peers)`` sends what is queued, then ends the rank's streams to ``peers`` (also
  from an agent that has no sender of the rank: one started again after the rank's last point);
* ``("publish", PublishOrder)``: seal the entries of rank ``r``'s point whose tensors the trainer copied into its
  arena, write its manifest, link its index and collect the rank's garbage (``moe_ft/store/handoff.py``,
  ``--ft-publish-by agent``); answers ``{"written", "deleted", "cpu_s"}`` once the point is published;
* ``("flush", rank)``: wait until the rank's queued copies are done; answers the rank's state;
* ``("bye", rank)``: the rank ends its run (its copies flushed first);
* ``("hello", rank)``: a trainer rank connected (sent by every client when it connects); answers the pid;
* ``("ping",)``: answers the agent's pid.

It exits once every rank that said hello has said bye and its queues are empty, or when no trainer has been
connected for ``--idle-exit`` seconds (the job died and did not come back), or on SIGTERM. Once it decided to,
it is found no more (pid file removed, socket closed, requests unanswered) before it finishes its queued work,
so that a trainer arriving then starts another agent instead of talking to a leaving one.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import hashlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import TYPE_CHECKING

from moe_ft.background import BackgroundWorker

if TYPE_CHECKING:
    from moe_ft.agent.replicas import ReplicaListener, ReplicateRequest
    from moe_ft.persist import PersistWriter
    from moe_ft.replication.sender import ReplicaSender
    from moe_ft.store import SnapshotStore
    from moe_ft.store.handoff import Finisher, PublishOrder
    from moe_ft.store.rules import RecoveryRule

logger = logging.getLogger("moe_ft.agent")

PID_FILE = "agent.pid"
KEY_FILE = "agent.key"
LOG_FILE = "agent.log"


def socket_address(agent_dir: str | os.PathLike, key: bytes) -> str:
    """The agent's abstract socket name: no file to go stale, unique per directory on the node and per key
    (``KEY_FILE``, made when the directory is first used): a directory deleted and created again, e.g. a lost
    node's store, gets another name even where the file system gives it the old inode number (ext4 does), so a
    new agent never meets the old one's socket, and a trainer never the old agent."""
    ident = f"{os.path.realpath(agent_dir)}:{os.stat(agent_dir).st_ino}:{hashlib.sha1(key).hexdigest()}"
    return f"\0moe-ft-agent-{hashlib.sha1(ident.encode()).hexdigest()[:20]}"


def proc_stat(pid: int) -> tuple[str, int] | None:
    """Process ``pid``'s state letter and start time (clock ticks after boot; ``/proc/<pid>/stat`` fields 3 and
    22), ``None`` when there is no such process. With its pid, the start time names one process: the pid file
    holds both, since a dead agent's pid is reused by another process sooner or later."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold anything
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[19])


LET_GO_TICKS = 5
"""Every this many ticks of the serve loop (0.2 s each) the agent closes what it holds of removed store
directories (:meth:`NodeAgent._let_go_of_removed`)."""


def _same_dir(path: Path, inode: int, key: bytes) -> bool:
    """Whether ``path`` is still the directory the agent serves (its inode, and its key: an inode number may
    be given again to a directory created anew)."""
    try:
        return os.stat(path).st_ino == inode and (path / KEY_FILE).read_bytes() == key
    except FileNotFoundError:
        return False


@dataclass(frozen=True)
class PersistRequest:
    """One due durable copy: what ``moe_ft.persist.PersistWriter.submit`` takes, and where."""

    rank: int
    iteration: int
    store_dir: str
    persist_dir: str
    job_id: str
    world_size: int
    rule: "RecoveryRule"
    """The rank's recovery rule (which points are complete)."""
    plan: dict | None = None
    """``pec``: the entries of point ``iteration`` to copy (``OperatorId -> Level``), else ``None``."""
    keep: int = 2


@dataclass(frozen=True)
class VerifyRequest:
    """Hash the deferred digests of rank ``rank``'s published point ``iteration`` in ``store_dir``."""

    rank: int
    iteration: int
    store_dir: str


@dataclass
class _Rank:
    """One rank's work here, run in order by ``worker``: verifications of its points (``store``, a reader of
    its store) and durable copies (``writer``, once it asked for one). A job that fails (a point deleted
    under it by a recovery, a full disk, a damaged entry) is logged with its traceback and skipped; the next
    request runs again: the agent outlives such moments."""

    rank: int
    store: "SnapshotStore"
    writer: "PersistWriter | None" = None
    key: tuple = ()
    """The durable copies' settings (``writer`` is made again when they change)."""
    verified: int = 0
    """Points whose deferred digests this agent recorded."""
    sender: "ReplicaSender | None" = None
    """Its replication to the peers' agents (``--ft-replicate-by agent``), once it asked for one."""
    sender_key: tuple = ()
    """The replication's store and peers (``sender`` is made again when they change: a new run)."""
    home: tuple[int, int] | None = None
    """The identity of ``store``'s directory when it was opened (``moe_ft.store.backend.dir_id``)."""
    worker: BackgroundWorker = field(init=False)

    def __post_init__(self) -> None:
        self.worker = BackgroundWorker(f"moe-ft-agent-rank{self.rank}", self.run,
                                       describe=lambda e: f"rank {self.rank}'s jobs failed: {e!r}")

    def run(self, job: tuple) -> None:
        kind, iteration, plan = job
        try:
            if kind == "verify":
                if self.store.record_verified(iteration):
                    self.verified += 1
            elif self.writer is not None:
                self.writer.persist(iteration, plan)
        except Exception as exc:  # kept going: see the class docstring
            from moe_ft.store.errors import MissingEntryError  # start-up time: imported with the store, by now

            what = "hashing" if kind == "verify" else "durable copy"
            if isinstance(exc, (FileNotFoundError, MissingEntryError)):  # collected by the trainer first: one line
                logger.warning("moe-ft agent: rank %d: %s of iteration %d skipped: the point is gone (%s)",
                               self.rank, what, iteration, exc)
            else:
                logger.exception("moe-ft agent: rank %d: %s of iteration %d skipped", self.rank, what, iteration)
            if kind != "verify" and self.writer is not None:
                self.writer.skipped.append((iteration, repr(exc)))


@dataclass
class NodeAgent:
    directory: Path
    idle_exit_s: float = 600.0
    started_by: str = "a trainer"
    """Who started it (``moe-ft launch``, or the first trainer of the node under plain torchrun)."""
    ranks: dict[int, _Rank] = field(default_factory=dict)
    """Ranks that sent work here (verification, durable copies, replication), each with its queue."""
    active: set[int] = field(default_factory=set)
    """Ranks that said hello and not bye since."""
    ever: set[int] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _connected: int = 0
    _last_seen: float = field(default_factory=time.monotonic)
    _stop: threading.Event = field(default_factory=threading.Event)
    listener: "ReplicaListener | None" = None
    """Receives the peers' replicas (started by the first replication request of any kind)."""
    _requests: threading.Condition = field(default_factory=threading.Condition)
    """Guards ``_busy`` and ``_exiting``; notified as each request ends."""
    _busy: int = 0
    """Requests being handled."""
    _exiting: bool = False
    """It is leaving (:meth:`_leave`): requests are left unanswered from then on."""
    finishers: dict[tuple[int, str], "Finisher"] = field(default_factory=dict)
    """Per rank and store whose points are handed over (``--ft-publish-by agent``): what publishes them here."""
    finisher_homes: dict[tuple[int, str], tuple[int, int] | None] = field(default_factory=dict)
    """The identity of each finisher's store directory when it was opened (``moe_ft.store.backend.dir_id``)."""

    def serve(self) -> None:
        key = (self.directory / KEY_FILE).read_bytes()
        home = os.stat(self.directory).st_ino
        server = socket.socket(socket.AF_UNIX)
        server.bind(socket_address(self.directory, key))
        server.listen(64)
        stat = proc_stat(os.getpid())
        assert stat is not None, "the agent's own /proc entry"
        pid_tmp = self.directory / f".{PID_FILE}.{os.getpid()}"
        pid_tmp.write_text(f"{os.getpid()} {stat[1]}\n")
        os.replace(pid_tmp, self.directory / PID_FILE)  # found by the trainers from here on
        print(f"moe-ft agent {os.getpid()}: serving {self.directory} (started by {self.started_by})", flush=True)
        threading.Thread(target=self._accept, args=(server, key), name="moe-ft-agent-accept", daemon=True).start()
        ticks = 0
        while not self._stop.wait(0.2):
            ticks += 1
            if ticks % LET_GO_TICKS == 0:
                self._let_go_of_removed()
            with self._lock:
                idle = self._connected == 0 and time.monotonic() - self._last_seen > self.idle_exit_s
                done = bool(self.ever) and not self.active and self._connected == 0
            gone = not _same_dir(self.directory, home, key)  # the store was wiped (a lost node's, or by hand)
            if idle or done or gone:
                why = ("every rank said bye" if done else "its directory is gone" if gone
                       else f"no trainer for {self.idle_exit_s:.0f} s")
                print(f"moe-ft agent {os.getpid()}: exiting ({why})", flush=True)
                break
        self._leave(server)
        self._close()

    def stop(self) -> None:
        self._stop.set()

    def _let_go_of_removed(self) -> None:
        """Close what the agent holds open of store directories removed under it (an elastic world change drops
        the old world's stores on the node, ``moe_ft/elastic/restore.py``): the read descriptors of a rank's
        store, a publisher's store, and the replica stores the listener writes. Open, they kept the deleted
        arena segments' pages on the node's tmpfs for the agent's life. Each reopens its directory when it is
        used again. Nothing is read from a removed store meanwhile: the arena checks a descriptor against the
        path before it reads (``moe_ft/store/arena.py``)."""
        # start-up time of the agent: the store is imported with the first request
        from moe_ft.store.backend import dir_id

        with self._lock:
            ranks = [r for r in self.ranks.values() if dir_id(r.store.backend.describe()) != r.home]
            for rank in ranks:
                getattr(rank.store.backend, "close", lambda: None)()  # the files layout holds no descriptor
                rank.home = dir_id(rank.store.backend.describe())
            gone = [self.finishers.pop(k) for k in list(self.finishers) if dir_id(k[1]) != self.finisher_homes[k]]
            for key in [k for k in self.finisher_homes if k not in self.finishers]:
                del self.finisher_homes[key]
        for finisher in gone:  # its order lock: one being finished keeps its mappings until it is done
            with finisher.lock:
                if finisher.segments is not None:
                    finisher.segments.close()
                getattr(finisher.store.backend, "close", lambda: None)()
        if self.listener is not None:
            for directory in self.listener.let_go_of_removed():
                logger.warning("moe-ft agent: replica store %s was removed: closed", directory)

    def _leave(self, server: socket.socket) -> None:
        """Be found no more before the slow close of :meth:`_close` (up to a minute per rank): a trainer that
        reads the pid file from now on starts another agent, one that connects is refused and tries again.
        The pid file goes first (a trainer that read it and finds the socket closed reads it again, once);
        ``shutdown`` wakes the thread blocked in ``accept`` (``close`` alone would leave the socket listening,
        and its name taken, until that thread returns: the next agent could not listen). A request that
        comes once the pid file is gone gets no answer (the lock is held from there: its trainer sends it
        again, to the next agent); those being answered are waited for, so that their work is queued before
        :meth:`_close`."""
        self._stop.set()  # also what the accept thread finds when shutdown wakes it
        with self._requests:
            with_pid = self.directory / PID_FILE
            with contextlib.suppress(FileNotFoundError, ValueError):
                if int(with_pid.read_text().split()[0]) == os.getpid():
                    with_pid.unlink()
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)
            server.close()
            if self.listener is not None:  # its port is the next agent's
                self.listener.close()
            self._exiting = True
            self._requests.wait_for(lambda: self._busy == 0, timeout=60)

    def _close(self) -> None:
        for rank in list(self.ranks.values()):
            rank.worker.close(timeout=60)
            if rank.sender is not None:
                rank.sender.abandon()

    def _accept(self, server: socket.socket, key: bytes) -> None:
        while True:
            try:
                sock, _ = server.accept()
            except OSError as exc:
                if self._stop.is_set():
                    return  # shut down by _leave
                logger.warning("moe-ft agent: accepting a connection failed: %r", exc)
                time.sleep(0.1)  # e.g. out of file descriptors: no busy loop
                continue
            with self._lock:
                self._connected += 1
            threading.Thread(target=self._serve_one, args=(Connection(sock.detach()), key), name="moe-ft-agent-conn",
                             daemon=True).start()

    def _serve_one(self, conn: Connection, key: bytes) -> None:
        try:
            try:  # what multiprocessing's Listener.accept does, on this thread: a slow client holds no other
                deliver_challenge(conn, key)
                answer_challenge(conn, key)
            except Exception as exc:  # a client that fails authentication: refused
                logger.warning("moe-ft agent: refused a connection: %r", exc)
                return
            while True:
                try:
                    request = conn.recv()
                except (EOFError, OSError):
                    return
                with self._requests:
                    if self._exiting:  # unanswered: the trainer sends it again, to the next agent
                        return
                    self._busy += 1
                try:
                    try:
                        answer = self._handle(request)
                    except Exception as exc:  # answered: the client raises it (a send to a lost peer, ...)
                        logger.warning("moe-ft agent: %s request failed: %r", request[0], exc)
                        answer = exc
                    conn.send(answer)
                finally:
                    with self._requests:
                        self._busy -= 1
                        self._requests.notify_all()
        finally:
            conn.close()
            with self._lock:
                self._connected -= 1
                self._last_seen = time.monotonic()

    def _handle(self, request: tuple):
        kind = request[0]
        if kind == "ping":
            return os.getpid()
        if kind == "hello":
            with self._lock:
                self.active.add(request[1])
                self.ever.add(request[1])
            return os.getpid()
        if kind == "persist":
            return self._persist(request[1])
        if kind == "verify":
            return self._verify(request[1])
        if kind == "publish":
            return self._publish(request[1])
        if kind.startswith("replica"):
            return self._replica(kind, request[1:])
        rank = self.ranks.get(request[1])
        if kind == "flush":
            if rank is not None:
                rank.worker.drain()
            return self._state(rank)
        if kind == "bye":
            if rank is not None:
                rank.worker.drain()
            with self._lock:
                self.active.discard(request[1])
            return None
        return ValueError(f"unknown request {kind!r}")

    def _rank(self, number: int, store_dir: str, retired: list[_Rank]) -> _Rank:
        """Rank ``number``'s work (made, or made again for another store directory); with the lock held. The
        work it replaces goes to ``retired``, for the caller to close once it released the lock (closing waits
        for its queued copies: every other rank's requests would wait with it)."""
        # start-up time of the agent: the store is imported with the first request
        from moe_ft.store import SnapshotStore, open_backend
        from moe_ft.store.backend import dir_id

        rank = self.ranks.get(number)
        if rank is None or rank.store.backend.describe() != store_dir:
            if rank is not None:
                retired.append(rank)
            store = SnapshotStore(open_backend(store_dir, create=False), shared_pins=True)
            rank = self.ranks[number] = _Rank(number, store, home=dir_id(store_dir))
        self.active.add(number)
        self.ever.add(number)
        return rank

    @staticmethod
    def _retire(retired: list[_Rank]) -> None:
        for rank in retired:
            rank.worker.close()
            if rank.sender is not None:
                rank.sender.abandon()

    def _verify(self, req: VerifyRequest):
        retired: list[_Rank] = []
        with self._lock:
            rank = self._rank(req.rank, req.store_dir, retired)
        self._retire(retired)
        rank.worker.submit(("verify", req.iteration, None))
        return self._state(rank)

    def _publish(self, order: "PublishOrder"):
        """Seal, publish and collect rank ``order.rank``'s point (``moe_ft/store/handoff.py``), on the rank's
        connection thread: the trainer waits for the answer before its allocator takes the point's regions."""
        # start-up time of the agent: the store is imported with the first request
        from moe_ft.store import SnapshotStore, open_backend
        from moe_ft.store.backend import dir_id
        from moe_ft.store.handoff import Finisher

        with self._lock:
            self.active.add(order.rank)
            self.ever.add(order.rank)
            finisher = self.finishers.get((order.rank, order.store_dir))
            if finisher is None:  # per store: a benchmark's rank publishes several side by side
                store = SnapshotStore(open_backend(order.store_dir, create=False), checksum=order.checksum,
                                      shared_pins=True)
                finisher = self.finishers[(order.rank, order.store_dir)] = Finisher(store)
                self.finisher_homes[(order.rank, order.store_dir)] = dir_id(order.store_dir)
        answer = finisher.finish(order)
        times = os.times()
        return {**answer, "cpu_s": times.user + times.system}

    def _persist(self, req: PersistRequest):
        # start-up time of the agent: the durable tier is imported with the first request for it
        from moe_ft.persist import DurableTier, PersistWriter

        key = (req.persist_dir, req.job_id, req.world_size, req.keep)
        retired: list[_Rank] = []
        with self._lock:
            rank = self._rank(req.rank, req.store_dir, retired)
            previous = rank.writer is not None and rank.key != key
        self._retire(retired)
        if previous:
            rank.worker.drain()  # the previous settings' copies first (the agent's lock released meanwhile)
        with self._lock:
            if rank.writer is None or rank.key != key:
                rank.writer = PersistWriter(rank.store, DurableTier(req.persist_dir, req.job_id, req.world_size),
                                            req.rule, rank=req.rank, interval=1, keep=req.keep, publish_timeout=0.0)
                rank.key = key
        rank.writer.rule = req.rule
        rank.worker.submit(("persist", req.iteration, req.plan))
        return self._state(rank)

    def _replica(self, kind: str, args: tuple):
        # start-up time of the agent: replication is imported with the first request for it
        from moe_ft.agent.addresses import agent_host
        from moe_ft.agent.replicas import ReplicaListener, SocketSink
        from moe_ft.replication.sender import ReplicaSender, SenderConfig, end_streams

        with self._lock:  # listening from the first replication request on (an agent started again after a
            # crash listens on the same port as before: the peers' senders find it there)
            if self.listener is None:
                self.listener = ReplicaListener(agent_host(), self.directory)
        if kind == "replica_listen":
            return self.listener.host, self.listener.port
        if kind == "replica_open":  # a new run or attempt of the rank (collective, at its build): its streams
            # in and out start afresh. A trainer restarted by torchrun says nothing else to the agent: its
            # predecessor's sender (a sticky error, the points of a timeline the recovery abandoned as done)
            # must not serve it
            self.listener.reopen(args[0])
            with self._lock:
                rank = self.ranks.get(args[0])
                if rank is not None and rank.sender is not None:
                    rank.sender.abandon()
                    rank.sender = None
            return None
        if kind == "replica_state":
            return {"streams": self.listener.state(args[0]), "torn": self.listener.torn}
        if kind == "replicate":
            req: "ReplicateRequest" = args[0]
            key = (req.store_dir, req.peers, req.select)
            retired: list[_Rank] = []
            with self._lock:
                work = self._rank(req.rank, req.store_dir, retired)
                if work.sender is None or work.sender_key != key:
                    if work.sender is not None:  # another run's: dropped without ending its streams
                        work.sender.abandon()
                    work.sender = ReplicaSender(SenderConfig(), work.store, SocketSink(req.rank, req.peers),
                                                [p.rank for p in req.peers], owner=req.rank, select=req.select)
                    work.sender_key = key
            self._retire(retired)
            sender = work.sender
            if isinstance(sender.transport, SocketSink):  # the owner's policy may change it (pec's K)
                sender.transport.keep = req.keep
            sender.budget = None if req.budget is None else (lambda: req.budget)
            sender.submit(req.iteration, req.plan)
            return self._replica_state(work)
        rank = self.ranks.get(args[0])
        if kind == "replica_close" and (rank is None or rank.sender is None):
            # an agent started again after the rank's last point has no sender of it, and the holders wait for
            # the end of its streams: ended from the peers the request names
            peers = args[1]
            end_streams(SocketSink(args[0], peers), [p.rank for p in peers], owner=args[0])
            return self._replica_state(rank)
        if rank is None or rank.sender is None:
            return self._replica_state(rank)
        if kind == "replica_flush":
            rank.sender.flush()
        elif kind == "replica_close":
            rank.sender.close()
            rank.sender = None
        elif kind == "replica_abandon":
            rank.sender.abandon()
            rank.sender = None
        else:
            raise ValueError(f"unknown request {kind!r}")
        return self._replica_state(rank)

    @staticmethod
    def _replica_state(rank: "_Rank | None") -> dict:
        """A rank's replication: the newest point on every peer, the last message sent, the points deferred,
        and the agent's CPU seconds so far."""
        times = os.times()
        sender = rank.sender if rank is not None else None
        last = sender.sent[-1] if sender is not None and sender.sent else None
        return {"replicated_iteration": sender.replicated_iteration if sender is not None else None,
                "sent": None if last is None else (last.iteration, last.nbytes, last.num_entries, last.seconds),
                "deferred": list(sender.deferred) if sender is not None else [], "cpu_s": times.user + times.system}

    @staticmethod
    def _state(rank: "_Rank | None") -> dict:
        """A rank's finished copies (``PersistRecord``) and the agent process's CPU seconds so far (user +
        system, every thread: what the node pays for the agent, reported per iteration by the trainers)."""
        times = os.times()
        writer = rank.writer if rank is not None else None
        return {"records": list(writer.records) if writer is not None else [],
                "paused": writer.paused if writer is not None else "",
                "verified": rank.verified if rank is not None else 0, "cpu_s": times.user + times.system}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_ft.agent", description="moe-ft node agent")
    parser.add_argument("--dir", required=True, help="agent directory (<store dir>/<job>/agent)")
    parser.add_argument("--idle-exit", type=float, default=600.0,
                        help="exit after this many seconds without a connected trainer")
    parser.add_argument("--nice", type=int, default=10, help="added niceness (the trainers come first)")
    parser.add_argument("--daemonize", action="store_true",
                        help="fork and leave the parent at once (the agent is then no trainer's child)")
    parser.add_argument("--started-by", default="a trainer", help="who started it (its log says so)")
    args = parser.parse_args(argv)
    if args.daemonize and os.fork():
        os._exit(0)  # the starter reaps this parent; the child is adopted by init (or the node's subreaper)
    os.nice(args.nice)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack, to the log
    import torch  # start-up time: imported after the nice (most of the agent's start-up)

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    agent = NodeAgent(Path(args.dir), idle_exit_s=args.idle_exit, started_by=args.started_by)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    agent.serve()
    return 0
