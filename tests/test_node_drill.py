"""Node loss end to end: 2 simulated nodes x 2 ranks (two torchrun agents on a c10d rendezvous
hosted by the test process, ``moe_ft/drills/cluster.py``), each node with its own store directory, replicas on
the other node. A lost node's agent and workers are SIGKILLed at once, its store is deleted, a replacement
agent joins; the job ends bitwise equal to a fault-free run (digests).

* one node lost mid-window (EP2xPP2: node 1; DP2xEP2: node 0, which holds rank 0 and the default group's
  store): its ranks fetch their entries from the peers on the surviving node, the report names them;
* both nodes lost at once: nothing in memory survives, recovery falls back to the newest complete durable
  point and trains more iterations again (counted from the progress the driver read before deleting the
  stores);
* a node lost while the durable tier writes a point (phase ``persist``).

The fault-free reference of each layout is one ``torchrun --standalone`` of the same 4-rank job (the
launcher does not change the training state); the tiny job runs ITERS iterations with window W.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _ft_helpers import wait_until

from moe_ft.cli.drill import node_flags, run_node_job
from moe_ft.drills.cluster import NodeLoss

pytestmark = pytest.mark.multiproc

ITERS, WINDOW, NODES = 10, 4, 2
NODE_RANKS = {0: {0, 1}, 1: {2, 3}}  # --local-addr 127.0.0.<node+1> keeps this mapping across replacements


@pytest.fixture(scope="module")
def env(corpus, tmp_path_factory):
    return {"data": corpus, "work": str(tmp_path_factory.mktemp("node_drill")),
            "store": str(tmp_path_factory.mktemp("node_drill_store"))}


@pytest.fixture(scope="module")
def reference(fault_free_digest):
    """``reference(layout)`` → digest of the fault-free run (one ``--standalone`` torchrun per session, on
    demand; replicas and node layout do not change the training state)."""
    return lambda layout: fault_free_digest(layout, ITERS)


def lose(env, job: str, *, layout: str, losses: list[str], max_restarts: int = 2, launcher: str | None = None,
         launcher_flags: tuple[str, ...] = (), extra_flags: tuple[str, ...] = (), faults: tuple[str, ...] = (),
         nodes: int = NODES) -> dict:
    parsed = [NodeLoss.parse(s) for s in losses]
    work = os.path.join(env["work"], job)
    os.makedirs(work)
    extra = node_flags(nodes=nodes, losses=parsed, faults=[], work=work, window=WINDOW) + list(extra_flags)
    res = run_node_job(job=job, workdir=work, faults=list(faults), losses=parsed, num_nodes=nodes, max_restarts=max_restarts,
                       launcher=launcher, launcher_flags=launcher_flags, timeout=400, layout=layout, policy="sparse", iters=ITERS, data=env["data"],
                       store=os.path.join(env["store"], job), window=WINDOW, extra=extra)
    assert res["rc"] == 0, f"{job} failed (rc {res['rc']}), see {res['logs']}"
    return res


def check_one_node_lost(res, *, lost: int, iteration: int, phase: str, point_end: int, kept: bool = False,
                        spares: bool = False):
    """One loss, one report: the lost node's ranks fetched their entries, each from ranks on the other node,
    then the whole job recovered the memory point ``point_end`` exactly. ``kept``: the survivors kept their
    processes (``moe-ft launch``); ``spares``: spares on the other node took the lost ranks and no replacement
    node started (else a replacement node ran them: every worker started again on it and the survivor under
    torchrun, only the replacement's under ``moe-ft launch``)."""
    (event,) = res["node_losses"]
    assert (event["nodes"], event["iteration"], event["phase"]) == ([lost], iteration, phase)
    assert event["survivors"] == [1 - lost] and event["survivor_workers_exited"] is not kept
    assert event["replaced"] == ("inprocess" if spares else "node")
    assert res["launches"] == ({"0": 1, "1": 1} if spares else {"0": 1 + (lost == 0), "1": 1 + (lost == 1)})
    (report,) = res["reports"]
    assert report["restart_kind"] == ("inprocess" if kept else "job")
    assert report["survivor_pids_kept"] is (True if kept else None)
    rp = report["recovery_point"]
    assert rp["source"] == "memory" and rp["end"] == point_end and rp["resume"] == point_end + 1
    assert report["replayed_iterations"] == list(range(rp["start"] + 1, point_end + 1))
    assert report["reexecuted_iterations"] == list(range(point_end + 1, event["last_completed"] + 1))
    assert report["failed"]["last_completed"] == event["last_completed"] >= iteration - 1
    fetched = rp["fetched"]
    assert {int(r) for r in fetched} == NODE_RANKS[lost], fetched  # the replacement's ranks, and only they
    for rank, f in fetched.items():
        # peers on the survivor node: its own ranks and, in-process, the lost ranks its spares run now
        here = NODE_RANKS[1 - lost] | (NODE_RANKS[lost] - {int(rank)} if spares else set())
        assert f["sources"] and set(f["sources"]) <= here, (rank, f)
        assert f["bytes"] > 0 and f["skipped"] == [] and point_end in f["points"]
    assert "fetch" in report["seconds"]
    assert event["iterations_redone"] == len(report["replayed_iterations"]) + len(report["reexecuted_iterations"])


@pytest.mark.timeout(600)
def test_ep2pp2_node1_lost_mid_window(env, reference):
    """Node 1 (ranks 2, 3: pipeline stage 1) dies at the start of iteration 6, inside window [4, 7]: its
    ranks fetch window [0, 3] from node 0, every rank replays 1 … 3 and re-executes 4 and 5. torchrun's
    agents (workers forked from a preloaded launcher): every worker starts again. The node agents hash the
    snapshots and move the replicas (``--ft-checksum-by agent --ft-replicate-by agent``, started by the
    trainers under torchrun: the trainers write each snapshot byte once and touch no replicated byte): node
    1's agent dies with its store, node 0's received and verified what the lost ranks fetch."""
    res = lose(env, "ep2pp2_node1", layout="ep2pp2", losses=["1:6"], launcher="preloaded",
               extra_flags=("--ft-checksum-by", "agent", "--ft-replicate-by", "agent",
                            "--ft-persist-agent-idle-exit", "60"))
    agent_log = Path(env["store"], "ep2pp2_node1", "node0", "ep2pp2_node1", "agent", "agent.log").read_text()
    assert "serving" in agent_log and "exiting (every rank said bye)" in agent_log, agent_log
    assert res["digest"] == reference("ep2pp2")
    check_one_node_lost(res, lost=1, iteration=6, phase="forward", point_end=3)
    assert res["node_losses"][0]["reexecuted"] == [4, 5]


@pytest.mark.timeout(600)
def test_dp2ep2_node0_lost_during_snapshot_copy(env, reference):
    """Node 0 (ranks 0, 1: rank 0 writes the reports) dies with the copy of iteration 7 in flight (window [4, 7]
    still open: the point is [0, 3], whose replicas node 0's agent hashed and sent some iterations earlier; at
    iteration 5, under the suite's load on two cores, that agent was up to three points behind and the lost
    ranks found no complete window on node 1: a correct fallback to the initial state, not this test's path). Under
    ``moe-ft launch`` with two warm spares per node: node 1's agent sees node 0's heartbeat stop and gives
    ranks 0 and 1 to its spares, which fetch from ranks 2, 3; ranks 2, 3 keep their processes; back to
    [0, 3]. The node agents (started by ``moe-ft launch``) hash the snapshots and move the replicas: the
    in-process recovery drops the failed attempt's senders in node 1's agent and the new attempt's take over."""
    res = lose(env, "dp2ep2_node0", layout="dp2ep2", losses=["0:7:snapshot"], launcher_flags=("--spares-per-node=2",),
               extra_flags=("--ft-checksum-by", "agent", "--ft-replicate-by", "agent",
                            "--ft-persist-agent-idle-exit", "60"))
    assert res["digest"] == reference("dp2ep2")
    check_one_node_lost(res, lost=0, iteration=7, phase="snapshot", point_end=3, kept=True, spares=True)


@pytest.mark.timeout(600)
def test_four_nodes_a_spare_takes_the_lost_rank_beside_a_survivor_and_receives_its_replicas(env, reference):
    """Four nodes of one rank each (``moe-ft launch``, one warm spare per node), node 2 lost at iteration 9:
    a spare on another node runs rank 2 beside that node's own rank. The new placement gives that process
    replicas the survivor beside it received before (a full data-parallel peer is overloaded when no other
    node has room), so the survivor's failed attempt gives up the replica stores whose streams ended; the
    job recovers window [4, 7] from memory and ends bitwise equal. Before, rank 2 placed 1 of 2 replicas and
    the job stopped; with that fixed, the spare waited for a store the survivor still held and the job hung."""
    res = lose(env, "dp2ep2_4nodes", layout="dp2ep2", losses=["2:9"], nodes=4)
    assert res["digest"] == reference("dp2ep2")
    (event,) = res["node_losses"]
    assert event["nodes"] == [2] and event["survivors"] == [0, 1, 3] and event["replaced"] == "inprocess"
    (report,) = res["reports"]
    rp = report["recovery_point"]
    assert rp["source"] == "memory" and rp["end"] == 7 and set(rp["fetched"]) == {"2"}, rp
    assert report["replayed_iterations"] == [5, 6, 7] and report["reexecuted_iterations"] == [8]


@pytest.mark.timeout(600)
def test_dp2ep2_node1_lost_while_persisting(env, reference):
    """Node 1 dies during the ``--save`` write after iteration 7 (phase ``persist``), with the durable
    writer flushing point 7 (same interval): both are torn, recovery comes from memory.

    Iteration 7 closes window [4, 7]; rank 2 dies while its snapshot of 7 is being published and sent, so
    whether node 0 holds it is a genuine race of the system (as on a real cluster). Both outcomes are legal
    and each is checked exactly: [4, 7] reached node 0 (replay 5 … 7, nothing re-executed), or it did not
    (back to [0, 3], replay 1 … 3, re-execute 4 … 7).

    ``moe-ft launch`` without spares and a fixed ``--nnodes 2``: no process can take the lost ranks, so node
    0's workers keep their processes and wait; a replacement node joins the rendezvous and takes ranks 2, 3
    (fetched from node 0), and nobody restarts but the lost node."""
    res = lose(env, "dp2ep2_persist", layout="dp2ep2", losses=["1:7:persist"], launcher_flags=("--spares-per-node=0",))
    assert res["digest"] == reference("dp2ep2")
    end = res["reports"][0]["recovery_point"]["end"]
    assert end in (3, 7), res["reports"][0]["recovery_point"]
    check_one_node_lost(res, lost=1, iteration=7, phase="persist", point_end=end, kept=True)
    assert res["node_losses"][0]["last_completed"] == 7
    assert res["reports"][0]["fallback_reason"] == ""
    log = "".join(Path(p).read_text() for p in res["logs"])
    assert "wait up to" in log and "replacement node(s) [1] joined" in log, res["logs"]


@pytest.mark.timeout(600)
def test_ep2pp2_both_nodes_lost_falls_back_to_durable(env, reference):
    """Both nodes die at the start of iteration 9: every store is gone, the relaunched job (a new
    rendezvous, fresh agents) recovers from the newest complete durable point and trains the iterations
    after it again although every node-local record was lost.

    The durable tier is written by the node agents (``--ft-persist-agent``), one per simulated node: the
    trainers ask for window [4, 7] when point 7 is published, during iteration 8. Whether the agents finish
    copying it before both nodes die at the start of 9 is a genuine race (the niced agents compete with four
    trainers for two cores here; on a cluster the node's loss kills its agent too), and both outcomes are
    legal; each is checked exactly: [4, 7] (replay 5 … 7, re-execute 8: four iterations again) or [0, 3]
    (replay 1 … 3, re-execute 4 … 8). The replacement nodes start their own agents, which leave once the job
    is done."""
    res = lose(env, "ep2pp2_both", layout="ep2pp2", losses=["0:9", "1:9"],
               extra_flags=("--ft-persist-agent", "--ft-persist-agent-idle-exit", "60"))
    assert res["digest"] == reference("ep2pp2")
    (event,) = res["node_losses"]
    assert event["nodes"] == [0, 1] and event["survivors"] == [] and event["rendezvous"].endswith(".g1")
    assert res["launches"] == {"0": 2, "1": 2}
    (report,) = res["reports"]
    rp = report["recovery_point"]
    start, end = (4, 7) if rp["end"] == 7 else (0, 3)
    assert rp["source"] == "durable" and (rp["start"], rp["end"], rp["resume"]) == (start, end, end + 1), rp
    assert f"complete durable point ending at iteration {end} " in report["message"]
    replayed, reexecuted = list(range(start + 1, end + 1)), list(range(end + 1, 9))
    assert report["replayed_iterations"] == replayed
    assert event["last_completed"] == 8
    # the report says how many iterations were trained again although every node-local record was lost
    # (rank 0 keeps its progress next to the durable tier)
    assert report["failed"]["last_completed"] == 8 and report["reexecuted_iterations"] == reexecuted
    assert (event["replayed"], event["reexecuted"], event["iterations_redone"]) == (replayed, reexecuted, 8 - start)
    logs = "".join(Path(p).read_text() for p in res["logs"])
    assert "moe-ft fault injection: rank 0 fails at iteration 9 (forward, node)" in logs
    agents = sorted(Path(env["store"], "ep2pp2_both").rglob("agent.log"))
    assert len(agents) == NODES, agents  # the replacement nodes' agents (the lost ones' went with their stores)
    for log in agents:  # each wrote the durable tier of the relaunched job, then left once its ranks were done
        wait_until(lambda: log.read_text().rstrip().endswith("exiting (every rank said bye)"), timeout=30,
                   message=log.read_text())


@pytest.mark.timeout(600)
def test_dp2ep2_a_fallback_on_two_nodes_spends_one_restart(env, reference):
    """Rank 3 (node 1) dies at iteration 5 under ``moe-ft launch`` with no spare and ``--reform-timeout 1``: a
    fresh interpreter takes the rank (attempt 1, one restart spent) but imports for seconds, the survivors
    give up, and the agents fall back to a full restart. Under ``--max-restarts 1`` that is the same
    failure's restart (given back, ``spent_by``), and the agent that did not announce the fallback restarts
    its group instead of taking the other's return to the rendezvous for a joining node. Bitwise."""
    res = lose(env, "dp2ep2_fallback", layout="dp2ep2", losses=[], faults=("3:5:forward",), launcher="inprocess",
               launcher_flags=("--spares-per-node=0", "--reform-timeout=1"), max_restarts=1)
    assert res["digest"] == reference("dp2ep2")
    assert res["launches"] == {"0": 1, "1": 1}  # no agent was started again
    (report,) = res["reports"]
    assert report["restart_kind"] == "job" and report["restart_count"] == 3, report
    assert report["fallback_reason"].startswith("re-forming the process groups took longer"), report
    log = "".join(Path(p).read_text() for p in res["logs"])
    assert "falling back to a full restart" in log or "every worker starts again" in log, res["logs"]
    assert "a node joins" not in log, res["logs"]
