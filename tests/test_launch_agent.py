"""``moe-ft launch``'s agent (``moe_ft/launch/agent.py``) in the moments where two of its paths meet: real
``SpareAgent``\\ s with real (sleeping) processes on a real ``TCPStore``, each monitor pass or decision
called in the order the race takes (no training, no rendezvous round)."""

from __future__ import annotations

import time

import pytest

from moe_ft.launch import protocol
from moe_ft.launch.agent import Fenced
from tests._launch_helpers import launch_store, place, sleeping_agent


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
