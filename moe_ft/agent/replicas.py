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
  message is read whole (one buffer), verified and published with
  :func:`~moe_ft.replication.receiver.publish_replica` into ``replica_store_config(root, job, owner,
  holder)`` of the destination the sender names (the holder rank's directory on this node). A connection
  that ends inside a message (the sending agent was killed) publishes nothing of it. A ``close`` frame ends
  one owner's stream to one holder: the holder's trainer waits for it at the end of training.

Wire format of one frame: ``uint64`` header length (big-endian), the JSON header, then the payload
(the receiving agent answers each frame with a ``uint64`` once it has published or rejected it):
``{"kind": "point", "owner", "iteration", "holder", "root", "job_id", "per_holder", "manifest": n,
"blobs": [[name, n], ...]}`` followed by the manifest and the blobs, or ``{"kind": "close", "owner",
"holder", "root", "job_id", "per_holder"}`` with no payload.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from moe_ft.replication.placement import needs_replication
from moe_ft.replication.receiver import Rejection, publish_replica, replica_store_config
from moe_ft.replication.transport import PeerUnreachable, PointMessage, PointSink

if TYPE_CHECKING:
    from moe_ft.state.operators import Level, OperatorId
    from moe_ft.store import SnapshotStore
    from moe_ft.store.manifest import EntryRecord

logger = logging.getLogger("moe_ft.agent")

HOST_ENV = "MOE_FT_AGENT_HOST"
"""The address the node agent listens on for its peers' replicas (default: this host name's address)."""

_LEN = struct.Struct(">Q")
KEEP_POINTS = 8
"""Newest replicated points kept per owner (as the trainer's receiver keeps them)."""


PORT_ENV = "MOE_FT_AGENT_PORT"
"""The port the node agent listens on for replicas (default: one derived from its directory, so that an agent
started again after a crash listens where its peers send)."""
PORT_FILE = "replica.port"
"""In the agent directory while an agent listens: the port it got. An agent started again after a crash tries
it first (its predecessor may have had to take another port than :func:`agent_port`, and the peers gathered
that one); an agent that exits on its own removes it."""


def agent_port(agent_dir: str | os.PathLike) -> int:
    """``$MOE_FT_AGENT_PORT``, else a port in [20000, 32000) derived from the agent directory's path (the
    same on every start of the node's agent; peers gathered it once, at build). The range lies below Linux's
    default ephemeral ports (``net.ipv4.ip_local_port_range``: 32768-60999), so that no outgoing
    connection on the node holds it by chance."""
    if os.environ.get(PORT_ENV):
        return int(os.environ[PORT_ENV])
    digest = hashlib.sha1(os.path.realpath(agent_dir).encode()).digest()
    return 20000 + int.from_bytes(digest[:4], "big") % 12000


def listen_ports(agent_dir: str | os.PathLike) -> tuple[int, ...]:
    """The ports an agent tries, in order: its crashed predecessor's (:data:`PORT_FILE`), then
    :func:`agent_port`."""
    try:
        previous = int((Path(agent_dir) / PORT_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return (agent_port(agent_dir),)
    return tuple(dict.fromkeys((previous, agent_port(agent_dir))))


def agent_host() -> str:
    """``$MOE_FT_AGENT_HOST``, else the address this node's host name resolves to, else loopback."""
    host = os.environ.get(HOST_ENV)
    if host:
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


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


def _send_frame(sock: socket.socket, header: dict, parts=()) -> None:
    head = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(head)) + head)
    for part in parts:
        sock.sendall(memoryview(part))


def _recv_exact(sock: socket.socket, nbytes: int) -> memoryview | None:
    """``nbytes`` bytes, or ``None`` when the connection ends first (at a frame boundary or inside one)."""
    buf = bytearray(nbytes)
    view, got = memoryview(buf), 0
    while got < nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return view


class SocketSink(PointSink):
    """Sends rank ``owner``'s points to its peers' agents (one connection per peer, made at the first send
    and made again once after a broken one)."""

    def __init__(self, owner: int, peers: tuple[Destination, ...], *, timeout_s: float = 300.0) -> None:
        self.owner, self.timeout_s = owner, timeout_s
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
                _send_frame(sock, header, parts)
                if _recv_exact(sock, _LEN.size) is None:
                    raise ConnectionError("the connection closed before the acknowledgement")
                return
            except OSError as exc:
                self._drop(rank)
                if attempt:
                    dst = self.peers[rank]
                    raise PeerUnreachable(f"the node agent of rank {rank} at {dst.host}:{dst.port}: {exc}") from exc

    def send_point(self, dst: int, message: PointMessage) -> int:
        header = {**self._header(self.peers[dst], "point"), "iteration": message.iteration,
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


class ReplicaListener:
    """The receiving half in a node agent (see the module docstring), listening on the first free port of
    :func:`listen_ports` of the agent directory, which it records there (:data:`PORT_FILE`) until it is
    closed on the agent's own exit."""

    def __init__(self, host: str, agent_dir: str | os.PathLike) -> None:
        self.server = self._bind(host, listen_ports(agent_dir))
        self.host, self.port = host, self.server.getsockname()[1]
        self.port_file = Path(agent_dir) / PORT_FILE
        tmp = self.port_file.with_name(f".{PORT_FILE}.{os.getpid()}")
        tmp.write_text(f"{self.port}\n")
        os.replace(tmp, self.port_file)  # a successor after a crash listens here too
        self.streams: dict[tuple[int, int], StreamState] = {}
        """``(holder, owner) -> StreamState``."""
        self.torn = 0
        """Connections that ended inside a message (nothing of it published)."""
        self._stores: dict[tuple, "SnapshotStore"] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="moe-ft-agent-replicas", daemon=True).start()

    @staticmethod
    def _bind(host: str, ports: tuple[int, ...]) -> socket.socket:
        """The first of ``ports`` free, else any (peers that gathered another port miss this agent's
        replicas until the job's next build, and their senders say so)."""
        for port in ports:
            try:
                return socket.create_server((host, port))
            except OSError as exc:  # taken by another process
                logger.warning("moe-ft agent: replica port %d unavailable (%r)", port, exc)
        return socket.create_server((host, 0))

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="moe-ft-agent-replica-in", daemon=True).start()

    def close(self) -> None:
        """The agent exits on its own: the next agent need not listen where this one did."""
        self.server.close()
        self.port_file.unlink(missing_ok=True)

    def state(self, holder: int) -> dict[int, dict]:
        """``{owner: {"received", "closed", "rejections"}}`` of the streams into ``holder``."""
        with self._lock:
            return {owner: {"received": s.received, "closed": s.closed, "rejections": list(s.rejections)}
                    for (h, owner), s in self.streams.items() if h == holder}

    def reopen(self, holder: int) -> None:
        """A new run of ``holder`` (a restart): its streams start again."""
        with self._lock:
            for key in [k for k in self.streams if k[0] == holder]:
                del self.streams[key]

    def _store(self, header: dict) -> "SnapshotStore":
        key = (header["root"], header["job_id"], header["owner"], header["holder"] if header["per_holder"] else None)
        with self._lock:
            store = self._stores.get(key)
            if store is None:
                store = self._stores[key] = replica_store_config(root=key[0], job_id=key[1], owner=key[2],
                                                                 holder=key[3]).build()
            return store

    def _stream(self, header: dict) -> StreamState:
        with self._lock:
            return self.streams.setdefault((header["holder"], header["owner"]), StreamState())

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    head = _recv_exact(conn, _LEN.size)
                    if head is None:
                        return  # the sender closed between frames
                    raw = _recv_exact(conn, _LEN.unpack(head)[0])
                    header = json.loads(bytes(raw)) if raw is not None else None
                    if header is None:
                        raise EOFError("inside a header")
                    if header["kind"] == "close":
                        self._stream(header).closed = True
                        conn.sendall(_LEN.pack(0))
                        continue
                    sizes = [header["manifest"], *(n for _, n in header["blobs"])]
                    payload = _recv_exact(conn, sum(sizes))
                    if payload is None:
                        raise EOFError(f"inside point {header['iteration']} of rank {header['owner']}")
                except (EOFError, OSError) as exc:
                    with self._lock:
                        self.torn += 1
                    logger.warning("moe-ft agent: a replica connection ended %s; nothing of that message is kept",
                                   exc)
                    return
                self._publish(header, payload, sizes)
                try:
                    conn.sendall(_LEN.pack(header["iteration"]))  # the sender's acknowledgement
                except OSError:
                    return

    def _publish(self, header: dict, payload: memoryview, sizes: list[int]) -> None:
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        names = [name for name, _ in header["blobs"]]
        message = PointMessage(owner=header["owner"], iteration=header["iteration"],
                               manifest=bytes(payload[:offsets[1]]),
                               blobs={name: bytes(payload[offsets[i + 1]:offsets[i + 2]]) for i, name in enumerate(names)})
        stream = self._stream(header)
        try:
            published, rejected = publish_replica(self._store(header), message, keep_points=KEEP_POINTS)
        except Exception:  # a full disk, a store removed under it: logged, the stream goes on
            logger.exception("moe-ft agent: replica of rank %d iteration %d not published", message.owner,
                             message.iteration)
            return
        with self._lock:
            stream.rejections.extend(rejected)
            stream.received += int(published)
