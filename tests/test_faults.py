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
    assert Fault.parse("0:7:persist:node") == Fault(0, 7, "persist", "node")
    for bad in ("1", "a:2", "1:2:nowhere", "1:2:forward:melt", "-1:2", "1:2:published:node"):
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


AGENT = """
import os, subprocess, sys, time
# a stand-in for a torchrun agent: two workers in sessions of their own (as torchrun starts them)
env = dict(os.environ, TORCHELASTIC_RUN_ID="drill")
worker = ("import sys, time; from moe_ft.faults import FaultPlan, Fault; rank = int(sys.argv[1]); "
          "time.sleep(0.5 * (rank == 1)); "
          "FaultPlan([Fault(1, 4, 'step', 'node')], sys.argv[2]).check(rank, 4, 'step'); time.sleep(60)")
procs = [subprocess.Popen([sys.executable, "-c", worker, str(r), sys.argv[1]], env=env, start_new_session=True)
         for r in range(2)]
with open(sys.argv[2], "w") as f:
    f.write(" ".join(str(p.pid) for p in procs))
for p in procs:
    p.wait()
sys.exit(3)  # not reached: the node fault kills this process first
"""


def test_node_kills_agent_and_every_worker(tmp_path):
    """Kind ``node``: the worker kills its agent (the parent), its sibling workers and itself."""
    import psutil

    pids = tmp_path / "pids"
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(tmp_path / "markers"), str(pids)],
                             cwd=os.path.dirname(os.path.dirname(__file__)))
    assert agent.wait(timeout=30) == -9
    for pid in map(int, pids.read_text().split()):
        try:
            status = psutil.Process(pid).status()
        except psutil.NoSuchProcess:
            continue
        # reparented to init (or a subreaper) once the agent died: dead, possibly not yet reaped
        assert status == psutil.STATUS_ZOMBIE, (pid, status)
    assert FaultPlan([Fault(1, 4, "step", "node")], tmp_path / "markers").fired() == [Fault(1, 4, "step", "node")]


def test_node_outside_torchrun_kills_only_itself(tmp_path):
    code = ("from moe_ft.faults import FaultPlan, Fault; import sys; "
            f"FaultPlan([Fault(0, 1, 'forward', 'node')], {str(tmp_path)!r}).check(0, 1, 'forward'); sys.exit(0)")
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    res = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)), env=env,
                         timeout=30)
    assert res.returncode == -9  # and this test process (its parent) is still here
