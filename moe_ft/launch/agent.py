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

**Layers.** :class:`SpareAgent` is built in layers, one job each, every layer using only those below it:

* ``state.py`` (:class:`~moe_ft.launch.state.AgentState`): what the agent holds, and the launch store;
* ``processes.py`` (:class:`~moe_ft.launch.processes.ProcessSupervision`): each process's context,
  environment, collection and stop;
* ``membership.py`` (:class:`~moe_ft.launch.membership.JobMembership`): the attempts of rendezvous rounds,
  the other agents' announcements, the heartbeat watch;
* ``spares.py`` (:class:`~moe_ft.launch.spares.SpareBookkeeping`): this node's spares, and the processes
  each dead rank is given;
* ``decisions.py`` (:class:`~moe_ft.launch.decisions.RecoveryDecisions`): the attempt announced after a
  failure;
* this module: torch elastic's hooks (start, restart, monitor, stop, exit barrier).

The policy those decisions follow is pure functions of the agents' view (``policy.py``); ``logs.py`` says
where each process logs.
"""

from __future__ import annotations

import signal
import time
from typing import Any

# torch elastic logs a worker's failure through torch's log formatter, which imports torch._dynamo on the
# first exception it formats: about 1 s on a slow machine, in the monitor pass that handles the first
# failure -- long enough to stall this node's heartbeat past a short --node-timeout (the other agents then
# declare a live node lost) and to delay every first recovery. Imported here, before any worker starts.
import torch._dynamo  # noqa: F401
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState

from moe_ft.launch import policy, protocol
from moe_ft.launch.decisions import RecoveryDecisions
from moe_ft.launch.membership import round_or_pid


class SpareAgent(RecoveryDecisions):
    """``LocalElasticAgent`` with per-worker processes, warm spares and in-process replacement."""

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        keep = self._regrouping  # a node joins: this node's workers stay (``_restart_workers``)
        kept = self._workers if keep else {}
        if not keep:
            self._close_all()
        spec = worker_group.spec
        per_node = spec.local_world_size
        self._node, self._nodes = worker_group.group_rank or 0, worker_group.group_world_size or 1
        self._round_tag = round_or_pid(spec.rdzv_handler)
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
            self._home = policy.rank_homes(self._groups, per_node=per_node, world_size=self._world, attempt=self._attempt)
            self._holders = dict(self._home)
            self._lost, self._dead, self._watch, self._seen = set(), {}, None, self._attempt
            self._finished_nodes = set()
            self._join_refused = False
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
        if healthy and self._may_grow() and self._job_ending(worker_group):
            return  # the node joins no more: the job ends, and the round with it
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

    def _job_ending(self, worker_group: WorkerGroup) -> bool:
        """Whether a worker of this round finished training (this node's, or a node listed ``finished/<round>/<n>``):
        a node that waits to join then does not. Its workers could not form their process groups with ranks that
        have left, and a node already in the exit barrier would wait there for a round it is not part of, until
        the barrier's timeout. Said once per round."""
        store = self._store_client(worker_group)
        done = sorted(({self._node} if self._finished else set())
                      | {n for n in range(self._nodes) if n not in self._lost and self._has_finished(store, n)})
        if done and not self._join_refused:
            self._join_refused = True
            print(f"moe-ft launch: a node waits to join, but the workers of node(s) {done} finished training: the job "
                  "ends without it", flush=True)
        return bool(done)

    def _may_grow(self) -> bool:
        """:func:`~moe_ft.launch.policy.may_grow` for this agent's view."""
        return policy.may_grow(min_nodes=self._min_nodes, max_nodes=self._max_nodes, nodes=self._nodes,
                               lost=self._lost)

    def _layout_intact(self, worker_group: WorkerGroup) -> bool:
        """:func:`~moe_ft.launch.policy.layout_intact` for this node (else torch elastic's restart when a node
        joins)."""
        return policy.layout_intact(node=self._node, per_node=worker_group.spec.local_world_size, dead=self._dead,
                                    home=self._home, devices={r: p.local_rank for r, p in self._workers.items()})

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
        (it counts every node of the rendezvous): wait for the live ones instead, each listed finished in this
        rendezvous round (``finished/<round>/<node>``, which ``_monitor_workers`` sets before the barrier). The
        round is the same on every node; the newest attempt an agent applied is not: an agent whose pass read
        the announcements just before another announced an attempt counted itself under the attempt before,
        the others under the new one, and each side waited out the barrier's timeout. The heartbeat goes on
        while the agent waits here: once the wait runs out (``exit_barrier_timeout``, 300 s) the agent leaves
        and beats no more, and the nodes still training, which watch it, would otherwise declare it lost and
        hand its finished ranks to spares."""
        if not self._inprocess or self._nodes == 1:
            super()._exit_barrier()
            return
        store = self._launch_store
        deadline = time.monotonic() + self._exit_barrier_timeout
        while time.monotonic() < deadline:
            store.add(self._keys.beat(self._node), 1)
            live = [n for n in range(self._nodes) if n not in self._lost]
            if store.check([self._keys.finished(self._round_tag, n) for n in live]):
                return
            time.sleep(0.05)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._started_in_pass = []  # each process started before this pass is held (_workers, _spares) or stopped
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
