"""The receiving side of replication by the node agents (:class:`ReplicaListener`, ``moe_ft/agent/replicas.py``)
in one process, fed by a raw socket that sends crafted frames: a sender that stalls inside a message is cut
off after the listener's stall timeout and publishes nothing; a malformed header, a size the replica store
could not hold and a destination outside the agent's job directory are refused before anything is allocated
or written, each counted and logged with the peer, and the listener keeps serving; a point is received into
one buffer and verified and written from views of it (no copy of the payload); verification on arrival is
what it was (a flipped byte, a wrong size, a damaged manifest)."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import time
import tracemalloc
import zlib
from pathlib import Path

import pytest
import torch
from _ft_helpers import wait_until

from moe_ft.agent.addresses import PORT_ENV
from moe_ft.agent.replicas import ReplicaListener
from moe_ft.replication.receiver import replica_store_config
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import StoreConfig
from moe_ft.store.backend import MANIFEST
from moe_ft.store.manifest import decode_manifest

pytestmark = pytest.mark.timeout(60)
OPS = [OperatorId.dense(0), OperatorId.expert_op(0, 0)]
LEN = struct.Struct(">Q")
STALL_S = 1.0
"""The listener's stall timeout in the test of a stalled sender (the agent's is
:data:`~moe_ft.agent.replicas.STALL_TIMEOUT_S`); the other tests keep one far above any pause of this process."""


def _tensors(it: int, op: OperatorId, rows: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{it}/{op}".encode()))
    return {"weight": torch.randn(rows, 64, generator=gen), "exp_avg.weight": torch.randn(rows, 64, generator=gen)}


class Node:
    """A replica holder's node (its agent's listener, ``<tmp>/nodeB/j/agent``) and an owner's store on another
    root, whose published points the tests send by hand."""

    def __init__(self, tmp_path: Path, stall_timeout_s: float) -> None:
        self.tmp = tmp_path
        self.root = str(tmp_path / "nodeB")
        agent_dir = tmp_path / "nodeB" / "j" / "agent"
        agent_dir.mkdir(parents=True)
        self.listener = ReplicaListener("127.0.0.1", agent_dir, stall_timeout_s=stall_timeout_s)
        self.owner = StoreConfig(root=str(tmp_path / "nodeA"), job_id="j", rank=0).build()

    def point(self, it: int, rows: int = 64) -> tuple[bytes, dict[str, bytes]]:
        """Publish point ``it`` in the owner's store; its manifest and blobs as they would be sent."""
        with self.owner.begin(it) as point:
            for op in OPS:
                point.put(op, Level.FULL, _tensors(it, op, rows))
            point.put_meta({"it": it})
            point.publish()
        manifest = self.owner.backend.read_blob(it, MANIFEST)
        return manifest, {e.blob: self.owner.backend.read_blob(it, e.blob)
                          for e in decode_manifest(manifest, it, "test").all_entries()}

    def header(self, kind: str = "point", **fields) -> dict:
        return {"kind": kind, "owner": 0, "holder": 1, "root": self.root, "job_id": "j", "per_holder": False,
                **fields}

    def connect(self) -> socket.socket:
        return socket.create_connection((self.listener.host, self.listener.port), timeout=10)

    def send_point(self, sock: socket.socket, it: int, manifest: bytes, blobs: dict[str, bytes], **fields) -> int:
        """One point frame; returns the acknowledged iteration."""
        header = self.header(iteration=it, manifest=len(manifest), blobs=[[k, len(v)] for k, v in blobs.items()],
                             **fields)
        send(sock, header, [manifest, *blobs.values()])
        return LEN.unpack(recv_exactly(sock, LEN.size))[0]

    def replicas(self):
        return replica_store_config(root=self.root, job_id="j", owner=0).build()

    def replica_dir(self) -> Path:
        return replica_store_config(root=self.root, job_id="j", owner=0).directory

    def received(self) -> int:
        return self.listener.state(1).get(0, {}).get("received", 0)

    def serves_a_good_point(self, it: int = 7) -> None:
        """The listener still serves: a whole point on a new connection is published and acknowledged."""
        manifest, blobs = self.point(it)
        before = self.received()
        with self.connect() as sock:
            assert self.send_point(sock, it, manifest, blobs) == it
        assert self.received() == before + 1
        replicas = self.replicas()
        assert it in replicas.points() and replicas.verify().problems == ()
        for op in OPS:
            got = replicas.load(it, op, Level.FULL)
            assert all(torch.equal(got[k], v) for k, v in _tensors(it, op, 64).items())


def send(sock: socket.socket, header: dict | bytes, parts=()) -> None:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    sock.sendall(LEN.pack(len(head)) + head)
    for part in parts:
        sock.sendall(memoryview(part))


def recv_exactly(sock: socket.socket, nbytes: int) -> bytes:
    data = b""
    while len(data) < nbytes:
        piece = sock.recv(nbytes - len(data))
        assert piece, "the listener closed the connection"
        data += piece
    return data


def closed_by_listener(sock: socket.socket) -> bool:
    """Whether the listener ended the connection (an orderly close, or a reset when it left bytes unread)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture
def make_node(tmp_path, monkeypatch):
    monkeypatch.setenv(PORT_ENV, "0")  # any free port: tests run side by side
    nodes: list[Node] = []

    def make(stall_timeout_s: float = 30.0) -> Node:
        nodes.append(Node(tmp_path, stall_timeout_s))
        return nodes[-1]

    yield make
    for node in nodes:
        node.listener.close()


@pytest.fixture
def node(make_node):
    return make_node()


def test_a_point_sent_whole_is_verified_published_and_acknowledged_and_close_ends_the_stream(node):
    manifest, blobs = node.point(3)
    with node.connect() as sock:
        assert node.send_point(sock, 3, manifest, blobs) == 3
        send(sock, node.header("close"))
        assert LEN.unpack(recv_exactly(sock, LEN.size))[0] == 0
    assert node.listener.state(1) == {0: {"received": 1, "closed": True, "rejections": []}}
    assert node.listener.torn == 0
    replicas = node.replicas()
    assert replicas.points() == [3] and replicas.verify().problems == ()


def test_the_holder_keeps_as_many_points_as_the_owner_says(node):
    """A fixed count held no complete sparse window of 6 points in 9 iterations of 24; the owner's frames say
    how many newest points its recovery rule needs (``points_to_keep``), and the holder keeps that many."""
    from moe_ft.agent.wire import KEEP_POINTS

    with node.connect() as sock:
        for it in range(12):
            assert node.send_point(sock, it, *node.point(it, rows=4), keep=10) == it
    assert node.replicas().points() == list(range(2, 12))
    with node.connect() as sock:  # an owner whose frames do not say: the default
        assert node.send_point(sock, 12, *node.point(12, rows=4)) == 12
    assert node.replicas().points() == list(range(13 - KEEP_POINTS, 13))


@pytest.mark.parametrize("where", ["length", "header", "payload"])
def test_a_sender_that_stalls_inside_a_message_is_cut_off_and_publishes_nothing(make_node, where, caplog):
    """A peer stopped mid-message (SIGSTOP, a partition) keeps its connection open and sends nothing more: the
    listener gives up after its stall timeout, counts the message as torn, frees its buffer and publishes
    nothing of it; a sender that later sends whole on a new connection is served."""
    node = make_node(STALL_S)
    manifest, blobs = node.point(3)
    header = node.header(iteration=3, manifest=len(manifest), blobs=[[k, len(v)] for k, v in blobs.items()])
    head = json.dumps(header).encode()
    frame = LEN.pack(len(head)) + head + manifest + b"".join(blobs.values())
    cut = {"length": 4, "header": LEN.size + len(head) // 2, "payload": len(frame) // 2}[where]
    with node.connect() as sock:
        sock.sendall(frame[:cut])  # and then nothing, the connection left open
        wait_until(lambda: node.listener.torn == 1, timeout=STALL_S + 10)
        assert closed_by_listener(sock)
        port = sock.getsockname()[1]
    assert not node.replica_dir().exists(), "a torn message must publish nothing"
    assert any("stalled" in r.getMessage() and f":{port} " in r.getMessage() for r in caplog.records), caplog.text
    node.serves_a_good_point()


def test_a_connection_idle_between_messages_is_kept(make_node):
    """The stall timeout holds inside a message only: a sender's connection waits for its next point as long as
    the next snapshot takes (it holds no buffer meanwhile)."""
    node = make_node(STALL_S)
    with node.connect() as sock:
        assert node.send_point(sock, 3, *node.point(3)) == 3
        time.sleep(2 * STALL_S)  # idle: longer than the stall timeout, between two messages
        assert node.send_point(sock, 4, *node.point(4)) == 4
    assert node.listener.torn == 0 and node.received() == 2


def _bad_frames(node: Node) -> dict[str, bytes]:
    """Frames (length, header) whose header the listener must refuse, by what is wrong with it."""
    good = node.header(iteration=3, manifest=10, blobs=[["a.ent", 20]])

    def frame(header) -> bytes:
        head = header if isinstance(header, bytes) else json.dumps(header).encode()
        return LEN.pack(len(head)) + head

    return {
        "not JSON": frame(b"\x00{not json"),
        "not UTF-8": frame(b'{"kind": "\xff"}'),
        "not an object": frame([1, 2, 3]),  # type: ignore[arg-type]
        "no kind": frame({k: v for k, v in good.items() if k != "kind"}),
        "unknown kind": frame({**good, "kind": "shell"}),
        "no blobs": frame({k: v for k, v in good.items() if k != "blobs"}),
        "owner a string": frame({**good, "owner": "0"}),
        "holder a bool": frame({**good, "holder": True}),
        "iteration negative": frame({**good, "iteration": -1}),
        "iteration beyond an ack": frame({**good, "iteration": 1 << 64}),
        "blobs not a list": frame({**good, "blobs": "a.ent"}),
        "a blob not a pair": frame({**good, "blobs": [["a.ent", 20, 1]]}),
        "a blob name not a string": frame({**good, "blobs": [[5, 20]]}),
        "a blob named twice": frame({**good, "blobs": [["a.ent", 20], ["a.ent", 20]]}),
        "a size negative": frame({**good, "blobs": [["a.ent", -20]]}),
        "a size a float": frame({**good, "manifest": 10.0}),
        "a size beyond the store": frame({**good, "manifest": 1 << 50}),
        "the header's length beyond any header": LEN.pack(1 << 50) + b"{}",
        "per_holder not a bool": frame({**good, "per_holder": 1}),
        "root not a string": frame({**good, "root": None}),
        "keep zero": frame({**good, "keep": 0}),
        "keep a string": frame({**good, "keep": "8"}),
    }


PROBLEMS = ["not JSON", "not UTF-8", "not an object", "no kind", "unknown kind", "no blobs", "owner a string",
            "holder a bool", "iteration negative", "iteration beyond an ack", "blobs not a list",
            "a blob not a pair", "a blob name not a string", "a blob named twice", "a size negative",
            "a size a float", "a size beyond the store", "the header's length beyond any header",
            "per_holder not a bool", "root not a string", "keep zero", "keep a string"]


@pytest.mark.parametrize("problem", PROBLEMS)
def test_a_malformed_header_is_refused_counted_and_logged_and_the_listener_keeps_serving(node, problem, caplog):
    """Before anything is allocated from its sizes: the message is counted (``torn``), one line names the peer
    and the problem, that connection is closed, nothing is written, and the next sender is served."""
    frames = _bad_frames(node)
    assert sorted(frames) == sorted(PROBLEMS)
    with node.connect() as sock:
        sock.sendall(frames[problem])
        assert closed_by_listener(sock)
        wait_until(lambda: node.listener.torn == 1, timeout=10)
        port = sock.getsockname()[1]
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and f":{port} " in refused[0], caplog.text
    assert not node.replica_dir().exists()
    node.serves_a_good_point()


@pytest.mark.parametrize("destination", [
    {"root": "elsewhere"},  # another job directory: a peer's store root, not this agent's
    {"job_id": "../../escape"},
    {"job_id": "j/../../../escape"},
    {"job_id": "ABSOLUTE"},
    {"root": "ABSOLUTE", "job_id": "."},
    {"job_id": "j\x00"},
])
@pytest.mark.parametrize("kind", ["point", "close"])
def test_a_header_cannot_direct_a_write_outside_the_agents_replica_directory(node, destination, kind, caplog):
    """``root``/``job_id`` of a header name the holder's store root and job: they must be this agent's own (the
    directory above its agent directory), resolved, else the message is refused and nothing is created."""
    elsewhere = node.tmp / "elsewhere"
    fields = {k: (str(elsewhere) if v in ("elsewhere", "ABSOLUTE") else v) for k, v in destination.items()}
    manifest, blobs = node.point(3)
    with node.connect() as sock:
        if kind == "point":
            header = {**node.header(iteration=3, manifest=len(manifest),
                                    blobs=[[k, len(v)] for k, v in blobs.items()]), **fields}
            parts = [manifest, *blobs.values()]
        else:
            header, parts = {**node.header("close"), **fields}, []
        with contextlib.suppress(ConnectionError):  # refused from its header on: the payload may meet a reset
            send(sock, header, parts)
        assert closed_by_listener(sock)
    wait_until(lambda: node.listener.torn == 1, timeout=10)
    assert any("refused" in r.getMessage() for r in caplog.records), caplog.text
    written = sorted(str(p.relative_to(node.tmp)) for p in node.tmp.rglob("FORMAT.json"))
    assert written == ["nodeA/j/rank0/FORMAT.json"], written  # the owner's store only
    assert node.listener.state(1) == {}  # a refused close ends no stream
    node.serves_a_good_point()


def test_a_point_is_received_into_one_buffer_and_written_without_copies(node):
    """The payload is read into one buffer and verified and written from views of it: the Python memory the
    receiving side allocates peaks near one payload (before: the blobs copied out of the buffer, then each
    again for its verification, over twice the payload)."""
    manifest, blobs = node.point(5, rows=1 << 14)  # 2 operators x 2 x 4 MiB
    payload = len(manifest) + sum(len(b) for b in blobs.values())
    with node.connect() as sock:
        tracemalloc.start()
        try:
            assert node.send_point(sock, 5, manifest, blobs) == 5
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert node.received() == 1 and node.listener.state(1)[0]["rejections"] == []
    assert payload < peak < 1.25 * payload, (peak, payload)
    replicas = node.replicas()
    assert replicas.verify().problems == ()
    for op in OPS:
        got = replicas.load(5, op, Level.FULL)
        assert all(torch.equal(got[k], v) for k, v in _tensors(5, op, 1 << 14).items())


def test_every_blob_is_verified_on_arrival_against_the_owners_digests(node, caplog):
    """A flipped byte and a blob of the wrong size are rejected, each logged, the rest of the point published;
    a damaged manifest publishes nothing of its point (what ``verify_message`` checks, over views)."""
    caplog.set_level(logging.WARNING)
    manifest, blobs = node.point(3)
    flipped, short = (name for name in blobs if "expert" in name or "dense" in name)
    damaged = bytearray(blobs[flipped])
    damaged[len(damaged) // 2] ^= 0x10
    with node.connect() as sock:
        node.send_point(sock, 3, manifest, {**blobs, flipped: bytes(damaged), short: blobs[short][:-8]})
        bad_manifest = bytearray(manifest)
        bad_manifest[len(bad_manifest) // 2] ^= 0x01
        node.send_point(sock, 4, bytes(bad_manifest), node.point(4)[1])
    rejections = {r.entry: r.reason for r in node.listener.state(1)[0]["rejections"]}
    entries = decode_manifest(manifest, 3, "test").all_entries()
    name_of = {e.blob: e.name for e in entries}
    assert "checksum mismatch" in rejections[name_of[flipped]], rejections
    assert "bytes arrived, manifest says" in rejections[name_of[short]], rejections
    assert set(rejections) == {name_of[flipped], name_of[short], "MANIFEST"}, rejections
    assert node.received() == 1
    replicas = node.replicas()
    assert replicas.points() == [3]
    assert set(replicas.catalog().point(3).entries) == set()  # both operators rejected: the metadata kept
    assert replicas.catalog().point(3).meta is not None
    assert sum("rejected" in r.getMessage() for r in caplog.records) == 3, caplog.text


def test_an_accepted_connection_probes_a_silent_peer():
    """An idle connection whose sending node vanished without closing ends after the keepalive probes (about two
    minutes) instead of holding its thread for the kernel's default of hours."""
    from moe_ft.agent.wire import KEEPALIVE_S, keepalive

    with socket.socket() as sock:
        keepalive(sock)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert [sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, n))
                for n in ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT")] == list(KEEPALIVE_S)


def test_the_end_of_a_stream_outlives_the_agent_that_received_it(node):
    """The agent that received a stream's end is killed before the holder's trainer asked for it: its successor
    still reports the stream ended (the trainer would otherwise wait out its timeout at the end of training);
    a new run of the holder starts the stream afresh."""
    with node.connect() as sock:
        send(sock, node.header("close"))
        assert LEN.unpack(recv_exactly(sock, LEN.size))[0] == 0
    agent_dir = node.listener.port_file.parent
    node.listener.server.close()  # killed: no cleanup of its own
    successor = ReplicaListener("127.0.0.1", agent_dir)
    try:
        assert successor.state(1) == {0: {"received": 0, "closed": True, "rejections": []}}
        assert successor.state(2) == {}
        successor.reopen(1)
        assert successor.state(1) == {}
    finally:
        successor.close()


def test_a_message_larger_than_the_nodes_available_memory_is_refused_before_its_buffer(node, monkeypatch, caplog):
    """A replica store on a large disk has room for more than memory holds: the receive buffer must fit too."""
    from moe_ft.agent import replicas

    assert replicas.available_memory() > 0
    manifest, blobs = node.point(3)
    monkeypatch.setattr(replicas, "available_memory", lambda: len(manifest))
    with node.connect() as sock:
        header = node.header(iteration=3, manifest=len(manifest), blobs=[[k, len(v)] for k, v in blobs.items()])
        send(sock, header)
        assert closed_by_listener(sock)
    wait_until(lambda: node.listener.torn == 1, timeout=10)
    assert "available memory" in caplog.text and not node.replica_dir().exists()
    monkeypatch.undo()
    node.serves_a_good_point()
