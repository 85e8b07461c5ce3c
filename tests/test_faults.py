"""Fault plan: parsing, keying by (rank, iteration, phase), once-only across restarts, seeded plans."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from _ft_helpers import wait_until

from moe_ft.drills.faults import Fault, FaultPlan, InjectedFault
from moe_ft.drills.processes import kill_tree

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
    code = ("from moe_ft.drills.faults import FaultPlan, Fault; import sys; "
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
import multiprocessing, os, subprocess, sys, time
# a stand-in for a torchrun agent: a named semaphore (as torchrun's spawn context makes, registered with a
# resource tracker it starts), two workers in sessions of their own (as torchrun starts them)
lock = multiprocessing.get_context("spawn").Lock()
with open(sys.argv[2] + ".sem", "w") as f:
    f.write(lock._semlock.name)
env = dict(os.environ, TORCHELASTIC_RUN_ID="drill")
worker = ("import sys, time; from moe_ft.drills.faults import FaultPlan, Fault; rank = int(sys.argv[1]); "
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


def _semaphore_file(name_file) -> Path:
    return Path("/dev/shm") / ("sem." + Path(name_file).read_text().lstrip("/"))


def test_node_kills_agent_and_every_worker(tmp_path):
    """Kind ``node``: the worker kills its agent (the parent), its sibling workers and itself, but not the
    agent's resource tracker, which removes the node's named semaphore from ``/dev/shm`` and exits."""
    pids = tmp_path / "pids"
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(tmp_path / "markers"), str(pids)],
                             cwd=os.path.dirname(os.path.dirname(__file__)))
    assert agent.wait(timeout=30) == -9

    def dead(pid: int) -> bool:  # reparented to init (or a subreaper) once the agent died: possibly unreaped
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    # SIGKILL is delivered asynchronously: a sibling may still be running for a moment after the agent is gone
    deadline = time.monotonic() + 10
    alive = list(map(int, pids.read_text().split()))
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if not dead(pid)]
        time.sleep(0.01)
    assert not alive, [(pid, psutil.Process(pid).status()) for pid in alive]
    assert FaultPlan([Fault(1, 4, "step", "node")], tmp_path / "markers").fired() == [Fault(1, 4, "step", "node")]
    semaphore = _semaphore_file(f"{pids}.sem")
    wait_until(lambda: not semaphore.exists(), timeout=10)


def test_kill_tree_leaves_the_resource_tracker_to_remove_the_semaphores(tmp_path):
    """The drill driver's ``kill_tree`` (a lost node's agent, a drill that timed out) spares the tracker too."""
    code = ("import multiprocessing, sys, time; lock = multiprocessing.get_context('spawn').Lock(); "
            "open(sys.argv[1], 'w').write(lock._semlock.name); time.sleep(60)")
    name_file = tmp_path / "sem"
    proc = subprocess.Popen([sys.executable, "-c", code, str(name_file)])
    wait_until(lambda: name_file.exists() and name_file.read_text(), timeout=30)
    semaphore = _semaphore_file(name_file)
    assert semaphore.exists()
    kill_tree(proc.pid)
    assert proc.wait(timeout=10) == -9
    wait_until(lambda: not semaphore.exists(), timeout=10)


def test_node_outside_torchrun_kills_only_itself(tmp_path):
    code = ("from moe_ft.drills.faults import FaultPlan, Fault; import sys; "
            f"FaultPlan([Fault(0, 1, 'forward', 'node')], {str(tmp_path)!r}).check(0, 1, 'forward'); sys.exit(0)")
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    res = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)), env=env,
                         timeout=30)
    assert res.returncode == -9  # and this test process (its parent) is still here


def test_node_loss_parse_and_one_fault_per_event():
    from moe_ft.drills.cluster import NodeLoss, check_losses, node_faults

    assert NodeLoss.parse("1:6") == NodeLoss(1, 6, "forward")
    assert NodeLoss.parse("0:7:persist") == NodeLoss(0, 7, "persist")
    for bad in ("1", "1:x", "1:2:nowhere", "1:2:published", "-1:3", "1:2:forward:node"):
        with pytest.raises(ValueError):
            NodeLoss.parse(bad)
    losses = [NodeLoss(1, 9), NodeLoss(0, 9), NodeLoss(1, 4, "snapshot")]
    # nodes lost at the same point: one node fault on the lowest node's first rank (the driver kills the rest)
    assert set(node_faults(losses, ranks_per_node=2)) == {Fault(2, 4, "snapshot", "node"), Fault(0, 9, "forward", "node")}
    with pytest.raises(ValueError, match="does not exist"):
        check_losses([NodeLoss(2, 3)], num_nodes=2)
    with pytest.raises(ValueError, match="twice"):
        check_losses([NodeLoss(1, 3), NodeLoss(1, 3)], num_nodes=2)


def test_node_flags_turn_on_the_durable_tier_when_every_node_is_lost(tmp_path):
    from moe_ft.cli.drill import node_flags
    from moe_ft.drills.cluster import NodeLoss

    one = node_flags(nodes=2, losses=[NodeLoss(1, 6)], faults=[], work=str(tmp_path), window=4)
    assert one == ["--ft-replicas", "1", "--ft-ranks-per-node", "2"]
    both = node_flags(nodes=2, losses=[NodeLoss(0, 9), NodeLoss(1, 9)], faults=[], work=str(tmp_path), window=4)
    assert both[4:] == ["--ft-persist-interval", "4", "--ft-persist-dir", str(tmp_path / "durable")]
    apart = node_flags(nodes=2, losses=[NodeLoss(0, 5), NodeLoss(1, 9)], faults=[], work=str(tmp_path), window=4)
    assert "--ft-persist-interval" not in apart  # never every node at once: a survivor holds the replicas
    with pytest.raises(ValueError, match="durable tier"):
        node_flags(nodes=2, losses=[NodeLoss(0, 9), NodeLoss(1, 9)], faults=[], work=str(tmp_path), window=4,
                   persist_interval=0)
    persist = node_flags(nodes=2, losses=[NodeLoss(1, 7, "persist")], faults=[], work=str(tmp_path), window=4)
    assert persist[-4:] == ["--save", str(tmp_path / "save"), "--save-interval", "4"]
    with pytest.raises(ValueError, match="multiple of --persist-interval"):  # 6 + 1 is not a multiple of 4
        node_flags(nodes=2, losses=[NodeLoss(1, 6, "persist")], faults=[], work=str(tmp_path), window=4)


def test_driver_reads_progress_and_markers_before_deleting_a_store(tmp_path):
    from moe_ft.drills.cluster import fired_markers, last_completed, redone_iterations

    job = tmp_path / "node1" / "job"
    (job / "faults").mkdir(parents=True)
    (job / "progress_rank2").write_text("8")
    (job / "progress_rank3").write_text("7")
    (job / "progress_rank3.tmp").write_text("")  # a write in flight is not progress
    plan = FaultPlan([Fault(2, 9, "forward", "exception")], job / "faults")
    with pytest.raises(InjectedFault):
        plan.check(2, 9, "forward")
    assert last_completed([tmp_path / "node0", tmp_path / "node1"]) == 8
    assert fired_markers(tmp_path / "node1") == [Fault(2, 9, "forward", "exception")]
    events = [{"last_completed": 8}]
    report = {"recovery_point": {"source": "durable", "end": 7, "resume": 8}, "replayed_iterations": [5, 6, 7]}
    redone_iterations(events, [report])
    assert events[0]["reexecuted"] == [8] and events[0]["iterations_redone"] == 4
    unpaired = [{"last_completed": 8}, {"last_completed": 9}]
    redone_iterations(unpaired, [report])  # a cascading failure left fewer reports: nothing is guessed
    assert "iterations_redone" not in unpaired[0]


def test_sigterm_stays_pending_on_a_paused_worker_until_it_resumes():
    """The elastic join pauses the running workers until their agent's SIGTERM is pending (moe_ft/drills/cluster.py)."""
    import signal

    from moe_ft.drills.processes import alive, sigterm_pending

    proc = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        os.kill(proc.pid, signal.SIGSTOP)
        stopped_by = time.monotonic() + 10  # on a loaded machine the stop takes effect a moment later
        while psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED and time.monotonic() < stopped_by:
            time.sleep(0.01)
        assert not sigterm_pending(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not sigterm_pending(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sigterm_pending(proc.pid) and alive(proc.pid), "a stopped process keeps SIGTERM pending"
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.wait(timeout=10) == -signal.SIGTERM
        assert not sigterm_pending(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_held_agents_are_released_together_once_each_is_ready(tmp_path):
    """An elastic drill's first start (``--nnodes 1:N`` closes its rendezvous ``last_call_timeout`` after
    the first node): the driver creates the trigger only when every held agent has imported and said so;
    an agent that exits (or the deadline) releases the others at once. Then a real held agent, released,
    runs its launcher."""
    import threading

    from moe_ft.drills.join import ready_marker, release_when_ready

    trigger = str(tmp_path / "start")
    released_early = []

    def agents() -> None:
        open(ready_marker(trigger, 1), "w").close()
        time.sleep(0.3)
        released_early.append(os.path.exists(trigger))
        open(ready_marker(trigger, 2), "w").close()

    t = threading.Thread(target=agents)
    t.start()
    assert release_when_ready(trigger, 2, give_up=lambda: False, poll_s=0.01) == 2
    t.join()
    assert released_early == [False] and os.path.exists(trigger)

    gone = str(tmp_path / "gone")
    assert release_when_ready(gone, 3, give_up=lambda: True) == 0 and os.path.exists(gone)

    held = str(tmp_path / "held")
    proc = subprocess.Popen([sys.executable, "-m", "moe_ft.drills.join", held, "torchrun", "--help"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        assert release_when_ready(held, 1, give_up=lambda: proc.poll() is not None or time.monotonic() > deadline) == 1
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "--nnodes" in out, out
    finally:
        proc.kill()
        proc.wait()
