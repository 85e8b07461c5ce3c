"""The sending chunk of each p2p send of Megatron-Core's interleaved schedule (moe_ft/localized/vstages.py),
checked against Megatron-Core's own schedule table."""

from __future__ import annotations

import pytest
from megatron.core.pipeline_parallel.schedules import get_schedule_table

from moe_ft.localized.vstages import BWD, FWD, sending_chunk, sending_vstage


def _chunks_from_table(m: int, c: int, g: int, pp: int, rank: int, direction: str) -> list[int]:
    """Chunks of the non-empty sends, in order, read off Megatron's table (forward k: table[k]; backward k:
    C-1-table[k]); the last chunk of the last rank sends no activation, the first of the first no gradient."""
    table = [chunk for _, chunk in get_schedule_table(m, c, g)]
    if direction == FWD:
        return [ch for ch in table if not (rank == pp - 1 and ch == c - 1)]
    return [c - 1 - ch for ch in table if not (rank == 0 and c - 1 - ch == 0)]


@pytest.mark.parametrize("pp,c,m", [(2, 2, 2), (2, 2, 4), (2, 2, 8), (4, 2, 8), (2, 3, 6), (4, 3, 4)])
@pytest.mark.parametrize("direction", [FWD, BWD])
def test_sending_chunk_matches_megatron_schedule_table(pp, c, m, direction):
    for rank in range(pp):
        expected = _chunks_from_table(m, c, pp, pp, rank, direction)
        got = [sending_chunk(pp_rank=rank, pp_size=pp, num_chunks=c, group_size=pp, direction=direction,
                             send_idx=i) for i in range(len(expected))]
        assert got == expected, (rank, direction)


def test_vstage_numbering_and_errors():
    # PP=2, 2 chunks: rank 1's forward sends come from chunk 0 only (chunk 1 is the model's last) -> vstage 1
    assert {sending_vstage(pp_rank=1, pp_size=2, num_chunks=2, group_size=2, direction=FWD, send_idx=i)
            for i in range(4)} == {1}
    assert [sending_vstage(pp_rank=0, pp_size=2, num_chunks=2, group_size=2, direction=FWD, send_idx=i)
            for i in range(4)] == [0, 0, 2, 2]
    with pytest.raises(ValueError, match="direction"):
        sending_chunk(pp_rank=0, pp_size=2, num_chunks=2, group_size=2, direction="up", send_idx=0)
    with pytest.raises(ValueError, match="no fwd sends"):
        sending_chunk(pp_rank=1, pp_size=2, num_chunks=1, group_size=2, direction=FWD, send_idx=0)


def test_replay_checks_the_virtual_stage_of_each_logged_send():
    """A log-fed receive whose logged virtual stage is not the one the replayed schedule runs there fails
    with the fix named; the right one is served."""
    from types import SimpleNamespace

    import torch

    from moe_ft.localized.collective_log import CollectiveSeam
    from moe_ft.localized.log_replay import LogFeed, LogReplay, LogSeams
    from moe_ft.localized.log_store import LogUnavailable
    from moe_ft.localized.upstream_log import P2PSeam

    act = torch.randn(4, 2, 8)
    cfg = SimpleNamespace(pipeline_dtype=torch.float32, use_ring_exchange_p2p=False, batch_p2p_comm=True,
                          microbatch_group_size_per_vp_stage=2)
    # rank 0 = pipeline rank 0 of PP=2 with 2 chunks; its prev is pipeline rank 1 (global rank 2), whose first
    # activation send comes from its chunk 0 = virtual stage 1
    comm = SimpleNamespace(prev_rank=2, next_rank=2, config=cfg, virtual_pipeline_model_parallel_size=2,
                           pp_group=SimpleNamespace(rank=lambda: 0, size=lambda: 2))

    def real(**kw):
        raise AssertionError(f"no real p2p: {kw}")

    for logged, ok in ((1, True), (3, False)):
        feed = LogFeed(sends={(7, 2, FWD, 0): [(logged, act)]})
        with LogReplay(LogSeams(P2PSeam(), CollectiveSeam({0: 0, 2: 2})), feed, replaying=[0], rank=0) as replay:
            replay.current = 7
            kwargs = dict(tensor_send_next=None, tensor_send_prev=None, recv_prev=True, recv_next=False,
                          tensor_shape=(4, 2, 8))
            if ok:
                assert torch.equal(replay.communicate(comm, real, **kwargs)[0].detach(), act)
            else:
                with pytest.raises(LogUnavailable, match="virtual stage 3, the replayed schedule expects virtual "
                                                         "stage 1"):
                    replay.communicate(comm, real, **kwargs)
