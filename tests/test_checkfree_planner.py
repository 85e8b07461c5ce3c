"""The recovery planner (``moe_ft/recovery/planner.py``): the decision, the per-operator sources and levels,
the minimum level and the audit log. Pure functions, no process group."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from moe_ft.recovery.planner import (
    LEVELS,
    MIN_LEVEL_CHOICES,
    SOURCE_LEVEL,
    RankInventory,
    RecoveryRefused,
    append_audit,
    check_min_level,
    checkfree_sources,
    decide,
    operator_sources,
    replay_source,
    summarize,
)
from moe_ft.state.operators import OperatorId


def pipelines(num_stages: int, num_pipelines: int = 1, lost=(), end: int = 5) -> list[RankInventory]:
    """Ranks of ``num_pipelines`` pipelines (Megatron's order: pipeline stage outermost)."""
    out = []
    for r in range(num_stages * num_pipelines):
        stage, pipe = divmod(r, num_pipelines)
        ranks = tuple(s * num_pipelines + pipe for s in range(num_stages))
        out.append(RankInventory(rank=r, pp_rank=stage, pp_ranks=ranks, memory_end=-1 if r in lost else end))
    return out


def test_decide_prefers_exact_then_durable_then_checkpoint_then_checkfree():
    assert decide(pipelines(4), durable_end=None, load_iteration=0, lossy=False).path == "memory"
    plan = decide(pipelines(4), durable_end=None, load_iteration=0, lossy=True)
    assert (plan.path, plan.level) == ("memory", "lossy")
    plan = decide(pipelines(4, lost=[1]), durable_end=7, load_iteration=0, lossy=False)
    assert (plan.path, plan.level, plan.lost_ranks) == ("durable", "durable", [1])
    plan = decide(pipelines(4, lost=[1]), durable_end=None, load_iteration=20, lossy=False)
    assert (plan.path, plan.level) == ("checkpoint", "durable")
    plan = decide(pipelines(4, lost=[1]), durable_end=None, load_iteration=0, lossy=False)
    assert (plan.path, plan.level, plan.rebuilt) == ("checkfree", "approximate", {1: (0, 2)})
    assert "stage(s) [1]" in plan.reason


def test_checkfree_only_for_intermediate_non_consecutive_stages():
    for lost, why in (([0], "intermediate stages only"), ([3], "intermediate stages only"),
                      ([1, 2], "no two consecutive stages")):
        plan = decide(pipelines(4, lost=lost), durable_end=None, load_iteration=0, lossy=False)
        assert (plan.path, plan.level) == ("start_over", "start_over") and why in plan.reason, plan.reason
    # two pipelines (DP 2): ranks 2 and 3 are stage 1 of pipelines 0 and 1, each rebuilt from its own neighbours
    rebuilt, why = checkfree_sources(pipelines(4, num_pipelines=2, lost=[2, 3]))
    assert rebuilt == {2: (0, 4), 3: (1, 5)} and why == ""
    rebuilt, _ = checkfree_sources(pipelines(5, lost=[1, 3]))  # non-consecutive: both
    assert rebuilt == {1: (0, 2), 3: (2, 4)}


def test_no_checkfree_with_virtual_pipeline_stages():
    """CheckFree rebuilds one model chunk per rank: with virtual stages the plan starts over (with its reason)
    instead of choosing a rebuild that raises once it runs."""
    plan = decide(pipelines(4, lost=[1]), durable_end=None, load_iteration=0, lossy=False, model_chunks=2)
    assert (plan.path, plan.level) == ("start_over", "start_over")
    assert "CheckFree rebuilds one model chunk per rank and this job has 2 (virtual pipeline stages)" in plan.reason


def test_checkfree_plus_rebuilds_first_and_last_stage_from_the_swap_partner():
    plan = decide(pipelines(4, lost=[0]), durable_end=None, load_iteration=0, lossy=False, checkfree_plus=True)
    assert (plan.path, plan.level, plan.rebuilt) == ("checkfree", "approximate", {0: (1,)})
    rebuilt, why = checkfree_sources(pipelines(4, lost=[3]), plus=True)
    assert rebuilt == {3: (2,)} and why == ""
    # the swapped intermediate stages copy their partner too; a stage between the pairs is averaged
    rebuilt, _ = checkfree_sources(pipelines(6, lost=[1, 3]), plus=True)
    assert rebuilt == {1: (0,), 3: (2, 4)}
    rebuilt, _ = checkfree_sources(pipelines(4, num_pipelines=2, lost=[0, 7]), plus=True)  # DP 2: own pipeline
    assert rebuilt == {0: (2,), 7: (5,)}
    plan = decide(pipelines(4, lost=[0, 1]), durable_end=None, load_iteration=0, lossy=False, checkfree_plus=True)
    assert plan.path == "start_over" and "swap partner (stage 1) lost their state together" in plan.reason
    plan = decide(pipelines(4, lost=[0]), durable_end=None, load_iteration=0, lossy=False)  # without the flag
    assert plan.path == "start_over" and "--ft-checkfree-plus" in plan.reason


def test_min_level_refuses_with_one_line():
    check_min_level("approximate", "approximate", "why")
    check_min_level("start_over", "none", "why")
    check_min_level("exact", "exact", "why")
    with pytest.raises(RecoveryRefused) as exc:
        check_min_level("approximate", "exact", "stage 1 lost")
    msg = str(exc.value)
    assert "\n" not in msg and "best available recovery is approximate (stage 1 lost)" in msg
    assert "--ft-min-recovery-level is exact" in msg
    with pytest.raises(RecoveryRefused):
        check_min_level("durable", "exact", "older point")
    with pytest.raises(ValueError, match="must be one of"):
        check_min_level("exact", "perfect", "")
    assert set(MIN_LEVEL_CHOICES) - {"none"} < set(LEVELS) and set(SOURCE_LEVEL.values()) <= set(LEVELS)


def test_flag_choices_match_the_planner():
    from moe_ft.config import FTConfig

    for level in MIN_LEVEL_CHOICES:
        assert FTConfig.from_flags(ft=True, ft_min_recovery_level=level).recovery.min_recovery_level == level
    assert FTConfig.from_flags(ft=True).recovery.min_recovery_level == "none"  # the default accepts everything
    with pytest.raises(ValueError, match="--ft-min-recovery-level"):
        FTConfig.from_flags(ft=True, ft_min_recovery_level="perfect")


@dataclass
class Point:
    start: int
    end: int
    full_at: dict = field(default_factory=dict)


OPS = [OperatorId.embedding(), OperatorId.dense(0), OperatorId.expert_op(0, 1)]


def test_operator_sources():
    window = Point(3, 5, {OPS[0]: 5, OPS[1]: 4, OPS[2]: 3})
    src = lambda **kw: operator_sources(OPS, **{"path": "memory", "point": window, "rebuilt_here": False,  # noqa: E731
                                                "fetched_here": False, "lossy": False, "resumed_from": "memory", **kw})
    assert set(src().values()) == {"window_replay"}
    assert set(src(point=Point(5, 5, {op: 5 for op in OPS})).values()) == {"local_point"}
    assert set(src(fetched_here=True).values()) == {"peer_replica"}
    assert set(src(resumed_from="durable").values()) == {"durable_point"}
    assert src(lossy=True) == {"embedding": "local_point", "dense.L0": "lossy", "expert.L0.E1": "lossy"}
    # CheckFree path: the rebuilt rank's operators, and the survivors' that trained during the replay next to it
    assert set(src(path="checkfree", rebuilt_here=True).values()) == {"checkfree"}
    assert src(path="checkfree") == {"embedding": "window_replay", "dense.L0": "replay_beside_rebuilt",
                                     "expert.L0.E1": "replay_beside_rebuilt"}
    assert set(src(point=None, resumed_from="checkpoint").values()) == {"checkpoint"}
    assert set(src(point=None, resumed_from="initial").values()) == {"start_over"}


def test_a_replay_without_determinism_is_not_reported_exact():
    """``--no-deterministic``: the operators a replay computed (FULL entry older than the point's end) reach
    ``nondeterministic``, below ``exact`` and above ``durable``; what was restored bitwise keeps its source."""
    window = Point(3, 5, {OPS[0]: 5, OPS[1]: 4, OPS[2]: 3})
    src = lambda **kw: operator_sources(OPS, **{"path": "memory", "point": window, "rebuilt_here": False,  # noqa: E731
                                                "fetched_here": False, "lossy": False, "resumed_from": "memory",
                                                "deterministic": False, **kw})
    replayed = {"embedding": "window_replay", "dense.L0": "nondeterministic_replay",
                "expert.L0.E1": "nondeterministic_replay"}
    assert src() == replayed
    assert src(fetched_here=True) == {**replayed, "embedding": "peer_replica"}
    assert set(src(point=Point(5, 5, {op: 5 for op in OPS})).values()) == {"local_point"}
    assert set(src(resumed_from="durable").values()) == {"durable_point"}
    assert src(lossy=True) == {"embedding": "local_point", "dense.L0": "lossy", "expert.L0.E1": "lossy"}
    assert src(path="checkfree")["dense.L0"] == "replay_beside_rebuilt"
    levels = summarize([src()])
    assert levels["level"] == "nondeterministic"
    assert LEVELS.index("durable") < LEVELS.index("nondeterministic") < LEVELS.index("exact")
    check_min_level("nondeterministic", "nondeterministic", "why")
    check_min_level("nondeterministic", "durable", "why")
    with pytest.raises(RecoveryRefused, match="best available recovery is nondeterministic"):
        check_min_level("nondeterministic", "exact", "why")
    with pytest.raises(RecoveryRefused):
        check_min_level("durable", "nondeterministic", "why")
    # the localized scope: a replaying rank's operators
    assert replay_source(True) == "window_replay" and replay_source(False) == "nondeterministic_replay"


def test_summary_keeps_each_operators_worst_source_and_the_job_level():
    s = summarize([{"embedding": "window_replay", "dense.L0": "window_replay"},
                   {"dense.L1": "checkfree", "expert.L1.E0": "checkfree"},
                   {"dense.L0": "peer_replica", "dense.L2": "replay_beside_rebuilt"}])
    assert s["level"] == "approximate"
    assert s["sources"] == {"checkfree": 2, "replay_beside_rebuilt": 1, "window_replay": 2}
    assert s["operators"]["dense.L0"] == "window_replay" and s["operators"]["dense.L1"] == "checkfree"
    assert summarize([{"embedding": "durable_point"}])["level"] == "durable"
    assert summarize([{"embedding": "start_over"}, {"x": "lossy"}])["level"] == "start_over"


def test_audit_log_appends(tmp_path):
    path = str(tmp_path / "job" / "recovery_audit.jsonl")
    append_audit(path, {"restart_count": 1, "level": "exact"})
    append_audit(path, {"restart_count": 2, "refused": "moe-ft recovery refused: …"})
    lines = [json.loads(line) for line in open(path).read().splitlines()]
    assert [r["restart_count"] for r in lines] == [1, 2] and all("time" in r for r in lines)
    assert lines[0]["level"] == "exact" and lines[1]["refused"].startswith("moe-ft recovery refused")
