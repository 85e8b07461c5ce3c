"""``tools/bench/elastic.py``: the failure-sequence model of continuing on fewer nodes vs waiting for a spare."""

from __future__ import annotations

import json

import pytest

from tools.bench.elastic import failure_sequence, main, simulate

KW = dict(nodes=8, hours=6.0, iter_time_s=1.0, samples_per_iter=100, restart_s=60.0, reshape_s=60.0)


def test_no_failure_trains_at_the_full_rate_under_both_policies():
    ideal = 100 * 3600.0
    for policy in ("elastic", "spare"):
        assert simulate(policy, [], **KW) == pytest.approx([ideal] * 6)


def test_one_failure_by_hand():
    events = [(1.0, "fail", 3), (1.5, "join", 3)]  # replacement after 30 min
    full = 100 * 3600.0
    elastic = simulate("elastic", events, **KW)
    spare = simulate("spare", events, **KW)
    # elastic: 1 min reshape, 29 min at 7/8, 1 min reshape, then full again
    assert elastic[1] == pytest.approx(full * (29 / 60 * 7 / 8 + 29 / 60))
    # spare: nothing from 1.0 until the replacement at 1.5 plus a 1-minute restart
    assert spare[1] == pytest.approx(full * 29 / 60)
    assert elastic[0] == spare[0] == pytest.approx(full) and elastic[2:] == spare[2:]


def test_sequence_is_seeded_and_replacements_follow_failures():
    a = failure_sequence(8, 24, 6, 0.5, seed=1)
    assert a == failure_sequence(8, 24, 6, 0.5, seed=1) and a != failure_sequence(8, 24, 6, 0.5, seed=2)
    fails = {(round(t + 0.5, 9), n) for t, kind, n in a if kind == "fail"}
    joins = {(round(t, 9), n) for t, kind, n in a if kind == "join"}
    assert joins <= fails


def test_elastic_wins_when_spares_are_slow(capsys):
    main(["--nodes", "8", "--hours", "24", "--mtbf-hours", "6", "--spare-delay-min", "120", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["elastic_over_spare"] > 2 and out["total"]["elastic"] > out["total"]["spare"]
