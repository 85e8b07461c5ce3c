"""The remote budget of replication (MoEtion §4.2, ``B_remote = BW_net × T_iter``): the
bytes a rank sends to its peers stay within ``B_remote`` per submitted iteration (a running total), the
newest recovery point goes first, superseded points are abandoned and the lag says how far behind the
newest replicated recovery point is. One process: in-process transport, in-memory stores."""

from __future__ import annotations

import torch

from moe_ft.replication import InProcessHub, ReceiverConfig, ReplicaReceiver, ReplicaSender, SenderConfig
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import DenseRule, KeepTwoRecoverable, MemoryBackend, NewestFullRule, SnapshotStore, SparseWindowRule

E0, E1, D0 = OperatorId.expert_op(0, 0), OperatorId.expert_op(0, 1), OperatorId.dense(0)
OPS = frozenset([E0, E1, D0])
NUMEL = 1000  # 4 kB per entry


def _publish(store: SnapshotStore, t: int, levels: dict) -> None:
    with store.begin(t) as point:
        for op, level in levels.items():
            point.put(op, level, {"w": torch.full((NUMEL,), float(t))})
        point.put_meta({"iteration": t})
        point.publish()


def _pair(rule, budget):
    hub = InProcessHub()
    local = SnapshotStore(MemoryBackend(name="rank0"), retention=KeepTwoRecoverable(rule=rule))
    replica = SnapshotStore(MemoryBackend(name="replica"))
    receiver = ReplicaReceiver(ReceiverConfig(keep_points=16), hub.endpoint(1), [0], lambda owner: replica)
    sender = ReplicaSender(SenderConfig(), local, hub.endpoint(0), [1], owner=0, budget=budget)
    return local, replica, sender, receiver


def _point_bytes(levels) -> int:
    """Payload of one replicated point of this test: measured on a throwaway store."""
    store = SnapshotStore(MemoryBackend())
    _publish(store, 0, levels)
    return sum(len(store.backend.read_blob(0, b)) for b in store.backend.blob_names(0))


def test_dense_points_within_budget_newest_first_with_lag():
    full = {op: Level.FULL for op in OPS}
    # half a point per iteration: every second point fits. Slack of 16 bytes: a point's manifest records its
    # creation time, whose printed length varies by a digit or two between points (the test was flaky with +1)
    budget = _point_bytes(full) // 2 + 16
    local, replica, sender, receiver = _pair(DenseRule(operators=OPS), lambda: budget)
    lags = []
    for t in range(10):
        _publish(local, t, full)
        sender.submit(t)
        sender.flush()
        assert sum(s.nbytes for s in sender.sent) <= budget * (t + 1)  # running total within B_remote
        lags.append(sender.lag(t))
    sent = [s.iteration for s in sender.sent]
    assert sent == [1, 3, 5, 7, 9]  # the newest point whenever the credit covers one
    assert sender.deferred == [0, 2, 4, 6, 8]  # superseded before they fit: never sent late
    assert lags == [1, 0, 1, 0, 1, 0, 1, 0, 1, 0]
    sender.close()
    receiver.join(timeout=10)
    assert replica.points() == sent and not replica.verify().problems


def test_unlimited_budget_sends_every_point():
    full = {op: Level.FULL for op in OPS}
    local, replica, sender, receiver = _pair(DenseRule(operators=OPS), lambda: 10**12)
    for t in range(4):
        _publish(local, t, full)
        sender.submit(t)
        sender.flush()
    assert [s.iteration for s in sender.sent] == [0, 1, 2, 3] and sender.lag(3) == 0 and not sender.deferred
    sender.close()
    receiver.join(timeout=10)


def test_sparse_window_is_replicated_whole_before_it_counts():
    """MoEvement windows of 3 (slice i FULL at w0 + i, COMPUTE before, NONE after): the lag counts from
    the newest window whose three points all reached the peer."""
    windows = [{E0: Level.FULL, E1: Level.COMPUTE, D0: Level.COMPUTE}, {E1: Level.FULL, D0: Level.COMPUTE},
               {D0: Level.FULL}]
    per_iteration = max(_point_bytes(w) for w in windows) + 64
    local, replica, sender, receiver = _pair(SparseWindowRule.aligned(OPS, window_size=3),
                                             lambda: per_iteration)
    ends = []
    for t in range(9):
        _publish(local, t, windows[t % 3])
        sender.submit(t)
        sender.flush()
        assert sum(s.nbytes for s in sender.sent) <= per_iteration * (t + 1)
        ends.append(sender.replicated_iteration)
    assert ends[2] == 2 and ends[5] == 5 and ends[8] == 8  # each window counts once its last point arrived
    assert ends[3] == 2 and ends[4] == 2  # while the next window is in flight
    sender.close()
    receiver.join(timeout=10)
    rp = replica.newest_recoverable(SparseWindowRule.aligned(OPS, window_size=3), verify=True)
    assert (rp.start, rp.end) == (6, 8)


def test_plan_restricts_what_is_sent_and_budget_follows_its_callable():
    """``submit(t, plan)``: only the plan's FULL operators (selective's remote plan) and the metadata go;
    the budget callable is read at every submit (B_remote follows the measured T_iter)."""
    full = {op: Level.FULL for op in OPS}
    budget = [10**9]
    local, replica, sender, receiver = _pair(NewestFullRule(operators=OPS), lambda: budget[0])
    _publish(local, 0, full)
    sender.submit(0, {E0: Level.FULL, E1: Level.NONE, D0: Level.FULL})
    sender.flush()
    assert sender.sent[0].num_entries == 3  # E0, D0, metadata
    credit = sender.credit
    budget[0] = 5
    _publish(local, 1, full)
    sender.submit(1)
    sender.flush()
    assert [s.iteration for s in sender.sent] == [0, 1] and sender.credit == credit + 5 - sender.sent[1].nbytes
    sender.close()
    receiver.join(timeout=10)
    point = replica.catalog().point(0)
    assert set(point.entries) == {E0, D0} and point.meta is not None


def test_a_point_collected_before_the_sender_reads_it_is_skipped_at_once():
    """The sender waits for a submitted point's publish; when a newer point is published and this one is not
    (the store's garbage collection took it, or it was never published) it skips it at once instead of
    waiting out ``publish_timeout_s`` (a node agent that replicates behind the trainer meets this often)."""
    import time

    full = {op: Level.FULL for op in OPS}
    local, replica, sender, receiver = _pair(DenseRule(operators=OPS), None)
    sender.config.publish_timeout_s = 60.0
    for t in range(4):  # the newest two recoverable points are kept: 0 and 1 are gone before the sender looks
        _publish(local, t, full)
    start = time.monotonic()
    for t in range(4):
        sender.submit(t)
    sender.flush()
    assert time.monotonic() - start < 10
    assert [s.iteration for s in sender.sent] == [2, 3]
    assert [it for it, _ in sender.skipped] == [0, 1] and all("superseded" in why for _, why in sender.skipped)
    sender.close()


def test_the_plans_of_points_never_sent_are_forgotten():
    """A plan is kept per submitted point until the point is sent: the plans of points skipped (collected
    first) or left behind by the budget (older than every point still wanted) go too, instead of piling up
    for the whole run in the node agent."""
    full = {op: Level.FULL for op in OPS}
    plan = {E0: Level.FULL, E1: Level.NONE, D0: Level.FULL}
    for budget in (None, lambda: 10**9):
        local, replica, sender, receiver = _pair(DenseRule(operators=OPS), budget)
        for t in range(4):  # 0 and 1 are collected before the sender reads them
            _publish(local, t, full)
        for t in range(4):
            sender.submit(t, plan)
        sender.flush()
        assert sender._plans == {}, budget
        sender.close()
        receiver.join(timeout=10)
        # the plan was kept and used while the points were sent: E1 (NONE in it) reached no replica
        assert replica.points() and all(E1 not in replica.catalog().point(t).entries
                                        for t in replica.points()), budget


def test_replicas_of_a_sparse_owner_hold_a_complete_window_whenever_its_store_does():
    """The holders keep as many newest points as the owner's retention holds (``points_to_keep``: three windows
    of the sparse policy), not a fixed 8, which held no complete window of 6 points after 9 of 24 iterations."""
    from moe_ft.policy import SparseConfig, SparsePolicy
    from moe_ft.replication.receiver import points_to_keep, publish_replica
    from moe_ft.replication.transport import PointMessage
    from moe_ft.state.operators import OperatorInfo
    from moe_ft.store.backend import MANIFEST

    w = 6
    ops = [OperatorId.expert_op(0, e) for e in range(w)]
    policy = SparsePolicy(SparseConfig(window=w, t_iter_s=1.0),
                          [OperatorInfo(op=op, bytes_compute=32, bytes_full=96) for op in ops])
    assert points_to_keep(policy) == 8 == points_to_keep(None)  # no window before the first plan
    rule = SparseWindowRule.aligned(ops, w)
    owner = SnapshotStore(MemoryBackend(), retention=KeepTwoRecoverable(rule=rule))
    replica = SnapshotStore(MemoryBackend())
    t = {"w": torch.ones(8)}
    for it in range(4 * w):
        policy.plan(it)
        assert points_to_keep(policy) == 3 * w
        with owner.begin(it) as point:
            for e, op in enumerate(ops):
                if e == it % w:
                    point.put(op, Level.FULL, t)
                elif e > it % w:
                    point.put(op, Level.COMPUTE, t)  # frozen until its FULL snapshot in the window
            point.put_meta({"iteration": it})
            point.publish()
        blobs = {b: owner.backend.read_blob(it, b) for b in owner.backend.blob_names(it) if b != MANIFEST}
        message = PointMessage(0, it, owner.backend.read_blob(it, MANIFEST), blobs)
        publish_replica(replica, message, keep_points=points_to_keep(policy))
        ours, theirs = owner.newest_recoverable(rule), replica.newest_recoverable(rule)
        assert (ours is None) == (theirs is None) and (ours is None or ours.end == theirs.end), it


def test_holders_keep_the_points_a_checkpoint_interval_spans():
    """Dense and pec publish a point every iteration (NONE between checkpoints): the holders keep the owner's
    retained checkpoints times their interval (``SnapshotPolicy.retained_points``)."""
    from moe_ft.policy import DenseConfig, DensePolicy, PECConfig, PECPolicy
    from moe_ft.replication.receiver import points_to_keep
    from moe_ft.state.operators import OperatorInfo

    infos = [OperatorInfo(op=OperatorId.expert_op(0, e), bytes_compute=32, bytes_full=96) for e in range(4)]
    infos.append(OperatorInfo(op=OperatorId.dense(0), bytes_compute=32, bytes_full=96))
    assert points_to_keep(DensePolicy(DenseConfig(interval=5), infos)) == 3 * 5
    assert points_to_keep(DensePolicy(DenseConfig(interval=2), infos)) == 8  # 6: the least a holder keeps
    pec = PECPolicy(PECConfig(k_snapshot=1, interval=3), infos)
    pec.plan(0)
    # a cycle of ceil(4/1) checkpoints and two more, each 3 iterations apart
    assert pec.retained_points() == (4 + 2) * 3 == points_to_keep(pec)
