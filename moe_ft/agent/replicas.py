"""Replication by the node agents (``--ft-replicate-by agent``; MoEtion Alg. 2, §5.1): the trainer names a
published point, its node's agent reads it from the store and sends it over TCP to the agents of the replica
peers' nodes, which verify every entry against the owner's checksums and publish it into their node's
replica store. No payload byte passes through a trainer process.

What runs where:

* **Sending agent** (:class:`SocketSink`): one :class:`~moe_ft.replication.sender.ReplicaSender` per trainer
  rank, in the agent, over a reader of the rank's store (the same newest-point-first and ``B_remote``
  rules as in the trainer). Each message goes to each peer's agent on a connection kept open per peer:
  ``socket.sendall`` of the header and of each blob's bytes as read from the store, no further copy.
* **Receiving agent** (:class:`ReplicaListener`): a TCP listener, one thread per incoming connection. A
  header is checked before anything is allocated from it or written where it says (:func:`parse_header`:
  fields and types; the destination, ``replica_store_config(root, job, owner, holder)``, must be this
  agent's own replica store; the sizes must fit in that store). A message is then read whole into one
  buffer, and verified and published from views of it
  (:func:`~moe_ft.replication.receiver.publish_replica`, without a copy of the payload). A connection that
  ends or stalls (:data:`STALL_TIMEOUT_S`) inside a message, or whose header is refused, publishes nothing
  of it and is closed; the message counts in :attr:`ReplicaListener.torn`. A ``close`` frame ends one
  owner's stream to one holder: the holder's trainer waits for it at the end of training.

The frames are in ``wire.py``, the agents' addresses in ``addresses.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from moe_ft.agent.addresses import AGENT_PORTS, FALLBACK_PORTS, PORT_FILE, listen_ports
from moe_ft.agent.wire import (
    KEEP_POINTS,
    LEN,
    MAX_HEADER_BYTES,
    brief,
    keepalive,
    parse_header,
    recv_exact,
    recv_into,
    send_frame,
)
from moe_ft.replication.placement import needs_replication
from moe_ft.replication.receiver import Rejection, publish_replica, replica_store_config
from moe_ft.replication.transport import PeerUnreachable, PointMessage, PointSink
from moe_ft.store.backend import dir_id
from moe_ft.store.capacity import existing_dir, used_bytes

if TYPE_CHECKING:
    from moe_ft.state.operators import Level, OperatorId
    from moe_ft.store import SnapshotStore
    from moe_ft.store.manifest import EntryRecord

logger = logging.getLogger("moe_ft.agent")

STALL_TIMEOUT_S = 60.0
"""A receive inside a message that makes no progress for this long ends the message as torn (nothing of it
published, its buffer freed, the connection closed). A live sending agent holds the whole message in memory
and ``sendall``s it, so it pauses only while descheduled (a niced agent on a busy node: seconds); a minute
without a byte means the sender or the path stopped (SIGSTOP, a partition), and waiting on would pin a thread
and the message's buffer, one more for each retry. It is shorter than the sender's own timeout
(:class:`SocketSink`, 300 s): the receiver lets go first, and the sender, once it runs again, finds the
connection broken and sends the point again on a new one. Between messages a connection waits without a
limit: it holds no buffer, and the next point comes when the next snapshot does."""
CLOSED_DIR = "streams"
"""In the agent directory: ``closed.<holder>.<owner>`` once owner's stream into holder ended. The holder's
trainer waits for the end of every stream at the end of training; an agent started again after the end
arrived (the previous one was killed) would otherwise never report it, and the trainer would wait out its
timeout. A new run of the holder (``replica_open``) removes its markers."""


@dataclass(frozen=True)
class Destination:
    """Where a peer keeps this rank's replicas: the peer agent's address and the holder's store."""

    rank: int
    host: str
    port: int
    root: str
    job_id: str
    per_holder: bool
    """Nodes simulated in one store root: the holder's own directory (``replica_store_config(holder=)``)."""


@dataclass(frozen=True)
class ReplicaSelect:
    """Which operator entries a point's message carries (``placement.needs_replication``); picklable, so a
    trainer can hand it to its agent."""

    dp_copy_off_node: bool
    expert_dp_copy_off_node: bool
    distributed_optimizer: bool

    def __call__(self, entry: "EntryRecord") -> bool:
        if entry.op is None or entry.level is None:  # the metadata entry: always sent
            return True
        return needs_replication(entry.op, entry.level, dp_copy_off_node=self.dp_copy_off_node,
                                 expert_dp_copy_off_node=self.expert_dp_copy_off_node,
                                 distributed_optimizer=self.distributed_optimizer)


@dataclass(frozen=True)
class ReplicateRequest:
    """Replicate rank ``rank``'s point ``iteration`` (of ``store_dir``) to ``peers``."""

    rank: int
    iteration: int
    store_dir: str
    peers: tuple[Destination, ...]
    select: ReplicaSelect
    plan: "dict[OperatorId, Level] | None" = None
    """The point's plan: the message carries the operators it saves FULL (a policy's remote plan), else all."""
    budget: int | None = None
    """``B_remote`` bytes this iteration adds to the sender's credit (MoEtion §4.2), ``None``: no limit."""
    keep: int = KEEP_POINTS
    """Newest points the holders keep of this rank's replicas (sent with each point)."""


class SocketSink(PointSink):
    """Sends rank ``owner``'s points to its peers' agents (one connection per peer, made at the first send
    and made again once after a broken one)."""

    def __init__(self, owner: int, peers: tuple[Destination, ...], *, timeout_s: float = 300.0,
                 keep: int = KEEP_POINTS) -> None:
        self.owner, self.timeout_s, self.keep = owner, timeout_s, keep
        self.peers = {p.rank: p for p in peers}
        self._socks: dict[int, socket.socket] = {}

    def _header(self, dst: Destination, kind: str) -> dict:
        return {"kind": kind, "owner": self.owner, "holder": dst.rank, "root": dst.root, "job_id": dst.job_id,
                "per_holder": dst.per_holder}

    def _sock(self, rank: int) -> socket.socket:
        sock = self._socks.get(rank)
        if sock is None:
            dst = self.peers[rank]
            sock = socket.create_connection((dst.host, dst.port), timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks[rank] = sock
        return sock

    def _send(self, rank: int, header: dict, parts=()) -> None:
        """One frame, then the receiving agent's acknowledgement: a point counts as sent once the peer read
        it whole and published it (or rejected it, as a receiver does), not when the kernel took the bytes
        (a write to a peer that just died succeeds). Sent again once on a new connection."""
        for attempt in (0, 1):
            try:
                sock = self._sock(rank)
                send_frame(sock, header, parts)
                if recv_exact(sock, LEN.size) is None:
                    raise ConnectionError("the connection closed before the acknowledgement")
                return
            except OSError as exc:
                self._drop(rank)
                if attempt:
                    dst = self.peers[rank]
                    raise PeerUnreachable(f"the node agent of rank {rank} at {dst.host}:{dst.port}: {exc}") from exc

    def send_point(self, dst: int, message: PointMessage) -> int:
        header = {**self._header(self.peers[dst], "point"), "iteration": message.iteration, "keep": self.keep,
                  "manifest": len(message.manifest), "blobs": [[k, len(v)] for k, v in message.blobs.items()]}
        self._send(dst, header, [message.manifest, *message.blobs.values()])
        return message.nbytes

    def close_to(self, dst: int) -> None:
        self._send(dst, self._header(self.peers[dst], "close"))
        self._drop(dst)

    def _drop(self, rank: int) -> None:
        sock = self._socks.pop(rank, None)
        if sock is not None:
            sock.close()


@dataclass
class StreamState:
    """One owner's stream into one holder on this node."""

    received: int = 0
    """Points published."""
    closed: bool = False
    """The owner's agent sent ``close``: nothing more comes."""
    rejections: list[Rejection] = field(default_factory=list)


class _Torn(Exception):
    """The connection ended or stalled inside a message (the reason says where)."""


class _Refused(Exception):
    """A frame's header refused (the reason says why)."""


def available_memory() -> int:
    """The node's available memory in bytes (``psutil``, ``MemAvailable`` on Linux): a message's receive buffer
    must fit, whatever room its store has on disk."""
    import psutil  # start-up time: the agent imports it with its first replica message

    return int(psutil.virtual_memory().available)


class ReplicaListener:
    """The receiving half in a node agent (see the module docstring), listening on the first free port of
    :func:`listen_ports` of the agent directory, which it records there (:data:`PORT_FILE`) until it is
    closed on the agent's own exit. It writes only into the replica stores of its job, beside the agent
    directory (``<store root>/<job>/agent``: ``<store root>/<job>/replicas/...``)."""

    def __init__(self, host: str, agent_dir: str | os.PathLike, *, stall_timeout_s: float = STALL_TIMEOUT_S) -> None:
        self.stall_timeout_s = stall_timeout_s
        """See :data:`STALL_TIMEOUT_S`."""
        self.job_dir = Path(os.path.realpath(agent_dir)).parent
        """The job directory of this agent's node (``<store root>/<job>``): its replica stores are under it."""
        self.server = self._bind(host, listen_ports(agent_dir))
        self.host, self.port = host, self.server.getsockname()[1]
        self.port_file = Path(agent_dir) / PORT_FILE
        self.closed_dir = Path(agent_dir) / CLOSED_DIR
        """See :data:`CLOSED_DIR`."""
        tmp = self.port_file.with_name(f".{PORT_FILE}.{os.getpid()}")
        tmp.write_text(f"{self.port}\n")
        os.replace(tmp, self.port_file)  # a successor after a crash listens here too
        self.streams: dict[tuple[int, int], StreamState] = {}
        """``(holder, owner) -> StreamState``."""
        self.torn = 0
        """Messages not received whole: the connection ended or stalled inside one, or its header was refused
        (malformed, a destination outside this agent's replica stores, more than the store can hold). Nothing
        of such a message is published, and its connection is closed."""
        self._stores: dict[tuple, "SnapshotStore"] = {}
        self._homes: dict[tuple, tuple[int, int] | None] = {}
        """The identity (``moe_ft.store.backend.dir_id``) of each cached store's directory when it was opened."""
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="moe-ft-agent-replicas", daemon=True).start()

    @staticmethod
    def _bind(host: str, ports: tuple[int, ...]) -> socket.socket:
        """The first of ``ports`` free, else the first free of the :data:`FALLBACK_PORTS` ports after the last
        of them in the agent range (below the ephemeral ports: a successor after a crash finds it in the port
        file and free, where a port the system picked could meanwhile be any outgoing connection's), else any.
        Peers that gathered another port miss this agent's replicas until the job's next build, and their
        senders say so."""
        for port in ports:
            try:
                return socket.create_server((host, port))
            except OSError as exc:  # taken by another process
                logger.warning("moe-ft agent: replica port %d unavailable (%r)", port, exc)
        base = ports[-1] - AGENT_PORTS[0] if ports and AGENT_PORTS[0] <= ports[-1] < AGENT_PORTS[1] else 0
        span = AGENT_PORTS[1] - AGENT_PORTS[0]
        for k in range(1, FALLBACK_PORTS + 1):
            with contextlib.suppress(OSError):
                return socket.create_server((host, AGENT_PORTS[0] + (base + k) % span))
        return socket.create_server((host, 0))

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self.server.accept()
            except OSError:
                return  # closed
            keepalive(conn)
            threading.Thread(target=self._serve, args=(conn, f"{addr[0]}:{addr[1]}"), name="moe-ft-agent-replica-in",
                             daemon=True).start()

    def close(self) -> None:
        """The agent exits on its own: the next agent need not listen where this one did."""
        self.server.close()
        self.port_file.unlink(missing_ok=True)

    def state(self, holder: int) -> dict[int, dict]:
        """``{owner: {"received", "closed", "rejections"}}`` of the streams into ``holder`` (ended streams
        included whose end reached a predecessor of this agent: :data:`CLOSED_DIR`)."""
        with self._lock:
            for owner in self._closed_markers(holder):
                self.streams.setdefault((holder, owner), StreamState()).closed = True
            return {owner: {"received": s.received, "closed": s.closed, "rejections": list(s.rejections)}
                    for (h, owner), s in self.streams.items() if h == holder}

    def reopen(self, holder: int) -> None:
        """A new run of ``holder`` (a restart): its streams start again."""
        with self._lock:
            for key in [k for k in self.streams if k[0] == holder]:
                del self.streams[key]
            for owner in self._closed_markers(holder):
                (self.closed_dir / f"closed.{holder}.{owner}").unlink(missing_ok=True)

    def _end_stream(self, holder: int, owner: int) -> None:
        self._stream({"holder": holder, "owner": owner}).closed = True
        self.closed_dir.mkdir(exist_ok=True)
        (self.closed_dir / f"closed.{holder}.{owner}").touch()

    def _closed_markers(self, holder: int) -> list[int]:
        prefix = f"closed.{holder}."
        names = os.listdir(self.closed_dir) if self.closed_dir.is_dir() else []
        return [int(n[len(prefix):]) for n in names if n.startswith(prefix) and n[len(prefix):].isdigit()]

    def destination(self, header: dict) -> Path:
        """The replica store directory a (parsed) header names, if it is this agent's own, for that owner (and
        holder): ``ValueError`` otherwise. Compared resolved (``..``, symbolic links, an absolute ``job_id``), so
        that no header directs a write anywhere else."""
        holder = header["holder"] if header["per_holder"] else None
        named = replica_store_config(root=header["root"], job_id=header["job_id"], owner=header["owner"],
                                     holder=holder).directory
        own = replica_store_config(root=str(self.job_dir.parent), job_id=self.job_dir.name, owner=header["owner"],
                                   holder=holder).directory
        if os.path.realpath(named) != os.path.realpath(own):  # ValueError itself for a NUL in the path
            raise ValueError(f"root {brief(header['root'])} and job_id {brief(header['job_id'])} name {named}, "
                             f"not this agent's replica store {own}")
        return own

    @staticmethod
    def room(directory: Path) -> int:
        """Bytes the replica store ``directory`` could hold: its file system's free space and what the store
        occupies already (its older points make way for new ones). A larger message could not be published,
        so it is refused before its buffer is allocated."""
        return shutil.disk_usage(existing_dir(directory)).free + used_bytes(directory)

    def _store(self, header: dict) -> "SnapshotStore":
        key = (header["root"], header["job_id"], header["owner"], header["holder"] if header["per_holder"] else None)
        with self._lock:
            store = self._stores.get(key)
            if store is None:
                store = self._stores[key] = replica_store_config(root=key[0], job_id=key[1], owner=key[2],
                                                                 holder=key[3]).build()
                self._homes[key] = dir_id(store.backend.describe())
            return store

    def let_go_of_removed(self) -> list[str]:
        """Close the cached replica stores whose directory was removed since they were opened (a world change
        drops the old world's replica stores, ``moe_ft/elastic/restore.py``), and return their directories.
        Their writer kept the deleted arena segments open and mapped: the pages stayed taken on the node's
        tmpfs for as long as the agent ran, unless the same owner's replicas came here again. A later message
        for that store opens its directory anew. One whose point is being written is kept for the next call."""
        out = []
        with self._lock:
            for key in [k for k, store in self._stores.items() if dir_id(store.backend.describe()) != self._homes[k]]:
                backend = self._stores[key].backend
                release = getattr(backend, "release_writer", None)  # the files layout holds no descriptor
                if release is not None and not release():
                    continue
                getattr(backend, "close", lambda: None)()  # its read descriptors
                del self._stores[key], self._homes[key]
                out.append(backend.describe())
        return out

    def _stream(self, header: dict) -> StreamState:
        with self._lock:
            return self.streams.setdefault((header["holder"], header["owner"]), StreamState())

    def _serve(self, conn: socket.socket, peer: str) -> None:
        with conn:
            serving = True
            while serving:
                serving = self._serve_frame(conn, peer)

    def _serve_frame(self, conn: socket.socket, peer: str) -> bool:
        """Receive, check and publish (or refuse) the next frame and acknowledge it; ``False`` once the
        connection is done. The message's buffer is released on return, before the next frame's arrives."""
        try:
            frame = self._read_frame(conn)
        except (_Torn, _Refused) as exc:
            with self._lock:
                self.torn += 1
            if isinstance(exc, _Refused):
                logger.warning("moe-ft agent: a replica message from %s refused: %s; connection closed, nothing of "
                               "it is kept", peer, exc)
            else:
                logger.warning("moe-ft agent: a replica connection from %s %s; nothing of that message is kept",
                               peer, exc)
            return False
        if frame is None:
            return False  # the sender closed between frames
        header, payload = frame
        if header["kind"] == "close":
            self._end_stream(header["holder"], header["owner"])
        else:
            self._publish(header, payload)
        try:
            conn.sendall(LEN.pack(header.get("iteration", 0)))  # the sender's acknowledgement
        except OSError:
            return False
        return True

    def _read_frame(self, conn: socket.socket) -> tuple[dict, memoryview] | None:
        """The next frame's checked header and payload (one buffer, allocated once the header passed), or
        ``None`` when the connection ends between frames. Raises :class:`_Torn` or :class:`_Refused`."""
        head = memoryview(bytearray(LEN.size))
        conn.settimeout(None)  # between messages: no limit (:data:`STALL_TIMEOUT_S`)
        try:
            got = conn.recv_into(head)
        except OSError as exc:  # a reset discards what arrived unread: a message may have been lost with it
            raise _Torn(f"was reset ({exc})") from None
        if got == 0:
            return None
        conn.settimeout(self.stall_timeout_s)
        self._receive(conn, head[got:], "inside a frame's length")
        nbytes = LEN.unpack(head)[0]
        if nbytes > MAX_HEADER_BYTES:
            raise _Refused(f"a header of {nbytes} bytes, more than any header ({MAX_HEADER_BYTES})")
        raw = memoryview(bytearray(nbytes))
        self._receive(conn, raw, "inside a header")
        try:
            header = parse_header(raw)
            directory = self.destination(header)
        except ValueError as exc:
            raise _Refused(str(exc)) from None
        if header["kind"] == "close":
            return header, memoryview(b"")  # no payload
        what = f"point {header['iteration']} of rank {header['owner']}"
        total = header["manifest"] + sum(n for _, n in header["blobs"])
        room = self.room(directory)
        if total > room:
            raise _Refused(f"{what} is {total} bytes, more than its replica store {directory} can hold ({room} "
                           f"bytes: its file system's free space and what the store occupies)")
        memory = available_memory()
        if total > memory:  # a store on a large disk: the buffer must fit in memory too
            raise _Refused(f"{what} is {total} bytes, more than this node's available memory ({memory} bytes)")
        payload = memoryview(bytearray(total))
        self._receive(conn, payload, f"inside {what}")
        return header, payload

    def _receive(self, conn: socket.socket, view: memoryview, where: str) -> None:
        try:
            if recv_into(conn, view):
                return
        except TimeoutError:
            raise _Torn(f"stalled {where} (no byte for {self.stall_timeout_s:g} s)") from None
        except OSError as exc:
            raise _Torn(f"ended {where} ({exc})") from None
        raise _Torn(f"ended {where}")

    def _publish(self, header: dict, payload: memoryview) -> None:
        """Verify and publish a point from views of its receive buffer (``publish_replica``: every blob checked
        against the owner's digests before anything is published, then written from its view)."""
        owner, iteration = header["owner"], header["iteration"]
        manifest = bytes(payload[:header["manifest"]])  # a few KB, decoded as JSON: the one copy made
        blobs, pos = {}, len(manifest)
        for name, nbytes in header["blobs"]:
            blobs[name] = payload[pos:pos + nbytes]
            pos += nbytes
        stream = self._stream(header)
        message = PointMessage(owner=owner, iteration=iteration, manifest=manifest, blobs=blobs)
        try:
            published, rejected = publish_replica(self._store(header), message,
                                                  keep_points=header.get("keep", KEEP_POINTS))
        except Exception:  # a full disk, a store removed under it: logged, the stream goes on
            logger.exception("moe-ft agent: replica of rank %d iteration %d not published", owner, iteration)
            return
        with self._lock:
            stream.rejections.extend(rejected)
            stream.received += int(published)
