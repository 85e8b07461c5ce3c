"""Replication by the node agents (``--ft-replicate-by agent``, ``moe_ft/agent/replicas.py``) with real agent
processes on two simulated nodes (two store roots, one agent each): a point named by rank 0's trainer is
sent by node A's agent and published by node B's, verified on arrival; a byte flipped on the wire is
rejected; the end of the stream reaches the holder; a sending agent SIGKILLed inside a message publishes
nothing of it, and the next request starts another agent that sends the point whole. A damaged local point is
skipped, not a sticky error; a new attempt of a trainer gets a fresh sender of its agent; the end of the
streams reaches the holders from an agent started again after the last point, and a peer unreachable then is
logged."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import time
import zlib
from pathlib import Path

import pytest
import torch
from _ft_helpers import stop_process, wait_until

from moe_ft.agent.addresses import PORT_FILE, agent_port, listen_ports
from moe_ft.agent.client import AgentClient, agent_pid
from moe_ft.agent.replicas import Destination, ReplicaSelect, ReplicateRequest, SocketSink
from moe_ft.agent.replication import AgentReceiver, AgentSender
from moe_ft.agent.server import NodeAgent
from moe_ft.replication.receiver import replica_store_config
from moe_ft.replication.sender import ReplicaSender, SenderConfig
from moe_ft.replication.transport import PointMessage, PointSink
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import DenseRule, KeepNewestRecoverable, StoreConfig
from moe_ft.store.backend import MANIFEST
from moe_ft.store.manifest import decode_manifest

pytestmark = pytest.mark.timeout(180)
OPS = [OperatorId.dense(0), OperatorId.expert_op(0, 0)]
SELECT = ReplicaSelect(dp_copy_off_node=False, expert_dp_copy_off_node=False, distributed_optimizer=False)


def _tensors(it: int, op: OperatorId, rows: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{it}/{op}".encode()))
    return {"weight": torch.randn(rows, 64, generator=gen), "exp_avg.weight": torch.randn(rows, 64, generator=gen)}


def _publish(store, it: int, rows: int = 256) -> None:
    with store.begin(it) as point:
        for op in OPS:
            point.put(op, Level.FULL, _tensors(it, op, rows))
        point.put_meta({"it": it})
        point.publish()


class Nodes:
    """Rank 0's store and agent on node A, rank 1 (its replica holder) with its agent on node B."""

    def __init__(self, tmp_path) -> None:
        self.roots = [str(tmp_path / "nodeA"), str(tmp_path / "nodeB")]
        self.store = StoreConfig(root=self.roots[0], job_id="j", rank=0).build(
            retention=KeepNewestRecoverable(rule=DenseRule(operators=frozenset(OPS))))
        self.clients = [AgentClient(os.path.join(root, "j", "agent"), rank, idle_exit_s=30)
                        for rank, root in enumerate(self.roots)]
        self.clients[0].call("ping")  # both agents running from here
        host, port = self.clients[1].call("replica_listen")
        self.clients[1].call("replica_open", 1)
        self.dest = Destination(rank=1, host=host, port=port, root=self.roots[1], job_id="j", per_holder=False)
        self.sender = AgentSender(self.clients[0], rank=0, store=self.store, peers=[self.dest], select=SELECT)
        self.receiver = AgentReceiver(self.clients[1], rank=1, sources=[0], store_for=lambda owner: replica_store_config(
            root=self.roots[1], job_id="j", owner=owner).build())

    def replicas(self):
        return self.receiver.store(0)

    def check_replica(self, it: int, rows: int = 256) -> None:
        assert it in self.replicas().points()
        assert self.replicas().verify().problems == ()
        for op in OPS:
            got = self.replicas().load(it, op, Level.FULL)
            assert all(torch.equal(got[k], v) for k, v in _tensors(it, op, rows).items())

    def bye(self) -> None:
        for client in self.clients:
            client.bye()


def test_agents_replicate_verified_points_reject_a_damaged_one_and_end_the_stream(tmp_path):
    nodes = Nodes(tmp_path)
    for it in range(3):
        _publish(nodes.store, it)
        nodes.sender.submit(it)
        nodes.sender.flush()  # each point sent before the next one's publish deletes it (newest point kept)
    assert nodes.sender.replicated_iteration == 2 and nodes.sender.lag(2) == 0
    assert nodes.sender.sent[-1].iteration == 2 and nodes.sender.sent[-1].num_entries == 3  # 2 operators + meta
    wait_until(lambda: nodes.receiver.poll().get(0, {}).get("received") == 3, timeout=20)
    nodes.check_replica(2)
    assert nodes.clients[0].pid != nodes.clients[1].pid  # two agents: the bytes crossed a socket

    # a byte flipped on the wire (sent straight to node B's agent): rejected, the rest of the point kept
    backend = nodes.store.backend
    manifest = backend.read_blob(2, MANIFEST)
    blobs = {e.blob: backend.read_blob(2, e.blob) for e in decode_manifest(manifest, 2, "test").all_entries()}
    victim = next(name for name in blobs if "expert" in name)
    damaged = bytearray(blobs[victim])
    damaged[len(damaged) // 2] ^= 0x10
    sink = SocketSink(0, (nodes.dest,))
    sink.send_point(1, PointMessage(owner=0, iteration=2, manifest=manifest, blobs={**blobs, victim: bytes(damaged)}))
    wait_until(lambda: nodes.receiver.poll()[0]["received"] == 4, timeout=20)
    (rejected,) = nodes.receiver.rejections
    assert rejected.entry == f"{OperatorId.expert_op(0, 0)}@FULL" and "checksum mismatch" in rejected.reason, rejected
    entries = nodes.replicas().catalog().point(2).entries  # the newer bytes replaced the point, less the damage
    assert OperatorId.dense(0) in entries and OperatorId.expert_op(0, 0) not in entries

    nodes.sender.close()  # the agent ends rank 0's stream: the holder's end-of-training wait returns
    nodes.receiver.join(timeout=20)
    nodes.bye()


def _deleted_files_held(pid: int, under: str) -> list[str]:
    """Files under ``under`` that process ``pid`` holds open or mapped although they were deleted."""
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # a descriptor closed meanwhile
            held.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    with open(f"/proc/{pid}/maps") as maps:
        held += [line.split(None, 5)[-1].strip() for line in maps]
    return [path for path in held if path.startswith(under) and path.endswith("(deleted)")]


def test_an_agent_lets_go_of_a_replica_store_removed_under_it(tmp_path):
    """An elastic world change removes the replica stores of ranks the new world does not have
    (``moe_ft/elastic/restore.py``). The agent that wrote one held its arena segments open and mapped, so their
    pages stayed taken on the node's tmpfs for the agent's life (32.8 MB of 32.8 for three 8 MB points of a
    rank, measured on /dev/shm). It closes them within a second or so; replicas that arrive later, once the
    holder's store is made again, are published where recovery reads them."""
    nodes = Nodes(tmp_path)
    _publish(nodes.store, 0)
    nodes.sender.submit(0)
    nodes.sender.flush()
    wait_until(lambda: nodes.receiver.poll().get(0, {}).get("received") == 1, timeout=20)
    directory = str(nodes.replicas().backend.describe())
    agent = nodes.clients[1].pid
    assert _deleted_files_held(agent, directory) == []
    shutil.rmtree(directory)
    wait_until(lambda: _deleted_files_held(agent, directory) == [], timeout=20,
               message=f"node B's agent still holds {_deleted_files_held(agent, directory)}")

    store = replica_store_config(root=nodes.roots[1], job_id="j", owner=0).build()  # the new holder's (its receiver)
    _publish(nodes.store, 1)
    nodes.sender.submit(1)
    nodes.sender.flush()
    wait_until(lambda: store.points() == [1], timeout=20)
    nodes.check_replica(1)
    nodes.bye()


def test_a_sending_agent_killed_inside_a_message_publishes_nothing_of_it(tmp_path):
    nodes = Nodes(tmp_path)
    rows = 1 << 16  # 2 x 16 MB per operator: far more than the sockets buffer while the receiver is stopped
    _publish(nodes.store, 0, rows)
    receiving, sending = nodes.clients[1].pid, nodes.clients[0].pid
    try:
        stop_process(receiving)  # node B's agent reads nothing: node A's blocks inside the message
        nodes.sender.submit(0)
        time.sleep(2.0)
        assert nodes.sender.sent == []  # still sending
        os.kill(sending, signal.SIGKILL)
        wait_until(lambda: agent_pid(tmp_path / "nodeA" / "j" / "agent") is None, timeout=10)
    finally:
        os.kill(receiving, signal.SIGCONT)
    wait_until(lambda: nodes.receiver.torn == 1 or nodes.receiver.poll() is None, timeout=20)
    assert nodes.replicas().points() == [], "a torn message must publish nothing"
    nodes.sender.submit(0)  # the broken connection: a new agent on node A, the request resent
    nodes.sender.flush()
    assert nodes.clients[0].pid != sending and nodes.clients[0].restarts == 1
    wait_until(lambda: nodes.receiver.poll().get(0, {}).get("received") == 1, timeout=30)
    nodes.check_replica(0, rows)
    nodes.sender.close()
    nodes.bye()


def test_points_written_without_digests_reach_the_peer_with_them(tmp_path):
    """``--ft-checksum-by agent`` with the agents replicating: the trainer writes each entry once, its digest
    deferred; the sending agent hashes the point before it sends it and sends the manifest with the digests,
    so the peer verifies every entry on arrival and its replica holds real digests, not pending ones."""
    from moe_ft.store.codec import PENDING

    nodes = Nodes(tmp_path)
    deferred = StoreConfig(root=nodes.roots[0], job_id="j2", rank=0, checksum_by="agent").build()
    nodes.sender.store = deferred
    _publish(deferred, 0)
    assert all(e.checksum == PENDING for e in deferred.catalog().point(0).all_entries() if e.op is not None)
    nodes.sender.submit(0)
    nodes.sender.flush()
    wait_until(lambda: nodes.receiver.poll().get(0, {}).get("received") == 1, timeout=20)
    assert nodes.receiver.rejections == []
    nodes.check_replica(0)
    assert all(e.checksum != PENDING for e in nodes.replicas().catalog().point(0).all_entries())
    assert (tmp_path / "nodeA" / "j2" / "rank0" / "verified" / "0.json").exists()  # hashed on node A's side
    nodes.sender.close()
    nodes.bye()


def test_a_receiving_agent_killed_costs_points_not_training_and_its_successor_listens_where_it_did(tmp_path):
    """Node B's agent SIGKILLed: node A's agent cannot deliver the next point, skips it for that peer and says
    so (the point does not count as replicated: the lag grows), and keeps its sender; node B's trainer's next
    call starts another agent, which listens on the same port, so the point after that reaches node B again.
    The port derived from node B's agent directory is held by another process throughout: the first agent
    listens on another port, and its successor finds that one in the port file its predecessor left."""
    blocker = socket.create_server(("", agent_port(tmp_path / "nodeB" / "j" / "agent")))
    nodes = Nodes(tmp_path)
    assert nodes.dest.port != blocker.getsockname()[1]
    assert 20000 <= nodes.dest.port < 32000  # the fallback stays below the ephemeral ports
    _publish(nodes.store, 0)
    nodes.sender.submit(0)
    nodes.sender.flush()
    wait_until(lambda: nodes.receiver.poll().get(0, {}).get("received") == 1, timeout=20)
    receiving = nodes.clients[1].pid
    os.kill(receiving, signal.SIGKILL)
    wait_until(lambda: agent_pid(tmp_path / "nodeB" / "j" / "agent") is None, timeout=10)
    _publish(nodes.store, 1)
    nodes.sender.submit(1)
    nodes.sender.flush()  # answered: the sending agent's sender did not fail
    assert nodes.sender.replicated_iteration == 0 and nodes.sender.lag(1) == 1
    log = (tmp_path / "nodeA" / "j" / "agent" / "agent.log").read_text()
    assert "point 1 not replicated: peer(s) [1] unreachable" in log, log
    nodes.receiver.poll()  # node B's trainer: a new agent, listening again
    assert nodes.clients[1].pid != receiving and nodes.clients[1].restarts == 1
    assert tuple(nodes.clients[1].call("replica_listen")) == (nodes.dest.host, nodes.dest.port)
    _publish(nodes.store, 2)
    nodes.sender.submit(2)
    nodes.sender.flush()
    assert nodes.sender.replicated_iteration == 2
    wait_until(lambda: 2 in nodes.replicas().points(), timeout=20)
    nodes.check_replica(2)
    assert 1 not in nodes.replicas().points()
    port_file = tmp_path / "nodeB" / "j" / "agent" / PORT_FILE
    assert int(port_file.read_text()) == nodes.dest.port
    nodes.sender.close()
    nodes.bye()
    wait_until(lambda: agent_pid(tmp_path / "nodeB" / "j" / "agent") is None, timeout=30)
    # an agent that leaves on its own: the next one starts from the derived port. The pid file goes first (the
    # agent is found no more), the port file when its listener closes, a moment later (CI saw the moment)
    wait_until(lambda: not port_file.exists(), timeout=10, message=f"{port_file} left behind")
    blocker.close()


def test_the_ports_an_agent_tries_are_its_predecessors_then_one_below_the_ephemeral_range(tmp_path, monkeypatch):
    monkeypatch.delenv("MOE_FT_AGENT_PORT", raising=False)
    ports = {agent_port(tmp_path / f"n{i}" / "agent") for i in range(200)}
    assert min(ports) >= 20000 and max(ports) < 32768 and len(ports) > 190
    agent_dir = tmp_path / "n0" / "agent"
    agent_dir.mkdir(parents=True)
    assert listen_ports(agent_dir) == (agent_port(agent_dir),)
    (agent_dir / PORT_FILE).write_text("45001\n")
    assert listen_ports(agent_dir) == (45001, agent_port(agent_dir))
    (agent_dir / PORT_FILE).write_text(f"{agent_port(agent_dir)}\n")
    assert listen_ports(agent_dir) == (agent_port(agent_dir),)
    monkeypatch.setenv("MOE_FT_AGENT_PORT", "23456")
    assert agent_port(agent_dir) == 23456
    # its own port taken, then the next one too: the one after, still in the agent range
    from moe_ft.agent.replicas import ReplicaListener

    own = agent_port(tmp_path / "n1" / "agent")
    monkeypatch.delenv("MOE_FT_AGENT_PORT")
    taken = []
    for port in (own, 20000 + (own - 20000 + 1) % 12000):
        with contextlib.suppress(OSError):
            taken.append(socket.create_server(("127.0.0.1", port)))
    server = ReplicaListener._bind("127.0.0.1", (own,))
    got = server.getsockname()[1]
    assert 20000 <= got < 32000 and got not in {t.getsockname()[1] for t in taken}
    for sock in (server, *taken):
        sock.close()


def test_an_agent_started_again_after_the_last_point_still_ends_the_streams(tmp_path):
    """Node A's agent SIGKILLed after rank 0's last point: the agent that rank 0's close starts has no sender
    of it, and ends its stream to the holder all the same (the holder's end-of-training wait returns)."""
    nodes = Nodes(tmp_path)
    _publish(nodes.store, 0)
    nodes.sender.submit(0)
    nodes.sender.flush()
    sending = nodes.clients[0].pid
    os.kill(sending, signal.SIGKILL)
    wait_until(lambda: agent_pid(tmp_path / "nodeA" / "j" / "agent") is None, timeout=10)
    nodes.sender.close()
    assert nodes.clients[0].pid != sending
    nodes.receiver.join(timeout=20)
    nodes.check_replica(0)
    nodes.bye()


class _Recorder(PointSink):
    """Takes every message and stream end (a peer that is always there)."""

    def __init__(self) -> None:
        self.points: list[int] = []
        self.closed: list[int] = []

    def send_point(self, dst: int, message: PointMessage) -> int:
        self.points.append(message.iteration)
        return message.nbytes

    def close_to(self, dst: int) -> None:
        self.closed.append(dst)


@pytest.mark.parametrize("budget", [None, 10**12], ids=["unlimited", "budgeted"])
def test_a_damaged_local_point_is_skipped_not_a_sticky_error(tmp_path, caplog, budget):
    """A manifest damaged in the local store: that point is skipped and logged (as the hashing job skips it),
    and the next one goes: a sticky error would fail every later point, and every later attempt the node
    agent serves with the same sender."""
    store = StoreConfig(root=str(tmp_path / "shm"), job_id="j", rank=0).build(
        retention=KeepNewestRecoverable(rule=DenseRule(operators=frozenset(OPS))))
    sink = _Recorder()
    sender = ReplicaSender(SenderConfig(), store, sink, [1], owner=0,
                           budget=None if budget is None else (lambda: budget))
    _publish(store, 0, rows=8)
    path, offset, length = store.backend.blob_location(0, MANIFEST)
    with open(path, "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    with caplog.at_level(logging.WARNING, logger="moe_ft.replication"):
        sender.submit(0)
        sender.flush()
    assert "point 0 not replicated: unreadable here" in caplog.text and sink.points == []
    _publish(store, 1, rows=8)
    sender.submit(1)
    sender.flush()
    assert sink.points == [1] and sender.replicated_iteration == 1
    sender.close()
    assert sink.closed == [1]


def _request(store, iteration: int, dest: Destination, budget: int | None = None) -> ReplicateRequest:
    return ReplicateRequest(rank=0, iteration=iteration, store_dir=store.backend.describe(), peers=(dest,),
                            select=SELECT, budget=budget)


def _in_process_agent(tmp_path, monkeypatch):
    """A node agent in this process (its handler called directly) whose replica listener is also the peer:
    rank 0's points go to holder 1, on the same node (its replica store beside rank 0's store)."""
    monkeypatch.setenv("MOE_FT_AGENT_HOST", "127.0.0.1")
    agent_dir = tmp_path / "nodeA" / "j" / "agent"
    agent_dir.mkdir(parents=True)
    agent = NodeAgent(Path(agent_dir))
    host, port = agent._handle(("replica_listen",))
    dest = Destination(rank=1, host=host, port=port, root=str(tmp_path / "nodeA"), job_id="j", per_holder=False)
    return agent, dest


def test_a_new_attempt_of_the_trainer_gets_a_fresh_sender(tmp_path, monkeypatch):
    """A trainer restarted by torchrun says no ``replica_abandon``: its build's ``replica_open`` replaces the
    sender its predecessor used. (b) Budgeted, after a rollback: the re-executed points are sent again (the
    old sender counted the abandoned timeline's 3 as sent, and would never send the new 3); (a) a sender with
    a sticky error does not fail the next attempt's requests."""
    agent, dest = _in_process_agent(tmp_path, monkeypatch)
    store = StoreConfig(root=str(tmp_path / "nodeA"), job_id="j", rank=0).build(
        retention=KeepNewestRecoverable(rule=DenseRule(operators=frozenset(OPS))))
    replicas = replica_store_config(root=dest.root, job_id="j", owner=0).build()
    budget = 10**12
    try:
        agent._handle(("replica_open", 0))
        for it in range(4):  # the first timeline
            _publish(store, it, rows=16)
            agent._handle(("replicate", _request(store, it, dest, budget)))
            assert agent._handle(("replica_flush", 0))["replicated_iteration"] == it
        first = agent.ranks[0].sender
        agent._handle(("replica_open", 0))  # the restarted trainer's build; it rolled back to 1
        store.discard_after(1)
        for it in (2, 3):  # re-executed: other bytes
            _publish(store, it, rows=32)
            agent._handle(("replicate", _request(store, it, dest, budget)))
            state = agent._handle(("replica_flush", 0))
            assert state["sent"][0] == it and state["replicated_iteration"] == it
        assert agent.ranks[0].sender is not first
        for op in OPS:
            got = replicas.load(3, op, Level.FULL)
            assert all(torch.equal(got[k], v) for k, v in _tensors(3, op, 32).items())

        def fails(entry):
            raise RuntimeError("a sender's sticky error")

        agent.ranks[0].sender.select = fails
        _publish(store, 4, rows=16)
        agent._handle(("replicate", _request(store, 4, dest, budget)))
        with pytest.raises(RuntimeError, match="sticky error"):
            agent._handle(("replica_flush", 0))
        agent._handle(("replica_open", 0))  # the next attempt
        agent._handle(("replicate", _request(store, 4, dest, budget)))
        assert agent._handle(("replica_flush", 0))["replicated_iteration"] == 4
    finally:
        agent.listener.close()


def test_the_streams_end_from_an_agent_without_the_ranks_sender_and_an_unreachable_peer_is_logged(
        tmp_path, monkeypatch, caplog):
    agent, dest = _in_process_agent(tmp_path, monkeypatch)
    free = socket.create_server(("127.0.0.1", 0))
    gone = Destination(rank=2, host="127.0.0.1", port=free.getsockname()[1], root=dest.root, job_id="j",
                       per_holder=False)
    free.close()  # nothing listens there: that peer's agent is down
    try:
        assert 0 not in agent.ranks  # an agent started after rank 0's last point
        with caplog.at_level(logging.WARNING, logger="moe_ft.replication"):
            agent._handle(("replica_close", 0, (dest, gone)))
        assert agent._handle(("replica_state", 1))["streams"][0]["closed"]
        assert "rank 0: the end of the stream to peer 2 not sent" in caplog.text
        caplog.clear()
        store = StoreConfig(root=str(tmp_path / "nodeA"), job_id="j", rank=0).build()
        sender = ReplicaSender(SenderConfig(), store, SocketSink(0, (gone,)), [2], owner=0)
        with caplog.at_level(logging.WARNING, logger="moe_ft.replication"):
            sender.close()  # logged, not raised: the end of training goes on
        assert "the end of the stream to peer 2 not sent" in caplog.text
    finally:
        agent.listener.close()
