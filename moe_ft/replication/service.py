"""Replication and persistence as the runtime uses them: built once (collectively) at the end of the first
iteration, fed one iteration number per step, closed at the end of training. Keeps ``runtime.py`` to a few
calls. Layout facts (nodes, data-parallel groups) are gathered here so that every rank computes the same
placement.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.distributed as dist
from megatron.core import parallel_state as ps

from moe_ft import comm
from moe_ft.agent.replicas import ReplicaSelect
from moe_ft.agent.replication import AgentReceiver, AgentSender, agent_endpoints
from moe_ft.replication.fetch import FetchResult, FetchTopology, fetch_from_peers
from moe_ft.replication.placement import (
    ReplicaPlacementConfig,
    ReplicaPlan,
    has_copy_off_node,
    nodes_from_places,
    place_replicas,
)
from moe_ft.replication.receiver import ReceiverConfig, ReplicaReceiver, replica_store_config
from moe_ft.replication.recompute_stream import RecomputeReceiver, RecomputeSender
from moe_ft.replication.sender import ReplicaSender, SenderConfig
from moe_ft.replication.transport import GlooTransport, GlooTransportConfig
from moe_ft.state.operators import Level

logger = logging.getLogger("moe_ft.replication")

ABANDON_RELEASE_S = 2.0
"""How long a failed attempt waits for its replica streams to end before it gives up their stores
(:meth:`ReplicaReceiver.release`): they end as soon as the failed peers' connections close."""


@dataclass(kw_only=True)
class Layout:
    """What placement needs to know about the job (identical on every rank)."""

    rank: int
    node_of: list[int]
    dp_groups: list[list[int]]
    expert_dp_groups: list[list[int]]
    distributed_optimizer: bool
    simulated: bool = False
    """Nodes simulated by rank blocks in a job of one launcher agent (``--ft-ranks-per-node``): the ranks
    share one store root, so only the placement says which simulated node holds which replicas."""

    @staticmethod
    def gather(*, ranks_per_node: int, distributed_optimizer: bool) -> "Layout":
        """Collective over all ranks (host path). Nodes are where the ranks run now (each rank's launcher
        group, ``GROUP_RANK``: a rank a spare of another node took over counts there); a job of one launcher
        group simulates nodes by ``ranks_per_node`` (0 = ``LOCAL_WORLD_SIZE``) rank blocks."""

        world, rank = dist.get_world_size(), dist.get_rank()
        per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        mine = (dist.get_process_group_ranks(ps.get_data_parallel_group()),
                dist.get_process_group_ranks(ps.get_expert_data_parallel_group()),
                int(os.environ.get("GROUP_RANK", "0")))
        everyone = comm.all_gather_object(mine)
        unique = lambda groups: [list(g) for g in sorted({tuple(g) for g in groups})]
        groups = [e[2] for e in everyone]
        return Layout(rank=rank, node_of=nodes_from_places(groups, ranks_per_node=per_node),
                      dp_groups=unique(e[0] for e in everyone), expert_dp_groups=unique(e[1] for e in everyone),
                      distributed_optimizer=distributed_optimizer, simulated=len(set(groups)) == 1)

    def group_of(self, groups: list[list[int]]) -> list[int]:
        return next(g for g in groups if self.rank in g)


class ReplicaFetch:
    """Rebuilds node-local stores from the replicas other ranks hold and from data-parallel peers after a
    node loss (``fetch.py``), whatever placement put the replicas where they are: every rank offers the
    replica stores its node holds, so a rank that a spare on another node took over in an earlier
    generation, or a placement that changed since, still finds its copies."""

    def __init__(self, layout: Layout, *, store_root: str, job_id: str, planned=None) -> None:
        """``planned``: the owners the placement gives this rank, for simulated nodes (``Layout.simulated``),
        whose replica stores share one root: there the plan, not the directory, says what a node holds."""
        self.layout, self.store_root, self.job_id = layout, store_root, job_id
        self.planned = None if planned is None else sorted(planned)
        self._stores: dict[int, object] = {}

    def owners_here(self) -> list[int]:
        """Owners whose replica store this node holds."""
        if self.planned is not None:
            return list(self.planned)
        root = Path(replica_store_config(root=self.store_root, job_id=self.job_id, owner=0).directory).parent
        found = []
        for d in root.iterdir() if root.is_dir() else ():
            if d.is_dir() and d.name.startswith("rank") and d.name[4:].isdigit():
                found.append(int(d.name[4:]))
        return sorted(found)

    def store(self, owner: int):
        store = self._stores.get(owner)
        if store is None:
            shared = replica_store_config(root=self.store_root, job_id=self.job_id, owner=owner)
            store = shared.build() if self.planned is None or shared.directory.is_dir() else None
            if self.planned is not None:  # simulated nodes share a root: each holder's copies are its own (the
                # shared directory holds what real nodes received before their ranks met on one node)
                mine = replica_store_config(root=self.store_root, job_id=self.job_id, owner=owner,
                                            holder=self.layout.rank).build()
                if store is None or max(mine.points(), default=-1) > max(store.points(), default=-1):
                    store = mine
            self._stores[owner] = store
        return store

    def fetch_missing(self, local) -> FetchResult:
        """Rebuild this rank's node-local store from replica holders and data-parallel peers when it lost
        points they hold (a replaced node). Collective; call before recovery agrees."""
        lay = self.layout
        group = lambda groups: {r: g for g in groups for r in g}  # noqa: E731
        topo = FetchTopology(dp_group=group(lay.dp_groups), expert_dp_group=group(lay.expert_dp_groups),
                             distributed_optimizer=lay.distributed_optimizer)
        return fetch_from_peers(local=local, rank=lay.rank, world_size=len(lay.node_of), topo=topo,
                                replica_store_of=self.store, replica_owners=self.owners_here())


class Replication:
    """Sender + receiver of one rank over a dedicated gloo group (build with :meth:`build`)."""

    def __init__(self, sender: ReplicaSender, receiver: ReplicaReceiver, plan: ReplicaPlan, layout: Layout, *,
                 compute_only: bool = False) -> None:
        self.sender, self.receiver, self.plan, self.layout = sender, receiver, plan, layout
        self.compute_only = compute_only
        """``--ft-optimizer-recompute-local compute``: see :meth:`remote_full`."""
        self.remote_chosen = 0
        """Expert snapshots whose FULL state was left to the peers so far."""

    @staticmethod
    def build(*, num_replicas: int, layout: Layout, store, store_root: str, job_id: str,
              remote_budget=None, recompute=None, compute_only: bool = False,
              agent=None, keep_points: Callable[[], int] = lambda: 8) -> "Replication | None":
        """Collective (the dedicated group). ``None`` when there is nothing to replicate to: ``r = 0``, or a
        single-node job (no other failure domain; logged). ``remote_budget``: a callable returning
        ``B_remote`` (bytes per iteration this rank may send, MoEtion §4.2; read at every submit so it may
        follow ``T_iter``), or ``None`` for no limit (``sender.py``). ``agent``: the node agent's client, when
        the agents move the replicas (``moe_ft/agent/replication.py``; no gloo group then). ``recompute``: a callable returning the
        :class:`~moe_ft.replication.optim_recompute.GradCapture` of this rank, to send continuing experts as
        gradients and recompute their optimizer step on the peers (MoEtion §5.2, ``recompute_stream.py``).
        ``keep_points``: how many newest points the holders keep of this rank's replicas, and this rank of its
        sources' (:func:`~moe_ft.replication.receiver.points_to_keep`; the agents are told at every point)."""
        if num_replicas == 0:
            return None
        if len(set(layout.node_of)) == 1:
            if layout.rank == 0:
                logger.warning("moe-ft: --ft-replicas %d ignored: all ranks are on one node (no other failure "
                               "domain); set --ft-ranks-per-node to simulate nodes", num_replicas)
            return None
        num_nodes = len(set(layout.node_of))
        if num_replicas > num_nodes - 1:  # each replica needs a node of its own, other than the owner's
            if layout.rank == 0:
                logger.warning("moe-ft: --ft-replicas %d lowered to %d: the job has %d nodes and each replica "
                               "lives on a node other than its owner's (and the other replicas')", num_replicas,
                               num_nodes - 1, num_nodes)
            num_replicas = num_nodes - 1
        plan = place_replicas(ReplicaPlacementConfig(num_replicas=num_replicas), node_of=layout.node_of,
                              dp_groups=layout.dp_groups)
        dp_off = has_copy_off_node(layout.rank, layout.group_of(layout.dp_groups), layout.node_of)
        edp_off = has_copy_off_node(layout.rank, layout.group_of(layout.expert_dp_groups), layout.node_of)
        select = ReplicaSelect(dp_copy_off_node=dp_off, expert_dp_copy_off_node=edp_off,
                               distributed_optimizer=layout.distributed_optimizer)
        holder = layout.rank if layout.simulated else None  # simulated nodes share one root: a dir per holder
        store_for = lambda owner: replica_store_config(root=store_root, job_id=job_id, owner=owner,  # noqa: E731
                                                       holder=holder).build()
        if agent is not None:
            ends = agent_endpoints(agent, rank=layout.rank, store_root=store_root, job_id=job_id,
                                   per_holder=holder is not None)
            sender = AgentSender(agent, rank=layout.rank, store=store, select=select, budget=remote_budget,
                                 peers=[ends[p] for p in plan.peers[layout.rank]], keep=keep_points)
            receiver = AgentReceiver(agent, rank=layout.rank, sources=plan.sources[layout.rank], store_for=store_for)
            return Replication(sender, receiver, plan, layout)  # type: ignore[arg-type]
        config = GlooTransportConfig()
        transport = GlooTransport(config, config.build_group())
        receiver_cls, sender_cls, sender_extra = ReplicaReceiver, ReplicaSender, {}
        if recompute is not None:
            receiver_cls, sender_cls, sender_extra = RecomputeReceiver, RecomputeSender, {"capture": recompute()}
        receiver = receiver_cls(ReceiverConfig(keep=keep_points), transport, plan.sources[layout.rank], store_for)
        sender = sender_cls(SenderConfig(), store, transport, plan.peers[layout.rank], owner=layout.rank,
                            select=select, budget=remote_budget, **sender_extra)
        return Replication(sender, receiver, plan, layout, compute_only=compute_only and recompute is not None)

    @property
    def capture(self):
        """The gradient capture of optimizer recomputation (``None`` when off)."""
        return getattr(self.sender, "capture", None)

    def begin_iteration(self, iteration: int) -> None:
        """Before the iteration's optimizer step (optimizer recomputation labels its captures)."""
        if self.capture is not None:
            self.capture.begin(iteration)

    def remote_full(self, iteration: int, plan) -> frozenset:
        """The experts whose FULL state at ``iteration`` is left to the peers (MoEtion §5.2: the owner
        snapshots only their compute weights), with ``--ft-optimizer-recompute-local compute``: those FULL in
        ``plan`` that the newest message already sent carried at ``iteration - 1`` and whose gradients of
        ``iteration`` were captured. The sender sends points in order and only this rule's way (no budget),
        so its next message is this point and carries them as gradients; any other expert is written FULL
        here as usual. Training thread, before the engine takes the snapshot."""
        if not self.compute_only:
            return frozenset()
        last = self.sender.last_sent
        if last is None or last[0] != iteration - 1:
            return frozenset()
        wanted = [op for op, lvl in plan.items() if op.is_expert and lvl == Level.FULL and op in last[1]]
        chosen = self.capture.complete(iteration, wanted)
        self.remote_chosen += len(chosen)
        return chosen

    def track(self, plan) -> None:
        """After the snapshot of an iteration: the experts it saved FULL are the ones whose next gradients
        optimizer recomputation may send instead of their FULL state (MoEtion Alg. 3)."""
        if self.capture is not None:
            self.capture.track(op for op, lvl in plan.items() if op.is_expert and lvl == Level.FULL)

    def submit(self, iteration: int, plan=None) -> None:
        """Replicate point ``iteration`` (only the operators ``plan`` saves FULL, if given: a policy's
        remote plan, e.g. ``SelectivePolicy.remote_plan``)."""
        self.sender.submit(iteration, plan)

    def discard_after(self, iteration: int) -> None:
        """Drop the replicas this rank holds of points newer than ``iteration`` (after a rollback)."""
        for owner in self.plan.sources[self.layout.rank]:
            self.receiver.store(owner).discard_after(iteration)
        if hasattr(self.receiver, "reset"):  # recomputed optimizer states of the abandoned timeline
            self.receiver.reset()
            self.sender.reset()  # the peers dropped them: the next point of every expert goes FULL

    def metrics(self, iteration: int) -> dict:
        sent = self.sender.sent
        out = {"replication_lag": self.sender.lag(iteration),
               "replication_bytes": sent[-1].nbytes if sent else 0,
               "replication_deferred": len(self.sender.deferred),
               "replica_rejections": len(self.receiver.rejections)}
        agent_cpu = getattr(self.sender, "agent_cpu", None)  # replication by the node agent
        if agent_cpu is not None and (ms := agent_cpu.ms_per_iteration()) is not None:
            out["agent_cpu_ms"] = ms
        if self.capture is not None:  # experts sent as gradients / recomputed here / failed recomputations
            records = self.sender.records
            out.update(recompute_sent=records[-1].num_gradients if records else 0,
                       recomputed=len(self.receiver.recomputed), recompute_failures=len(self.receiver.failures))
            if self.compute_only:
                out["recompute_lost"] = len(self.sender.lost)
        return out

    def abandon(self) -> None:
        """A failed attempt: the node agent stops sending this rank's points without ending its streams (the
        trainer's own threads are left to the failed attempt's groups), and the replica stores whose streams
        ended are given up, so that the next attempt's placement may give their owners to a rank in another
        process of this node (a spare that took a lost node's rank)."""
        if isinstance(self.sender, AgentSender):
            self.sender.abandon()
        if isinstance(self.receiver, ReplicaReceiver):  # another process of this node may receive them next
            self.receiver.release(timeout=ABANDON_RELEASE_S)

    def close(self, snapshots=()) -> None:
        """Collective in effect: every rank's receiver waits for its sources to close their streams.
        ``snapshots``: the engine's :class:`SnapshotRecord` list, summarised on the recomputation line."""
        try:
            self.sender.close()
            self.receiver.join(timeout=600)
        finally:  # the node agent leaves once every rank said bye: also when a stream did not end
            if isinstance(self.sender, AgentSender):
                self.sender.client.bye()
        if self.capture is not None:  # one line per rank: what MoEtion Alg. 3 saved on the wire
            records = self.sender.records
            grads, full = sum(r.gradient_bytes for r in records), sum(r.replaced_bytes for r in records)
            # one write per line: ranks share the job's stdout, and print() writes the newline separately
            sys.stdout.write(f"moe-ft optimizer recomputation rank {self.layout.rank}: {len(records)} points sent "
                             f"{sum(r.num_gradients for r in records)} experts as gradients ({grads / 1e6:.3f} MB for "
                             f"{full / 1e6:.3f} MB of FULL state) and {sum(r.num_full for r in records)} as FULL "
                             f"({sum(r.full_bytes for r in records) / 1e6:.3f} MB), capture {self.capture.seconds:.3f} s; "
                             "recomputed "
                             f"{len(self.receiver.recomputed)} for its sources in {self.receiver.seconds:.3f} s, "
                             f"{len(self.receiver.failures)} failed"
                             + (f"; compute weights only for {self.remote_chosen} expert snapshots, "
                                f"{len(self.sender.lost)} lost" if self.compute_only else "")
                             + (f"; snapshots wrote {sum(r.bytes for r in snapshots) / 1e6:.3f} MB, hashed "
                                f"{sum(r.remote_bytes for r in snapshots) / 1e6:.3f} MB for the peers, engine "
                                f"thread {sum(r.thread_cpu_s for r in snapshots):.3f} s CPU "
                                f"({sum(r.entries_cpu_s for r in snapshots):.3f} s on entries)" if snapshots else "")
                             + "\n")
            sys.stdout.flush()
