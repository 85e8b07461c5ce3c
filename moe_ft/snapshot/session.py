"""One snapshot policy with its node-local store and snapshot engine, as the runtime uses it.

The policy decides, the engine copies, the store keeps: this module only wires them. The store's
retention keeps two recovery points common to all ranks by the policy's own completeness rule
(:meth:`moe_ft.policy.base.SnapshotPolicy.retention_rule`, :class:`KeepTwoRecoverable`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from moe_ft.policy import build_policy
from moe_ft.snapshot import EngineConfig, SnapshotEngine
from moe_ft.snapshot.bubbles import BubbleGate, BubbleSchedule
from moe_ft.snapshot.mapped import store_checksum
from moe_ft.state.operators import Level
from moe_ft.store import StoreConfig
from moe_ft.store.capacity import SNAPSHOT_POINTS
from moe_ft.store.codec import DEFAULT_CHECKSUM
from moe_ft.store.retention import KeepTwoRecoverable

if TYPE_CHECKING:
    from moe_ft.replication.config import ReplicationConfig
    from moe_ft.runtime.context import BuildContext
    from moe_ft.snapshot.config import SnapshotConfig


class SnapshotSession:
    """Policy + store + engine of one configuration (the benchmark runs several side by side)."""

    def __init__(self, name: str, policy, engine, store, *, operators, store_root: str, job_id: str,
                 publisher=None) -> None:
        self.name, self.policy, self.engine, self.store = name, policy, engine, store
        self.operators = list(operators)
        self.store_root, self.job_id = store_root, job_id
        self.last_plan: dict = {}
        self.publisher = publisher
        """The node agent that publishes the store's points (``--ft-publish-by agent``: ``moe_ft/agent/publish.py``)."""

    def realign_retention(self) -> None:
        """Retention by the policy's current rule (after a recovery restored the policy's state, e.g. the
        recorded sparse window rather than one aligned to this run's start)."""
        self.store.retention = KeepTwoRecoverable(rule=self.policy.retention_rule(self.operators))

    def reconfigure(self, registry, iteration: int) -> None:
        """This rank's operators changed after ``iteration`` (an in-run rebalance moved experts): finish the
        copies in flight, copy from ``registry``'s tensors from now on (new host buffers for the new
        operators), make the snapshot of ``iteration`` a dense recovery point (the policy's
        :meth:`~moe_ft.policy.base.SnapshotPolicy.start_dense`) and keep retention on the new operators."""

        config = self.engine.config
        self.engine.close()
        self.engine = SnapshotEngine(config, registry, self.store)
        self.operators = list(registry)
        self.policy.start_dense(iteration)
        self.realign_retention()

    @property
    def retention_rule(self):
        return self.store.retention.rule

    def close(self) -> None:
        try:
            self.engine.close()  # its last points published first
        finally:
            if self.publisher is not None:
                self.publisher.close()

    def metrics(self) -> dict:
        """The FT log line's fields of what serves this session outside the trainer (the publishing agent)."""
        return self.publisher.metrics() if self.publisher is not None else {}


def build_session(config: "SnapshotConfig", ctx: "BuildContext", *, job_suffix: str = "",
                  replication: "ReplicationConfig | None" = None) -> SnapshotSession:
    """Build the policy from the flags (every rank the same; ``replication``: the replication flags, which
    bound its budgets), open its first window at the start iteration, and the store and engine of this rank."""

    cls = config.policy_cls
    policy = build_policy(config.policy, cls.config_from_flags(config, ctx.t_iter_s, replication=replication),
                          ctx.catalogue)
    policy.plan(ctx.start_iteration, ctx.popularity)  # opens the first window (sparse)
    operators = list(ctx.registry)
    retention = KeepTwoRecoverable(rule=policy.retention_rule(operators))
    job_id = config.job_id + job_suffix
    # the arena's first segment holds what retention keeps at the least (moe_ft/store/capacity.py)
    state = [t for op in operators for t in ctx.registry[op].tensors(Level.FULL).values()]
    full = sum(t.nbytes for t in state)
    # a CUDA registry copies straight into the arena and hashes on the device (moe_ft/snapshot/mapped.py); a CPU
    # one hashes as it copies into the arena (SnapshotStore.copies_hashing)
    checksum = config.store_checksum
    if checksum == "auto":
        checksum = store_checksum(any(t.is_cuda for t in state), config.store_layout, config.snapshot_direct_write,
                                  config.snapshot_bubble_aware) or DEFAULT_CHECKSUM
    store = StoreConfig(root=config.store_dir, job_id=job_id, rank=ctx.rank, recycle=config.store_recycle,
                        layout=config.store_layout, initial_bytes=SNAPSHOT_POINTS * full, checksum=checksum,
                        checksum_by=config.checksum_by).build(
        retention=retention, fault_hook=ctx.store_fault_hook)
    bubbles = None
    if config.snapshot_bubble_aware:
        # the runtime's BubbleScheduling component drains the trace and intervals every iteration
        bubbles = BubbleSchedule(BubbleGate(keep_intervals=True), trace=[])
    engine = SnapshotEngine(EngineConfig(num_slots=config.snapshot_slots, bubbles=bubbles,
                                         write_threads=config.snapshot_write_threads or None,
                                         copy_piece_bytes=config.snapshot_copy_piece_mb * 2 ** 20,
                                         copy_by=config.snapshot_copy_by,
                                         copy_programs=config.snapshot_copy_programs,
                                         direct_write=None if config.snapshot_direct_write else False),
                            ctx.registry, store)
    publisher = None
    if config.publish_by == "agent":
        # start-up time: the agent's client is imported only when the mode is on
        from moe_ft.agent.publish import AgentPublisher

        publisher = AgentPublisher(store, rank=ctx.rank, agent_dir=os.path.join(config.store_dir, job_id, "agent"))
    return SnapshotSession(config.policy, policy, engine, store, operators=operators,
                           store_root=config.store_dir, job_id=job_id, publisher=publisher)
