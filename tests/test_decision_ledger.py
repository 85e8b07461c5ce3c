"""The record of failed recovery decisions (``moe_ft/recovery/ledger.py``): what a rank records survives
the process, a torn record counts as none, the ranks' records merge, and the bound they put on a global
recovery is below every failed point."""

from __future__ import annotations

import json

from moe_ft.recovery.ledger import GLOBAL, LOCALIZED, Avoided, DecisionLedger


def test_record_load_clear(tmp_path):
    ledger = DecisionLedger(str(tmp_path), rank=2)
    assert not ledger.load() and ledger.load().below is None
    ledger.record(GLOBAL, 8, "RuntimeError: replay diverged at iteration 8")
    ledger.record(LOCALIZED, 9, "ValueError: entry does not match")
    again = DecisionLedger(str(tmp_path), rank=2).load()  # another process reads what this one wrote
    assert again.global_points == {8: "RuntimeError: replay diverged at iteration 8"}
    assert again.localized == {9: "ValueError: entry does not match"} and again.below == 7
    ledger.clear()
    assert not ledger.load()
    ledger.clear()  # nothing to clear: no error


def test_a_torn_record_counts_as_none(tmp_path):
    ledger = DecisionLedger(str(tmp_path), rank=0)
    ledger.record(GLOBAL, 5, "x")
    with open(ledger.path, "w") as f:
        f.write('{"global": {"5"')
    assert not ledger.load()


def test_ranks_merge_and_the_bound_is_below_every_failed_point():
    a = Avoided(localized={9: "a"}, global_points={8: "a"})
    b = Avoided.from_json(json.loads(json.dumps(Avoided(global_points={5: "b"}).to_json())))
    merged = a.merge(b)
    assert merged.localized == {9: "a"} and merged.global_points == {8: "a", 5: "b"} and merged.below == 4
    assert merged.to_json() == {"localized": {"9": "a"}, "global": {"5": "b", "8": "a"}}
