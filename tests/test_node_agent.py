"""The node agent (``moe_ft/agent/``) as real processes: a trainer starts it, it outlives that trainer, it
writes the durable tier from the ranks' node-local stores (verified, pinned against their garbage
collection), a killed agent is started again by the next call, and it exits once every rank said bye. A pid
file that names another process, or an agent that is leaving, makes the trainer start another agent; an agent
that does not answer is an error after a bound, not a hang."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import subprocess
import threading
import time
import zlib
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from types import SimpleNamespace

import pytest
import torch
from _ft_helpers import stop_process, wait_until

from moe_ft.agent.client import AgentClient, agent_pid
from moe_ft.agent.server import KEY_FILE, LOG_FILE, PID_FILE, NodeAgent, PersistRequest, proc_stat, socket_address
from moe_ft.background import BackgroundWorker
from moe_ft.persist import DurableTier
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import DenseRule, KeepNewestRecoverable, StoreConfig

pytestmark = pytest.mark.timeout(180)
OPS = [OperatorId.dense(0), OperatorId.expert_op(0, 0)]
RULE = DenseRule(operators=frozenset(OPS))


def _tensors(rank: int, it: int, op: OperatorId) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{rank}/{it}/{op}".encode()))
    return {"weight": torch.randn(256, 64, generator=gen), "exp_avg.weight": torch.randn(256, 64, generator=gen)}


def _store(tmp_path, rank):
    return StoreConfig(root=str(tmp_path / "shm"), job_id="j", rank=rank).build(
        retention=KeepNewestRecoverable(rule=RULE))


def _publish(store, rank, it):
    with store.begin(it) as point:
        for op in OPS:
            point.put(op, Level.FULL, _tensors(rank, it, op))
        point.put_meta({"it": it})
        point.publish()


def _request(tmp_path, rank, it) -> PersistRequest:
    return PersistRequest(rank=rank, iteration=it, store_dir=str(tmp_path / "shm" / "j" / f"rank{rank}"),
                          persist_dir=str(tmp_path / "durable"), job_id="j", world_size=2, rule=RULE)


def _trainer_that_leaves(agent_dir: str, tmp_path, conn) -> None:
    """Rank 0: asks for a durable copy, waits for it, and exits without saying bye (a killed worker)."""
    client = AgentClient(agent_dir, 0, idle_exit_s=30)
    client.persist(_request(tmp_path, 0, 3))
    conn.send((client.pid, [r.end for r in client.flush()["records"]]))
    os._exit(0)


def _two_ranks(tmp_path, iterations: int):
    """The agent directory and two ranks' stores holding points 0 .. iterations - 1."""
    stores = [_store(tmp_path, r) for r in (0, 1)]
    for it in range(iterations):
        for r, s in enumerate(stores):
            _publish(s, r, it)
    return tmp_path / "shm" / "j" / "agent", stores


def _check_durable(tmp_path, end):
    tier = DurableTier(tmp_path / "durable", "j", 2)
    assert tier.newest_complete().end == end
    for rank in (0, 1):
        durable = tier.store(rank)
        assert durable.verify().problems == ()
        for op in OPS:
            got = durable.load(end, op, Level.FULL)
            assert all(torch.equal(got[k], v) for k, v in _tensors(rank, end, op).items())


def test_the_agent_writes_the_durable_tier_outlives_a_trainer_and_leaves_after_the_last_bye(tmp_path):
    agent_dir, stores = _two_ranks(tmp_path, 4)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_trainer_that_leaves, args=(str(agent_dir), tmp_path, child))
    proc.start()
    pid, ends = parent.recv()
    proc.join(30)
    assert ends == [3] and agent_pid(agent_dir) == pid != os.getpid()  # the trainer is gone, the agent is not
    other = AgentClient(agent_dir, 1, idle_exit_s=30)
    other.persist(_request(tmp_path, 1, 3))
    state = other.flush()
    assert [r.complete for r in state["records"]] == [True] and other.pid == pid  # the same agent
    assert state["cpu_s"] > 0  # the agent's own CPU, which the trainers report per iteration
    _check_durable(tmp_path, 3)
    # the agent read the trainer's points pinned, never through their deletion: the store is untouched
    assert stores[0].points() == [3] and stores[0].verify().problems == ()
    other.bye()
    assert agent_pid(agent_dir) == pid  # rank 0 never said bye
    AgentClient(agent_dir, 0).bye()
    wait_until(lambda: agent_pid(agent_dir) is None, timeout=20)


def test_a_killed_agent_is_started_again_and_a_torn_copy_is_never_complete(tmp_path):
    agent_dir, stores = _two_ranks(tmp_path, 2)
    clients = [AgentClient(agent_dir, r, idle_exit_s=30) for r in (0, 1)]
    for r, c in enumerate(clients):
        c.persist(_request(tmp_path, r, 1))
        c.flush()
    first = clients[0].pid
    _publish(stores[0], 0, 2)
    clients[0].persist(_request(tmp_path, 0, 2))
    os.kill(first, signal.SIGKILL)  # during or after rank 0's copy of 2: rank 1 never copied 2 anyway
    wait_until(lambda: agent_pid(agent_dir) is None, timeout=10)
    tier = DurableTier(tmp_path / "durable", "j", 2)
    assert tier.newest_complete().end == 1  # nothing half-written counts
    _publish(stores[1], 1, 2)
    for r, c in enumerate(clients):
        c.persist(_request(tmp_path, r, 2))  # the broken connection: a new agent, the request resent
        assert [rec.end for rec in c.flush()["records"]][-1] == 2
    assert clients[0].pid == clients[1].pid != first and clients[0].restarts == 1
    _check_durable(tmp_path, 2)
    for c in clients:
        c.bye()
    wait_until(lambda: agent_pid(agent_dir) is None, timeout=20)


def test_the_agent_hashes_deferred_points_and_a_killed_one_leaves_them_unverified_never_wrong(tmp_path, caplog):
    """``--ft-checksum-by agent``: points written without digests are hashed by the real agent, which records
    the digests beside them; a durable copy queued after the hashing carries them. The agent SIGKILLed with
    hashing requests queued: the next call starts another; the points it never hashed stay unverified (their
    structure is checked, and the store says so), never marked verified with wrong digests."""
    from moe_ft.agent.server import VerifyRequest
    from moe_ft.store.codec import PENDING

    store = StoreConfig(root=str(tmp_path / "shm"), job_id="j", rank=0, checksum_by="agent").build()  # no GC
    agent_dir = tmp_path / "shm" / "j" / "agent"
    client = AgentClient(agent_dir, 0, idle_exit_s=30)
    verify = lambda it: client.call("verify", VerifyRequest(0, it, store.backend.describe()))  # noqa: E731
    _publish(store, 0, 0)
    verify(0)
    client.persist(_request(tmp_path, 0, 0))
    assert client.flush()["verified"] == 1
    point = store.catalog().point(0)
    assert all(e.checksum != PENDING for e in point.entries.values()) and not store.verify().problems
    durable = DurableTier(tmp_path / "durable", "j", 2).store(0)
    assert all(e.checksum == point.entries[op].checksum for op, e in durable.catalog().point(0).entries.items())

    first = client.pid
    stop_process(first)  # the agent cannot run: the request waits in its socket, then it dies
    for it in (1, 2):
        _publish(store, 0, it)
    client._connect().send(("verify", VerifyRequest(0, 1, store.backend.describe())))  # never answered
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: agent_pid(agent_dir) is None, timeout=10)
    verify(2)  # a new agent
    assert client.flush()["verified"] == 1 and client.pid != first
    resolved = store.catalog()
    assert all(e.checksum != PENDING for e in resolved.point(2).entries.values())
    assert {e.checksum for e in resolved.point(1).entries.values()} == {PENDING}
    with caplog.at_level(logging.WARNING, logger="moe_ft.store"):
        assert store.newest_recoverable(RULE, verify=True).end == 2
        assert all(torch.equal(store.load(1, op, Level.FULL)[k], v) for op in OPS
                   for k, v in _tensors(0, 1, op).items())
    assert "iteration 1 is not verified yet" in caplog.text
    client.bye()
    AgentClient(agent_dir, 0).bye()
    wait_until(lambda: agent_pid(agent_dir) is None, timeout=20)


def test_a_sparse_rule_travels_as_its_windows():
    import pickle

    from moe_ft.store.rules import SparseWindowRule, portable

    live = SparseWindowRule.aligned(OPS, window_size=4)  # a closure: not picklable as it is
    with pytest.raises((AttributeError, pickle.PicklingError, TypeError)):
        pickle.dumps(live)
    sent = pickle.loads(pickle.dumps(portable(live, range(12))))
    assert [sent.window_of(e) for e in range(12)] == [live.window_of(e) for e in range(12)]
    assert sent.operators == live.operators and portable(RULE, [1]) is RULE


def test_moe_ft_launch_starts_the_node_agent_the_training_flags_ask_for(tmp_path):
    """``moe-ft launch`` reads the training flags (``--ft --ft-persist-interval N --ft-persist-agent``), starts
    the node's agent where the trainers look for it, before any worker; trainers then find it running."""
    from pathlib import Path

    from moe_ft.launch.cli import node_agent_of, start_node_agent

    store = str(tmp_path / "shm")
    flags = ["--num-layers", "2", "--ft", "--ft-store-dir", store, "--ft-job-id", "j", "--ft-persist-interval", "4",
             "--ft-persist-agent", "--ft-persist-agent-idle-exit", "5"]
    assert node_agent_of(flags) == (os.path.join(store, "j", "agent"), 5.0)
    assert node_agent_of([f for f in flags if f != "--ft-persist-agent"]) is None
    assert node_agent_of(["--ft-persist-agent", "--ft-persist-interval", "4"]) is None  # no --ft
    assert node_agent_of(["--ft", "--ft-persist-agent"]) is None  # no durable tier
    assert node_agent_of(["--ft", "--ft-checksum-by", "agent"])[0] == "/dev/shm/moe_ft/default/agent"  # hashing
    assert node_agent_of(["--ft", "--ft-persist-interval", "2", "--ft-persist-agent"])[0] == \
        "/dev/shm/moe_ft/default/agent"  # the training flags' defaults
    pid = start_node_agent(flags)
    agent_dir = Path(store, "j", "agent")
    try:
        assert pid is not None and agent_pid(agent_dir) == pid
        client = AgentClient(agent_dir, 0)
        client.call("ping")
        assert client.pid == pid  # the trainer found the launcher's agent
        log = (agent_dir / "agent.log").read_text()
        assert f"moe-ft agent {pid}: serving {agent_dir} (started by moe-ft launch)" in log
        client.bye()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def _agent_dir(tmp_path):
    """An agent directory with its key, as the first trainer of a node makes it."""
    agent_dir = tmp_path / "shm" / "j" / "agent"
    agent_dir.mkdir(parents=True)
    (agent_dir / KEY_FILE).write_bytes(os.urandom(32))
    return agent_dir


def test_a_pid_file_naming_another_process_does_not_stop_the_next_agent(tmp_path):
    """A SIGKILLed agent's pid reused by an unrelated process: the trainer must start an agent, not connect to
    that process's (nonexistent) socket forever. The pid file holds the agent's start time too."""
    agent_dir = _agent_dir(tmp_path)
    other = subprocess.Popen(["sleep", "120"])
    try:
        started = proc_stat(other.pid)[1]
        (agent_dir / PID_FILE).write_text(f"{other.pid} {started}\n")
        assert agent_pid(agent_dir) == other.pid  # pid and start time: that process
        (agent_dir / PID_FILE).write_text(f"{other.pid} {started - 1}\n")  # the agent that wrote it started then
        assert agent_pid(agent_dir) is None
        (agent_dir / PID_FILE).write_text(f"{other.pid}\n")  # a pid alone identifies no process
        assert agent_pid(agent_dir) is None
        client = AgentClient(agent_dir, 0, idle_exit_s=30)
        assert client.call("ping") == client.pid != other.pid
        assert agent_pid(agent_dir) == client.pid
        client.bye()
        wait_until(lambda: agent_pid(agent_dir) is None, timeout=20)
    finally:
        other.kill()
        other.wait()


def test_a_leaving_agent_is_found_no_more_and_the_trainer_starts_another(tmp_path):
    """An agent that decided to exit removes its pid file and stops listening before its slow close (here a
    rank's work that takes until the test releases it), and answers no request from then on: the trainer's
    request, on its open connection, goes to a new agent (started under it, listening on the same socket name
    while the old one still closes)."""
    agent_dir = _agent_dir(tmp_path)
    agent = NodeAgent(agent_dir, idle_exit_s=30)  # in this process: its pid file names this process
    release = threading.Event()
    slow = BackgroundWorker("slow-rank-work", lambda _: release.wait(60), describe=repr)
    slow.submit(None)
    agent.ranks[7] = SimpleNamespace(worker=slow, sender=None)  # type: ignore[assignment]
    serving = threading.Thread(target=agent.serve, daemon=True)
    serving.start()
    client = AgentClient(agent_dir, 0, idle_exit_s=30)
    try:
        wait_until(lambda: agent_pid(agent_dir) == os.getpid(), timeout=10)
        assert client.call("ping") == os.getpid()
        agent.stop()  # leaving: its close waits for rank 7's work
        wait_until(lambda: agent_pid(agent_dir) is None, timeout=10)
        assert serving.is_alive()  # still closing
        new = client.call("ping")
        assert new == client.pid != os.getpid() and client.restarts == 1
        assert serving.is_alive()
    finally:
        release.set()
        serving.join(30)
        client.bye()
    wait_until(lambda: agent_pid(agent_dir) is None, timeout=20)


def test_a_connection_that_an_exiting_agent_closes_is_made_again_to_a_new_agent(tmp_path):
    """The agent exits as the trainer connects: it accepted the connection, then removed its pid file and
    closed everything. The connection (its authentication, the hello) is part of what is tried again: the
    trainer starts a new agent and its request is answered, instead of failing the engine's thread."""
    agent_dir = _agent_dir(tmp_path)
    (agent_dir / PID_FILE).write_text(f"{os.getpid()} {proc_stat(os.getpid())[1]}\n")
    server = socket.socket(socket.AF_UNIX)
    server.bind(socket_address(agent_dir, (agent_dir / KEY_FILE).read_bytes()))
    server.listen(4)

    def exit_on_first_connection() -> None:
        sock, _ = server.accept()
        (agent_dir / PID_FILE).unlink()
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        sock.close()

    leaving = threading.Thread(target=exit_on_first_connection, daemon=True)
    leaving.start()
    client = AgentClient(agent_dir, 0, idle_exit_s=30)
    try:
        assert client.call("ping") == client.pid != os.getpid() and client.restarts == 1
    finally:
        leaving.join(10)
        client.bye()
    wait_until(lambda: agent_pid(agent_dir) is None, timeout=20)


def _fake_agent(agent_dir, *, handshake: bool):
    """A process that holds the agent's pid file and socket and never answers: with ``handshake`` it
    authenticates the connection and answers the hello, then reads requests and answers none (a stuck agent);
    without, it never even accepts (a stopped agent, whose kernel still completes the connection)."""
    (agent_dir / PID_FILE).write_text(f"{os.getpid()} {proc_stat(os.getpid())[1]}\n")
    server = socket.socket(socket.AF_UNIX)
    server.bind(socket_address(agent_dir, (agent_dir / KEY_FILE).read_bytes()))
    server.listen(4)
    conns = []

    def serve(conn: Connection) -> None:
        key = (agent_dir / KEY_FILE).read_bytes()
        with contextlib.suppress(EOFError, OSError):
            deliver_challenge(conn, key)
            answer_challenge(conn, key)
            conn.recv()
            conn.send(os.getpid())  # the hello
            while True:
                conn.recv()

    def accept() -> None:
        with contextlib.suppress(OSError):  # closed by the test
            while True:
                conns.append(Connection(server.accept()[0].detach()))
                threading.Thread(target=serve, args=(conns[-1],), daemon=True).start()

    if handshake:
        threading.Thread(target=accept, daemon=True).start()
    return server, conns


@pytest.mark.parametrize("handshake", [False, True], ids=["stopped", "stuck"])
def test_an_agent_that_does_not_answer_is_an_error_naming_it_not_a_hang(tmp_path, handshake):
    agent_dir = _agent_dir(tmp_path)
    server, conns = _fake_agent(agent_dir, handshake=handshake)
    try:
        client = AgentClient(agent_dir, 0, timeout_s=0.5, drain_timeout_s=1.0)
        with pytest.raises(RuntimeError, match="did not answer") as failed:
            client.call("ping")
        message = str(failed.value)
        assert f"node agent {os.getpid()} of {agent_dir}" in message and f"kill -9 {os.getpid()}" in message
        assert ("'ping' within 0.5 s" if handshake else "the connection's authentication within 0.5 s") in message
        if handshake:  # a request that waits for the rank's work gets the longer bound
            with pytest.raises(RuntimeError, match="did not answer 'flush' within 1 s"):
                client.flush()
    finally:
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
        server.close()
        for conn in conns:
            conn.close()


def test_a_long_wait_for_a_stopped_agent_is_logged_and_a_goodbye_starts_no_agent(tmp_path, caplog):
    """A trainer that waits for its agent's answer (its exit waits for the rank's durable copies) says so while
    it waits, with the agent's state and what to do; a goodbye where no agent runs (it was killed) starts none."""
    agent_dir = _agent_dir(tmp_path)
    client = AgentClient(agent_dir, 0, timeout_s=0.5, drain_timeout_s=1.0)
    pid = client.call("ping")
    client.notice_s = 0.3
    stop_process(pid)
    try:
        with caplog.at_level(logging.WARNING, logger="moe_ft.agent"):
            with pytest.raises(RuntimeError, match="did not answer 'flush' within 1 s"):
                client.flush()
        notices = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
        assert 2 <= len(notices) <= 4, notices
        assert all(f"for node agent {pid} to answer 'flush'; it is stopped (`kill -CONT {pid}`)" in m for m in notices)
    finally:
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: agent_pid(agent_dir) is None, timeout=10)
    client.bye()
    assert agent_pid(agent_dir) is None and client.restarts == 0
    assert (agent_dir / LOG_FILE).read_text().count("serving") == 1


def test_a_request_a_stopped_agent_does_not_read_is_an_error_after_the_bound_not_a_hang(tmp_path):
    """A request larger than the socket's buffer (a first publish order carries every entry layout) blocks its
    send while the agent is stopped: the send is bounded too, raises the error of an unanswered request, drops
    the torn connection and is not sent again; once the agent is killed the next request starts another."""
    agent_dir = _agent_dir(tmp_path)
    client = AgentClient(agent_dir, 0, timeout_s=0.5, idle_exit_s=30)
    pid = client.call("ping")
    stop_process(pid)
    failed: list[BaseException] = []

    def send_large() -> None:
        try:
            client.call("ping", b"x" * (4 << 20))
        except BaseException as exc:  # noqa: BLE001 - checked below
            failed.append(exc)

    sender = threading.Thread(target=send_large, daemon=True)
    try:
        sender.start()
        sender.join(20)
        assert not sender.is_alive(), "the send into a stopped agent hung"
    finally:
        os.kill(pid, signal.SIGKILL)  # never left stopped; a send still blocked then fails
    sender.join(10)
    (error,) = failed
    assert isinstance(error, RuntimeError) and "did not answer 'ping' (its request was not read) within 0.5 s" in str(error)
    assert f"kill -CONT {pid}" in str(error) and f"kill -9 {pid}" in str(error)
    assert client._conn is None and client.restarts == 0  # dropped, and not sent to another agent
    wait_until(lambda: agent_pid(agent_dir) is None, timeout=10)
    assert client.call("ping") != pid and client.restarts == 1
    client.bye()


def test_a_directory_created_again_gets_another_socket_name_even_with_the_old_inode(tmp_path):
    """A store wiped and created again may get its old inode number (ext4 does): the socket name also hangs on
    the directory's key, made anew with it, so a new agent does not meet the old one's socket (and a trainer is
    not sent to an agent whose key it does not hold); the old agent sees that its directory is gone."""
    from moe_ft.agent.server import _same_dir

    agent_dir = _agent_dir(tmp_path)
    old_key, new_key = (agent_dir / KEY_FILE).read_bytes(), os.urandom(32)
    assert socket_address(agent_dir, old_key) != socket_address(agent_dir, new_key)  # same path, same inode
    inode = os.stat(agent_dir).st_ino
    assert _same_dir(agent_dir, inode, old_key)
    (agent_dir / KEY_FILE).write_bytes(new_key)  # as a directory created again, with the old inode number
    assert not _same_dir(agent_dir, inode, old_key)


def test_a_rank_whose_store_changes_waits_for_its_old_work_without_holding_up_the_others(tmp_path):
    """Rank 0 comes back with another store directory while its old work is still queued: the old work is
    finished (and its sender dropped) outside the agent's lock, so rank 1's requests are answered meanwhile."""
    from moe_ft.agent.server import VerifyRequest
    from moe_ft.background import BackgroundWorker
    from moe_ft.store import StoreConfig

    stores = {name: StoreConfig(root=str(tmp_path / name), job_id="j", rank=0).build() for name in ("a", "b", "c")}
    agent = NodeAgent(_agent_dir(tmp_path), idle_exit_s=30)
    release, abandoned = threading.Event(), []
    old = BackgroundWorker("old-rank-work", lambda _: release.wait(30), describe=repr)
    old.submit(None)
    agent.ranks[0] = SimpleNamespace(worker=old, store=stores["a"], writer=None,  # type: ignore[assignment]
                                     sender=SimpleNamespace(abandon=lambda: abandoned.append(0)))
    moving = threading.Thread(target=agent._verify, args=(VerifyRequest(0, 5, stores["b"].backend.describe()),))
    moving.start()
    try:
        wait_until(lambda: agent.ranks[0].store.backend.describe() == stores["b"].backend.describe(), timeout=10)
        start = time.monotonic()
        agent._verify(VerifyRequest(1, 5, stores["c"].backend.describe()))  # rank 1: not behind rank 0's old work
        assert time.monotonic() - start < 5 and moving.is_alive()
    finally:
        release.set()
        moving.join(30)
    assert not old.alive and abandoned == [0]
    for rank in agent.ranks.values():
        rank.worker.close()


def test_a_point_collected_before_the_agent_hashed_it_is_one_line_not_a_traceback(tmp_path, caplog):
    from moe_ft.agent.server import _Rank
    from moe_ft.store import SnapshotStore, StoreConfig, open_backend

    cfg = StoreConfig(root=str(tmp_path), job_id="j", rank=0)
    cfg.build()
    rank = _Rank(0, SnapshotStore(open_backend(cfg.directory, create=False), shared_pins=True))
    try:
        with caplog.at_level("WARNING", logger="moe_ft.agent"):
            rank.run(("verify", 12, None))
    finally:
        rank.worker.close()
    (record,) = [r for r in caplog.records if "iteration 12" in r.getMessage()]
    assert "the point is gone" in record.getMessage() and record.exc_info is None


def test_a_connection_that_breaks_twice_is_one_error_naming_the_agent_and_its_log(tmp_path, monkeypatch):
    """The request is resent once on a new connection; where that breaks too, the error names the agent, the
    request and the agent's log (it was a bare ``ConnectionRefusedError``/``EOFError`` from the socket)."""
    client = AgentClient(tmp_path / "agent", rank=0)
    attempts = []

    def refuse():
        attempts.append(1)
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(client, "_connect", refuse)
    monkeypatch.setattr(client, "_await_gone", lambda pid: None)
    with pytest.raises(RuntimeError, match=r"node agent of .* could not be reached for 'ping'.*Connection refused.*"
                                           r"agent\.log") as info:
        client.call("ping")
    assert len(attempts) == 2 and isinstance(info.value.__cause__, ConnectionRefusedError)
