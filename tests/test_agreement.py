"""The recovery agreement (``moe_ft/recovery/agreement.py``) over real gloo ranks: every rank ends on the same
point, and ranks that hold the same operator restore it from the same iteration."""

from __future__ import annotations

import json

import pytest
import torch

from moe_ft.state.operators import Level, OperatorId

E0, D0 = OperatorId.expert_op(0, 0), OperatorId.dense(0)


def _replica(skip: int | None):
    """A data-parallel replica's store of a lossy policy (the dense operator FULL every iteration, the expert at
    1 and 3); ``skip``: a point this rank never published (its store was full then)."""
    from moe_ft.store import MemoryBackend, SnapshotStore

    store = SnapshotStore(MemoryBackend())
    for it in (1, 2, 3, 4):
        if it == skip:
            continue
        with store.begin(it) as point:
            point.put(D0, Level.FULL, {"w": torch.full((4,), float(it))})
            if it in (1, 3):
                point.put(E0, Level.FULL, {"w": torch.full((4,), float(it))})
            point.put_meta({"iteration": it})
            point.publish()
    return store


def _worker(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from moe_ft.recovery.agreement import agree_on_point
    from moe_ft.store import NewestFullRule

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        store = _replica(skip=3 if rank == 1 else None)
        rule = NewestFullRule(operators=frozenset([E0, D0]))
        point, proposals = agree_on_point(
            lambda bound: store.newest_recoverable(rule, at_or_before=bound, verify=True))
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump({"end": point.end, "full_at": {str(op): it for op, it in point.full_at.items()},
                       "proposals": proposals}, f)
        dist.barrier()  # neither rank tears the group down while the other still uses it
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_replicas_never_restore_one_operator_from_different_iterations(tmp_path):
    """Rank 1 never published point 3 (its store was full), which holds the expert's FULL entry: at the points
    after it rank 0 would restore the expert from 3 and rank 1 from 1, and their weights would differ. The
    agreement goes back to the newest point where both restore each operator from the same iteration."""
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(f"file://{tmp_path}/rendezvous", str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1]
    assert results[0]["end"] == 2 and results[0]["full_at"] == {"dense.L0": 2, "expert.L0.E0": 1}
    assert results[0]["proposals"] == [4, 2, 2]  # 4 refused; then 3 on rank 0 and 2 on rank 1, then 2 on both
