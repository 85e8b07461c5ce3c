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

import json
import os

import pytest
import torch
import torch.distributed as dist

from moe_ft.checkfree.config import CheckFreeConfig
from moe_ft.checkfree.recovery import read_copies
from moe_ft.elastic.inventory import (
    REPLICA_SUBDIR,
    LayoutRecord,
    StoreDir,
    node_inventory,
    old_generation_share,
    store_dirs,
    write_record,
)
from moe_ft.elastic.restart import decide, ranks_behind, required_operators
from moe_ft.elastic.restore import discard_if_behind, discard_node_points, old_copy_dirs
from moe_ft.localized.component import log_root
from moe_ft.localized.survivor_points import SURVIVOR_SUBDIR
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


EMBEDDING = "embedding.word_embeddings.weight"


def test_a_world_change_drops_the_old_worlds_checkfree_copies(tmp_path):
    """CheckFree+ copies are named by holder rank and iteration. Old rank 0 of this node held the embedding copies
    of iterations 5-9; the new world (new rank 0 here) restored iteration 6 and copied 7 itself. Its owner lost
    between its snapshot of 8 and sending that copy, the rebuild asks rank 0 for the copy of 8: it must be
    missing (the rebuild is then refused, as in the same world), not the old world's abandoned iteration 8."""
    root, checkfree = tmp_path / "store", CheckFreeConfig(plus=True)
    for rank in (0, 5):  # old rank 5 ran here too; the new world has no rank 5
        old = checkfree.copy_store(str(root / JOB), rank)
        for it in range(5, 10):
            old.refresh("embedding", it, {EMBEDDING: torch.full((4, 2), float(it))})

    discard_node_points(str(root), JOB, rank=0, world_size=4)

    new = checkfree.copy_store(str(root / JOB), 0)
    new.refresh("embedding", 7, {EMBEDDING: torch.full((4, 2), -7.0)})
    assert read_copies(new, lost_stage=0, num_stages=4, iteration=7, rank=0)["copies"]["embedding"][EMBEDDING][0, 0] == -7
    assert "no embedding copy of iteration 8" in read_copies(new, lost_stage=0, num_stages=4, iteration=8,
                                                              rank=0)["missing"]
    assert not (root / JOB / "checkfree_copies" / "rank5").exists()


def test_each_old_copy_directory_is_one_ranks_job(tmp_path):
    """Each rank removes its own number's copies before it trains; the node's lowest rank those of numbers no
    rank here has."""
    for rank in range(5):
        (tmp_path / f"rank{rank}").mkdir()

    def share(rank):
        return [p.name for p in old_copy_dirs(tmp_path, rank=rank, ranks_here={1, 3})]

    assert share(3) == ["rank3"]
    assert share(1) == ["rank0", "rank1", "rank2", "rank4"]


def test_a_world_change_drops_the_upstream_logs_of_numbers_no_rank_here_has(tmp_path):
    """Old ranks 0 and 5 logged here; the new world has rank 0 here and no rank 5. Rank 5's logs are never written
    or pruned again: the sweep removes them; rank 0's own directory, open in its upstream logging, stays."""
    root = tmp_path / "store"
    for rank in (0, 5):
        (log_root(root / JOB, rank) / "7").mkdir(parents=True)

    discard_node_points(str(root), JOB, rank=0, world_size=4)

    assert (log_root(root / JOB, 0) / "7").is_dir()
    assert not log_root(root / JOB, 5).exists()
    assert [p.name for p in old_copy_dirs(tmp_path, rank=3, ranks_here={1, 3}, own=False)] == []


def _spare_worker(rank: int, init: str, base: str) -> None:
    """Node A (rank 0) ran generation 1 (world 3) to iteration 7; node B (rank 1) ran rank 2 of generation 0
    (world 4, to iteration 9), then waited as a spare through generation 1 and kept the survivor point of 9
    it spilled. Now they train together (world 2)."""
    from megatron.core import parallel_state as ps  # start-up time of the other tests' processes

    os.environ["LOCAL_WORLD_SIZE"] = "1"  # a node per rank
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    ps.initialize_model_parallel()
    try:
        root = f"{base}/node{rank}"
        ops = sorted(required_operators(1, 2), key=str)
        plans, loads = {0: [[1, 0], [0, 1]]}, {0: [1.0, 1.0]}
        if rank == 0:
            write_record(root, JOB, 0, LayoutRecord(1, 3, 1, 7, plans, loads))
            _publish_all(StoreConfig(root=root, job_id=JOB, rank=0).build(), [6, 7], ops)
        else:
            write_record(root, JOB, 2, LayoutRecord(0, 4, 1, 9, plans, loads))
            _publish_all(StoreConfig(root=f"{root}/{JOB}", job_id=SURVIVOR_SUBDIR, rank=2).build(), [9], ops)
        decision = decide(store_dir=root, job_id=JOB, num_layers=1, num_experts=2, ep_size=1, slots=2,
                          min_replicas=1, strategy="mro")
        discard_if_behind(decision, root, JOB, rank=rank, world_size=2)
        with open(f"{base}/rank{rank}.json", "w") as f:
            json.dump({"kind": decision.kind, "iteration": decision.iteration, "behind": decision.behind,
                       "points": sorted(node_inventory(root, JOB, prefer_rank=rank).full)}, f)
        dist.barrier()
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _publish_all(store, iterations, ops) -> None:
    for it in iterations:
        with store.begin(it) as point:
            for op in ops:
                point.put(op, Level.FULL, {"w": torch.full((4,), float(it))})
            point.put_meta({"iteration": it})
            point.publish()


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_former_spares_node_drops_the_older_generation_it_kept(tmp_path):
    """A node that waited as a spare through a generation runs no rank of it, so that world change did not sweep
    it. When it trains again, the decision neither counts its older generation's points nor lets the restore
    read them: before, it restored iteration 9 of generation 0 (a timeline generation 1 left when it restored
    an earlier point) instead of generation 1's 7, and node B offered it to every rank."""
    import torch.multiprocessing as mp  # start-up time: only the multi-process tests need it

    mp.spawn(_spare_worker, args=(f"file://{tmp_path}/rendezvous", str(tmp_path)), nprocs=2, join=True)
    node_a, node_b = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert (node_a["kind"], node_a["iteration"], node_a["behind"]) == ("reshape", 7, [1]), node_a
    assert node_a["points"] == [6, 7] and node_b["points"] == [], (node_a, node_b)


def test_a_node_is_behind_only_with_records_all_older():
    """A node without records holds nothing of the job (new, or a first start); one with a record of the newest
    generation trained in it."""
    def gathered(*generations):
        return [{"rank": r, "records": [{"generation": g} for g in gens]} for r, gens in enumerate(generations)]

    assert ranks_behind(gathered([2], [1], [], [1, 2]), 2) == [1]
    assert ranks_behind(gathered([0], [0]), 0) == []
