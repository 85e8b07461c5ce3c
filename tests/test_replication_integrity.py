"""Integrity: lookup order with verified fallback, torn-point refusal, expert-completeness validator."""


import pytest
import torch
from _ft_helpers import damage_blob

from moe_ft.persist.validate import refuse_mixed_iterations, validate_experts
from moe_ft.replication import (
    InProcessHub,
    ReceiverConfig,
    ReplicaReceiver,
    ReplicaSender,
    SenderConfig,
    replica_store_config,
)
from moe_ft.replication.lookup import EntryLocator, NoValidEntryError
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import DenseRule, StoreConfig
from moe_ft.store.rules import RecoveryPoint

pytestmark = pytest.mark.timeout(60)
OP = OperatorId.expert_op(1, 3)


def _flip(store, it, blob):
    damage_blob(store, it, blob, lambda data: data[:-40] + bytes([data[-40] ^ 0x01]) + data[-39:])


@pytest.fixture
def tiers(tmp_path):
    """Rank 0's local store, replicas on two peers (sent through the in-process transport) and a durable copy."""
    local = StoreConfig(root=str(tmp_path / "n0"), job_id="j", rank=0).build()
    w = torch.arange(1000, dtype=torch.float32)
    with local.begin(7) as point:
        point.put(OP, Level.FULL, {"w": w, "exp_avg.w": w * 2})
        point.put_meta({"grad_norm": 1.5})
        point.publish()
    hub = InProcessHub()
    receivers = [ReplicaReceiver(ReceiverConfig(), hub.endpoint(peer), [0],
                                 lambda o, p=peer: replica_store_config(root=str(tmp_path / f"n{p}"), job_id="j",
                                                                        owner=o).build()) for peer in (1, 2)]
    sender = ReplicaSender(SenderConfig(), local, hub.endpoint(0), [1, 2], owner=0)
    sender.submit(7)
    sender.close()
    for r in receivers:
        r.join(30)
    durable = StoreConfig(root=str(tmp_path / "durable"), job_id="j", rank=0).build()
    with durable.begin(7) as point:
        point.put(OP, Level.FULL, {"w": w, "exp_avg.w": w * 2})
        point.publish()
    locator = EntryLocator(local=local, replicas=[("replica@rank1", receivers[0].store(0)),
                                                  ("replica@rank2", receivers[1].store(0))], durable=durable)
    return locator, w


def test_fallback_order_and_reasons(tiers, caplog):
    locator, w = tiers
    blob = "expert.L1.E3.full.ent"
    assert locator.find_entry(OP, Level.FULL, 7).source == "local"
    _flip(locator.local, 7, blob)
    found = locator.find_entry(OP, Level.FULL, 7)
    assert found.source == "replica@rank1" and torch.equal(found.tensors["w"], w)
    assert found.skipped[0][0] == "local" and "checksum mismatch" in found.skipped[0][1]
    assert "from replica@rank1" in caplog.text
    _flip(locator.replicas[0][1], 7, blob)
    assert locator.find_entry(OP, Level.FULL, 7).source == "replica@rank2"
    locator.replicas[1][1].delete_point(7)
    with pytest.raises(NoValidEntryError, match=r"local: checksum mismatch.*replica@rank2: missing.*older point"):
        locator.find_entry(OP, Level.FULL, 7, include_durable=False)
    found = locator.find_entry(OP, Level.FULL, 7)
    assert found.source == "durable" and torch.equal(found.tensors["exp_avg.w"], w * 2)
    assert locator.find_entry(None, None, 7).tensors["__meta__"] == {"grad_norm": 1.5}  # meta from local
    with pytest.raises(NoValidEntryError, match="missing"):
        locator.find_entry(OP, Level.FULL, 8)


def test_refuse_mixed_iterations():
    a, b = OperatorId.expert_op(0, 0), OperatorId.dense(0)
    point = RecoveryPoint(4, 4, {a: 4, b: 4}, ())
    refuse_mixed_iterations(point, {a: 4, b: 4}, dense=True)
    with pytest.raises(ValueError, match="torn recovery point"):
        refuse_mixed_iterations(point, {a: 4, b: 3}, dense=True)
    sparse = RecoveryPoint(2, 4, {a: 2, b: 3}, ())
    refuse_mixed_iterations(sparse, {a: 2, b: 3})
    with pytest.raises(ValueError, match="expert.L0.E0"):
        refuse_mixed_iterations(sparse, {a: 3, b: 3})


def test_validate_experts_over_ep_shards(tmp_path):
    # EP=2: rank 0 holds experts 0-1, rank 1 experts 2-3 of 2 layers; both hold dense/gate
    ops = {r: [OperatorId.expert_op(l, e) for l in range(2) for e in (2 * r, 2 * r + 1)]
           + [OperatorId.dense(0), OperatorId.dense(1)] for r in range(2)}
    stores = [StoreConfig(root=str(tmp_path), job_id="j", rank=r).build() for r in range(2)]
    for r, store in enumerate(stores):
        with store.begin(5) as point:
            for op in ops[r]:
                point.put(op, Level.FULL, {"w": torch.ones(3)})
            point.put_meta({})
            point.publish()
    parts = {r: s.newest_recoverable(DenseRule(operators=frozenset(ops[r])), verify=True) for r, s in enumerate(stores)}
    assert validate_experts(parts, num_layers=2, num_experts=4, other_operators=[OperatorId.dense(1)]) == []
    problems = validate_experts({0: parts[0]}, num_layers=2, num_experts=4)  # rank 1's shard lost
    assert problems == [f"expert.L{l}.E{e}: no FULL entry in the point (no rank holds it)"
                        for l in range(2) for e in (2, 3)]
