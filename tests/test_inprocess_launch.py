"""``moe-ft launch``: survivors keep their processes, a warm spare (or a fresh process) takes the failed
rank, and recovery ends bitwise equal to the fault-free run (``moe_ft/launch/``).

The store protocol, the failure classification and the connection severing are checked in-process; the
drills kill real processes under the launcher (workers forked from a preloaded launcher, as the other
drills of the suite) and compare the final digest with the session's fault-free reference.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import WorkerState

from moe_ft.cli.drill import run_job
from moe_ft.drills.faults import InjectedFault
from moe_ft.launch import cli, protocol, worker
from moe_ft.launch.agent import SpareAgent
from moe_ft.launch.membership import Fenced
from moe_ft.launch.policy import plan_replacements, rank_homes
from tests._launch_helpers import sleeping_agent, store_client

ITERS, WINDOW = 10, 3


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_protocol_announces_attempts_and_assigns_spares(store):
    keys = protocol.Keys("run")
    assert protocol.current_attempt(store, keys) == 0
    assert protocol.announcement(store, keys, 1) == {}
    assert protocol.wait_for_attempt_after(store, keys, 0, timeout_s=0.1) is None  # nobody announced
    got = {}
    spare = store_client(store)  # a wait in the store holds its client's connection
    waiter = threading.Thread(target=lambda: got.update(protocol.wait_for_assignment(spare, keys, "0.0")))
    waiter.start()
    assert protocol.claim_spare(store, keys, "0.0", 1, rank=3, local_rank=3)
    attempt = protocol.announce(store, keys, kind="inprocess", failed=[3], detected_at=12.5, slots={3: "0.0"})
    waiter.join(5)
    assert attempt == 1 and got == {"rank": 3, "local_rank": 3, "attempt": 1}
    assert protocol.wait_for_attempt_after(store, keys, 0, timeout_s=1) == 1
    assert protocol.announcement(store, keys, 1) == {"kind": "inprocess", "failed": [3], "detected_at": 12.5,
                                                     "slots": {"3": "0.0"}}
    # pids: ranks 0-2 kept theirs, rank 3 (replaced) did not matter
    for rank, (before, after) in enumerate([(10, 10), (11, 11), (12, 12), (13, 99)]):
        store.set(keys.pid(0, rank), str(before))
        store.set(keys.pid(1, rank), str(after))
    assert worker.pids_kept(store, keys, 1, 4) is True
    store.set(keys.pid(1, 2), "77")
    assert worker.pids_kept(store, keys, 1, 4) is False
    store.set(keys.pid(1, 2), "12")
    # two failures close together: attempt 2 (rank 1 failed) announced before the survivors rejoined
    # attempt 1, so they recorded their pids in attempt 0 and 2 only; rank 3's replacement joined attempt 1
    skip = protocol.Keys("skip")
    protocol.announce(store, skip, kind="inprocess", failed=[3], detected_at=1.0)
    protocol.announce(store, skip, kind="inprocess", failed=[1], detected_at=2.0)
    for rank, pids in {0: (10, None, 10), 1: (11, None, 88), 2: (12, None, 12), 3: (13, 99, 99)}.items():
        for at, pid in enumerate(pids):
            if pid is not None:
                store.set(skip.pid(at, rank), str(pid))
    assert worker.pids_kept(store, skip, 2, 4) is True
    store.delete_key(skip.pid(1, 3))  # rank 3's replacement had not joined attempt 1: compared with the dead pid
    assert worker.pids_kept(store, skip, 2, 4) is False
    # a shrink renumbers the survivors: ranks 2, 3 (their node lost) are gone, 0 and 1 keep their numbers
    # here, and their pids are compared under the new ones
    protocol.announce(store, keys, kind="inprocess", failed=[2, 3], detected_at=13.0,
                      resize={"ranks": {0: 0, 1: 1}, "world_size": 2, "nodes": {0: 0}})
    store.set(keys.pid(2, 0), "10")
    store.set(keys.pid(2, 1), "11")
    assert worker.pids_kept(store, keys, 2, 2) is True
    # a decision lock taken by one agent holds off another until that attempt is published
    assert protocol.lock_next(store, keys, "node0") == 3 and protocol.lock_next(store, keys, "node1") is None
    assert protocol.claim_spare(store, keys, "1.0", 3, rank=2, local_rank=1, world_size=4, group_rank=1)
    assert not protocol.claim_spare(store, keys, "1.0", 3, rank=3, local_rank=1)  # a spare is given once


def test_rank_homes_follow_the_announced_places_and_refuse_a_layout_place_without_a_node():
    """Each rank's node in a round: the identity, or a replacement's mapping (round node 3 runs the lost
    node's place 1). A mapping that leaves a place of the layout without a node, or puts two nodes in one,
    is refused with the mapping in the message (it was a bare ``KeyError: 3`` in the agent)."""
    assert rank_homes({0: 0, 1: 1}, per_node=2, world_size=4, attempt=0) == {0: 0, 1: 0, 2: 1, 3: 1}
    assert rank_homes({0: 0, 1: 2, 2: 3, 3: 1}, per_node=1, world_size=4, attempt=2) == {0: 0, 1: 3, 2: 1, 3: 2}
    with pytest.raises(RuntimeError, match=r"attempt 5 places .*\{0: 0, 1: 1, 2: 2\}.*no node at place\(s\) \[3\]"):
        rank_homes({0: 0, 1: 1, 2: 2}, per_node=1, world_size=4, attempt=5)
    with pytest.raises(RuntimeError, match=r"several nodes at \{2: \[2, 3\]\}"):
        rank_homes({0: 0, 1: 1, 2: 2, 3: 2}, per_node=1, world_size=4, attempt=5)


def test_replacement_policy_orders_local_spares_fresh_processes_then_remote_spares():
    holders = {0: 0, 1: 0, 2: 1, 3: 1}
    # node 1 lost: its ranks take this node's spare, then a spare another node lists; never a fresh process
    assert plan_replacements([2, 3], node=0, holders=holders, local_spares=1, free_devices=4,
                             remote_spares=1) == ([(2, "local"), (3, "remote")], [])
    # not enough spares for the lost node's ranks: nothing planned, the uncovered ranks returned
    assert plan_replacements([2, 3], node=0, holders=holders, local_spares=1, free_devices=4,
                             remote_spares=0) == ([], [3])
    # this node's own dead rank: a local spare, else a fresh process here (its state is in this node's
    # store), and a remote spare only when no device is free
    assert plan_replacements([1], node=0, holders=holders, local_spares=0, free_devices=1,
                             remote_spares=2) == ([(1, "fresh")], [])
    assert plan_replacements([0, 1], node=0, holders=holders, local_spares=1, free_devices=0,
                             remote_spares=1) == ([(0, "local"), (1, "remote")], [])
    assert plan_replacements([0, 1], node=0, holders=holders, local_spares=0, free_devices=0,
                             remote_spares=1) == ([(0, "remote")], [1])
    # a lost node's rank first, even when this node also lost one
    assert plan_replacements([1, 2], node=0, holders=holders, local_spares=1, free_devices=1,
                             remote_spares=0) == ([(2, "local"), (1, "fresh")], [])


def test_a_node_declared_lost_fences_itself(store, tmp_path):
    """An agent that was only slow finds its node among an announcement's ``lost``: it stops its workers
    (a real process here) and raises ``Fenced``, so that no rank runs twice."""
    agent, group = sleeping_agent(store, tmp_path, "fence", 1, node_timeout_s=1.0)
    agent._node, agent._nodes, agent._world, agent._groups = 1, 2, 2, {0: 0, 1: 1}
    proc = agent._start_one(group, name="rank1", rank=1, local_rank=0)
    agent._workers = {1: proc}
    keys = protocol.Keys("fence")
    agent._apply_announcements(group)  # nothing announced: nothing happens
    assert proc.context.wait(0) is None
    protocol.announce(store, keys, kind="inprocess", failed=[1], detected_at=time.time(), holders={"1": 0}, lost=[1])
    with pytest.raises(Fenced, match="node 1 was declared lost in attempt 1"):
        agent._apply_announcements(group)
    assert agent._workers == {} and proc.context.wait(0) is not None  # the worker was stopped


def test_a_stall_of_the_watcher_is_not_a_lost_node(store, tmp_path, monkeypatch, capsys):
    """Node 0's agent watches node 1's heartbeat in the real store, on a clock the test moves. One 5 s gap
    between two reads (the watcher, or the store every agent beats through, stalled: node 1 could not beat
    either) does not declare node 1 lost; node 1 beats once the stall is over and the watch starts again.
    A node that really stopped is declared after ``--node-timeout`` of regular reads, and also when every
    read comes late."""
    from types import SimpleNamespace

    from moe_ft.launch import membership

    clock = [100.0]
    monkeypatch.setattr(membership, "time", SimpleNamespace(monotonic=lambda: clock[0], time=time.time))
    agent, group = sleeping_agent(store, tmp_path, "stall", 1, node_timeout_s=2.0)
    agent._node, agent._nodes, agent._world, agent._groups = 0, 2, 2, {0: 0, 1: 1}
    agent._holders, agent._lost, agent._dead, agent._seen = {0: 0, 1: 1}, set(), {}, 0
    beat = protocol.Keys("stall").beat(1)

    def read_at(t: float) -> bool:
        """One pass at time ``t``: is node 1 lost?"""
        clock[0] = t
        agent._beat_and_watch(group)
        return 1 in agent._lost

    store.add(beat, 1)
    assert not read_at(100.0)  # the watch starts
    assert not read_at(105.0)  # a 5 s stall: counted as 1 s of silence, not 5
    store.add(beat, 1)  # node 1's pass that the stall held up
    assert not read_at(105.1)  # it moved: the watch starts again
    assert not any(read_at(105.1 + 0.1 * k) for k in range(1, 20))  # node 1 stopped: 1.9 s of silence
    assert read_at(107.2) and agent._dead == {1: pytest.approx(time.time(), abs=60)}
    assert "node 1 sent no heartbeat for 2.1 s: lost (ranks [1])" in capsys.readouterr().out

    agent._lost, agent._dead, agent._watch = set(), {}, None  # every read 1.5 s late: lost at the second
    assert not read_at(200.0) and not read_at(201.5) and read_at(203.0)


def test_the_process_taking_a_rank_takes_its_device(store, tmp_path):
    """A spare (or a fresh process) that takes a rank of its own node takes the dead process's device index
    (``LOCAL_RANK``): on a GPU node with one GPU per rank a spare's own index is no device. The spare's
    index goes to the next spare started. Real processes under a real agent."""
    agent, group = sleeping_agent(store, tmp_path, "devices", 2, spares_per_node=1)
    agent._node, agent._nodes, agent._world, agent._groups = 0, 1, 2, {0: 0}
    agent._holders, agent._home = {0: 0, 1: 0}, {0: 0, 1: 0}
    try:
        agent._workers = {r: agent._start_one(group, name=f"rank{r}", rank=r, local_rank=r) for r in (0, 1)}
        agent._fill_spares(group)
        (spare,) = agent._spares
        assert spare.local_rank == 2
        agent._workers[1].context.close()  # rank 1 dies
        agent._reap(1, time.time())
        assignments, fresh, missing = agent._assign(group, 1, [1])
        assert assignments == {1: (0, spare.slot)} and fresh == [] and missing == []
        keys = protocol.Keys("devices")
        assert json.loads(store.get(keys.spare(spare.slot)))["local_rank"] == 1
        assert agent._workers[1] is spare and spare.local_rank == 1
        assert agent._free_device(group) == 2  # the next spare gets the former spare's index

        agent._spares_per_node = 0  # no spare left: a fresh process on rank 0's device
        agent._workers[0].context.close()
        agent._reap(0, time.time())
        assignments, fresh, missing = agent._assign(group, 2, [0])
        assert fresh == [0] and agent._workers[0].local_rank == 0
    finally:
        agent._close_all()


def test_a_lost_node_without_spares_waits_for_a_replacement_node(store, tmp_path):
    """A fixed ``--nnodes 2``, no spare anywhere, node 1 lost: node 0's agent announces an ``"await"``
    attempt instead of a full restart (its workers keep running). A second failure while it waits cannot be
    planned on top: a fallback. Then the replacement round, where the joining node sorts *first* (round
    node 0) and the survivor is round node 1: the survivor's workers keep ranks 0, 1 and the joining node
    starts ranks 2, 3 under group rank 1 (real agents, real processes, a real store)."""
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.api import Worker

    agent, group = sleeping_agent(store, tmp_path, "await", 2)
    agent._node, agent._nodes, agent._world, agent._groups = 0, 2, 4, {0: 0, 1: 1}
    agent._home = agent._holders = {0: 0, 1: 0, 2: 1, 3: 1}
    agent._lost, agent._dead = {1}, {2: 10.0, 3: 10.0}
    keys = protocol.Keys("await")
    joiner = None
    try:
        agent._workers = {r: agent._start_one(group, name=f"rank{r}", rank=r, local_rank=r) for r in (0, 1)}
        kept = dict(agent._workers)
        assert agent._can_await([2, 3]) and not agent._can_await([1, 2, 3])  # a survivor's rank: no
        assert agent._decide(group)
        info = protocol.announcement(store, keys, 1)
        assert (info["kind"], info["failed"], info["lost"], info["wait_s"]) == ("await", [2, 3], [1], 600.0)
        assert agent._awaiting == {2, 3} and all(p.context.wait(0) is None for p in kept.values())

        # the replacement round: the joining node is round node 0, the survivor round node 1
        def placed(a, g, node):
            g.group_rank, g.group_world_size = node, 2
            g.workers = [Worker(local_rank=i, global_rank=node * 2 + i, role_rank=node * 2 + i, world_size=4,
                                role_world_size=4) for i in range(2)]
            g.spec.rdzv_handler._state_holder = SimpleNamespace(state=SimpleNamespace(round=3))

        joiner, joiner_group = sleeping_agent(store, tmp_path / "joiner", "await", 2)
        placed(joiner, joiner_group, 0)
        placed(agent, group, 1)
        pids = {}
        thread = threading.Thread(target=lambda: pids.update(joiner=joiner._start_workers(joiner_group)))
        thread.start()
        agent._regrouping = True
        pids["survivor"] = agent._start_workers(group)
        thread.join(30)
        info = protocol.announcement(store, keys, 2)
        assert (info["kind"], info["failed"], info["replaced"], info["nodes"]) == ("inprocess", [2, 3], [1],
                                                                                   {"0": 1, "1": 0})
        assert agent._workers == kept and agent._attempt == joiner._attempt == 2 and agent._awaiting == set()
        assert pids["survivor"] == {0: kept[0].pid, 1: kept[1].pid}
        assert sorted(joiner._workers) == [2, 3] and joiner._groups == agent._groups == {0: 1, 1: 0}
        assert agent._home == joiner._home == {0: 1, 1: 1, 2: 0, 3: 0}  # rank → round node that runs it

        # a further failure while the survivors wait: no plan on top of the wait, a full restart
        agent._awaiting, agent._dead, agent._lost = {2, 3}, {1: 11.0, 2: 10.0, 3: 10.0}, {1}
        agent._node, agent._home, agent._holders = 0, {0: 0, 1: 0, 2: 1, 3: 1}, {0: 0, 1: 0, 2: 1, 3: 1}
        agent._remaining_restarts = 1  # the await spent the spec's one
        assert not agent._decide(group)
        info = protocol.announcement(store, keys, 3)
        assert info["kind"] == "fallback" and "rank 1 failed while the job waited for a replacement" in info["reason"]
    finally:
        agent._close_all()
        if joiner is not None:
            joiner._close_all()


def test_only_an_attempt_with_survivors_is_joined_within_the_reform_timeout(store):
    """The processes of an in-process attempt wait at most ``--reform-timeout`` for each other; those of a
    full restart (announced ``"job"``: every process starts afresh, imports included) wait as long as at the
    first start. Before, a full restart used the reform timeout too, and with a short one its fresh
    processes gave up on each other until the restarts ran out (the fallback drill below, in CI)."""
    keys = protocol.Keys("reform")
    member = worker.Membership(store, keys, attempt=0, rank=0)
    assert not member.reforming  # the job's first start
    member.attempt = 1
    assert not member.reforming  # an attempt nobody announced: a full start's timeout, as in launch_facts
    member.attempt = protocol.announce(store, keys, kind="inprocess", failed=[1], detected_at=0.0)
    assert member.reforming
    member.attempt = protocol.announce(store, keys, kind="job", failed=[0, 1], detected_at=0.0)
    assert not member.reforming
    assert not worker.Membership(attempt=3, rank=0).reforming  # not under moe-ft launch


def test_a_survivor_waits_through_an_await_attempt(store, monkeypatch):
    """A survivor that sees an ``"await"`` attempt keeps waiting (up to its ``wait_s`` plus the re-form
    timeout) and joins the attempt that follows; a rank the await lists stops; no attempt in time: it gives
    up (the agents then restart the job)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # rejoin sets it: restored after the test
    monkeypatch.setenv(protocol.REFORM_TIMEOUT_ENV, "0.2")
    keys = protocol.Keys("wait")
    member = worker.Membership(worker._client(10), keys, attempt=0, rank=0)
    protocol.announce(store, keys, kind="await", failed=[2, 3], detected_at=0.0, lost=[1], wait_s=5.0)
    threading.Timer(1.0, lambda: protocol.announce(store, keys, kind="inprocess", failed=[2, 3],
                                                   detected_at=0.0, nodes={"0": 0, "1": 1})).start()
    assert member.rejoin("RuntimeError: Connection closed by peer", True)  # waited past the re-form timeout
    assert member.attempt == 2 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "2"
    protocol.announce(store, keys, kind="await", failed=[0, 1], detected_at=0.0, lost=[0], wait_s=5.0)
    assert not member.rejoin("RuntimeError: Connection closed by peer", True) and not member.gave_up
    other = worker.Membership(worker._client(10), keys, attempt=3, rank=2)
    protocol.announce(store, keys, kind="await", failed=[0, 1], detected_at=0.0, lost=[0], wait_s=0.1)
    t0 = time.monotonic()
    assert not other.rejoin("RuntimeError: Connection closed by peer", True) and other.gave_up
    assert time.monotonic() - t0 < 5


def test_only_peer_failures_keep_the_process():
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4495")
    assert worker.peer_failure(gloo)
    assert worker.peer_failure(dist.DistNetworkError("socket timeout"))
    assert not worker.peer_failure(InjectedFault("injected"))
    assert not worker.peer_failure(ValueError("Connection closed by peer"))  # not a collective's error
    assert not worker.Membership().rejoin("RuntimeError: Connection closed by peer", True)  # not launched


def test_sever_shuts_peer_connections_and_keeps_the_store(monkeypatch):
    """A peer blocked reading from this process sees end-of-stream at once; the kept connections (the
    launch store's, those inherited at start) stay up."""

    def pair():
        server = socket.create_server(("127.0.0.1", 0))
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        server.close()
        return client, accepted

    peer_side, mine = pair()
    store_client, store_server = pair()
    inherited_client, inherited_server = pair()
    kept_ports = {sock.getsockname()[1] for sock in (store_client, store_server, inherited_client, inherited_server)}
    monkeypatch.setattr(worker, "_KEPT", {(c.laddr, c.raddr) for c in worker._tcp_connections()
                                          if c.laddr[1] in kept_ports})
    got = []
    reader = threading.Thread(target=lambda: got.append(peer_side.recv(16)))
    reader.start()
    assert worker.sever_peer_connections() >= 1
    reader.join(5)
    assert got == [b""]  # end of stream: the blocked read returned
    store_client.sendall(b"x")
    assert store_server.recv(1) == b"x"
    inherited_client.sendall(b"y")
    assert inherited_server.recv(1) == b"y"
    for s in (peer_side, mine, store_client, store_server, inherited_client, inherited_server):
        s.close()


def test_a_newer_attempt_ends_a_wait_in_the_store_at_once(store, monkeypatch):
    """The agent's notice: a worker forming attempt 1's groups waits in the store for a rank that died
    meanwhile; the agent announces attempt 2 and the wait fails within a poll, not after the timeout;
    the worker then joins attempt 2. A fallback announcement makes it give up instead."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # rejoin sets it: restored after the test
    monkeypatch.setattr(worker, "_KEPT", set(worker._endpoints()))
    keys = protocol.Keys("watch")
    protocol.announce(store, keys, kind="inprocess", failed=[1], detected_at=0.0)
    member = worker.Membership(worker._client(10), keys, attempt=1, rank=0)
    member.watch(poll_s=0.02)
    forming = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
    threading.Timer(0.3, lambda: protocol.announce(store, keys, kind="inprocess", failed=[2], detected_at=0.0)).start()
    t0 = time.monotonic()
    with pytest.raises(dist.DistError) as raised:
        forming.get("rank 1 never writes this")
    assert time.monotonic() - t0 < 5 and member.superseded
    # a connection made after the notice, before this process rejoined (a store client's constructor retries
    # its connect when its handshake was severed), is shut down too: its wait ends within a poll
    late = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
    t0 = time.monotonic()
    with pytest.raises(dist.DistError):
        late.get("a peer of the old attempt never writes this")
    assert time.monotonic() - t0 < 5
    assert member.rejoin(f"{raised.type.__name__}: {raised.value}", worker.peer_failure(raised.value))
    assert member.attempt == 2 and not member.superseded
    # this process's rank was given to another process (its node was declared lost): it must not rejoin
    protocol.announce(store, keys, kind="inprocess", failed=[0, 1], detected_at=0.0, lost=[0])
    assert not member.rejoin("RuntimeError: Connection closed by peer", True) and not member.gave_up
    protocol.announce(store, keys, kind="fallback", failed=[3], detected_at=0.0, reason="no spare for rank 3")
    # (this process stopped above; one of attempt 3 meets the fallback)
    member = worker.Membership(worker._client(10), keys, attempt=3, rank=2)
    assert not member.rejoin("RuntimeError: Connection closed by peer", True) and member.gave_up


def test_launcher_flags_are_checked(capsys):
    for flags, message in ((["--spares-per-node", "-1"], "--spares-per-node must be >= 0 (got -1)"),
                           (["--reform-timeout", "0"], "--reform-timeout must be a finite number of seconds > 0"),
                           # nan compares false with 0, inf overflows the timedelta of the first recovery
                           (["--reform-timeout", "nan"], "--reform-timeout must be a finite number of seconds > 0"),
                           (["--reform-timeout", "inf"], "--reform-timeout must be a finite number of seconds > 0"),
                           (["--node-timeout", "nan"], "--node-timeout must be a finite number of seconds > 0"),
                           (["--stop-timeout", "-1"], "--stop-timeout must be a finite number of seconds > 0"),
                           (["--max-restarts", "-1"], "--max-restarts must be >= 0 (got -1)"),
                           (["--full-restart", "--spares-per-node", "1"], "--spares-per-node needs in-process")):
        with pytest.raises(SystemExit) as exit_:
            cli.parse_args(["--standalone", *flags, "train.py"])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    from moe_ft.cli.main import main as moe_ft_main  # `moe-ft launch` hands its command line over as is

    with pytest.raises(SystemExit) as exit_:
        moe_ft_main(["launch", "--standalone", "--spares-per-node", "-1", "train.py"])
    assert exit_.value.code == 2 and "--spares-per-node must be >= 0" in capsys.readouterr().err
    assert moe_ft_main(["launch", "--help"]) == 0  # torch elastic's @record turns exit(0) into a return
    out = capsys.readouterr().out
    assert out.startswith("usage: moe-ft launch") and "--spares-per-node" in out
    assert "--nproc-per-node" in out  # torchrun's own flags
    args = cli.parse_args(["--standalone", "--nproc-per-node", "4", "--spares-per-node", "2", "train.py", "--lr", "1"])
    assert (args.spares_per_node, args.rdzv_backend, args.training_script_args) == (2, "c10d", ["--lr", "1"])
    cli.parse_args(["--standalone", "--spares-per-node", "1", "--max-restarts", "0", "train.py"])  # a fault-free run
    assert "no spare will take a rank" in capsys.readouterr().err


def test_a_single_node_full_restart_needs_no_rendezvous_round():
    """torchrun's default rendezvous (static) has no rounds: a one-node job's full restart is announced all the
    same (the round only tells the other nodes' agents which attempt it is); it used to raise at the first
    full restart, after the job had run under in-process recovery."""
    from types import SimpleNamespace

    from torch.distributed import HashStore

    from moe_ft.launch.agent import SpareAgent

    store, keys = HashStore(), protocol.Keys("job")
    agent = object.__new__(SpareAgent)
    agent._started, agent._keys, agent._node, agent._nodes = True, keys, 0, 1
    agent._store_client = lambda group: store  # type: ignore[method-assign]
    protocol.announce(store, keys, kind="fallback", failed=[1], detected_at=0.0, reason="no spare for rank 1")
    group = SimpleNamespace(spec=SimpleNamespace(rdzv_handler=object()),  # a handler without rounds
                            workers=[SimpleNamespace(global_rank=r) for r in (0, 1)])
    assert agent._job_attempt(group) == 2  # type: ignore[arg-type]
    assert protocol.announcement(store, keys, 2) | {"detected_at": 0} == {
        "kind": "job", "failed": [0, 1], "detected_at": 0, "reason": "no spare for rank 1"}


def test_a_job_stopped_by_a_lost_node_ends_with_one_line(monkeypatch, capsys):
    """Ranks of a lost node found by the heartbeat watch: the run fails with no worker of this node failed;
    torch's error report asserts on that, so the launcher says it in one line, exit 1."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    class Stopped:
        def __init__(self, spec, logs, **kwargs) -> None:
            self.spec = spec  # the launcher's worker spec, as the real agent takes it

        def run(self):
            return RunResult(state=WorkerState.FAILED, failures={})

    monkeypatch.setattr(cli, "SpareAgent", Stopped)
    assert cli.main(["--standalone", "--nproc-per-node", "1", "train.py"]) == 1
    assert "node(s) were lost and could not be recovered" in capsys.readouterr().err


def test_max_restarts_bounds_in_process_replacements(tmp_path):
    """Workers that fail at every start (a bad build, say) are replaced in process at most --max-restarts
    times, then the job stops with the reason: no endless replacement loop."""
    script = tmp_path / "fail.py"
    script.write_text("import sys, time\ntime.sleep(0.2)\nsys.exit(1)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "moe_ft", "launch", "--standalone", "--nproc-per-node", "2",
                           "--max-restarts", "2", "--monitor-interval", "0.1", str(script)], cwd=root,
                          capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    attempts = [int(a) for a in re.findall(r"moe-ft launch: ranks? [0-9, ]+ failed; attempt (\d+) gives", out)]
    assert attempts == [1, 2], out[-3000:]
    assert "--max-restarts 2 spent" in out and "the job stops" in out


# ------------------------------------------------------------------------------------------ drills
@pytest.fixture(scope="module")
def drill_env(corpus, tmp_path_factory):
    return {"data": corpus, "work": str(tmp_path_factory.mktemp("inprocess")),
            "store": str(tmp_path_factory.mktemp("inprocess_store"))}


def launch(env, job, *, layout, faults, scope, launcher_flags=(), max_restarts=3, launcher="inprocess-preloaded"):
    return run_job(job=job, workdir=env["work"], faults=list(faults), max_restarts=max_restarts, timeout=300,
                   launcher=launcher, launcher_flags=tuple(launcher_flags), layout=layout,
                   policy="sparse", iters=ITERS, data=env["data"], store=env["store"], window=WINDOW,
                   scope=scope, extra=[])


def check_inprocess(reports, count: int) -> None:
    assert len(reports) == count, reports
    for r in reports:
        assert r["restart_kind"] == "inprocess" and r["survivor_pids_kept"] is True, r
        assert {"detect", "reform", "restore", "replay", "kill_to_resume"} <= set(r["seconds"]), r["seconds"]
        assert r["token_loss"]["tokens"] == 0.0


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_pp4_two_kills_survivors_keep_their_processes(drill_env, fault_free_digest):
    """PP=4, localized scope: stage 2 dies in a backward pass, later stage 1 dies in a forward pass; each
    time the spare takes the rank (a new spare is started for the second), survivors keep their pids."""
    res = launch(drill_env, "pp4_two", layout="pp4", faults=["2:4:backward", "1:7:forward"], scope="localized")
    assert res["rc"] == 0, res["log"]
    assert res["digest"] == fault_free_digest("pp4", ITERS)
    check_inprocess(res["reports"], 2)
    assert [r["scope"]["mode"] for r in res["reports"]] == ["localized", "localized"]


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_no_spare_left_a_fresh_process_takes_the_rank(drill_env, fault_free_digest):
    """EP2 x PP2, global scope, no spares: the agent starts a fresh process for the failed rank while the
    survivors wait in-process."""
    res = launch(drill_env, "ep2pp2_fresh", layout="ep2pp2", faults=["3:6:backward"], scope="global",
                 launcher_flags=["--spares-per-node=0"])
    assert res["rc"] == 0, res["log"]
    assert res["digest"] == fault_free_digest("ep2pp2", ITERS)
    check_inprocess(res["reports"], 1)
    assert "gives it to a fresh process" in open(res["log"]).read()


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_spare_killed_while_taking_over_then_a_survivor_killed_during_recovery(drill_env, fault_free_digest):
    """EP2 x PP2, global scope: rank 3 dies in iteration 6; the spare that takes rank 3 dies while it
    replays iteration 4; in the next attempt a survivor (rank 1) dies while replaying iteration 5. Each
    death is replaced in-process (three attempts); the last recovery completes, bitwise."""
    faults = ["3:6:backward", "3:4:recovery", "1:5:recovery"]
    res = launch(drill_env, "ep2pp2_cascade", layout="ep2pp2", faults=faults, scope="global")
    assert res["rc"] == 0, res["log"]
    assert res["digest"] == fault_free_digest("ep2pp2", ITERS)
    log = open(res["log"]).read()
    for fault in ("rank 3 fails at iteration 4 (recovery, exit)", "rank 1 fails at iteration 5 (recovery, exit)"):
        assert f"moe-ft fault injection: {fault}" in log
    (report,) = res["reports"]  # the two interrupted recoveries wrote none
    assert report["restart_count"] == 3
    check_inprocess([report], 1)


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_replacement_that_does_not_arrive_in_time_falls_back_to_a_full_restart(drill_env, fault_free_digest):
    """No spare, workers started as fresh interpreters (seconds of imports), and a reform timeout of 1 s:
    the survivors stop waiting for the fresh process to form the new group, give up, and the agent
    restarts every worker (``restart_kind`` "job"); the job still ends bitwise. With ``--max-restarts 1``:
    one failure spends one restart, its in-process attempt and the full restart that follows together."""
    res = launch(drill_env, "dp2ep2_fallback", layout="dp2ep2", faults=["1:5:forward"], scope="global",
                 launcher="inprocess", launcher_flags=["--spares-per-node=0", "--reform-timeout=1"], max_restarts=1)
    assert res["rc"] == 0, res["log"]
    assert res["digest"] == fault_free_digest("dp2ep2", ITERS)
    (report,) = res["reports"]
    assert report["restart_kind"] == "job" and report["survivor_pids_kept"] is None
    assert "falling back to a full restart" in open(res["log"]).read()
    assert report["fallback_reason"] == "re-forming the process groups took longer than --reform-timeout (1 s)"


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_stopped_rank_is_killed_and_replaced(drill_env, fault_free_digest):
    """EP2 x PP2, global scope: rank 2 stops itself (SIGSTOP) in iteration 5, its peers wait for it in their
    collectives; after ``--stop-timeout`` its agent kills it and a spare takes the rank, bitwise."""
    res = launch(drill_env, "ep2pp2_stopped", layout="ep2pp2", faults=["2:5:forward:stop"], scope="global",
                 launcher_flags=["--stop-timeout=1"])
    assert res["rc"] == 0, res["log"]
    assert res["digest"] == fault_free_digest("ep2pp2", ITERS)
    check_inprocess(res["reports"], 1)
    assert "rank 2 (pid " in open(res["log"]).read() and "stood stopped for" in open(res["log"]).read()


def test_workers_and_spares_are_stopped_together():
    """Each worker runs in a context of its own whose close waits for it: closed one after another, four
    workers that each take a while to write their held state would take four times as long."""
    from types import SimpleNamespace

    from moe_ft.launch.agent import SpareAgent

    closing: list[float] = []

    def proc():
        def close(sig, timeout):
            closing.append(time.monotonic())
            time.sleep(0.5)  # writing its held state before it exits
        return SimpleNamespace(context=SimpleNamespace(close=close))

    agent = object.__new__(SpareAgent)
    agent._workers, agent._spares, agent._shutdown_timeout = {r: proc() for r in range(3)}, [proc()], 30
    agent._started_in_pass, agent._starter = [], ThreadPoolExecutor(max_workers=1)  # no start under way
    start = time.monotonic()
    agent._close_all()
    assert len(closing) == 4 and max(closing) - start < 0.4 and time.monotonic() - start < 1.5
    assert agent._workers == {} and agent._spares == []


def test_one_fallback_is_announced_for_one_failure():
    """The workers of the other nodes leave because of a node's fallback (they give up waiting, exit 75): their
    agents do not announce fallbacks of their own on top, so the full restart's report keeps the first cause."""
    from types import SimpleNamespace

    from torch.distributed import HashStore

    from moe_ft.launch.agent import SpareAgent

    store, keys = HashStore(), protocol.Keys("job")
    agent = object.__new__(SpareAgent)
    agent._keys, agent._node, agent._dead = keys, 1, {}
    agent._store_client = lambda group: store  # type: ignore[method-assign]
    group = SimpleNamespace()
    protocol.announce(store, keys, kind="inprocess", failed=[2], detected_at=0.0)
    agent._announce_fallback(group, [3], "rank 3 failed while the job waited for a replacement")  # type: ignore[arg-type]
    assert protocol.current_attempt(store, keys) == 2 and agent._attempt == 2
    agent._announce_fallback(group, [0, 1], "re-forming the process groups took longer than --reform-timeout")  # type: ignore[arg-type]
    assert protocol.current_attempt(store, keys) == 2 and agent._attempt == agent._seen == 2
    assert protocol.announcement(store, keys, 2)["reason"] == "rank 3 failed while the job waited for a replacement"


def test_a_survivor_that_skipped_attempts_applies_each_of_them(store, monkeypatch):
    """A second failure was announced while a survivor still held its state after the first: it joins the
    newest attempt with the rank and world size every announcement since its own made of it (a shrink it
    skipped included), and stops when a skipped one gave its rank to another process."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    for name, value in (("TORCHELASTIC_RESTART_COUNT", "1"), ("RANK", "3"), ("WORLD_SIZE", "4"),
                        ("LOCAL_WORLD_SIZE", "1"), ("ROLE_RANK", "3"), ("ROLE_WORLD_SIZE", "4"),
                        ("GROUP_RANK", "3"), ("GROUP_WORLD_SIZE", "4")):
        monkeypatch.setenv(name, value)  # rejoin sets them: restored after the test
    keys = protocol.Keys("skipped")
    protocol.announce(store, keys, kind="inprocess", failed=[1], detected_at=0.0)  # this process's attempt 1
    protocol.announce(store, keys, kind="inprocess", failed=[2], detected_at=0.0,  # the job shrank: 3 -> 1
                      resize={"ranks": {"0": 0, "3": 1}, "world_size": 2})
    protocol.announce(store, keys, kind="inprocess", failed=[0], detected_at=0.0)  # then rank 0 failed
    member = worker.Membership(worker._client(10), keys, attempt=1, rank=3)
    assert member.rejoin("RuntimeError: Connection closed by peer", True)
    assert (member.attempt, member.rank, member.resized) == (3, 1, True)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("1", "2")
    # a skipped attempt gave this process's rank (1, after the shrink) to another process: it stops
    protocol.announce(store, keys, kind="inprocess", failed=[1], detected_at=0.0, lost=[1])
    protocol.announce(store, keys, kind="inprocess", failed=[0], detected_at=0.0)
    assert not member.rejoin("RuntimeError: Connection closed by peer", True) and not member.gave_up


def test_spares_that_keep_exiting_are_not_started_for_ever(caplog):
    """A spare that cannot start (a broken environment) was started again at every monitor pass: after
    ``SPARE_EXITS`` exits in a row the node starts no more (a failed rank then gets a fresh process)."""
    from types import SimpleNamespace

    from moe_ft.launch.spares import SPARE_EXITS

    started: list[str] = []

    def start_spare(group, device):
        started.append(f"spare_{len(started)}")
        return SimpleNamespace(slot=started[-1], context=SimpleNamespace(wait=lambda timeout: "exited"))

    agent = object.__new__(SpareAgent)
    agent._spares, agent._spares_per_node, agent._spare_exits, agent._inprocess = [], 1, 0, False
    agent._free_device = lambda group: 0  # type: ignore[method-assign]
    agent._start_spare = start_spare  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="moe_ft.launch"):
        for _ in range(10):  # monitor passes
            agent._fill_spares(None)  # type: ignore[arg-type]
            agent._reap_spares()
    assert len(started) == SPARE_EXITS and agent._spares == []
    assert "no more spares here" in caplog.text


def test_a_stopped_worker_or_spare_is_killed_after_the_stop_timeout(store, tmp_path):
    """torch elastic watches exits only: a worker stopped by SIGSTOP left its peers waiting in their
    collectives until the groups' timeout. The agent kills a process that stood stopped for
    ``--stop-timeout`` (its next pass then sees a failed worker, or a spare that exited); one continued
    before that is left alone. Real processes under a real agent."""
    import signal

    agent, group = sleeping_agent(store, tmp_path, "stopped", 1, stop_timeout_s=0.5)
    agent._finished = {}
    try:
        agent._workers = {0: agent._start_one(group, name="rank0", rank=0, local_rank=0)}
        agent._spares = [agent._start_spare(group, 1)]
        worker, spare = agent._workers[0], agent._spares[0]
        os.kill(worker.pid, signal.SIGSTOP)
        os.kill(spare.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while len(agent._stopped) < 2 and time.monotonic() < deadline:  # the stop takes effect asynchronously
            agent._kill_stopped()
            time.sleep(0.05)
        assert set(agent._stopped) == {worker.pid, spare.pid}
        os.kill(spare.pid, signal.SIGCONT)  # continued within the timeout: left alone
        time.sleep(0.6)
        agent._kill_stopped()
        assert set(agent._stopped) == {worker.pid}  # killed now (it stood stopped 0.6 s)
        result = worker.context.wait(10)
        assert result is not None and result.is_failed()
        assert next(iter(result.failures.values())).exitcode == -signal.SIGKILL
        assert spare.context.wait(0) is None
    finally:
        agent._close_all()


def test_a_fallback_after_an_in_process_attempt_spends_no_second_restart():
    """One failure spends one of --max-restarts, however it is recovered: when the survivors give up forming
    the in-process attempt that replaced the failed rank (it spent one), the fallback says so and each agent
    gives one back before torch elastic spends one on the full restart (once per fallback: the agent whose
    workers left because of it too). A fallback after a grow (which spent none) gives nothing back."""
    from types import SimpleNamespace

    from torch.distributed import HashStore

    store, keys = HashStore(), protocol.Keys("refund")
    group = SimpleNamespace(spec=SimpleNamespace(max_restarts=1))

    def agent(node):
        a = object.__new__(SpareAgent)
        a._keys, a._node, a._dead, a._seen, a._refunded, a._remaining_restarts = keys, node, {}, 1, -1, 0
        a._store_client = lambda group: store  # type: ignore[method-assign]
        return a

    protocol.announce(store, keys, kind="inprocess", failed=[2], detected_at=0.0)  # spent the one restart
    first, second = agent(0), agent(1)
    first._announce_fallback(group, [0], "re-forming took too long", recovery_gave_up=True)  # type: ignore[arg-type]
    assert protocol.announcement(store, keys, 2)["spent_by"] == 1
    first._refund_recovery(group)  # type: ignore[arg-type]
    first._refund_recovery(group)  # type: ignore[arg-type]
    assert first._remaining_restarts == 1  # torch elastic's restart can follow, once
    second._announce_fallback(group, [3], "re-forming took too long", recovery_gave_up=True)  # type: ignore[arg-type]
    second._refund_recovery(group)  # type: ignore[arg-type]
    assert second._seen == 2 and second._remaining_restarts == 1

    protocol.announce(store, keys, kind="inprocess", failed=[], detected_at=0.0, resize={})  # 3: a grow
    third = agent(0)
    third._seen = 3
    third._announce_fallback(group, [0], "re-forming took too long", recovery_gave_up=True)  # type: ignore[arg-type]
    third._refund_recovery(group)  # type: ignore[arg-type]
    assert "spent_by" not in protocol.announcement(store, keys, 4) and third._remaining_restarts == 0


def test_a_peers_full_restart_is_not_taken_for_a_joining_node(monkeypatch):
    """A node waiting at the rendezvous while this node's workers are healthy is a node that joins only when
    the job may grow (``--nnodes MIN:MAX`` with fewer than MAX live) and no fallback is announced: after a
    peer's fallback it is that peer's agent restarting, and keeping the workers (which leave for the full
    restart anyway) made the agents spend restarts against each other."""
    from types import SimpleNamespace

    from torch.distributed import HashStore
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    calls: list[str] = []
    monkeypatch.setattr(LocalElasticAgent, "_restart_workers", lambda self, group: calls.append("restart"))
    store, keys = HashStore(), protocol.Keys("join")
    agent = object.__new__(SpareAgent)
    agent._keys, agent._store_client = keys, lambda group: store  # type: ignore[method-assign]
    agent._inprocess, agent._awaiting, agent._dead, agent._lost, agent._node, agent._seen = True, set(), {}, set(), 0, 0
    agent._attempt, agent._falling_back, agent._remaining_restarts = 0, False, 1
    agent._workers = {0: SimpleNamespace(local_rank=0)}
    agent._finished, agent._finished_nodes, agent._round_tag, agent._join_refused = {}, set(), "r0", False
    agent._home, agent._nodes, agent._min_nodes, agent._max_nodes = {0: 0, 1: 1}, 2, 1, 3
    agent._initialize_workers = lambda group: calls.append("keep")  # type: ignore[method-assign]
    group = SimpleNamespace(state=WorkerState.HEALTHY, spec=SimpleNamespace(local_world_size=1))

    def decided() -> str:
        calls.clear()
        agent._restart_workers(group)  # type: ignore[arg-type]
        return calls[-1]

    assert decided() == "keep"  # 2 of at most 3 nodes: a node joins, the workers stay
    agent._max_nodes = 2
    assert decided() == "restart"  # every node is live: no join possible
    agent._max_nodes, agent._min_nodes = 3, None
    assert decided() == "restart"  # a fixed --nnodes never grows
    agent._min_nodes = 1
    protocol.announce(store, keys, kind="fallback", failed=[1], detected_at=0.0, reason="rank 1 gave up")
    assert decided() == "restart"  # the waiting node is the peer that fell back
    agent._awaiting = {1}  # nor is it the replacement node the survivors waited for
    assert decided() == "restart"


def test_an_agent_back_in_the_rendezvous_after_a_fallback_is_not_a_lost_node(store, tmp_path):
    """After a fallback, an agent whose workers left first is back in the rendezvous and beats no more: the
    others must not declare its node lost (seen in CI: node 1's agent then gave node 0's ranks away and, the
    budget spent by the in-process attempt, stopped the job). Its own workers' exit then restarts the group,
    with the in-process attempt's restart given back. A real agent and process, a real store."""
    import signal

    agent, group = sleeping_agent(store, tmp_path, "fellback", 1, node_timeout_s=0.3)
    agent._node, agent._nodes, agent._world, agent._groups = 1, 2, 2, {0: 0, 1: 1}
    agent._holders = agent._home = {0: 0, 1: 1}
    keys = protocol.Keys("fellback")
    try:
        agent._workers = {1: agent._start_one(group, name="rank1", rank=1, local_rank=0)}
        protocol.announce(store, keys, kind="inprocess", failed=[0], detected_at=time.time(), holders={"0": 0})
        protocol.announce(store, keys, kind="fallback", failed=[0], detected_at=time.time(), reason="gave up",
                          spent_by=1)
        deadline = time.monotonic() + 1.5  # five node timeouts without a beat from node 0
        while time.monotonic() < deadline:
            assert agent._monitor_workers(group).state == WorkerState.HEALTHY
            time.sleep(0.05)
        assert agent._lost == set() and protocol.current_attempt(store, keys) == 2
        assert agent._remaining_restarts == 0  # the in-process attempt spent the one
        os.kill(agent._workers[1].pid, signal.SIGKILL)  # (a worker leaving for the full restart exits 75)
        agent._workers[1].context.wait(10)
        assert agent._monitor_workers(group).state == WorkerState.FAILED
        assert agent._remaining_restarts == 1  # given back: torch elastic's full restart follows
    finally:
        agent._close_all()
