"""The snapshot copy in pieces (moe_ft/snapshot/pacing.py): how a copy is cut, and the pieces issued with a pause
between each two. The pause itself is a device-side sleep on a GPU (tests/gpu/test_gpu_mapped.py times what
it is for); here a recorded stand-in."""

from __future__ import annotations

import random

import pytest
import torch

from moe_ft.snapshot import EngineConfig
from moe_ft.snapshot.config import SnapshotConfig
from moe_ft.snapshot.pacing import CopyPacer, plan_pieces


@pytest.mark.parametrize("seed", range(20))
def test_pieces_cover_every_byte_once_in_order_and_are_full_but_the_last(seed):
    rng = random.Random(seed)
    sizes = tuple(rng.choice([0, 1, 3, 4, 17, 64, 1000, 4096, 10_000]) for _ in range(rng.randint(1, 30)))
    piece = rng.choice([1, 7, 64, 1000, 5000, 1 << 20])
    pieces = plan_pieces(sizes, piece)
    slices = [s for p in pieces for s in p]
    want = [(i, a) for i, n in enumerate(sizes) for a in range(n)]
    got = [(i, a) for i, lo, hi in slices for a in range(lo, hi)]
    assert got == want  # every byte once, in order; empty tensors are left out
    assert all(lo < hi for _, lo, hi in slices)
    totals = [sum(hi - lo for _, lo, hi in p) for p in pieces]
    assert all(t == piece for t in totals[:-1]) and 0 < totals[-1] <= piece if pieces else sum(sizes) == 0
    assert len(pieces) == -(-sum(sizes) // piece)


def test_bad_piece_sizes_and_unequal_copies_are_refused():
    with pytest.raises(ValueError, match="piece_bytes must be >= 1"):
        plan_pieces((4,), 0)
    with pytest.raises(ValueError, match="piece_bytes must be >= 1"):
        CopyPacer(0, pause=lambda us: None)
    with pytest.raises(ValueError, match="gap_us must be > 0"):
        CopyPacer(8, gap_us=0, pause=lambda us: None)
    with pytest.raises(ValueError, match="equal sizes"):
        CopyPacer(8, pause=lambda us: None).copy([torch.zeros(4, dtype=torch.uint8)], [torch.zeros(5, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="copy_piece_bytes must be >= 0"):
        EngineConfig(copy_piece_bytes=-1)
    with pytest.raises(ValueError, match="snapshot-copy-piece-mb"):
        SnapshotConfig(snapshot_copy_piece_mb=-1)


def test_a_paced_copy_copies_every_byte_with_a_pause_between_pieces(monkeypatch):
    g = torch.Generator().manual_seed(0)
    src = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in (5, 0, 3000, 17, 1024)]
    dst = [torch.zeros_like(s) for s in src]
    events: list = []
    pacer = CopyPacer(1024, gap_us=3.5, pause=lambda us: events.append(("pause", us)))
    real_copy = torch._foreach_copy_

    def spy(d, s, non_blocking=False):
        events.append(("copy", sum(t.numel() for t in s)))
        return real_copy(d, s, non_blocking=non_blocking)

    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    pacer.copy(dst, src)
    assert all(torch.equal(d, s) for d, s in zip(dst, src))
    assert events == [("copy", 1024), ("pause", 3.5), ("copy", 1024), ("pause", 3.5), ("copy", 1024),
                      ("pause", 3.5), ("copy", 4046 - 3072)] and pacer.pieces == 4


def test_a_cpu_engine_says_the_copy_is_not_paced(tmp_path, capsys):
    """Only the GPU copy into the store's regions is paced: a CPU engine asked for pieces says so, in one line."""
    from moe_ft.snapshot import SnapshotEngine
    from moe_ft.state.operators import OperatorId
    from moe_ft.state.registry import OperatorRegistry, OperatorState
    from moe_ft.store import KeepAll, StoreConfig

    op = OperatorId.dense(0)
    registry = OperatorRegistry({op: OperatorState(op=op, compute={"w": torch.ones(4)}, optim={})}, pp_rank=0, ep_rank=0)
    store = StoreConfig(root=str(tmp_path), job_id="j", rank=0).build(retention=KeepAll())
    engine = SnapshotEngine(EngineConfig(copy_piece_bytes=1 << 20), registry, store)
    try:
        assert engine.mapped is None
        assert "the copy is not paced (--ft-snapshot-copy-piece-mb)" in capsys.readouterr().err
    finally:
        engine.close()
