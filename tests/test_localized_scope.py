"""The recovery scope (``moe_ft/localized/scope.py``): who replays, who loads, and when it falls back to the
global replay (MoEvement §3.4, App. A)."""

from __future__ import annotations

from moe_ft.localized.scope import RankReport, components_of, decide_scope


def pipeline(num_stages=4, *, survivor=9, window=(6, 8), logged=(3, 9), ep=1, **per_rank):
    """Reports of one pipeline of ``num_stages`` stages x ``ep`` ranks per stage (rank = stage * ep + e);
    ``per_rank``: ``r<rank>=dict(...)`` overrides."""
    out = []
    for stage in range(num_stages):
        for e in range(ep):
            rank = stage * ep + e
            pp_ranks = tuple(s * ep + e for s in range(num_stages))
            fields = {**dict(survivor=survivor, window=window, logged=logged), **per_rank.get(f"r{rank}", {})}
            out.append(RankReport(rank=rank, pp_rank=stage, pp_ranks=pp_ranks, **fields))
    return out


def test_one_failed_stage_replays_and_the_rest_load():
    s = decide_scope(pipeline(r2=dict(survivor=-1, survivor_why_not="it published no survivor point")))
    assert s.mode == "localized" and s.target == 9
    assert s.failed == [2] and s.replaying == [2] and s.loading == [0, 1, 3]
    assert s.failed_stages == [2] and s.components == [[2]] and s.replay_from == 7
    assert "rank 2: it published no survivor point" in s.reason


def test_the_whole_stage_group_replays_with_expert_parallelism():
    s = decide_scope(pipeline(2, ep=2, r3=dict(survivor=-1)))  # stage 1 = ranks 2, 3
    assert s.mode == "localized" and s.failed == [3] and s.replaying == [2, 3] and s.loading == [0, 1]


def test_adjacent_stages_recover_jointly_non_adjacent_independently():
    s = decide_scope(pipeline(4, r1=dict(survivor=-1), r2=dict(survivor=-1)))
    assert s.mode == "localized" and s.replaying == [1, 2] and s.components == [[1, 2]]
    s = decide_scope(pipeline(5, r1=dict(survivor=-1), r3=dict(survivor=-1)))
    assert s.mode == "localized" and s.components == [[1], [3]] and s.loading == [0, 2, 4]


def test_a_survivor_point_older_than_the_target_counts_as_failed():
    s = decide_scope(pipeline(r0=dict(survivor=8)))
    assert s.mode == "localized" and s.failed == [0] and s.replaying == [0]
    assert "older than the job's newest completed 9" in s.why_failed[0]


def test_everyone_survived_loads_without_replay():
    s = decide_scope(pipeline())
    assert s.mode == "localized" and s.replaying == [] and s.loading == [0, 1, 2, 3]


def test_global_fallbacks_name_the_reason():
    assert decide_scope(pipeline(), requested="global").reason == "--ft-recovery-scope global"
    assert "no pipeline parallelism" in decide_scope(pipeline(1, r0=dict(survivor=-1))).reason
    s = decide_scope(pipeline(survivor=-1))
    assert s.mode == "global" and "no rank published a survivor point" in s.reason
    s = decide_scope(pipeline(2, r0=dict(survivor=-1), r1=dict(survivor=-1, survivor_why_not="corrupt")))
    assert s.mode == "global" and "no rank published" in s.reason
    s = decide_scope(pipeline(2, ep=2, r0=dict(survivor=-1), r3=dict(survivor=8)))  # a rank of each stage
    assert s.mode == "global" and "every pipeline stage lost a rank" in s.reason and s.failed == [0, 3]
    s = decide_scope(pipeline(r2=dict(survivor=-1, window=None)))
    assert s.mode == "global" and "replaying rank(s) [2] have no recovery point" in s.reason


def test_logs_must_cover_the_replay_at_both_boundaries():
    ok = decide_scope(pipeline(r2=dict(survivor=-1), r1=dict(logged=(7, 9)), r3=dict(logged=(7, 9))))
    assert ok.mode == "localized"
    s = decide_scope(pipeline(r2=dict(survivor=-1), r3=dict(logged=(8, 9))))
    assert s.mode == "global" and "rank 3 (stage 3) logged [8, 9] but replaying stage 2 needs iterations [7, 9]" in s.reason
    s = decide_scope(pipeline(r2=dict(survivor=-1), r1=dict(logged=None)))
    assert s.mode == "global" and "rank 1 (stage 1) logged nothing" in s.reason
    # stage 0 has no upstream neighbour; stage 1 replays jointly with it: only stage 2's log matters
    s = decide_scope(pipeline(r0=dict(survivor=-1), r1=dict(survivor=-1, logged=None), r3=dict(logged=None)))
    assert s.mode == "localized" and s.components == [[0, 1]]


def test_components_of():
    assert components_of([]) == []
    assert components_of([3, 1, 2, 5]) == [[1, 2, 3], [5]]


def test_logged_range_is_the_gap_free_tail():
    from moe_ft.recovery.localized import _contiguous_tail

    assert _contiguous_tail([]) is None
    assert _contiguous_tail([5, 3, 4]) == (3, 5)
    assert _contiguous_tail([1, 2, 4, 5, 6]) == (4, 6)  # a gap: only the newest run can feed a replay to the end
