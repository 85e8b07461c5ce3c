"""A world change drops every point of the old world from the node's stores (Lazarus §4.3: the new world's
state comes from the agreed point, or -- ``fallback`` -- from the durable tier the usual way).

The node's ranks are numbered again in the new world, so a rank of the new world with an old rank's number is
not that rank. Before, only directories numbered like a rank of this node or beyond the new world were emptied:
on the 4-node drill that lost nodes 0 and 1 (``--ft-policy dense --use-distributed-optimizer --ft-replicas 1``,
fallback), node 2 kept its replicas of old rank 1 (a lost node's) and the usual recovery fetched them, 2.2 MB,
into new rank 1's node-local store as its points 0-3; losing node 0 alone left node 1 with old rank 1's
snapshot points (new rank 1 runs on node 2) for the rest of the run.
"""

from __future__ import annotations

import torch

from moe_ft.elastic.inventory import REPLICA_SUBDIR, StoreDir, node_inventory, old_generation_share, store_dirs
from moe_ft.elastic.restore import discard_node_points
from moe_ft.localized.survivor import SURVIVOR_SUBDIR
from moe_ft.persist.durable import DurableTier
from moe_ft.replication.receiver import replica_store_config
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import StoreConfig

JOB = "job"
DENSE = OperatorId.dense(0)


def _publish(store, iterations) -> None:
    for it in iterations:
        with store.begin(it) as point:
            point.put(DENSE, Level.FULL, {"w": torch.full((4,), float(it))})
            point.put_meta({"iteration": it})
            point.publish()


def _old_world_node(root) -> None:
    """Node 1 of a 6-rank world (old ranks 1 and 4 ran here), one replica of ranks 0, 2 and 5 held here."""
    job = root / JOB
    for rank in (1, 4):
        _publish(StoreConfig(root=str(root), job_id=JOB, rank=rank).build(), [2, 3])
        _publish(StoreConfig(root=str(job), job_id=SURVIVOR_SUBDIR, rank=rank).build(), [3])
    for owner in (0, 2, 5):
        _publish(replica_store_config(root=str(root), job_id=JOB, owner=owner).build(), [2, 3])


def test_a_world_change_leaves_no_old_point_on_the_node(tmp_path):
    """The node now runs new rank 0 of a 4-rank world, alone: every old directory is emptied or removed, the
    replica stores of ranks the new world has are kept (emptied) for the new placement, the durable tier is
    untouched."""
    root = tmp_path / "store"
    _old_world_node(root)
    durable = DurableTier(str(tmp_path / "save"), JOB, 6)
    _publish(durable.store(1), [2])

    discard_node_points(str(root), JOB, rank=0, world_size=4)

    assert node_inventory(str(root), JOB, prefer_rank=0).full == {}
    assert {(d.kind, d.rank) for d in store_dirs(str(root), JOB)} == {("replica", 0), ("replica", 2)}
    for owner in (0, 2):  # a new-world receiver writes into the emptied store
        _publish(replica_store_config(root=str(root), job_id=JOB, owner=owner).build(), [0])
        assert replica_store_config(root=str(root), job_id=JOB, owner=owner).build().points() == [0]
    assert durable.store(1).points() == [2]


def test_each_old_directory_is_one_ranks_job():
    """Two ranks of the new world on the node: each empties its own number's directories, the lowest one the
    rest; it removes those of ranks that run elsewhere or no more, and empties the replica stores of the new
    world's other ranks (a receiver may hold them open)."""
    dirs = [StoreDir(kind, rank, "/s", f"{JOB}/{sub}") for kind, sub in
            (("snapshot", ""), ("survivor", SURVIVOR_SUBDIR), ("replica", REPLICA_SUBDIR)) for rank in range(6)]

    def share(rank):
        empty, remove = old_generation_share(dirs, rank=rank, ranks_here={1, 3}, world_size=4)
        return sorted((d.kind, d.rank) for d in empty), sorted((d.kind, d.rank) for d in remove)

    assert share(3) == ([("replica", 3), ("snapshot", 3), ("survivor", 3)], [])
    empty, remove = share(1)
    assert empty == [("replica", 0), ("replica", 1), ("replica", 2), ("snapshot", 1), ("survivor", 1)]
    assert remove == sorted([(kind, rank) for kind in ("snapshot", "survivor") for rank in (0, 2, 4, 5)]
                            + [("replica", 4), ("replica", 5)])
    assert len(empty) + len(remove) + len(share(3)[0]) == len(dirs)
