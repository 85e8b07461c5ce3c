"""The agent of ``moe-ft launch``: torch elastic's ``LocalElasticAgent`` that replaces only what failed.

torch elastic starts a node's workers in one process context, and a context whose process fails
terminates all its processes: one death restarts the whole group. This agent keeps the rendezvous, the
store, the worker specification, the restart budget and the monitor loop of ``LocalElasticAgent``, and
changes three things:

* every worker runs in a process context of its own (``start_processes`` with one process), so a death
  ends only that process;
* ``--spares-per-node N`` starts N more processes with the group. A spare does everything that does not
  depend on its rank (imports, flag parsing, the CPU layer) and then waits in the store for one;
* when a worker dies, the agent gives its rank to a spare (or starts a fresh worker when none is left),
  starts a spare in its place and announces a new attempt in the store (``protocol.py``). The surviving
  workers keep their processes: they leave the failed attempt's process groups and join the new one
  (``worker.py``).

**Several nodes.** The agents share the rendezvous store (the c10d backend's). Each bumps a heartbeat
counter every monitor pass and watches the next live node in ring order; a node whose counter stands
still for ``--node-timeout`` seconds is lost, and the agent watching it gives its ranks (``holders`` in the
announcements say which node runs which rank) to spares: its own first, then those other nodes list in
the store. Two agents never announce the same attempt: the announcer takes the attempt's decision lock
first, and an agent that loses it looks again once that attempt is out. A process always keeps its device
index (``LOCAL_RANK``): the node runs ``--nproc-per-node`` + ``--spares-per-node`` processes at most, so a
node that took a lost rank starts one spare fewer.

A worker that exits with :data:`~moe_ft.launch.protocol.GAVE_UP_EXIT_CODE` (it could not join a new
attempt in time, or the agents announced a fallback because no spare was left for a lost node's ranks),
or a failure while the restart budget is spent, takes torch elastic's usual path: stop every worker and
restart the group (a full restart, which spends one of ``--max-restarts``; with several nodes, a new
rendezvous round, which waits for a replacement node). Node 0's agent numbers that attempt for all.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from string import Template
from typing import Any

import psutil

# torch elastic logs a worker's failure through torch's log formatter, which imports torch._dynamo on the
# first exception it formats: about 1 s on a slow machine, in the monitor pass that handles the first
# failure -- long enough to stall this node's heartbeat past a short --node-timeout (the other agents then
# declare a live node lost) and to delay every first recovery. Imported here, before any worker starts.
import torch._dynamo  # noqa: F401
import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, PContext, Std, start_processes

from moe_ft.launch import protocol

log = logging.getLogger("moe_ft.launch")

SPARE_EXITS = 3
"""Spares of a node that may exit while they wait, without one taking a rank in between, before the node
starts no more (a spare that cannot start, e.g. a broken environment or no free memory, would otherwise be
started again at every monitor pass, each with a log directory of its own). A failed rank then goes to a
fresh process, as with ``--spares-per-node 0``."""


@dataclass
class LaunchLogs:
    """Where each process's logs go (torchrun's ``--log-dir``, ``--redirects``, ``--tee``)."""

    root: str | None = None
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    line_prefix_template: str | None = None

    def __post_init__(self) -> None:
        if self.root is None:
            self.root = tempfile.mkdtemp(prefix="moe_ft_launch_")

    def specs(self, name: str, local_rank: int) -> DefaultLogsSpecs:
        """One process's log specification (a directory of its own: torch elastic clears an attempt's
        directory whenever a context starts, which would erase the other processes' error files)."""
        def pick(value):
            return value.get(local_rank, Std.NONE) if isinstance(value, dict) else value

        assert self.root is not None
        return DefaultLogsSpecs(log_dir=os.path.join(self.root, name), redirects=pick(self.redirects),
                                tee=pick(self.tee))

    def prefix(self, role: str, rank: int | str, local_rank: int) -> dict[int, str] | None:
        if not self.line_prefix_template:
            return None
        return {0: Template(self.line_prefix_template).safe_substitute(role_name=role, rank=rank,
                                                                         local_rank=local_rank)}


class Fenced(RuntimeError):
    """The other agents declared this node lost: it stopped its workers and leaves the job (the rendezvous
    stays open for the others)."""


@dataclass
class _Process:
    context: PContext
    local_rank: int
    """The device index this process holds for its whole life (``LOCAL_RANK``)."""
    slot: str = ""
    """A spare's slot (its key in the store); ``""`` for a worker started with a rank."""

    @property
    def pid(self) -> int:
        return next(iter(self.context.pids().values()))


@dataclass
class _NodeWatch:
    node: int
    beat: int
    since: float
    """``time.monotonic()`` when ``beat`` was first seen."""
    seen: float
    """``time.monotonic()`` of the latest read that found ``beat`` unchanged (or first found it)."""
    silent: float = 0.0
    """Seconds of silence counted so far: each gap between two reads counts for at most half the timeout
    (``SpareAgent._beat_and_watch``)."""


@dataclass
class _Claims:
    """What a decision took before it announced (``SpareAgent._assign``), so that a decision that raises gives it
    all back (``SpareAgent._undo``): a spare claimed for a rank that no announcement names never runs it, and the
    next decision finds every spare and device that was free before."""

    store: list[tuple[str, str]] = field(default_factory=list)
    """``(slot, assignment)`` of every spare claimed in the store, this node's and other nodes'."""
    local: list[tuple[int, _Process, int]] = field(default_factory=list)
    """``(rank, spare, its device before)``: this node's spares given a rank."""
    fresh: list[tuple[int, _Process]] = field(default_factory=list)
    """``(rank, process)``: processes started for a rank."""
    freed: dict[int, int] = field(default_factory=dict)
    """Dead rank → the device it left, taken by the process planned for it."""


class SpareAgent(LocalElasticAgent):
    """``LocalElasticAgent`` with per-worker processes, warm spares and in-process replacement."""

    def __init__(self, spec, logs: LaunchLogs, *, spares_per_node: int = 0,
                 reform_timeout_s: float = protocol.DEFAULT_REFORM_TIMEOUT_S,
                 node_timeout_s: float = protocol.DEFAULT_NODE_TIMEOUT_S,
                 stop_timeout_s: float = protocol.DEFAULT_STOP_TIMEOUT_S, start_method: str = "spawn",
                 shutdown_timeout: int = 30, inprocess: bool = True, min_nodes: int | None = None,
                 max_nodes: int = 1) -> None:
        if "shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters:
            super().__init__(spec, logs_specs=DefaultLogsSpecs(log_dir=logs.root), start_method=start_method,
                             shutdown_timeout=shutdown_timeout)
        else:  # torch < 2.13 (the GPU images' 2.11): the agent has no shutdown timeout of its own
            super().__init__(spec, logs_specs=DefaultLogsSpecs(log_dir=logs.root), start_method=start_method)
            self._shutdown_timeout = shutdown_timeout
        self._logs = logs
        self._spares_per_node = spares_per_node
        self._reform_timeout_s = reform_timeout_s
        self._node_timeout_s = node_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._stopped: dict[int, float] = {}
        """pid of a process of this node seen stopped → ``time.monotonic()`` when it was first seen so."""
        self._inprocess = inprocess
        self._min_nodes = min_nodes
        """``--nnodes MIN:MAX`` with MIN < MAX: a lost node with no spare left shrinks the job in-process
        (``None``: a fixed node count, no shrink)."""
        self._max_nodes = max_nodes
        """``--nnodes``' MAX: a node may join (the job grows in-process) only while fewer nodes are live."""
        self._refunded = -1
        self._falling_back = False
        """A fallback was announced (by any agent) since this group started: every node's workers leave for a
        full restart, and an agent that already went back to the rendezvous beats no more -- it is not lost."""
        """The fallback attempt whose restart this agent gave back (:meth:`_refund_recovery`), once."""
        self._workers: dict[int, _Process] = {}
        """This node's workers by global rank (a lost node's ranks may run here, on former spares)."""
        self._spares: list[_Process] = []
        self._spare_exits = 0
        """Spares that exited while waiting since one last took a rank (:data:`SPARE_EXITS`)."""
        self._published_spares = ""
        self._slots = 0
        self._round_tag = ""
        """``r<rendezvous round>`` (``p<pid>`` without rounds): a spare's slot (``<round>.<node>.<n>``) names its
        round, so that a replacement agent of the same node (a new process counting from 0) never reads an
        assignment given to a spare of the lost one; ``finished/<round>/<node>`` names it too."""
        self._finished_nodes: set[int] = set()
        """Nodes of this round whose workers all finished (``finished/<round>/<node>``): never watched, never
        lost, their spares gone."""
        self._launch_store: Any = None
        self._keys = protocol.Keys(spec.rdzv_handler.get_run_id())
        self._attempt = 0
        self._seen = 0
        """The newest attempt whose announcement this agent applied."""
        self._finished: dict[int, Any] = {}
        """Workers that exited 0, by global rank: their return values."""
        self._dead: dict[int, float] = {}
        """Ranks known dead and not replaced yet → wall time their death was seen."""
        self._freed: dict[int, int] = {}
        """Dead rank of this node → the device index its process held (given to the process that takes it)."""
        self._holders: dict[int, int] = {}
        """Global rank → the node (group rank of the rendezvous round) whose process runs it."""
        self._home: dict[int, int] = {}
        """Global rank → the node the layout puts it on (``holders`` differs after a cross-node take-over)."""
        self._world = 0
        self._groups: dict[int, int] = {}
        """Node → the ``GROUP_RANK`` its workers see: its index among the live nodes (an in-process shrink
        renumbers the nodes for the workers; the agents keep the round's numbers among themselves)."""
        self._lost: set[int] = set()
        self._surplus: set[int] = set()
        """Ranks whose workers the global batch left out (``--ft-elastic``, exit ``STANDBY_EXIT_CODE``): not dead,
        not replaced; a spare runs on their devices."""
        self._awaiting: set[int] = set()
        """Ranks of lost nodes that wait for a replacement node (a fixed ``--nnodes N`` with no spare left): the
        survivors keep their processes meanwhile (an ``"await"`` attempt)."""
        self._watch: _NodeWatch | None = None
        self._node = 0
        self._nodes = 1
        self._started = False
        self._regrouping = False
        """Set while a joining node is taken in with the workers kept (``_restart_workers``)."""

    # ------------------------------------------------------------------------------ the store
    def _endpoint(self, worker_group: WorkerGroup) -> tuple[str, int]:
        """The launch store: the rendezvous backend's ``TCPStore`` (it outlives every worker node), else,
        on one node, the workers' own master store."""
        store = getattr(worker_group.spec.rdzv_handler, "_store", None)
        if isinstance(store, dist.TCPStore):
            return store.host, store.port
        if (worker_group.group_world_size or 1) > 1:
            raise RuntimeError("moe-ft launch replaces ranks across nodes through the rendezvous store: use "
                               "--rdzv-backend c10d, or --full-restart")
        assert worker_group.master_addr is not None and worker_group.master_port is not None
        return worker_group.master_addr, worker_group.master_port

    def _store_client(self, worker_group: WorkerGroup):
        if self._launch_store is None:
            host, port = self._endpoint(worker_group)
            self._launch_store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=300))
        return self._launch_store

    # ------------------------------------------------------------------------------ processes
    def _env(self, worker_group: WorkerGroup, *, rank: int, local_rank: int, slot: str = "") -> dict[str, str]:
        spec = worker_group.spec
        env: dict[str, str] = {
            "RANK": str(rank), "LOCAL_RANK": str(local_rank), "GROUP_RANK": str(self._groups.get(self._node, self._node)),
            "ROLE_RANK": str(rank), "ROLE_NAME": spec.role, "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "WORLD_SIZE": str(self._world), "GROUP_WORLD_SIZE": str(self._world // spec.local_world_size),
            "ROLE_WORLD_SIZE": str(self._world),
            "MASTER_ADDR": str(worker_group.master_addr), "MASTER_PORT": str(worker_group.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(self._attempt), "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
            "TORCHELASTIC_USE_AGENT_STORE": str(spec.rdzv_handler.use_agent_store),
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(self._shutdown_timeout),  # the survivors' dump deadline
        }
        if self._inprocess:  # the workers may outlive a failure: they find the agent's announcements here
            host, port = self._endpoint(worker_group)  # and form every attempt's groups through it
            env.update({"MASTER_ADDR": host, "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                        protocol.RUN_ENV: spec.rdzv_handler.get_run_id(),
                        protocol.REFORM_TIMEOUT_ENV: str(self._reform_timeout_s)})
            if self._min_nodes is not None:  # nodes may join: the workers look for the agents' regroup
                env[protocol.GROWS_ENV] = "1"
            # NCCL's watchdog, on a failed collective, aborts the communicators and raises in the waiting
            # thread without ending the process (torch's default, 3, ends it: no survivor would stay)
            env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        if slot:
            env[protocol.SPARE_ENV] = slot
        for name in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"):
            if name in os.environ:
                env[name] = os.environ[name]
        return env

    def _start_one(self, worker_group: WorkerGroup, *, name: str, rank: int, local_rank: int,
                   slot: str = "") -> _Process:
        spec = worker_group.spec
        assert spec.entrypoint is not None
        context = start_processes(
            name=spec.role, entrypoint=spec.entrypoint, args={0: tuple(spec.args)},
            envs={0: self._env(worker_group, rank=rank, local_rank=local_rank, slot=slot)},
            logs_specs=self._logs.specs(name, local_rank),
            log_line_prefixes=self._logs.prefix(spec.role, rank if rank >= 0 else f"spare{slot}", local_rank),
            start_method=self._start_method)
        return _Process(context, local_rank, slot)

    def _reap(self, rank: int, seen: float) -> None:
        """A worker of this node died (seen at wall time ``seen``): its process is collected and its device
        is free for the process that takes its rank (on GPUs the spare's own index may be no device)."""
        proc = self._workers.pop(rank)
        proc.context.close()
        self._dead[rank] = seen
        self._freed[rank] = proc.local_rank

    def _free_device(self, worker_group: WorkerGroup) -> int | None:
        """The lowest device index no process of this node holds (``None``: all taken)."""
        used = {p.local_rank for p in [*self._workers.values(), *self._spares]}
        free = [i for i in range(worker_group.spec.local_world_size + self._spares_per_node) if i not in used]
        return free[0] if free else None

    def _start_spare(self, worker_group: WorkerGroup, local_rank: int) -> _Process:
        slot = f"{self._round_tag}.{self._node}.{self._slots}"
        self._slots += 1
        return self._start_one(worker_group, name=f"spare_{slot}", rank=-1, local_rank=local_rank, slot=slot)

    def _reap_spares(self) -> None:
        """Forget the spares that exited while waiting (:meth:`_fill_spares` starts others, up to
        :data:`SPARE_EXITS` in a row)."""
        for spare in list(self._spares):
            if spare.context.wait(0) is not None:
                self._spares.remove(spare)
                self._spare_exits += 1
                if self._spare_exits < SPARE_EXITS:
                    log.warning("moe-ft launch: spare %s exited while waiting; starting another", spare.slot)
                elif self._spare_exits == SPARE_EXITS:
                    log.warning("moe-ft launch: %d spares of this node exited while waiting (the last: %s; see "
                                "their logs): no more spares here, a failed rank goes to a fresh process",
                                SPARE_EXITS, spare.slot)

    def _fill_spares(self, worker_group: WorkerGroup) -> None:
        while len(self._spares) < self._spares_per_node and self._spare_exits < SPARE_EXITS:
            device = self._free_device(worker_group)
            if device is None:  # this node runs a lost node's rank on a former spare's device
                break
            self._spares.append(self._start_spare(worker_group, device))
        self._list_spares(worker_group)

    def _list_spares(self, worker_group: WorkerGroup) -> None:
        """Write this node's waiting spares to ``spares/<node>`` when they changed (in-process only)."""
        if self._inprocess:
            listed = json.dumps([{"slot": p.slot, "local_rank": p.local_rank} for p in self._spares])
            if listed != self._published_spares:
                self._store_client(worker_group).set(self._keys.node_spares(self._node), listed)
                self._published_spares = listed

    def _close_all(self, death_sig=None, timeout: int | None = None) -> None:
        """Stop every worker and spare together: each runs in a context of its own, whose ``close`` signals it
        and waits up to ``timeout`` for it (a worker writes its held state before it exits); one after the
        other, N workers would take N times as long, and a scheduler's grace period could end before the
        last was even signalled."""
        procs = [*self._workers.values(), *self._spares]
        wait = timeout if timeout is not None else self._shutdown_timeout
        if procs:
            with ThreadPoolExecutor(len(procs), thread_name_prefix="moe-ft-launch-close") as pool:
                list(pool.map(lambda proc: proc.context.close(death_sig, wait), procs))
        self._workers, self._spares = {}, []

    # ------------------------------------------------------------------------- the agent's hooks
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        keep = self._regrouping  # a node joins: this node's workers stay (``_restart_workers``)
        kept = self._workers if keep else {}
        if not keep:
            self._close_all()
        spec = worker_group.spec
        per_node = spec.local_world_size
        self._node, self._nodes = worker_group.group_rank or 0, worker_group.group_world_size or 1
        self._round_tag = _round_or_pid(spec.rdzv_handler)
        self._groups, self._world = {n: n for n in range(self._nodes)}, worker_group.workers[0].world_size
        if keep and self._awaiting:  # a replacement node joins: the survivors keep their ranks, whatever
            renumber = {old: old for old in kept}  # number the new round gives their node
        else:
            renumber = {old: self._node * per_node + proc.local_rank for old, proc in kept.items()}
        if not self._inprocess:  # torch elastic's numbering (each agent counts its restarts)
            self._attempt = spec.max_restarts - self._remaining_restarts
        else:
            if any(w.global_rank != self._node * per_node + w.local_rank for w in worker_group.workers):
                raise RuntimeError("moe-ft launch needs the same --nproc-per-node on every node")
            self._attempt = (self._round_attempt(worker_group, renumber) if self._nodes > 1 or keep
                             else self._job_attempt(worker_group))
            if self._nodes > 1:  # a replacement node may have taken a lost node's place in the layout
                nodes = protocol.announcement(self._store_client(worker_group), self._keys, self._attempt).get("nodes")
                self._groups = {int(n): int(g) for n, g in nodes.items()} if nodes else self._groups
            self._home = rank_homes(self._groups, per_node=per_node, world_size=self._world, attempt=self._attempt)
            self._holders = dict(self._home)
            self._lost, self._dead, self._watch, self._seen = set(), {}, None, self._attempt
            self._finished_nodes = set()
            self._falling_back = False
            self._awaiting, self._surplus, self._freed = set(), set(), {}
            self._store_client(worker_group).set(self._keys.surplus(self._node), "[]")
            self._published_spares = ""  # listed again under this round's node number
        self._started = True
        self._finished = {}
        self._workers = {renumber[old]: proc for old, proc in kept.items()}
        first = self._groups.get(self._node, self._node) * per_node  # this node's first rank in the layout
        for worker in worker_group.workers:
            if first + worker.local_rank not in self._workers:
                self._workers[first + worker.local_rank] = self._start_one(
                    worker_group, name=f"rank{first + worker.local_rank}_attempt{self._attempt}",
                    rank=first + worker.local_rank, local_rank=worker.local_rank)
        self._fill_spares(worker_group)
        return {w.local_rank: self._workers[first + w.local_rank].pid for w in worker_group.workers}

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """torch elastic calls this after a failure (every worker stops and starts again) and, with the
        group healthy, when a node waits to join. In-process, a join keeps the workers: the agents set
        ``regroup/<a>``; every worker sees it and, at the end of the same iteration on every rank (they
        agree in one all-reduce, ``FTRuntime.after_log``), leaves the attempt holding that iteration's state
        and waits; the agents form the new rendezvous round, node 0's announces the round's attempt
        (``resize``: every kept worker's rank in the grown layout), the joining nodes start their workers,
        and the kept ones re-plan in their processes as after a shrink."""
        if self._inprocess and worker_group.state == WorkerState.HEALTHY:
            self._apply_announcements(worker_group)  # the decision below needs what was announced since the pass
        # after a fallback, a node waiting at the rendezvous is an agent restarting its group, not a node joining
        healthy = self._inprocess and worker_group.state == WorkerState.HEALTHY and not self._falling_back
        if healthy and self._awaiting:
            # the replacement node for a lost one: the survivors already left their attempt and wait
            print(f"moe-ft launch: a replacement node is waiting; the workers of node {self._node} keep their "
                  "processes", flush=True)
            self._regrouping = True
            try:
                self._initialize_workers(worker_group)  # the rendezvous; node 0 announces the replacement
            finally:
                self._regrouping = False
            return
        if not (healthy and self._may_grow() and self._layout_intact(worker_group)):
            super()._restart_workers(worker_group)  # e.g. a peer's full restart: its agent waits in the rendezvous
            return
        self._store_client(worker_group).set(self._keys.regroup(self._seen), "1")
        print(f"moe-ft launch: a node joins; the workers of node {self._node} leave attempt {self._seen} after "
              "an iteration and keep their processes", flush=True)
        self._regrouping = True
        try:
            self._initialize_workers(worker_group)  # the rendezvous, then _start_workers keeps the workers
        finally:
            self._regrouping = False

    def _may_grow(self) -> bool:
        """``--nnodes MIN:MAX`` with fewer than MAX nodes live: a node waiting at the rendezvous may join."""
        return self._min_nodes is not None and self._nodes - len(self._lost) < self._max_nodes

    def _layout_intact(self, worker_group: WorkerGroup) -> bool:
        """Every rank of this node runs here on its own device, nothing dead: the workers can keep their
        processes when the job grows (else torch elastic's restart)."""
        per_node = worker_group.spec.local_world_size
        return (not self._dead and len(self._workers) == per_node
                and all(self._home.get(r) == self._node for r in self._workers)
                and sorted(p.local_rank for p in self._workers.values()) == list(range(per_node)))

    def _round_attempt(self, worker_group: WorkerGroup, renumber: dict[int, int]) -> int:
        """The attempt of the rendezvous round just formed, the same on every node: each agent posts which
        of its workers stayed (``member/<r>/<node>``: old rank → new rank); node 0's agent announces either
        the grown job (kind ``"inprocess"``, ``resize``) when some did, or a full restart (``_job_attempt``),
        and sets ``round/<r>``; the others read it."""
        store = self._store_client(worker_group)
        rdzv_round = _rendezvous_round(worker_group.spec.rdzv_handler)
        store.set(self._keys.member(rdzv_round, self._node), json.dumps({str(o): n for o, n in renumber.items()}))
        key = self._keys.round(rdzv_round)
        if self._node != 0:
            return int(store.get(key))  # waits for node 0's agent
        posts = [json.loads(store.get(self._keys.member(rdzv_round, n))) for n in range(self._nodes)]
        ranks = {old: new for post in posts for old, new in post.items()}
        previous = protocol.announcement(store, self._keys, protocol.current_attempt(store, self._keys))
        if not ranks:
            attempt = self._job_attempt(worker_group)
        elif previous.get("kind") == "await":
            attempt = self._replacement_attempt(worker_group, posts, previous)
        else:
            grown = [n for n, post in enumerate(posts) if not post]
            resize = {"ranks": ranks, "world_size": self._world, "nodes": {str(n): n for n in range(self._nodes)}}
            attempt = protocol.announce(store, self._keys, kind="inprocess", failed=[], detected_at=time.time(),
                                        by="node0", resize=resize, grown=grown)
            print(f"moe-ft launch: node(s) {grown} joined; attempt {attempt} grows the job to {self._world} ranks "
                  f"on {self._nodes} nodes, the other workers keep their processes", flush=True)
        store.set(key, str(attempt))
        return attempt

    def _replacement_attempt(self, worker_group: WorkerGroup, posts: list[dict], waited: dict) -> int:
        """Node 0's agent, in the round a replacement node joined after an ``"await"`` attempt (``waited``):
        announce the attempt in which the joining nodes run the lost nodes' ranks. Every survivor node keeps
        its place in the layout (its posted ranks); the joining nodes (empty posts) take the places left, in
        round order (``nodes``: round node → the group rank its workers see)."""
        per_node = worker_group.spec.local_world_size
        places = {n: {int(old) // per_node for old in post} for n, post in enumerate(posts) if post}
        joining = [n for n, post in enumerate(posts) if not post]
        free = sorted(set(range(self._nodes)) - {p for ps in places.values() for p in ps})
        if any(len(ps) != 1 for ps in places.values()) or len(joining) != len(free):
            raise RuntimeError(f"moe-ft launch: the round after the wait for a replacement node has survivor "
                               f"places {places} and joining nodes {joining} for free places {free}: the layout "
                               "cannot be kept; restart the job")
        nodes = {**{n: next(iter(ps)) for n, ps in places.items()}, **dict(zip(joining, free))}
        holders = {rank: n for n, g in nodes.items() for rank in range(g * per_node, (g + 1) * per_node)}
        attempt = protocol.announce(self._store_client(worker_group), self._keys, kind="inprocess",
                                    failed=waited.get("failed", []), detected_at=waited.get("detected_at", time.time()),
                                    by="node0", nodes=nodes, holders=holders, replaced=free)
        print(f"moe-ft launch: replacement node(s) {joining} joined; attempt {attempt} gives them the ranks "
              f"{', '.join(map(str, waited.get('failed', [])))} of the lost node(s), the other workers keep their "
              "processes", flush=True)
        return attempt

    def _job_attempt(self, worker_group: WorkerGroup) -> int:
        """The attempt of a start of the whole group: 0 for the job's first, else the next one, which node
        0's agent announces (kind ``"job"``, with the reason of the fallback before it) for the rendezvous
        round and the other nodes' agents read."""
        store = self._store_client(worker_group)
        if not self._started and protocol.current_attempt(store, self._keys) == 0:
            return 0
        # the other nodes' agents find the attempt under the rendezvous round; one node has nobody to tell
        # (and torchrun's default static rendezvous has no rounds)
        key = self._keys.round(_rendezvous_round(worker_group.spec.rdzv_handler)) if self._nodes > 1 else None
        if self._node != 0:
            return int(store.get(key))
        previous = protocol.announcement(store, self._keys, protocol.current_attempt(store, self._keys))
        reason = previous.get("reason", "") if previous.get("kind") == "fallback" else ""
        attempt = protocol.announce(store, self._keys, kind="job", failed=sorted(w.global_rank for w in worker_group.workers),
                                    detected_at=time.time(), by="node0", reason=reason)
        if key is not None:
            store.set(key, str(attempt))
        return attempt

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._close_all()

    def _shutdown(self, death_sig=None, timeout: int = 30) -> None:
        """torch elastic's ``run`` passes on the signal the launcher got (Ctrl-C's SIGINT, SIGHUP, SIGQUIT):
        the workers get SIGTERM whatever it was, the one signal on which a survivor keeps its state
        (``run_guarded``). Passed on as is, a SIGINT ended every worker in a ``KeyboardInterrupt`` traceback
        (exit -2) with nothing held or published."""
        del death_sig
        self._close_all(signal.SIGTERM, timeout)

    def _exit_barrier(self) -> None:
        """With in-process replacement across nodes, a lost node never reaches torch elastic's exit barrier
        (it counts every node of the rendezvous): count the live ones instead. The heartbeat goes on while
        the agent waits here, and the node is listed finished (``_monitor_workers``) before it comes: once the
        wait runs out (``exit_barrier_timeout``, 300 s) the agent leaves and beats no more, and the nodes still
        training, which watch it, would otherwise declare it lost and hand its finished ranks to spares."""
        if not self._inprocess or self._nodes == 1:
            super()._exit_barrier()
            return
        store, key = self._launch_store, self._keys.exit(self._seen)
        store.add(key, 1)
        deadline = time.monotonic() + self._exit_barrier_timeout
        while time.monotonic() < deadline:
            store.add(self._keys.beat(self._node), 1)
            if int(store.add(key, 0)) >= self._nodes - len(self._lost):
                return
            time.sleep(0.05)

    def _kill_stopped(self) -> None:
        """Kill this node's processes that stood stopped (SIGSTOP, SIGTSTP: a job-control stop) for
        ``--stop-timeout`` seconds. torch elastic watches exits only: the peers of a stopped rank would wait
        in their collectives until the process groups' timeout (a stopped process's own watchdog cannot
        run). Killed, it is a failed worker (replaced as any) or a spare that exited. A process stopped by a
        debugger (a tracing stop) is left alone."""
        now = time.monotonic()
        stopped: dict[int, float] = {}
        procs = [*((f"rank {r}", p) for r, p in self._workers.items() if r not in self._finished),
                 *((f"spare {p.slot}", p) for p in self._spares)]
        for name, proc in procs:
            pid = proc.pid
            if not _is_stopped(pid):
                continue
            stopped[pid] = since = self._stopped.get(pid, now)
            if now - since >= self._stop_timeout_s:
                print(f"moe-ft launch: {name} (pid {pid}) stood stopped for {now - since:.1f} s (--stop-timeout "
                      f"{self._stop_timeout_s:g}): killed, and replaced like a failed process", flush=True)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._stopped = stopped

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._kill_stopped()
        if self._inprocess:
            self._apply_announcements(worker_group)
            self._adopt_claimed_spares(worker_group)
        failures = {}
        for rank, proc in list(self._workers.items()):
            if rank in self._finished:
                continue
            result = proc.context.wait(0)
            if result is None:
                continue
            if result.is_failed():
                failure = next(iter(result.failures.values()))
                if self._inprocess and failure.exitcode == protocol.STANDBY_EXIT_CODE:
                    self._stand_by(worker_group, rank)
                    continue
                failures[rank] = failure
            else:
                self._finished[rank] = next(iter(result.return_values.values()), None)
        self._reap_spares()
        if not self._workers and self._surplus and self._store_client(worker_group).check([self._keys.done]):
            self._finished = {r: None for r in self._surplus}  # this node's workers all stood by; the job ended
        if self._finished and len(self._finished) >= len(self._workers) and not self._dead:
            if self._inprocess:  # before the exit barrier, whose wait may run out before the others finish
                self._store_client(worker_group).set(self._keys.finished(self._round_tag, self._node), "1")
            closing, self._spares = self._spares, []
            self._list_spares(worker_group)  # unlisted before they stop: no other node's agent claims them
            for spare in closing:
                spare.context.close()
            # torch elastic records an event per worker of the group (its round's ranks), which this node may
            # no longer run (another node's spare took them, or they stood by)
            values = {w.global_rank: None for w in worker_group.workers}
            return RunResult(state=WorkerState.SUCCEEDED, return_values={**values, **self._finished})
        gave_up = any(f.exitcode == protocol.GAVE_UP_EXIT_CODE for f in failures.values())
        stopped = any(f.exitcode in protocol.STOP_EXIT_CODES for f in failures.values())
        # finished: nobody to rejoin; falling back: the full restart comes anyway
        if failures and (not self._inprocess or self._finished or gave_up or stopped or self._falling_back):
            if self._inprocess and (gave_up or stopped):  # the others need not wait for their own timeouts
                reason = (f"re-forming the process groups took longer than --reform-timeout "
                          f"({self._reform_timeout_s:g} s)" if gave_up else
                          f"rank(s) {sorted(r for r, f in failures.items() if f.exitcode in protocol.STOP_EXIT_CODES)} "
                          "stopped on purpose (bad flags, or recovery refused)")
                self._announce_fallback(worker_group, sorted(failures), reason, recovery_gave_up=True)
            if self._inprocess:
                self._refund_recovery(worker_group)
            return RunResult(state=WorkerState.FAILED, failures=failures)
        if self._inprocess:
            now = time.time()
            for rank in failures:
                self._reap(rank, now)
            if self._nodes > 1 and not self._falling_back:  # an agent back in the rendezvous beats no more
                self._beat_and_watch(worker_group)
            if set(self._dead) - self._awaiting and not self._decide(worker_group):
                return RunResult(state=WorkerState.FAILED, failures=failures)
        self._fill_spares(worker_group)
        return RunResult(state=WorkerState.HEALTHY)

    # ------------------------------------------------------------------ in-process replacement
    def _apply_announcements(self, worker_group: WorkerGroup) -> None:
        """Take in the attempts other agents announced: who runs which rank, which nodes are lost; ranks
        they replaced are no longer this agent's to replace."""
        store = self._store_client(worker_group)
        newest = protocol.current_attempt(store, self._keys)
        for attempt in range(self._seen + 1, newest + 1):
            info = protocol.announcement(store, self._keys, attempt)
            if self._node in info.get("lost", []):  # fenced: the others gave this node's ranks away
                self._close_all()
                raise Fenced(f"moe-ft launch: node {self._node} was declared lost in attempt {attempt} (its "
                             "heartbeat stood still past --node-timeout); its workers are stopped so that no "
                             "rank runs twice")
            if _spends_restart(info):  # another agent replaced failed ranks, or made the survivors wait for a
                self._remaining_restarts -= 1  # replacement node: the job's budget is spent by one
            if info.get("kind") == "await":
                self._lost.update(info.get("lost", []))
                self._awaiting = set(info.get("failed", []))
            self._falling_back = self._falling_back or info.get("kind") == "fallback"
            if info.get("kind") == "inprocess":
                self._lost.update(info.get("lost", []))
                if "resize" in info:
                    self._apply_resize(info["resize"], info.get("failed", []))
                    continue
                self._holders.update({int(r): n for r, n in info.get("holders", {}).items()})
                for rank in info.get("failed", []):
                    self._dead.pop(rank, None)
            self._attempt = max(self._attempt, attempt)
        self._seen = max(self._seen, newest)

    def _adopt_claimed_spares(self, worker_group: WorkerGroup) -> None:
        """Spares of this node that another node's agent gave a rank become this node's workers, once the
        attempt that gives it is announced (a claim whose decision failed is released and never taken)."""
        store = self._store_client(worker_group)
        for spare in list(self._spares):
            assignment = protocol.spare_assignment(store, self._keys, spare.slot)
            if assignment is not None and protocol.claim_stands(store, self._keys, spare.slot, assignment):
                self._spares.remove(spare)
                self._workers[assignment["rank"]] = spare

    def _beat_and_watch(self, worker_group: WorkerGroup) -> None:
        """Bump this node's heartbeat; declare the watched node lost when its heartbeat stood still for
        ``--node-timeout`` (its ranks join the dead ones).

        The silence is counted from this agent's reads, each gap between two reads for at most half the
        timeout. A pause of the watcher, or of the store that every agent beats through, shows up as one long
        gap after which the watched counter has not moved yet (the watched agent was held up as well): no
        evidence that the node is gone. A lost node is still declared, after two reads at the least however
        slow the passes. Measured on a loaded machine: the drills' rendezvous store stalled about 5 s for
        every agent at once, and each agent then declared its neighbour lost."""
        store = self._store_client(worker_group)
        store.add(self._keys.beat(self._node), 1)
        live = [n for n in range(self._nodes) if n not in self._lost]
        after = [n for n in live if n > self._node] + [n for n in live if n < self._node]
        node = next((n for n in after if not self._has_finished(store, n)), None)
        if node is None:
            return
        beat = int(store.add(self._keys.beat(node), 0))
        now = time.monotonic()
        watch = self._watch
        if watch is None or watch.node != node or watch.beat != beat:
            self._watch = _NodeWatch(node, beat, since=now, seen=now)
            return
        timeout = self._node_timeout_s
        if int(store.add(self._keys.suspect(self._seen), 0)):  # a worker saw a peer fail in this attempt
            timeout = max(protocol.MIN_SUSPECT_TIMEOUT_S, timeout / protocol.SUSPECT_FACTOR)
        watch.silent += min(now - watch.seen, timeout / 2)
        watch.seen = now
        if watch.silent < timeout:
            return
        self._lost.add(node)
        seen = time.time()
        for rank, holder in self._holders.items():
            if holder == node:
                self._dead.setdefault(rank, seen)
        print(f"moe-ft launch: node {node} sent no heartbeat for {now - watch.since:.1f} s: lost "
              f"(ranks {sorted(r for r, h in self._holders.items() if h == node)})", flush=True)
        self._watch = None

    def _has_finished(self, store, node: int) -> bool:
        """Whether ``node``'s workers all finished in this round (``finished/<round>/<node>``): its agent waits in
        the exit barrier, and leaves once the barrier is done or its wait ran out. Either way it is no failure:
        nobody watches it, declares it lost or gives its ranks away."""
        if node not in self._finished_nodes and store.check([self._keys.finished(self._round_tag, node)]):
            self._finished_nodes.add(node)
        return node in self._finished_nodes

    def _decide(self, worker_group: WorkerGroup) -> bool:
        """Announce the next attempt for the dead ranks: ``False`` when the job must restart instead (a
        fallback was announced). Another agent holding the decision lock: try again next pass."""
        store = self._store_client(worker_group)
        attempt = protocol.lock_next(store, self._keys, by=f"node{self._node}")
        if attempt is None:
            return True
        claims = _Claims()
        try:
            return self._decide_locked(worker_group, attempt, claims)
        except BaseException:
            # fenced while reading what was announced, a signal, a spare that would not start: the attempt
            # stays unannounced. The spares it claimed go back first (while the lock still keeps every other
            # agent from announcing the attempt), then its lock, or no agent could announce it again (no
            # replacement, no fallback, and the full restart refused). A store that fails here too must not
            # hide the first error.
            with contextlib.suppress(Exception):
                self._undo(store, claims)
            with contextlib.suppress(Exception):
                protocol.release(store, self._keys, attempt)
            raise

    def _undo(self, store, claims: _Claims) -> None:
        """Give back what a decision that raised took (:class:`_Claims`): its claims in the store, this node's
        spares (as spares again, on their own devices), the processes it started for ranks (stopped), and the
        dead ranks' devices."""
        for slot, claim in claims.store:
            protocol.release_spare(store, self._keys, slot, claim)
        for rank, proc, device in reversed(claims.local):
            self._workers.pop(rank, None)
            proc.local_rank = device
            self._spares.insert(0, proc)
        for rank, proc in claims.fresh:
            self._workers.pop(rank, None)
            proc.context.close(timeout=self._shutdown_timeout)
        self._freed.update(claims.freed)

    def _decide_locked(self, worker_group: WorkerGroup, attempt: int, claims: _Claims) -> bool:
        """:meth:`_decide` once the decision lock of ``attempt`` is held."""
        store = self._store_client(worker_group)
        self._apply_announcements(worker_group)  # what was announced before the lock may cover them
        if not self._dead:
            protocol.release(store, self._keys, attempt)
            return True
        dead, detected = sorted(self._dead), min(self._dead.values())
        if self._remaining_restarts <= 0:  # torchrun's budget: failures the job survives, however recovered
            self._announce_fallback(worker_group, dead, (
                f"--max-restarts {worker_group.spec.max_restarts} spent (every failure counts, replaced in process "
                f"or restarted); rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} failed"), attempt,
                then="the job stops")
            return False
        if self._awaiting:  # the survivors already wait for a replacement node: no second plan on top
            new = sorted(set(dead) - self._awaiting)
            self._announce_fallback(worker_group, dead, (
                f"rank{'s' if len(new) > 1 else ''} {', '.join(map(str, new))} failed while the job waited for "
                f"a replacement of node(s) {sorted(self._lost)}"), attempt)
            return False
        assignments, fresh, missing = self._assign(worker_group, attempt, dead, claims)
        if missing and not assignments and self._can_shrink(dead):
            self._shrink(worker_group, attempt, dead, detected)
            return True
        if missing and not assignments and self._can_await(dead):
            self._await_node(worker_group, attempt, dead, detected)
            return True
        if missing:
            self._announce_fallback(worker_group, dead, (
                f"no spare left for rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of "
                f"lost node(s) {sorted(self._lost)} (--spares-per-node {self._spares_per_node})"), attempt)
            return False
        holders = {rank: node for rank, (node, _) in assignments.items()}
        protocol.publish(store, self._keys, attempt, kind="inprocess", failed=dead, detected_at=detected,
                         holders=holders, lost=sorted(self._lost),
                         slots={rank: slot for rank, (_, slot) in assignments.items()})
        self._holders.update(holders)
        self._dead = {}
        self._seen = self._attempt = attempt
        self._remaining_restarts -= 1
        givers = sorted({node for node, _ in assignments.values()})
        print(f"moe-ft launch: rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} failed; "
              f"attempt {attempt} gives {'them' if len(dead) > 1 else 'it'} to "
              f"{'a fresh process' if fresh else 'spares' if len(dead) > 1 else 'a spare'}"
              f"{'' if givers == [self._node] else ' on node(s) ' + ', '.join(map(str, givers))}, "
              "the other workers keep their processes", flush=True)
        return True

    def _stand_by(self, worker_group: WorkerGroup, rank: int) -> None:
        """Rank ``rank``'s worker stood by (the global batch trains on fewer ranks, ``moe_ft/elastic/standby.py``):
        its process is collected and a warm spare starts on its device, for the next failed rank."""
        proc = self._workers.pop(rank)
        proc.context.close()
        self._surplus.add(rank)
        self._store_client(worker_group).set(self._keys.surplus(self._node), json.dumps(sorted(self._surplus)))
        self._spares.append(self._start_spare(worker_group, proc.local_rank))
        print(f"moe-ft launch: rank {rank} stood by (the global batch trains on fewer ranks): a spare waits on its "
              "device", flush=True)

    def _stood_by(self) -> list[int]:
        """Ranks of the live nodes whose workers stood by (``surplus/<node>``)."""
        store = self._launch_store
        out: list[int] = []
        for node in range(self._nodes):
            if node not in self._lost and store is not None and store.check([self._keys.surplus(node)]):
                out += json.loads(store.get(self._keys.surplus(node)))
        return out

    def _can_shrink(self, dead: list[int]) -> bool:
        """A shrink keeps the layout contiguous: every dead rank is a lost node's, every live rank runs on
        its layout node (no earlier cross-node take-over), and enough nodes are left."""
        if self._min_nodes is None or self._stood_by():  # a stood-by rank has no process to renumber
            return False
        live = [n for n in range(self._nodes) if n not in self._lost]
        return len(live) >= max(self._min_nodes, 1) and self._only_lost_nodes(dead)

    def _only_lost_nodes(self, dead: list[int]) -> bool:
        """Every dead rank is a lost node's, and every live rank runs on its layout node, a live one (no earlier
        cross-node take-over): the lost nodes' places can be dropped (shrink) or refilled (replacement node)
        whole. A live rank of a lost node runs on another node's former spare: a shrink would drop its place
        and leave its process running outside the job."""
        return (all(self._home.get(r) in self._lost for r in dead)
                and all(self._holders.get(r) == n and n not in self._lost
                        for r, n in self._home.items() if r not in dead))

    def _can_await(self, dead: list[int]) -> bool:
        """A fixed ``--nnodes N`` whose lost nodes' ranks no spare can take: the survivors wait in their
        processes for replacement nodes when every dead rank is a lost node's and every live rank runs on its
        layout node (the replacement then takes exactly the lost nodes' places)."""
        return (self._min_nodes is None and self._nodes > 1 and bool(self._lost) and not self._stood_by()
                and self._only_lost_nodes(dead) and {r for r, n in self._home.items() if n in self._lost} <= set(dead))

    def _await_node(self, worker_group: WorkerGroup, attempt: int, dead: list[int], detected: float) -> None:
        """Announce that the lost nodes' ranks wait for replacement nodes (kind ``"await"``): the survivors
        leave the attempt, keep their processes and state, and wait up to the rendezvous's join timeout; the
        replacement's agent joins the rendezvous, torch elastic sees a waiting node and ``_restart_workers``
        forms the next round with the survivors' workers kept (``_replacement_attempt``)."""
        wait_s = _join_timeout_s(worker_group.spec.rdzv_handler)
        protocol.publish(self._store_client(worker_group), self._keys, attempt, kind="await", failed=dead,
                         detected_at=detected, lost=sorted(self._lost), wait_s=wait_s)
        self._awaiting = set(dead)
        self._seen = self._attempt = attempt
        self._remaining_restarts -= 1
        print(f"moe-ft launch: no spare for ranks {', '.join(map(str, dead))} of lost node(s) {sorted(self._lost)}; "
              f"attempt {attempt}: the other workers keep their processes and wait up to {wait_s:.0f} s for a "
              "replacement node", flush=True)

    def _shrink(self, worker_group: WorkerGroup, attempt: int, dead: list[int], detected: float) -> None:
        """Announce the job without the lost nodes: the live nodes keep their order, their ranks are
        renumbered contiguously (``resize.ranks``: old → new), the world is smaller; the workers keep
        their processes and re-plan as after an elastic restart."""
        per_node = worker_group.spec.local_world_size
        live = [n for n in range(self._nodes) if n not in self._lost]
        index = {n: i for i, n in enumerate(live)}
        ranks = {r: index[n] * per_node + r % per_node for r, n in self._home.items() if n in index}
        resize = {"ranks": ranks, "world_size": len(live) * per_node, "nodes": index}
        protocol.publish(self._store_client(worker_group), self._keys, attempt, kind="inprocess", failed=dead,
                         detected_at=detected, lost=sorted(self._lost), resize=resize)
        self._apply_resize(json.loads(json.dumps(resize)), dead)
        self._seen = self._attempt = attempt
        self._remaining_restarts -= 1
        print(f"moe-ft launch: no spare for ranks {', '.join(map(str, dead))} of lost node(s) "
              f"{sorted(self._lost)}; attempt {attempt} shrinks the job to {resize['world_size']} ranks on "
              f"{len(live)} node(s), the workers keep their processes", flush=True)

    def _apply_resize(self, resize: dict, failed: list[int]) -> None:
        """Take in a shrink (JSON form: string keys) whose announcement covers the dead ranks ``failed``: this
        node's workers under their new ranks. A rank that died here since the shrink was decided (not among
        ``failed``) stays dead under its new number, for this agent's next decision: forgotten, it had no
        process and nobody replaced it."""
        ranks = {int(old): new for old, new in resize["ranks"].items()}
        for rank in sorted(set(self._workers) - set(ranks)):  # refused by _only_lost_nodes: never left running
            log.warning("moe-ft launch: the shrink drops rank %d, which runs on this node: its worker is stopped",
                        rank)
            self._workers[rank].context.close(timeout=self._shutdown_timeout)
        self._workers = {ranks[r]: p for r, p in self._workers.items() if r in ranks}
        self._home = {ranks[r]: n for r, n in self._home.items() if r in ranks}
        self._holders = dict(self._home)
        self._dead = {ranks[r]: seen for r, seen in self._dead.items() if r in ranks and r not in failed}
        self._freed = {ranks[r]: device for r, device in self._freed.items() if r in ranks and r not in failed}
        self._world, self._groups = int(resize["world_size"]), {int(n): g for n, g in resize["nodes"].items()}

    def _announce_fallback(self, worker_group: WorkerGroup, failed: list[int], reason: str,
                           attempt: int | None = None, then: str = "every worker starts again",
                           recovery_gave_up: bool = False) -> None:
        """Tell every worker to leave for a full restart (kind ``"fallback"``); ``attempt``: the decision
        lock already held. Another agent deciding meanwhile: its attempt stands, the restart follows anyway.
        ``recovery_gave_up``: the workers could not go on in the attempt before (they gave up forming it, or
        stopped on purpose in it); when that attempt spent a restart for its failure, the announcement says
        so (``spent_by``) and every agent gives that restart back (:meth:`_refund_recovery`)."""
        store = self._store_client(worker_group)
        if attempt is None:
            newest = protocol.current_attempt(store, self._keys)
            if protocol.announcement(store, self._keys, newest).get("kind") == "fallback":
                # another agent's fallback is what made these workers leave: one full restart covers both,
                # and its reason (the first cause) stays the one the report shows
                print(f"moe-ft launch: {reason}: the full restart of attempt {newest} covers it", flush=True)
                self._seen = self._attempt = newest
                self._falling_back = True
                return
            attempt = protocol.lock_next(store, self._keys, by=f"node{self._node}")
        if attempt is None:
            return
        extra = {}
        if recovery_gave_up and _spends_restart(protocol.announcement(store, self._keys, attempt - 1)):
            extra["spent_by"] = attempt - 1
        protocol.publish(store, self._keys, attempt, kind="fallback", failed=failed,
                         detected_at=min(self._dead.values(), default=time.time()), reason=reason, **extra)
        print(f"moe-ft launch: {reason}: {then}", flush=True)
        self._seen = self._attempt = attempt
        self._falling_back = True

    def _refund_recovery(self, worker_group: WorkerGroup) -> None:
        """One failure spends one of ``--max-restarts``, however it is recovered. When the in-process attempt
        that spent one for a failure falls back (the fallback says ``spent_by``), the full restart torch
        elastic is about to spend another on is the same failure's: give one back (once per fallback), so
        that ``--max-restarts 1`` survives one failure whose in-process recovery fell back."""
        info = protocol.announcement(self._store_client(worker_group), self._keys, self._seen)
        if info.get("kind") == "fallback" and "spent_by" in info and self._refunded != self._seen:
            self._refunded = self._seen
            self._remaining_restarts = min(self._remaining_restarts + 1, worker_group.spec.max_restarts)

    def _assign(self, worker_group: WorkerGroup, attempt: int, dead: list[int],
                claims: _Claims | None = None) -> tuple[dict[int, tuple[int, str]], list[int], list[int]]:
        """Give each dead rank a process as :func:`plan_replacements` orders it, claiming remote spares
        with ``compare_set`` (one another agent claimed first is skipped); every claim, spare and device
        taken is recorded in ``claims`` (:meth:`_undo` gives them back). Returns ``(rank → (node, slot),
        ranks given fresh processes, ranks left without one)``."""
        claims = _Claims() if claims is None else claims
        store = self._store_client(worker_group)
        remote = self._listed_spares(store)
        plan, missing = plan_replacements(dead, node=self._node, holders=self._holders,
                                          local_spares=len(self._spares), free_devices=self._free_devices(worker_group),
                                          remote_spares=len(remote))
        assignments: dict[int, tuple[int, str]] = {}
        fresh = []
        for rank, source in plan:
            if source != "remote":
                device = self._freed.pop(rank, None)  # the rank ran here: its successor takes its device
                if device is not None:
                    claims.freed[rank] = device
                proc = self._claim_local(store, attempt, rank, device, claims) if source == "local" else None
                if proc is None and self._holders.get(rank) == self._node:
                    # a fresh process on a free device of this node, imports while the others wait (planned,
                    # or the local spares planned were claimed by other agents meanwhile)
                    device = self._free_device(worker_group) if device is None else device
                    if device is not None:
                        proc = self._start_spare(worker_group, device)
                        fresh.append(rank)
                        claims.fresh.append((rank, proc))
                        claim = protocol.claim_spare(store, self._keys, proc.slot, attempt, rank, proc.local_rank,
                                                     world_size=self._world, group_rank=self._groups[self._node])
                        assert claim is not None, f"spare {proc.slot} was started a moment ago: nobody claimed it"
                        claims.store.append((proc.slot, claim))
                if proc is not None:
                    self._workers[rank] = proc
                    assignments[rank] = (self._node, proc.slot)
                    continue
                if device is not None:  # none here after all: the device stays the rank's for a later pass
                    self._freed[rank] = device
                    del claims.freed[rank]
            while remote:  # a spare another node lists
                node, slot, device = remote.pop(0)
                claim = protocol.claim_spare(store, self._keys, slot, attempt, rank, device, world_size=self._world,
                                             group_rank=self._groups[node])
                if claim is not None:
                    claims.store.append((slot, claim))
                    assignments[rank] = (node, slot)
                    break
            else:
                missing.append(rank)
        return assignments, fresh, missing

    def _claim_local(self, store, attempt: int, rank: int, device: int | None, claims: _Claims) -> _Process | None:
        """Give ``rank`` a spare of this node (``device``: the index the rank's dead process held, which the
        spare takes). Another node's agent may have claimed the spare for a lost node's rank since this
        node's last pass (it is listed in the store): the spare then runs that rank here, as
        :meth:`_adopt_claimed_spares` would have found, and the next one is tried (one whose claim no
        announcement names, left by a fallback, stays a spare). ``None``: none left."""
        kept: list[_Process] = []
        try:
            while self._spares:
                proc = self._spares.pop(0)
                index = proc.local_rank if device is None else device
                claim = protocol.claim_spare(store, self._keys, proc.slot, attempt, rank, index, world_size=self._world,
                                             group_rank=self._groups[self._node])
                if claim is not None:
                    claims.store.append((proc.slot, claim))
                    claims.local.append((rank, proc, proc.local_rank))
                    self._spare_exits = 0  # spares work here: the bound counts exits in a row
                    proc.local_rank = index  # the spare's own index goes to the next spare started
                    return proc
                taken = protocol.spare_assignment(store, self._keys, proc.slot)
                if taken is not None and protocol.claim_stands(store, self._keys, proc.slot, taken):
                    self._workers[taken["rank"]] = proc
                else:
                    kept.append(proc)
            return None
        finally:
            self._spares[:0] = kept

    def _free_devices(self, worker_group: WorkerGroup) -> int:
        used = {p.local_rank for p in [*self._workers.values(), *self._spares]}
        return len([i for i in range(worker_group.spec.local_world_size + self._spares_per_node) if i not in used])

    def _listed_spares(self, store) -> list[tuple[int, str, int]]:
        """``(node, slot, device)`` of the waiting spares the other live nodes list."""
        out = []
        for node in range(self._nodes):
            if (node == self._node or node in self._lost or self._has_finished(store, node)
                    or not store.check([self._keys.node_spares(node)])):
                continue
            out += [(node, s["slot"], s["local_rank"]) for s in json.loads(store.get(self._keys.node_spares(node)))]
        return out


def rank_homes(groups: dict[int, int], *, per_node: int, world_size: int, attempt: int) -> dict[int, int]:
    """Rank → the node of this rendezvous round that runs it, from ``groups`` (round node → its place in the
    layout: the identity, or what a replacement's attempt announced). Every place of the layout must have a
    node: a mapping that leaves one out (an announcement from another round, or two nodes in one place)
    raises naming it instead of leaving ranks without a home."""
    places = list(range(-(-world_size // per_node)))
    taken: dict[int, list[int]] = {}
    for node, place in groups.items():
        taken.setdefault(place, []).append(node)
    missing = [p for p in places if p not in taken]
    shared = {p: ns for p, ns in taken.items() if len(ns) > 1}
    if missing or shared:
        raise RuntimeError(f"moe-ft launch: attempt {attempt} places the round's nodes at {dict(sorted(groups.items()))} "
                           f"(node -> place in the layout of {len(places)} places of {per_node} ranks)"
                           + (f"; no node at place(s) {missing}" if missing else "")
                           + (f"; several nodes at {shared}" if shared else "")
                           + ": the ranks there would have no process. Restart the job (torchrun restarts it from "
                             "its snapshots); please report this with the launch logs")
    place_node = {place: nodes[0] for place, nodes in taken.items()}
    return {rank: place_node[rank // per_node] for rank in range(world_size)}


def plan_replacements(dead: list[int], *, node: int, holders: dict[int, int], local_spares: int, free_devices: int,
                      remote_spares: int) -> tuple[list[tuple[int, str]], list[int]]:
    """Which process takes each dead rank (the policy of ``SpareAgent._assign``; pure). ``node``: the
    deciding agent's; ``holders``: rank → the node that ran it. In order:

    * the ranks of other nodes (a lost node's) first: they can go only to spares, this node's
      (``"local"``) then those other nodes list (``"remote"``);
    * this node's own dead ranks: a local spare, else a fresh process on a free device of this node
      (``"fresh"``: the rank's state is in this node's store, a warm spare elsewhere would have to fetch
      it), else a remote spare.

    Returns ``([(rank, source)], ranks left without a process)``. When the spares cannot take every other
    node's rank, nothing is planned and those left over are returned (the caller shrinks or falls back)."""
    others = [r for r in dead if holders.get(r) != node]
    if len(others) > local_spares + remote_spares:
        return [], others[local_spares + remote_spares:]
    plan: list[tuple[int, str]] = []
    missing: list[int] = []
    for rank in others + [r for r in dead if r not in others]:
        if local_spares:
            local_spares -= 1
            plan.append((rank, "local"))
        elif rank not in others and free_devices:
            free_devices -= 1
            plan.append((rank, "fresh"))
        elif remote_spares:
            remote_spares -= 1
            plan.append((rank, "remote"))
        else:
            missing.append(rank)
    return plan, missing


def _spends_restart(info: dict) -> bool:
    """Whether an announced attempt spent one of ``--max-restarts`` (it replaced failed ranks in process, or
    made the survivors wait for a replacement node; a grow spends none)."""
    return info.get("kind") == "await" or (info.get("kind") == "inprocess" and bool(info.get("failed")))


def _is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is in a job-control stop (state ``T``; not a debugger's tracing stop)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:  # gone, or not ours to read
        return False


def _round_or_pid(handler) -> str:
    """The rendezvous round (``r<n>``), or this agent's pid (``p<pid>``) under a handler without rounds."""
    try:
        return f"r{_rendezvous_round(handler)}"
    except RuntimeError:
        return f"p{os.getpid()}"


def _join_timeout_s(handler) -> float:
    """The rendezvous's join timeout (``--rdzv-conf join_timeout``, torch's default 600 s): how long the
    survivors wait for a replacement node."""
    try:
        return float(handler._settings.timeout.join.total_seconds())
    except AttributeError:
        return 600.0


def _rendezvous_round(handler) -> int:
    """The rendezvous round the agents just completed (torch 2.13's ``DynamicRendezvousHandler`` keeps it
    in its state holder): the same number on every node, so it names the full restart's attempt."""
    try:
        return int(handler._state_holder.state.round)
    except AttributeError:
        raise RuntimeError("moe-ft launch needs the c10d/etcd-v2 dynamic rendezvous (torch 2.13's "
                           "DynamicRendezvousHandler) to number full restarts across nodes") from None
