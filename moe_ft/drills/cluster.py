"""Simulated nodes for node-loss drills: ``num_nodes`` torchrun agents on this one machine.

The driver (this process) hosts the c10d rendezvous store itself, so that any node can die without taking
the rendezvous with it; every agent joins it as a client::
    torchrun --nnodes 2 --node-rank K --nproc-per-node 2 --max-restarts M --monitor-interval 1 \\
      --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT --rdzv-id JOB \\
      --rdzv-conf is_host=false,keep_alive_interval=1,keep_alive_max_attempt=3 \\
      --local-addr 127.0.0.<K+1> pretrain_gpt_moe.py … --ft-store-dir <stores>/node<K> …

Two torch 2.13 details shape this:

* c10d assigns group ranks by sorting the participants' ``(addr, pid, …)``, not by ``--node-rank``;
  ``--local-addr 127.0.0.<K+1>`` makes node K hold global ranks ``K*R … K*R+R-1`` in every round, also after
  it was replaced by a process with another pid (placement and the drill's faults rely on that).
* With the shared agent store (the default) a survivor keeps the bootstrap address of the round in which it
  first joined, i.e. the store of a node that may be gone. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` makes
  every round publish a fresh master address; worker rank 0 then hosts the default group's store
  (``env://``), a new one per attempt.

A node loss ``NODE:ITER[:PHASE]`` becomes the fault ``R:ITER:PHASE:node`` on the node's first rank R
(``moe_ft.drills.faults.kill_node``: agent and workers SIGKILLed at once). When the driver sees that agent die it
kills the other nodes lost at the same ``(ITER, PHASE)`` (a multi-node loss), deletes the lost nodes'
store directories (their snapshots and the replicas they held are gone), waits until the survivors'
workers have exited (torchrun: their gloo peers vanished; their agents restart them and count the restart)
or, under ``moe-ft launch``, until the agents announced that the survivors wait for a replacement in their
processes (no spare left), and starts replacement agents with the same ``--node-rank``. If no node survived, the replacements join a new
rendezvous (``<job>.g<n>``): the job is relaunched and can only recover from the durable tier.

**Elastic mode** (``ClusterConfig.elastic``; ``moe-ft drill --elastic``): the agents run with ``--nnodes
1:N``; a lost node is *not* replaced -- its store is deleted and the survivors' agents restart their workers
on the smaller world (the job's ``--ft-elastic`` re-plans, ``moe_ft/elastic/restart.py``). ``joins``
(``NODE:ITER``) starts an agent for a node once the job completed ``ITER`` (progress records of the live
nodes): the running agents see a waiting node, stop their workers and re-rendezvous on the larger world.
The running workers are paused (SIGSTOP) from the join until their agent's SIGTERM is pending, so the world
changes right after ``ITER`` whatever the machine's load (the join event records ``paused_s``).

The faults' once-only markers lie in one directory shared by every node (``--ft-fail-marker-dir``; a
rank that a spare on another node took over finds its fault fired), and fired faults are not scheduled
again on a replacement. Each agent launch writes its recovery reports to a directory of its own (``reports/node<K>.<n>``,
shared storage: they survive the node).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from moe_ft.drills.faults import PHASES, Fault
from moe_ft.drills.join import release_when_ready
from moe_ft.drills.launchers import launcher_argv
from moe_ft.drills.processes import alive, kill_tree, sigterm_pending, workers
from moe_ft.drills.report import last_completed
from moe_ft.launch import protocol


@dataclass(frozen=True, order=True)
class NodeLoss:
    """Node ``node`` is lost at ``phase`` of ``iteration`` (``NODE:ITER[:PHASE]``, phases as for ``--fail``)."""

    node: int
    iteration: int
    phase: str = "forward"

    @classmethod
    def parse(cls, text: str) -> "NodeLoss":
        parts = text.split(":")
        if not 2 <= len(parts) <= 3:
            raise ValueError(f"bad node loss {text!r}: expected NODE:ITER[:PHASE], e.g. 1:6:snapshot")
        try:
            node, iteration = int(parts[0]), int(parts[1])
        except ValueError:
            raise ValueError(f"bad node loss {text!r}: NODE and ITER must be integers") from None
        loss = cls(node, iteration, *parts[2:])
        if loss.phase not in PHASES or loss.phase == "published":
            raise ValueError(f"node loss phase must be one of {[p for p in PHASES if p != 'published']}, "
                             f"got {loss.phase!r}")
        if node < 0 or iteration < 0:
            raise ValueError(f"node loss {text!r}: NODE and ITER must be >= 0")
        return loss

    def __str__(self) -> str:
        return f"{self.node}:{self.iteration}:{self.phase}"


@dataclass(frozen=True, order=True)
class NodeJoin:
    """Node ``node`` starts (joins the job) once iteration ``iteration`` completed (``NODE:ITER``)."""

    node: int
    iteration: int

    @classmethod
    def parse(cls, text: str) -> "NodeJoin":
        parts = text.split(":")
        try:
            node, iteration = (int(p) for p in parts)
        except ValueError:
            raise ValueError(f"bad node join {text!r}: expected NODE:ITER with integers, e.g. 1:9") from None
        if node < 0 or iteration < 0:
            raise ValueError(f"node join {text!r}: NODE and ITER must be >= 0")
        return cls(node, iteration)

    def __str__(self) -> str:
        return f"{self.node}:{self.iteration}"


@dataclass(kw_only=True)
class ClusterConfig:
    """Shape and timing of the simulated cluster."""

    num_nodes: int = 2
    """Torchrun agents (simulated nodes)."""
    ranks_per_node: int = 2
    """Workers per agent (``--nproc-per-node``)."""
    max_restarts: int = 3
    """``--max-restarts`` of every agent (survivors spend one per node loss)."""
    timeout: float = 300.0
    """Wall seconds for the whole job (every incarnation); then everything is killed (rc 124)."""
    keep_alive_interval: int = 1
    """Rendezvous heartbeat seconds; a dead node leaves the rendezvous after 3 missed beats."""
    survivor_exit_timeout: float = 120.0
    """Seconds to wait for the survivors' workers to exit after a loss before the replacement starts."""
    elastic: bool = False
    """Lost nodes are not replaced (``--nnodes 1:N``): training goes on with the survivors."""
    joins: tuple["NodeJoin", ...] = ()
    """Elastic mode: nodes (re)started once the job has completed an iteration."""
    last_call_timeout: int = 10
    """Elastic mode: seconds the rendezvous waits for more nodes once the minimum (1) has joined. The first
    start releases every agent at once (``_start``), yet on a loaded machine one agent still joined more than
    3 s after the first (the job started on 3 of 4 nodes); a round that fewer than N nodes join (a torchrun
    restart after a loss, a full restart) waits this long once."""
    launcher: str = "torchrun"
    """The agents' launcher (``moe_ft.drills.launchers.LAUNCHERS``): ``torchrun``, ``preloaded`` (torchrun's
    agent with workers forked from a process that imported the training stack once), ``inprocess`` or
    ``inprocess-preloaded`` (``moe-ft launch``: warm spares, survivors keep their processes)."""
    node_timeout: float = 2.0
    """In-process launchers: ``--node-timeout`` of the agents (seconds without a heartbeat before a node's
    ranks go to spares on the other nodes)."""
    launcher_flags: tuple[str, ...] = ()
    """More flags for every agent (e.g. ``--spares-per-node=2``)."""
    join_pause_timeout: float = 25.0
    """Elastic mode: longest pause of the running workers while a joining node's agent enters the
    rendezvous (``SimulatedCluster._join``)."""

    @property
    def inprocess(self) -> bool:
        """The agents replace lost ranks in-process (``moe-ft launch``)."""
        return self.launcher.startswith("inprocess")

    def __post_init__(self) -> None:
        if self.num_nodes < 2:
            raise ValueError(f"a node-loss drill needs at least 2 nodes, got {self.num_nodes}")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks per node must be >= 1, got {self.ranks_per_node}")
        if self.joins and not self.elastic:
            raise ValueError("node joins need the elastic mode (a lost node is otherwise replaced at once)")
        for join in self.joins:
            if not 0 <= join.node < self.num_nodes:
                raise ValueError(f"node join {join}: node {join.node} does not exist (--nodes {self.num_nodes})")


def node_faults(losses: list[NodeLoss], ranks_per_node: int) -> list[Fault]:
    """One ``node`` fault per distinct ``(ITER, PHASE)``, on the first rank of the lowest node lost then (the
    driver kills the other nodes of that event)."""
    first: dict[tuple[int, str], NodeLoss] = {}
    for loss in sorted(losses):
        first.setdefault((loss.iteration, loss.phase), loss)
    return [Fault(l.node * ranks_per_node, l.iteration, l.phase, "node") for l in first.values()]


def check_losses(losses: list[NodeLoss], num_nodes: int) -> None:
    for loss in losses:
        if loss.node >= num_nodes:
            raise ValueError(f"--fail-node {loss}: node {loss.node} does not exist (--nodes {num_nodes})")
    if len(set(losses)) != len(losses):
        raise ValueError(f"--fail-node given twice for the same node and point: {[str(l) for l in losses]}")


def fired_markers(store: Path, pattern: str = "*/faults/*.fired") -> list[Fault]:
    """The faults whose once-only marker lies in a node's store (``<store>/<job>/faults/*.fired``), or in
    the drill's shared marker directory (``pattern="*.fired"``)."""
    out = []
    for marker in sorted(store.glob(pattern)):
        text = marker.read_text().splitlines()
        if text:
            out.append(Fault.parse(text[0]))
    return out


ArgvFor = Callable[[int, int, list[str]], list[str]]
"""``argv_for(node, launch_idx, faults)`` → the training script's arguments for one agent launch."""


class SimulatedCluster:
    """Runs one job on ``config.num_nodes`` torchrun agents and plays the node losses (see the module doc)."""

    def __init__(self, config: ClusterConfig, *, script: str, root: str, store_of: Callable[[int], str],
                 argv_for: ArgvFor, log_prefix: str, run_id: str, marker_dir: str | None = None) -> None:
        self.config, self.script, self.root = config, script, root
        self.marker_dir = marker_dir
        """The faults' shared marker directory (``--ft-fail-marker-dir``: a rank that moved to another node's
        spare finds its fault fired); ``None``: each node's store holds its own."""
        self.store_of, self.argv_for, self.log_prefix, self.run_id = store_of, argv_for, log_prefix, run_id
        self.generation = 0  # bumped when every node was lost: a new rendezvous
        self.launches: dict[int, int] = {}  # node → number of agents started for it
        self.agents: dict[int, subprocess.Popen] = {}
        self.logs: list[str] = []
        self.events: list[dict] = []
        self.fired: set[Fault] = set()
        self.dropped: set[int] = set()  # elastic mode: lost nodes not (yet) started again
        self.waiting: dict[int, str] = {}  # elastic mode: pre-started agents -> the trigger file they wait for
        self.root_tmp = os.path.dirname(log_prefix)
        self.joined: list[dict] = []
        self.spared: set[int] = set()
        """Lost nodes whose ranks spares took (in-process): replaced only if the agents fall back later."""
        self.checked_attempt = 0

    # ----------------------------------------------------------------------------------------- launch
    def _rdzv_id(self) -> str:
        return self.run_id if self.generation == 0 else f"{self.run_id}.g{self.generation}"

    def _launch(self, node: int, faults: list[Fault], port: int, trigger: str | None = None) -> None:
        """Start node ``node``'s agent; with ``trigger`` it imports torch, then waits for that file before
        it joins the rendezvous (``moe_ft.drills.join``)."""
        c = self.config
        launch_idx = self.launches.get(node, 0)
        self.launches[node] = launch_idx + 1
        pending = [str(f) for f in faults if f not in self.fired]
        rdzv_conf = f"is_host=false,keep_alive_interval={c.keep_alive_interval},keep_alive_max_attempt=3," \
                    f"join_timeout={int(c.timeout)}"
        nnodes = str(c.num_nodes)
        if c.elastic:
            rdzv_conf += f",last_call_timeout={c.last_call_timeout}"
            nnodes = f"1:{c.num_nodes}"
        launcher = launcher_argv(c.launcher) if trigger is None else ["-m", "moe_ft.drills.join", trigger, c.launcher]
        if c.inprocess:  # agents notice a lost node within node_timeout (their heartbeats, every pass)
            launcher += [*c.launcher_flags, f"--node-timeout={c.node_timeout}", "--monitor-interval=0.1"]
            if c.joins:  # a join pauses the running workers (SIGSTOP, ``_join``): no stopped worker to kill
                launcher.append(f"--stop-timeout={c.join_pause_timeout + 30}")
        else:
            launcher += [*c.launcher_flags, "--monitor-interval=1"]
        cmd = [sys.executable, *launcher, f"--nnodes={nnodes}", f"--node-rank={node}",
               f"--nproc-per-node={c.ranks_per_node}", f"--max-restarts={c.max_restarts}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={self._rdzv_id()}",
               f"--rdzv-conf={rdzv_conf}", f"--local-addr=127.0.0.{node + 1}",
               self.script, *self.argv_for(node, launch_idx, pending)]
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                   PYTHONPATH=self.root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        log_path = f"{self.log_prefix}.node{node}.{launch_idx}.log"
        self.logs.append(log_path)
        with open(log_path, "w") as log:
            self.agents[node] = subprocess.Popen(cmd, env=env, cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
                                                 start_new_session=True)

    # -------------------------------------------------------------------------------------------- run
    def run(self, faults: list[Fault], losses: list[NodeLoss]) -> dict:
        """Start every node, replace lost ones until every agent exits 0 (or one fails, or time is up).
        Returns ``rc`` (0, the failing agent's code, or 124), ``node_losses`` (one event per loss) and the
        agents' ``logs``."""

        c = self.config
        faults = list(faults) + node_faults(losses, c.ranks_per_node)
        events = {(l.iteration, l.phase): sorted({m.node for m in losses if (m.iteration, m.phase) ==
                                                   (l.iteration, l.phase)}) for l in losses}
        # the rendezvous lives here, not on a node: every node can be lost
        # start-up time: `moe-ft drill --help` (and every moe-ft command) stays free of torch
        import torch.distributed as dist

        rdzv = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
        deadline = time.monotonic() + c.timeout
        done: set[int] = set()
        joins = sorted(c.joins, key=lambda j: (j.iteration, j.node))
        finished_at = None  # when the first agent exited 0 (the job ended)
        rc = 0
        try:
            self._start(faults, rdzv.port, deadline)
            while len(done) < c.num_nodes:
                if time.monotonic() > deadline:
                    rc = 124
                    break
                time.sleep(0.05)
                exited = {n: code for n, a in self.agents.items() if n not in done and (code := a.poll()) is not None}
                for node, code in exited.items():
                    if code == 0:
                        done.add(node)
                        finished_at = finished_at or time.monotonic()
                if c.elastic and finished_at and time.monotonic() - finished_at > c.last_call_timeout + 10:
                    for node, agent in self.agents.items():  # joined after the job ended: nothing to join
                        if node not in done and agent.poll() is None:
                            kill_tree(agent.pid)
                            agent.wait()
                            done.add(node)
                            self.joined = [dict(j, missed=True) if j["node"] == node else j for j in self.joined]
                for join in joins:  # pre-start the agent of a lost node that will come back (imports)
                    if join.node in self.dropped and join.node not in self.waiting:
                        self.waiting[join.node] = os.path.join(self.root_tmp, f"join{join.node}.{len(self.joined)}")
                        self._launch(join.node, faults, rdzv.port, trigger=self.waiting[join.node])
                while joins and joins[0].node in self.waiting and self._completed() >= joins[0].iteration:
                    join = joins.pop(0)  # the node comes back: its agent joins, the world grows
                    self.joined.append(self._join(join, rdzv))
                    done.discard(join.node)
                if self.spared and self._fell_back(rdzv):  # a full restart needs every node again
                    for node in sorted(self.spared):
                        self._launch(node, faults, rdzv.port)
                        done.discard(node)
                    print(f"moe-ft node drill: the agents fell back to a full restart: replacement(s) for node(s) "
                          f"{sorted(self.spared)} started", file=sys.stderr, flush=True)
                    self.spared = set()
                if not any(code != 0 for code in exited.values()):
                    continue
                lost = self._lost_event(exited, events)
                if lost is None:  # an agent failed without a node fault: the job failed
                    rc = next(code for code in exited.values() if code != 0)
                    break
                (iteration, phase), nodes = lost
                if c.elastic:
                    self._drop(nodes, iteration, phase)
                    done.update(nodes)  # gone for good (until a join starts it again)
                elif not self._replace(nodes, iteration, phase, faults, rdzv):
                    done.update(nodes)  # spares on the surviving nodes run the lost ranks
                    self.spared.update(nodes)
        finally:
            for agent in self.agents.values():
                if agent.poll() is None:
                    kill_tree(agent.pid)
                agent.wait()
            del rdzv
        return {"rc": rc, "node_losses": self.events, "node_joins": self.joined, "logs": self.logs,
                "launches": {str(n): k for n, k in sorted(self.launches.items())}}

    def _start(self, faults: list[Fault], port: int, deadline: float) -> None:
        """Start every node's agent. Elastic mode: each imports, then all are released into the rendezvous
        together (``moe_ft.drills.join``): with ``--nnodes 1:N`` it closes ``last_call_timeout`` after the
        first node joined, and on a loaded machine an agent still importing would miss the first world."""
        c = self.config
        trigger = os.path.join(self.root_tmp, f"start.{self._rdzv_id()}") if c.elastic else None
        if trigger is not None:  # what an earlier run left in the same directory
            for stale in [trigger, *glob.glob(glob.escape(trigger) + ".ready.*")]:
                if os.path.exists(stale):
                    os.remove(stale)
        for node in range(c.num_nodes):
            self._launch(node, faults, port, trigger=trigger)
        if trigger is not None:
            release_when_ready(trigger, c.num_nodes, give_up=lambda: time.monotonic() > deadline or any(
                a.poll() is not None for a in self.agents.values()))

    def _join(self, join: "NodeJoin", rdzv) -> dict:
        """Node ``join.node`` comes back now: release its pre-started agent. The running workers are paused
        (SIGSTOP) from here until their agent has asked them to stop (torch elastic: SIGTERM pending;
        ``moe-ft launch``: the agents' ``regroup`` key, the workers leave after the iteration they are in)
        -- the agent polls the rendezvous every ``--monitor-interval`` and a loaded machine runs many short
        iterations in that time; paused, the world changes right after the iteration the drill names, on
        any machine. Capped at ``join_pause_timeout`` seconds (the agent SIGKILLs 30 s after its SIGTERM:
        they resume long before)."""

        running = [pid for n, a in self.agents.items() if n != join.node and a.poll() is None
                   for pid in workers(a.pid)]
        for pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        completed = self._completed()
        Path(self.waiting.pop(join.node)).touch()
        self.dropped.discard(join.node)
        t0 = time.monotonic()
        while (time.monotonic() - t0 < self.config.join_pause_timeout
               and not any(sigterm_pending(pid) or not alive(pid) for pid in running)
               and not (self.config.inprocess and self._regrouping(rdzv))):
            time.sleep(0.05)
        paused = time.monotonic() - t0
        for pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        return {"node": join.node, "after_iteration": join.iteration, "last_completed": completed,
                "paused_s": round(paused, 2)}

    def _lost_event(self, exited: dict[int, int], events: dict) -> tuple[tuple[int, str], list[int]] | None:
        """The scheduled loss that killed an exited agent (its ``node`` marker), or None."""
        for node, code in exited.items():
            if code == 0:
                continue
            for fault in self._fired(node):
                key = (fault.iteration, fault.phase)
                if fault.kind == "node" and fault not in self.fired and key in events:
                    return key, events[key]
        return None

    def _fired(self, node: int) -> list[Fault]:
        """The fired faults of node ``node``'s ranks (all of them for a ``node`` fault's first rank)."""
        if self.marker_dir is None:
            return fired_markers(Path(self.store_of(node)))
        per_node = self.config.ranks_per_node
        return [f for f in fired_markers(Path(self.marker_dir), "*.fired") if f.rank // per_node == node]

    def _completed(self) -> int:
        """The newest iteration a live node's ranks completed (their progress records)."""
        live = [n for n, a in self.agents.items() if a.poll() is None]
        return last_completed([Path(self.store_of(n)) for n in live])

    def _drop(self, nodes: list[int], iteration: int, phase: str) -> None:
        """Elastic mode: the lost nodes go down with their stores and are not replaced."""
        for node in nodes:
            kill_tree(self.agents[node].pid)
            self.agents[node].wait()
        survivors = [n for n, a in self.agents.items() if n not in nodes and a.poll() is None]
        completed = last_completed([Path(self.store_of(n)) for n in self.agents])
        for node in nodes:
            store = Path(self.store_of(node))
            self.fired.update(self._fired(node))
            shutil.rmtree(store, ignore_errors=True)
        self.dropped.update(nodes)
        self.events.append({"nodes": nodes, "iteration": iteration, "phase": phase, "survivors": survivors,
                            "last_completed": completed, "replaced": False})
        print(f"moe-ft node drill: lost node(s) {nodes} at iteration {iteration} ({phase}); stores deleted; "
              f"not replaced (elastic): the job goes on with nodes {survivors}", file=sys.stderr, flush=True)

    def _regrouping(self, rdzv) -> bool:
        """Whether the agents asked the workers of the current attempt to regroup (a node joins)."""
        keys = protocol.Keys(self._rdzv_id())
        return bool(rdzv.check([keys.regroup(protocol.current_attempt(rdzv, keys))]))

    def _new_announcements(self, rdzv) -> list[dict]:
        """The attempts the agents announced since the last look (``moe_ft/launch/protocol.py``)."""
        keys = protocol.Keys(self._rdzv_id())
        newest = protocol.current_attempt(rdzv, keys)
        out = [protocol.announcement(rdzv, keys, a) for a in range(self.checked_attempt + 1, newest + 1)]
        self.checked_attempt = newest
        return out

    def _fell_back(self, rdzv) -> bool:
        """Whether the agents announced a fallback to a full restart since the last look."""
        return any(info.get("kind") == "fallback" for info in self._new_announcements(rdzv))

    def _replace(self, nodes: list[int], iteration: int, phase: str, faults: list[Fault], rdzv) -> bool:
        """The lost nodes go down with their stores; replacement agents start for them unless (in-process
        launchers) spares on the surviving nodes took their ranks. Returns whether replacements started."""
        t0 = time.monotonic()
        for node in nodes:  # the other nodes lost in the same event go down now
            kill_tree(self.agents[node].pid)
            self.agents[node].wait()
        survivors = [n for n in self.agents if n not in nodes]
        survivor_workers = [pid for n in survivors for pid in workers(self.agents[n].pid)]
        completed = last_completed([Path(self.store_of(n)) for n in self.agents])
        for node in nodes:  # the node is gone: its snapshots and the replicas it held with it
            store = Path(self.store_of(node))
            self.fired.update(self._fired(node))
            shutil.rmtree(store, ignore_errors=True)
        lost_ranks = {n * self.config.ranks_per_node + r for n in nodes for r in range(self.config.ranks_per_node)}
        taken = awaited = None
        while any(alive(pid) for pid in survivor_workers) and time.monotonic() - t0 < self.config.survivor_exit_timeout:
            if survivors and self.config.inprocess:
                # spares took every lost rank, the survivors wait in their processes for a replacement node,
                # or a fallback
                for info in self._new_announcements(rdzv):
                    if info.get("kind") == "fallback":
                        taken = awaited = False
                    elif info.get("kind") == "inprocess" and lost_ranks <= set(info.get("failed", [])):
                        taken = True
                    elif info.get("kind") == "await" and lost_ranks <= set(info.get("failed", [])):
                        awaited = True
                if taken or awaited:
                    break
            time.sleep(0.05)
        survivors_exited = not any(alive(pid) for pid in survivor_workers)
        event = {"nodes": nodes, "iteration": iteration, "phase": phase, "survivors": survivors,
                 "last_completed": completed, "survivor_workers_exited": survivors_exited,
                 "rendezvous": self._rdzv_id(), "replaced": "inprocess" if taken else "node"}
        if taken:
            self.events.append(dict(event, seconds_to_replacement=round(time.monotonic() - t0, 3)))
            print(f"moe-ft node drill: lost node(s) {nodes} at iteration {iteration} ({phase}); stores deleted; "
                  "spares on the surviving nodes took their ranks", file=sys.stderr, flush=True)
            return False
        if not survivors:
            self.generation += 1
            self.checked_attempt = 0  # a new rendezvous id: its own attempt counter
        for node in nodes:
            self._launch(node, faults, rdzv.port)
        self.events.append(dict(event, rendezvous=self._rdzv_id(),
                                seconds_to_replacement=round(time.monotonic() - t0, 3)))
        print(f"moe-ft node drill: lost node(s) {nodes} at iteration {iteration} ({phase}); stores deleted; "
              f"replacement started (rendezvous {self._rdzv_id()}){'; the survivors wait for it in their processes' if awaited else ''}",
              file=sys.stderr, flush=True)
        return True


def redone_iterations(events: list[dict], reports: list[dict]) -> None:
    """Add to each loss event the iterations trained again because of it: the recovery's replayed window
    plus ``resume … last_completed`` (the driver read ``last_completed`` from the stores before deleting
    them; a job that lost every node cannot know it). Events and reports pair up in order when there is
    one report per loss (no cascading failure); otherwise nothing is added."""
    if len(events) != len(reports):
        return
    for event, report in zip(events, reports):
        point = report["recovery_point"]
        reexecuted = list(range(point["resume"], event["last_completed"] + 1))
        event.update(recovery_source=point["source"], recovery_end=point["end"],
                     replayed=report["replayed_iterations"], reexecuted=reexecuted,
                     iterations_redone=len(report["replayed_iterations"]) + len(reexecuted))
