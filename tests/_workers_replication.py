"""Replication contract and multi-rank replication, shared by the in-process and the gloo transports.

``contract_sender`` / ``contract_receiver`` are the transport contract: the in-process test runs them on
two threads, ``main()`` (under torchrun) on two gloo processes. ``replicate_4ranks`` is the 2 nodes x 2
ranks scenario. Run: ``python -m torch.distributed.run --nproc-per-node N tests/_workers_replication.py
{contract|nodes} OUT_DIR``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from moe_ft.replication import (
    ReceiverConfig,
    ReplicaPlacementConfig,
    ReplicaReceiver,
    ReplicaSender,
    SenderConfig,
    has_copy_off_node,
    needs_replication,
    place_replicas,
    replica_store_config,
)
from moe_ft.replication.transport import PointMessage, Transport
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import SnapshotStore, StoreConfig
from moe_ft.store.backend import MANIFEST

BIG = 5000  # elements of the large tensor: more than one chunk with chunk_bytes=4096


def point_tensors(owner: int, iteration: int) -> dict[OperatorId, tuple[Level, dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1000 * owner + iteration)
    return {
        OperatorId.expert_op(0, owner): (Level.FULL, {"w": torch.randn(BIG, generator=g),
                                                      "exp_avg.w": torch.randn(7, 3, generator=g),
                                                      "bf": torch.randn(4, generator=g).to(torch.bfloat16)}),
        OperatorId.dense(0): (Level.COMPUTE, {"w": torch.randn(5, 5, generator=g)}),
        OperatorId.gate(0): (Level.FULL, {"w": torch.randn(2, 8, generator=g), "step": torch.tensor(iteration)}),
    }


def write_point(store: SnapshotStore, owner: int, iteration: int) -> None:
    with store.begin(iteration) as point:
        for op, (level, tensors) in point_tensors(owner, iteration).items():
            point.put(op, level, tensors)
        point.put_meta({"grad_norm": 0.5 + iteration, "owner": owner}, {"rng": torch.arange(3)})
        point.publish()


def check_replica(replica: SnapshotStore, owner: int, iterations, ops=None) -> None:
    """Every iteration's entries are there, verified, and bitwise equal to what the owner wrote."""
    assert set(iterations) <= set(replica.points()), (replica.points(), list(iterations))
    catalog = replica.verify(iterations)
    assert not catalog.problems, catalog.problems
    for it in iterations:
        expected = point_tensors(owner, it)
        held = set(catalog.point(it).entries)
        assert held == set(ops if ops is not None else expected), (it, held)
        for op in held:
            level, tensors = expected[op]
            got = replica.load(it, op, level)
            assert got.keys() == tensors.keys()
            for name, t in tensors.items():
                assert got[name].dtype == t.dtype and torch.equal(got[name].reshape(-1).view(torch.uint8),
                                                                  t.reshape(-1).view(torch.uint8)), (it, op, name)
        meta = replica.load_meta(it)
        assert meta.meta == {"grad_norm": 0.5 + it, "owner": owner}


def contract_sender(transport: Transport, peer: int, store: SnapshotStore) -> None:
    me = transport.rank
    sender = ReplicaSender(SenderConfig(), store, transport, [peer], owner=me)
    for it in (3, 4, 5):
        write_point(store, me, it)
        sender.submit(it)
    sender.flush()
    assert sender.replicated_iteration == 5 and sender.lag(6) == 1 and not sender.skipped
    assert [s.iteration for s in sender.sent] == [3, 4, 5]
    # a point damaged on the wire: one entry flipped, one truncated -> both rejected, the rest kept
    write_point(store, me, 6)
    blobs = {n: bytearray(store.backend.read_blob(6, n)) for n in store.backend.blob_names(6) if n != MANIFEST}
    expert, dense = "expert.L0.E%d.full.ent" % me, "dense.L0.compute.ent"
    blobs[expert][200] ^= 0x10
    blobs[dense] = blobs[dense][:-3]
    transport.send_point(peer, PointMessage(owner=me, iteration=6, manifest=store.backend.read_blob(6, MANIFEST),
                                            blobs={k: bytes(v) for k, v in blobs.items()}))
    # a damaged manifest rejects the whole point
    transport.send_point(peer, PointMessage(owner=me, iteration=7, manifest=b'{"format": "x"}', blobs={}))
    sender.close()


def contract_receiver(transport: Transport, peer: int, root: str) -> None:
    receiver = ReplicaReceiver(ReceiverConfig(keep_points=3), transport, [peer],
                               lambda owner: replica_store_config(root=root, job_id="job", owner=owner).build())
    receiver.join(timeout=120)
    replica = receiver.store(peer)
    # keep_points=3: point 3 was trimmed; point 6 holds only the entries that verified
    assert replica.points() == [4, 5, 6]
    check_replica(replica, peer, [4, 5])
    catalog = replica.verify([6])
    assert set(catalog.point(6).entries) == {OperatorId.gate(0)} and catalog.point(6).meta is not None
    rejected = sorted((r.iteration, r.entry) for r in receiver.rejections)
    assert rejected == [(6, "dense.L0@COMPUTE"), (6, f"expert.L0.E{peer}@FULL"), (7, "MANIFEST")], rejected
    assert [(o, it) for o, it, _ in receiver.received] == [(peer, 3), (peer, 4), (peer, 5), (peer, 6)]


def replicate_nodes(transport: Transport, root: str, world: int, rank: int) -> dict:
    """2 nodes x 2 ranks: node of rank = rank // 2, DP groups {0, 2} and {1, 3}, r = 1, fp32 with a
    non-distributed optimizer: dense state has a DP copy on the other node and is not sent."""
    import torch.distributed as dist

    node_of = [r // 2 for r in range(world)]
    groups = [[0, 2], [1, 3]]
    plan = place_replicas(ReplicaPlacementConfig(num_replicas=1), node_of=node_of, dp_groups=groups)
    node_root = os.path.join(root, f"node{node_of[rank]}")
    store = StoreConfig(root=node_root, job_id="job", rank=rank).build()
    group = next(g for g in groups if rank in g)
    select = lambda e: needs_replication(e.op, e.level, dp_copy_off_node=has_copy_off_node(rank, group, node_of),
                                         expert_dp_copy_off_node=False, distributed_optimizer=False)
    receiver = ReplicaReceiver(ReceiverConfig(), transport, plan.sources[rank],
                               lambda o: replica_store_config(root=node_root, job_id="job", owner=o).build())
    sender = ReplicaSender(SenderConfig(), store, transport, plan.peers[rank], owner=rank, select=select)
    for it in range(4):
        write_point(store, rank, it)
        sender.submit(it)
    sender.close()
    receiver.join(timeout=120)
    dist.barrier()
    peer = plan.peers[rank][0]
    replica = replica_store_config(root=os.path.join(root, f"node{node_of[peer]}"), job_id="job", owner=rank).build()
    assert replica.points() == [0, 1, 2, 3]
    check_replica(replica, rank, range(4), ops=[OperatorId.expert_op(0, rank)])  # gate, dense: DP copy
    for it in range(4):  # the peer holds the owner's bytes and checksums
        own, rep = store.catalog().point(it), replica.catalog().point(it)
        for op, entry in rep.entries.items():
            assert entry.checksum == own.entries[op].checksum
            assert replica.backend.read_blob(it, entry.blob) == store.backend.read_blob(it, entry.blob)
    return {"rank": rank, "peer": peer, "sources": list(plan.sources[rank]),
            "bytes": [s.nbytes for s in sender.sent], "rejections": len(receiver.rejections)}


def main() -> None:
    import torch.distributed as dist

    from moe_ft.replication import GlooTransport, GlooTransportConfig

    torch.set_num_threads(1)
    mode, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = GlooTransportConfig(chunk_bytes=4096, timeout_s=120)
    transport = GlooTransport(config, config.build_group())
    if mode == "contract":
        assert world == 2
        if rank == 0:
            contract_sender(transport, 1, StoreConfig(root=os.path.join(out, "sender"), job_id="job", rank=0).build())
        else:
            contract_receiver(transport, 0, os.path.join(out, "receiver"))
        result = {"rank": rank}
    else:
        result = replicate_nodes(transport, out, world, rank)
    with open(os.path.join(out, f"result{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
