"""The durable tier's runtime component (MoC §5.1 two-level): after every snapshot it hands the due
iteration to the writer (the trainer's background thread, or the node agent with ``--ft-persist-agent``),
keeps rank 0's progress record in the tier, and forgets the abandoned timeline after a recovery."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from moe_ft.agent.persist import AgentPersistence
from moe_ft.persist.durable import DurableTier
from moe_ft.persist.megatron_dense import MegatronDenseWriter
from moe_ft.persist.writer import PersistWriter
from moe_ft.recovery.progress import write_progress
from moe_ft.runtime.components import Component
from moe_ft.state.operators import Level

if TYPE_CHECKING:
    from moe_ft.persist.config import DurableConfig


class Durable(Component):
    """The durable tier (MoC §5.1 two-level): background copies of recovery points, plus Megatron-format
    copies when every point of the policy is dense (plain Megatron loads them)."""

    def __init__(self, writer, megatron_dense, rank: int, popularity=None) -> None:
        self.writer, self.megatron_dense, self.rank = writer, megatron_dense, rank
        self.popularity = popularity
        """The job's :class:`moe_ft.popularity.ExpertPopularity`: told which experts a partial persist plan
        wrote (``None``: nobody counts)."""

    @classmethod
    def build(cls, config: "DurableConfig", ctx, session) -> "Durable":
        """``config`` with its root resolved (:meth:`DurableConfig.resolved`) and an interval."""
        tier = DurableTier(config.dir, session.job_id, ctx.world_size)
        writer: PersistWriter | AgentPersistence
        if config.agent:  # the node agent copies; the trainer sends iteration numbers
            writer = AgentPersistence(session.store, tier, session.retention_rule, rank=ctx.rank,
                                      interval=config.interval, keep=config.keep,
                                      job_id=session.job_id,
                                      agent_dir=os.path.join(session.store_root, session.job_id, "agent"),
                                      idle_exit_s=config.agent_idle_exit)
        else:
            writer = PersistWriter(session.store, tier, session.retention_rule, rank=ctx.rank, interval=config.interval,
                                   keep=config.keep, publish_timeout=config.publish_timeout)
        # this run owns every iteration after its start: an earlier run's done markers and partial points past
        # it (a rank killed before the others finished the point) would otherwise join this run's parts into
        # a "complete" point the moment this run's other ranks mark theirs done; complete points are kept
        tier.discard_after(ctx.rank, ctx.start_iteration - 1)
        dense = None
        if session.policy.dense_points:
            dense = MegatronDenseWriter(config.dir, ctx.state)
        return cls(writer, dense, ctx.rank, ctx.popularity)

    @property
    def directory(self) -> Path:
        return self.writer.tier.directory

    def after_snapshot(self, iteration, plan, session, replaying) -> None:
        due = self.writer.due(iteration)
        persist_plan = session.policy.persist_plan(iteration, plan) if due else None
        self.writer.submit(iteration, persist_plan)
        if persist_plan is not None and self.popularity is not None:
            # two-level PEC (MoC §5.1): a durable point restores an expert from its last persisted FULL, which
            # can be older than its last snapshot FULL; the recovery counts its loss from there
            self.popularity.mark_persisted(iteration, [op for op, lvl in persist_plan.items() if lvl == Level.FULL])
        if self.megatron_dense is not None:
            dense = bool(plan) and all(lvl == Level.FULL for lvl in plan.values())
            if dense and due and not replaying:
                self.megatron_dense.save(iteration + 1)  # collective; the write runs in the background
            self.megatron_dense.poll()

    def after_iteration(self, iteration: int) -> None:
        if self.rank == 0:  # outlives every node (one small file, rank 0)

            write_progress(self.directory / "progress", iteration)

    def after_recovery(self, report, session) -> None:
        self.writer.settle()
        self.writer.tier.discard_after(self.rank, report.recovery_point["resume"] - 1)
        self.writer.rule = session.retention_rule  # the restored policy's windows

    def after_reconfigure(self, session) -> None:
        self.writer.rule = session.retention_rule  # the operators this rank holds now

    def metrics(self, record) -> dict:
        out: dict[str, float | str] = {}
        if isinstance(self.writer, AgentPersistence) and (ms := self.writer.agent_cpu_ms_per_iteration()) is not None:
            out["agent_cpu_ms"] = ms  # the node agent's CPU, not the trainer's
        paused = self.writer.paused or (self.megatron_dense.paused if self.megatron_dense is not None else "")
        if paused:
            out["durable_paused"] = paused
        ends = self.writer.tier.complete_points() if self.writer.records else []
        if not ends:
            return out
        p = self.writer.records[-1]  # the newest point every rank finished, not this rank's newest flush
        return {**out, "persist_end": ends[-1], "persist_mb_s": p.nbytes / 1e6 / max(p.seconds, 1e-9)}

    def close(self) -> None:
        self.writer.close()
        if self.megatron_dense is not None:
            self.megatron_dense.close()
