"""Recovery reports on disk: one file per recovery, never overwritten by another recovery that reports the
same torchrun restart count (a replacement node's agent counts from 0 again); a report written again (its
final version, after the replay) replaces its own file."""

from __future__ import annotations

import json

from moe_ft.recovery.report import RecoveryReport


def _report(resume: int) -> RecoveryReport:
    return RecoveryReport(policy="sparse", restart_count=1, failed={"last_completed": resume - 1},
                          recovery_point={"resume": resume})


def test_same_restart_count_gets_a_sequence_number(tmp_path):
    first, second = _report(5), _report(9)
    a = first.write(str(tmp_path))
    first.message = "final"
    assert first.write(str(tmp_path)) == a  # rewritten in place
    b = second.write(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recovery_001.json", "recovery_001_1.json"]
    assert json.loads(open(a).read())["message"] == "final"
    assert json.loads(open(b).read())["recovery_point"] == {"resume": 9}
