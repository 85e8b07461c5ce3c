"""Fault plan: parsing, keying by (rank, iteration, phase), once-only across restarts, seeded plans."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moe_ft.faults import Fault, FaultPlan, InjectedFault

pytestmark = pytest.mark.timeout(60)


def test_parse_and_validate():
    assert Fault.parse("1:6") == Fault(1, 6, "forward", "exit")
    assert Fault.parse("2:5:snapshot:hang") == Fault(2, 5, "snapshot", "hang")
    for bad in ("1", "a:2", "1:2:nowhere", "1:2:forward:melt", "-1:2"):
        with pytest.raises(ValueError):
            Fault.parse(bad)


def test_fires_only_at_its_key_and_only_once(tmp_path):
    plan = FaultPlan([Fault(1, 3, "backward", "exception")], tmp_path)
    plan.check(0, 3, "backward")  # other rank
    plan.check(1, 2, "backward")  # other iteration
    plan.check(1, 3, "forward")   # other phase
    with pytest.raises(InjectedFault):
        plan.check(1, 3, "backward")
    assert plan.fired() == [Fault(1, 3, "backward", "exception")]
    again = FaultPlan([Fault(1, 3, "backward", "exception")], tmp_path)  # the restarted process
    again.check(1, 3, "backward")  # marker on disk: does not fire again


def test_exit_kills_the_process_with_sigkill(tmp_path):
    code = ("from moe_ft.faults import FaultPlan, Fault; import sys; "
            f"FaultPlan([Fault(0, 1, 'step', 'exit')], {str(tmp_path)!r}).check(0, 1, 'step'); sys.exit(0)")
    res = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)), timeout=30)
    assert res.returncode == -9
    res = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)), timeout=30)
    assert res.returncode == 0  # fired before: the restart passes


def test_seeded_plan_is_deterministic(tmp_path):
    a = FaultPlan.seeded(7, num_ranks=4, iterations=range(2, 20), count=3, marker_dir=tmp_path)
    b = FaultPlan.seeded(7, num_ranks=4, iterations=range(2, 20), count=3, marker_dir=tmp_path)
    c = FaultPlan.seeded(8, num_ranks=4, iterations=range(2, 20), count=3, marker_dir=tmp_path)
    assert a.faults == b.faults and a.faults != c.faults
    assert len({f.iteration for f in a.faults}) == 3
