"""``moe-ft launch``'s agent (``moe_ft/launch/agent.py`` and its layers) in the moments where two of its paths meet: real
``SpareAgent``\\ s with real (sleeping) processes on a real ``TCPStore``, each monitor pass or decision
called in the order the race takes (no training, no rendezvous round)."""

from __future__ import annotations

import errno
import json
import signal
import sys
import threading
import time

import pytest
from torch.distributed.elastic.agent.server.api import WorkerState

from moe_ft.launch import protocol
from moe_ft.launch.membership import Fenced
from tests._ft_helpers import ROOT, wait_until
from tests._launch_helpers import launch_store, place, sleeping_agent, store_client


@pytest.fixture
def store():
    return launch_store()


def test_a_decision_that_raises_releases_its_lock(store, tmp_path):
    """Node 1's agent takes the lock of attempt 2 for its dead rank, then finds node 1 declared lost in
    attempt 1 (fenced). The lock goes with it: node 0's agent can still announce attempt 2 for its own dead
    rank (a fallback here, the one restart spent), where before it found the lock held on every pass and
    the job could neither replace nor restart."""
    a, group_a = sleeping_agent(store, tmp_path / "a", "lock", 1, spares_per_node=1)
    b, group_b = sleeping_agent(store, tmp_path / "b", "lock", 1)
    place([a, b], nodes=3)
    keys = protocol.Keys("lock")
    try:
        a._workers = {0: a._start_one(group_a, name="rank0", rank=0, local_rank=0)}
        b._workers = {1: b._start_one(group_b, name="rank1", rank=1, local_rank=0)}
        a._fill_spares(group_a)
        b._apply_announcements(group_b)  # node 1's pass starts: nothing announced yet
        a._lost, a._dead = {1}, {1: time.time()}  # node 0's agent declares node 1 lost: its spare takes rank 1
        assert a._decide(group_a) and protocol.current_attempt(store, keys) == 1
        b._workers[1].context.close()  # node 1's rank died in the same pass
        b._reap(1, time.time())
        with pytest.raises(Fenced):
            b._decide(group_b)
        assert not store.check([keys.decision(2)])

        a._workers[0].context.close()
        a._reap(0, time.time())
        assert not a._decide(group_a)
        assert protocol.current_attempt(store, keys) == 2
        assert protocol.announcement(store, keys, 2)["kind"] == "fallback"
    finally:
        a._close_all()
        b._close_all()


_JOIN = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
slot = os.environ.get("MOE_FT_SPARE_SLOT")
from moe_ft.launch import worker
membership = worker.join()  # a spare waits here for its rank
if slot:
    with open(os.path.join(sys.argv[2], slot), "w") as f:
        f.write(f"{membership.rank} {membership.attempt}")
time.sleep(120)
"""


def test_a_decision_that_raises_gives_back_the_spares_it_claimed(store, tmp_path, monkeypatch):
    """Node 0's rank 0 died and node 2 is lost. Node 0's agent claims node 1's spare for rank 2, then cannot
    start a fresh process for rank 0 (the fork fails): the decision raises, and gives back what it took. Node 1
    keeps listing its spare and holds it as a spare, node 0 keeps rank 0's device, and when node 1's own rank 1
    dies next its agent gives rank 1 to that spare, whose process (a real worker in ``join``) runs rank 1.
    Before, the claim stayed: node 1's agent took the spare as rank 2's worker, its process started rank 2 in
    an attempt nobody announced, rank 1 went to a fresh process, and node 0 forgot rank 0's device."""
    a, group_a = sleeping_agent(store, tmp_path / "a", "undo", 1, max_restarts=3)
    b, group_b = sleeping_agent(store, tmp_path / "b", "undo", 1, max_restarts=3, spares_per_node=1)
    place([a, b], nodes=3)
    ran = tmp_path / "ran"
    ran.mkdir()
    group_b.spec.entrypoint, group_b.spec.args = sys.executable, ("-c", _JOIN, ROOT, str(ran))
    keys = protocol.Keys("undo")

    def fork_fails(*args, **kwargs):
        raise OSError(errno.EAGAIN, "fork: Resource temporarily unavailable")

    try:
        a._workers = {0: a._start_one(group_a, name="rank0", rank=0, local_rank=0)}
        b._workers = {1: b._start_one(group_b, name="rank1", rank=1, local_rank=0)}
        b._fill_spares(group_b)
        (spare,) = b._spares
        a._workers[0].context.close()
        a._reap(0, time.time())
        a._lost, a._dead[2] = {2}, time.time()
        monkeypatch.setattr(a, "_start_spare", fork_fails)
        with pytest.raises(OSError, match="fork"):
            a._decide(group_a)
        b._adopt_claimed_spares(group_b)
        b._fill_spares(group_b)
        assert b._spares == [spare] and sorted(b._workers) == [1]
        assert json.loads(store.get(keys.node_spares(1))) == [{"slot": spare.slot, "local_rank": 1}]
        assert a._freed == {0: 0} and sorted(a._dead) == [0, 2] and not store.check([keys.decision(1)])

        b._workers[1].context.close()
        b._reap(1, time.time())
        assert b._decide(group_b)
        info = protocol.announcement(store, keys, 1)
        assert (info["failed"], info["slots"]) == ([1], {"1": spare.slot}) and b._workers[1] is spare
        assert wait_until(lambda: (ran / spare.slot).exists(), timeout=60, message="the spare taking its rank")
        assert (ran / spare.slot).read_text() == "1 1"
    finally:
        a._close_all()
        b._close_all()


def test_a_spare_acts_only_on_a_claim_its_attempt_names(store):
    """A claim stands once its attempt's announcement gives the rank to the slot: a spare that read a claim its
    decision then released waits on, and takes the rank the announced attempt gives it."""
    keys = protocol.Keys("stands")
    got: dict = {}
    spare = store_client(store)
    waiter = threading.Thread(target=lambda: got.update(protocol.wait_for_assignment(spare, keys, "r0.1.0")),
                              daemon=True)
    waiter.start()
    first = protocol.claim_spare(store, keys, "r0.1.0", 1, rank=2, local_rank=1)
    assert first is not None and protocol.claim_stands(store, keys, "r0.1.0", json.loads(first)) is None
    protocol.release_spare(store, keys, "r0.1.0", first)  # the claiming decision raised
    assert protocol.spare_assignment(store, keys, "r0.1.0") is None
    second = protocol.claim_spare(store, keys, "r0.1.0", 1, rank=1, local_rank=1)
    assert second is not None and not got
    protocol.announce(store, keys, kind="inprocess", failed=[1], detected_at=1.0, slots={1: "r0.1.0"})
    waiter.join(10)
    assert got == {"rank": 1, "local_rank": 1, "attempt": 1}
    assert protocol.claim_stands(store, keys, "r0.1.0", json.loads(first)) is False
    assert protocol.claim_stands(store, keys, "r0.1.0", json.loads(second)) is True


class CountingStore:
    """A store client that counts the requests made through it (a wait that runs out is two: the wait and its
    cancel)."""

    def __init__(self, store):
        self._store, self.requests = store, 0

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def call(*args, **kwargs):
            self.requests += 1
            try:
                return method(*args, **kwargs)
            except Exception:
                self.requests += name == "wait"
                raise
        return call


def test_a_waiting_spare_loads_the_store_only_when_an_attempt_is_announced(store):
    """A spare waits in the store for the next announcement: a few requests while it waits, none while a claim
    waits for its attempt, and it takes its rank as soon as the attempt is announced. Before, it looked every
    20 ms: about 50 requests a second while unclaimed and 150 while a claim waited, per spare, on the one
    store every node uses."""
    keys = protocol.Keys("quiet")
    spare = CountingStore(store_client(store))
    got: dict = {}
    waiter = threading.Thread(target=lambda: got.update(protocol.wait_for_assignment(spare, keys, "r0.1.0")),
                              daemon=True)
    waiter.start()
    time.sleep(1.0)
    idle = spare.requests
    assert idle <= 4, f"{idle} store requests in 1 s of waiting"
    assert protocol.claim_spare(store, keys, "r0.1.0", 1, rank=1, local_rank=0)
    time.sleep(0.5)  # the agent's decision goes on: other claims, fresh processes
    assert spare.requests == idle and not got
    protocol.announce(store, keys, kind="inprocess", failed=[1], detected_at=1.0, slots={1: "r0.1.0"})
    waiter.join(5)
    assert got == {"rank": 1, "local_rank": 0, "attempt": 1}


_RECORD_SIGNAL = r"""
import signal, sys, time
def record(signum, frame):
    open(sys.argv[1], "w").write(signal.Signals(signum).name)
    sys.exit(0)
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(sig, record)
open(sys.argv[2], "w").close()
time.sleep(120)
"""


@pytest.mark.parametrize("received", [signal.SIGINT, signal.SIGHUP, signal.SIGQUIT], ids=lambda s: s.name)
def test_the_workers_get_sigterm_whatever_signal_stopped_the_launcher(store, tmp_path, received):
    """torch elastic's ``run`` shuts the agent down with the signal the launcher got; the workers keep their
    state on SIGTERM only (``run_guarded``), so that is what they get (a real worker records it)."""
    agent, group = sleeping_agent(store, tmp_path, "signal", 1)
    place([agent], nodes=1)
    got, ready = tmp_path / "got", tmp_path / "ready"
    group.spec.entrypoint, group.spec.args = sys.executable, ("-c", _RECORD_SIGNAL, str(got), str(ready))
    try:
        proc = agent._start_one(group, name="rank0", rank=0, local_rank=0)
        agent._workers = {0: proc}
        wait_until(ready.exists, timeout=30, message="the worker's signal handlers")
        agent._shutdown(received, timeout=10)
        assert got.read_text() == "SIGTERM"
        assert not proc.context.wait(0).is_failed()
    finally:
        agent._close_all()


def test_a_node_whose_workers_finished_first_is_not_declared_lost(store, tmp_path):
    """Node 0's worker exits 0 while node 1's still runs (its final flush, say): node 0's agent waits in the
    exit barrier, node 1's keeps watching it for longer than ``--node-timeout``. Node 0 is not lost and its
    finished rank goes to no spare; before, the barrier beat no more and node 1 handed rank 0 to its spare."""
    a, group_a = sleeping_agent(store, tmp_path / "a", "done", 1, node_timeout_s=0.5)
    b, group_b = sleeping_agent(store, tmp_path / "b", "done", 1, node_timeout_s=0.5, spares_per_node=1)
    place([a, b], nodes=2)
    group_a.spec.entrypoint, group_a.spec.args = sys.executable, ("-c", "pass")
    keys = protocol.Keys("done")
    barrier = None
    try:
        a._workers = {0: a._start_one(group_a, name="rank0", rank=0, local_rank=0)}
        b._workers = {1: b._start_one(group_b, name="rank1", rank=1, local_rank=0)}
        b._fill_spares(group_b)
        assert wait_until(lambda: a._monitor_workers(group_a).state == WorkerState.SUCCEEDED, timeout=30)
        barrier = threading.Thread(target=a._exit_barrier)
        barrier.start()
        watched = time.monotonic()
        while time.monotonic() - watched < 2.0:  # four node timeouts of node 1's passes
            assert b._monitor_workers(group_b).state == WorkerState.HEALTHY
            time.sleep(0.1)
        assert b._lost == set() and protocol.current_attempt(store, keys) == 0 and sorted(b._workers) == [1]
        assert barrier.is_alive()  # node 1 has not finished: node 0 still waits for it
        store.set(keys.finished("r0", 1), "1")  # node 1's workers finish
        barrier.join(10)
        assert not barrier.is_alive()
    finally:
        a._close_all()
        b._close_all()


def test_nodes_that_read_different_attempts_leave_the_exit_barrier_together(store, tmp_path):
    """Node 1's agent reads the announcements at the start of its pass (none new), and stalls in the store
    (the drills' store once stalled every agent for about 5 s); meanwhile node 0's agent announces attempt 1 and
    both nodes' workers finish. Node 1's pass then finds its worker finished: the two agents enter the exit
    barrier having applied different attempts (0 and 1), and both leave it at once. Before, each counted itself
    under its own newest attempt (``exit/0``, ``exit/1``) and both waited out the barrier's timeout (300 s in
    torch elastic, 3 s here)."""
    a, group_a = sleeping_agent(store, tmp_path / "a", "apart", 1)
    b, group_b = sleeping_agent(store, tmp_path / "b", "apart", 1)
    place([a, b], nodes=2)
    for group in (group_a, group_b):
        group.spec.entrypoint, group.spec.args = sys.executable, ("-c", "pass")
    keys = protocol.Keys("apart")
    adopt = b._adopt_claimed_spares

    def stalled_pass(group):  # between node 1's read of the announcements and its look at its processes
        adopt(group)
        protocol.announce(store, keys, kind="inprocess", failed=[0], detected_at=time.time(), holders={0: 0})
        assert wait_until(lambda: a._monitor_workers(group_a).state == WorkerState.SUCCEEDED, timeout=30)
        wait_until(lambda: b._workers[1].context.wait(0) is not None, timeout=30, message="node 1's worker done")

    try:
        a._workers = {0: a._start_one(group_a, name="rank0", rank=0, local_rank=0)}
        b._workers = {1: b._start_one(group_b, name="rank1", rank=1, local_rank=0)}
        b._adopt_claimed_spares = stalled_pass
        assert b._monitor_workers(group_b).state == WorkerState.SUCCEEDED
        assert (a._seen, b._seen) == (1, 0)
        left = {}
        for agent in (a, b):
            agent._exit_barrier_timeout = 3.0
        barriers = [threading.Thread(target=lambda agent=agent: (agent._exit_barrier(),
                                                                  left.update({agent._node: time.monotonic()})))
                    for agent in (a, b)]
        began = time.monotonic()
        for barrier in barriers:
            barrier.start()
        for barrier in barriers:
            barrier.join(10)
        assert sorted(left) == [0, 1] and max(left.values()) - began < 2.0, {n: t - began for n, t in left.items()}
    finally:
        a._close_all()
        b._close_all()


def test_a_node_that_finished_and_left_is_not_declared_lost(store, tmp_path):
    """Node 0's worker exits 0 and its agent's exit-barrier wait runs out (300 s in torch elastic, 0.3 s here)
    while node 1's worker still runs: node 0's agent leaves and beats no more. Node 1's agent, watching it for
    four node timeouts, declares nothing lost, announces nothing and claims none of node 0's (stopped) spares.
    Before, it declared node 0 lost and gave the finished rank 0 to its spare, and still listed node 0's
    stopped spare for the next lost rank."""
    a, group_a = sleeping_agent(store, tmp_path / "a", "left", 1, node_timeout_s=0.5, spares_per_node=1)
    b, group_b = sleeping_agent(store, tmp_path / "b", "left", 1, node_timeout_s=0.5, spares_per_node=1)
    place([a, b], nodes=2)
    keys = protocol.Keys("left")
    try:
        a._fill_spares(group_a)  # a sleeping spare; the worker then exits 0 at once
        group_a.spec.entrypoint, group_a.spec.args = sys.executable, ("-c", "pass")
        a._workers = {0: a._start_one(group_a, name="rank0", rank=0, local_rank=0)}
        b._workers = {1: b._start_one(group_b, name="rank1", rank=1, local_rank=0)}
        b._fill_spares(group_b)
        assert [node for node, _, _ in b._listed_spares(store)] == [0]
        assert wait_until(lambda: a._monitor_workers(group_a).state == WorkerState.SUCCEEDED, timeout=30)
        a._exit_barrier_timeout = 0.3
        a._exit_barrier()  # runs out: node 1 has not finished
        assert store.check([keys.finished("r0", 0)]) and not store.check([keys.finished("r0", 1)])
        watched = time.monotonic()
        while time.monotonic() - watched < 2.0:  # four node timeouts of node 1's passes
            assert b._monitor_workers(group_b).state == WorkerState.HEALTHY
            time.sleep(0.1)
        assert b._lost == set() and protocol.current_attempt(store, keys) == 0 and sorted(b._workers) == [1]
        assert b._listed_spares(store) == []
    finally:
        a._close_all()
        b._close_all()


def test_a_rank_that_died_while_another_node_shrank_the_job_is_replaced(store, tmp_path):
    """``--nnodes 2:3``, no spares. Node 1's agent shrinks the job (node 2 lost); node 0's rank 0 died in the
    same moment. Node 0's agent, deciding for it, takes in the shrink first: rank 0 stays dead under its new
    number and gets a fresh process in the next attempt. Before, the shrink cleared every dead rank: rank 0
    had no process and nobody replaced it."""
    a, group_a = sleeping_agent(store, tmp_path / "a", "forget", 1, max_restarts=3, min_nodes=2, max_nodes=3)
    b, group_b = sleeping_agent(store, tmp_path / "b", "forget", 1, max_restarts=3, min_nodes=2, max_nodes=3)
    place([a, b], nodes=3)
    keys = protocol.Keys("forget")
    try:
        a._workers = {0: a._start_one(group_a, name="rank0", rank=0, local_rank=0)}
        b._workers = {1: b._start_one(group_b, name="rank1", rank=1, local_rank=0)}
        a._apply_announcements(group_a)  # node 0's pass starts: nothing announced yet
        b._lost, b._dead = {2}, {2: time.time()}
        assert b._decide(group_b)
        assert protocol.announcement(store, keys, 1)["resize"]["world_size"] == 2
        a._workers[0].context.close()
        a._reap(0, time.time())
        assert a._decide(group_a)
        info = protocol.announcement(store, keys, 2)
        assert (info["kind"], info["failed"], info["holders"]) == ("inprocess", [0], {"0": 0})
        assert sorted(a._workers) == [0] and a._workers[0].context.wait(0) is None and a._dead == {}
        assert a._world == 2 and a._workers[0].local_rank == 0
    finally:
        a._close_all()
        b._close_all()


def test_no_shrink_drops_a_rank_running_on_another_nodes_former_spare(store, tmp_path):
    """``--nnodes 1:3``, one rank per node. Node 2 was lost earlier and its rank 2 runs on node 0's former
    spare; now node 1 is lost with no spare left. Dropping the lost nodes' places would drop rank 2, which
    runs: the agent falls back to a full restart instead of shrinking. Before, it shrank to rank 0 alone and
    rank 2's process ran on outside the job, its agent tracking it no more. A shrink announced anyway stops
    any worker of this node that it drops."""
    agent, group = sleeping_agent(store, tmp_path, "shrink", 1, max_restarts=3, min_nodes=1, max_nodes=3)
    place([agent], nodes=3)
    agent._node, agent._holders[2], agent._lost = 0, 0, {2}
    keys = protocol.Keys("shrink")
    try:
        agent._workers = {0: agent._start_one(group, name="rank0", rank=0, local_rank=0),
                          2: agent._start_one(group, name="rank2", rank=2, local_rank=1)}
        rank2 = agent._workers[2]
        agent._lost.add(1)
        agent._dead = {1: time.time()}
        assert not agent._can_shrink([1])
        assert not agent._decide(group)
        assert protocol.announcement(store, keys, 1)["kind"] == "fallback"
        assert agent._workers[2] is rank2 and rank2.context.wait(0) is None

        agent._apply_resize({"ranks": {"0": 0}, "world_size": 1, "nodes": {"0": 0}}, [1])
        assert sorted(agent._workers) == [0] and rank2.context.wait(0) is not None
    finally:
        agent._close_all()
        rank2.context.close()


def test_a_spare_another_agent_claimed_first_runs_its_rank_and_the_dead_rank_gets_another(store, tmp_path):
    """Node 1 lists one spare. Node 0's agent gives it lost node 2's rank 2; before node 1's agent has seen
    that (its pass began just before the claim), its own rank 1 dies and it plans its spare for it. The
    claim fails: the spare runs rank 2 here (as the claim says) and rank 1 gets a fresh process. Before, the
    failed claim was ignored: node 1's agent believed the spare ran rank 1 and announced it so, while the
    spare took rank 2."""
    a, group_a = sleeping_agent(store, tmp_path / "a", "race", 1, max_restarts=3)
    b, group_b = sleeping_agent(store, tmp_path / "b", "race", 1, max_restarts=3, spares_per_node=1)
    place([a, b], nodes=3)
    keys = protocol.Keys("race")
    try:
        a._workers = {0: a._start_one(group_a, name="rank0", rank=0, local_rank=0)}
        b._workers = {1: b._start_one(group_b, name="rank1", rank=1, local_rank=0)}
        b._fill_spares(group_b)
        (spare,) = b._spares
        b._apply_announcements(group_b)  # node 1's pass starts: nothing announced or claimed yet
        b._adopt_claimed_spares(group_b)
        a._lost, a._dead = {2}, {2: time.time()}
        assert a._decide(group_a) and protocol.announcement(store, keys, 1)["holders"] == {"2": 1}
        b._workers[1].context.close()  # node 1's rank dies in the same pass
        b._reap(1, time.time())
        assert b._decide(group_b)
        info = protocol.announcement(store, keys, 2)
        assert (info["failed"], info["holders"]) == ([1], {"1": 1})
        assert b._workers[2] is spare and b._workers[1] is not spare and b._workers[1].local_rank == 0
        assert json.loads(store.get(keys.spare(b._workers[1].slot)))["rank"] == 1
    finally:
        a._close_all()
        b._close_all()


def test_a_node_that_waits_to_join_as_the_job_ends_does_not_regroup_it(store, tmp_path, capsys):
    """``--nnodes 1:3``: node 1's workers finished (it waits in the exit barrier) when a third node waits at the
    rendezvous. Node 0's agent, still training, must not regroup the job for it: the finished ranks cannot form
    the grown round's process groups, and node 1 would wait in the barrier for a round it is not part of."""
    a, group_a = sleeping_agent(store, tmp_path / "a", "ending", 1, min_nodes=1, max_nodes=3)
    b, _ = sleeping_agent(store, tmp_path / "b", "ending", 1, min_nodes=1, max_nodes=3)
    place([a, b], nodes=2)
    keys = protocol.Keys("ending")
    rendezvous = []
    a._initialize_workers = lambda group: rendezvous.append(group)  # the grown round's rendezvous
    group_a.state = WorkerState.HEALTHY
    try:
        a._workers = {0: a._start_one(group_a, name="rank0", rank=0, local_rank=0)}
        store.set(keys.finished("r0", 1), "1")  # node 1's workers finished
        for _ in range(2):  # torch elastic asks again at each pass while the node waits
            a._restart_workers(group_a)
        assert rendezvous == [] and not store.check([keys.regroup(a._seen)])
        assert a._workers[0].context.wait(0) is None  # node 0's worker keeps training
        assert capsys.readouterr().out.count("finished training: the job ends without it") == 1
        store.delete_key(keys.finished("r0", 1))  # the control: no node finished, the same pass regroups
        a._join_refused, a._finished_nodes = False, set()
        a._restart_workers(group_a)
        assert rendezvous == [group_a] and store.check([keys.regroup(a._seen)])
    finally:
        a._close_all()
