"""Common shape of snapshot policies.

A policy maps an iteration (and the expert popularity counters) to a :data:`SnapshotPlan` and does
nothing else: no bytes move, no process group is touched. Every rank builds the same policy from the same
*global* operator catalogue and calls :meth:`SnapshotPolicy.plan` with identical popularity counters, so
every rank gets the same plan; the snapshot engine keeps the entries of its own operators. Ties are always
broken by :class:`OperatorId` order.

Where an operator's bytes are copied is the ``(pp_rank, ep_rank)`` of its :class:`OperatorInfo` (its
*rank key*). Every rank snapshots the planned operators its registry holds, so a non-expert operator
(replicated over the expert-parallel ranks of a stage) is copied by each holder (with the distributed
optimizer, each rank's shard); :meth:`SnapshotPolicy.bytes_per_rank` charges it on each. Per-rank budgets and
balance are computed on that key.
"""

from __future__ import annotations

import abc
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Mapping, Optional, Sequence

from moe_ft.state.catalogue import copied_bytes
from moe_ft.state.operators import Level, OperatorId, OperatorInfo, SnapshotPlan
from moe_ft.store.capacity import SNAPSHOT_POINTS
from moe_ft.store.rules import DenseRule, RecoveryRule

if TYPE_CHECKING:  # only for annotations: policies read counters, they never build them
    from moe_ft.config import FTConfig
    from moe_ft.popularity import ExpertPopularity
    from moe_ft.replication.config import ReplicationConfig
    from moe_ft.snapshot.config import SnapshotConfig

RankKey = tuple[int, int]
"""``(pp_rank, ep_rank)``: the device whose link an operator's snapshot bytes cross."""


class SnapshotPolicy(abc.ABC):
    """Base of every policy. Subclasses set ``name`` and implement :meth:`plan`; stateful ones override
    :meth:`state_dict` / :meth:`load_state_dict` so a restarted job continues the same schedule.

    A policy also owns what its plans *mean* for the rest of the system, so that no other module switches
    on policy names (``docs/architecture.md``): which stored points form a recovery point
    (:meth:`recovery_rule`), which ones retention must keep (:meth:`retention_rule`), what goes to the
    durable tier (:meth:`persist_plan`), whether recovery loses tokens (:attr:`lossy`) and how the loss is
    measured (:attr:`token_loss_metric`, :meth:`token_loss_denominator`, :meth:`after_recovery`)."""

    name: str = ""
    lossy: ClassVar[bool] = False
    """Recovery restores each operator's newest FULL entry and loses the tokens routed to it since
    (``pec``, ``selective``); exact policies reload a dense point or replay a window."""
    token_loss_metric: ClassVar[Optional[str]] = None
    """Name of the lost-token metric a lossy recovery reports (MoC ``PLT``, MoEtion ``MLT``)."""
    token_loss_layers: ClassVar[str] = "mean"
    """How the metric combines the per-MoE-layer fractions: ``mean`` (MoC eq. 7) or ``sum`` (MoEtion eq. 6)."""
    reads_popularity: ClassVar[bool] = False
    """Whether :meth:`plan` reads the popularity counters (then they are summed over all ranks)."""
    dense_points: ClassVar[bool] = False
    """Every snapshot point holds every operator FULL: the durable tier can also write it in
    Megatron's ``dist_checkpointing`` format (plain Megatron loads it)."""

    starts_dense: ClassVar[bool] = False
    """:meth:`start_dense` is implemented: the policy can make one iteration's snapshot a recovery point on
    its own (every operator FULL), which the in-run rebalance needs (the new plan is recoverable at once)."""

    def __init__(self, operators: Sequence[OperatorInfo]) -> None:
        self.operators: tuple[OperatorInfo, ...] = validate_operators(operators)
        self.info: Mapping[OperatorId, OperatorInfo] = MappingProxyType({i.op: i for i in self.operators})

    @abc.abstractmethod
    def plan(self, iteration: int, popularity: Optional["ExpertPopularity"] = None) -> SnapshotPlan:
        """The plan for the snapshot taken after iteration ``iteration``: every operator → a level.

        Calling it twice with the same arguments and state returns the same plan."""

    def state_dict(self) -> dict:
        return {"name": self.name}

    def start_dense(self, iteration: int) -> None:
        """The snapshot after ``iteration`` (not yet planned) must hold every operator FULL and be a
        recovery point by itself, and no recovery may replay across it (the operators' holders changed
        there: ``moe_ft/elastic/rebalance_component.py``). Policies with :attr:`starts_dense` implement it."""
        raise ValueError(f"the {self.name} policy cannot make a snapshot a dense recovery point (an in-run "
                         f"rebalance needs one); use --ft-policy sparse or dense")

    def load_state_dict(self, state: Mapping) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"state of policy {state.get('name')!r} cannot be loaded into policy {self.name!r}")

    # ---------------------------------------------------------------- what the plans mean elsewhere
    @classmethod
    def config_from_flags(cls, flags: "SnapshotConfig", t_iter_s: float, *,
                          replication: Optional["ReplicationConfig"] = None) -> Any:
        """This policy's config dataclass from the ``--ft-*`` snapshot flags; ``t_iter_s``: the measured
        iteration time (budgets and windows derived from a bandwidth need it); ``replication``: the replication
        flags (``--ft-replicas``, ``--ft-replication-bandwidth``), which bound those budgets too
        (:func:`moe_ft.policy.window.snapshot_copy_bandwidth`); ``None``: no replicas."""
        raise ValueError(f"policy {cls.name!r} cannot be built from --ft-* flags: give it a config_from_flags "
                         "classmethod, or build it with build_policy(name, config, operators)")

    @classmethod
    def check_flags(cls, config: "FTConfig") -> None:
        """Reject flag combinations this policy cannot honour (``ValueError`` naming the fix)."""

    def recovery_rule(self, operators: Iterable[OperatorId], *, store=None, start_iteration: int = 0) -> RecoveryRule:
        """Which stored points form a recovery point. Default: a dense point (every operator FULL
        at one iteration). ``store``: the store recovery reads (a policy may read what it recorded there);
        ``start_iteration``: where this run started (no point before it was taken by this schedule)."""
        return DenseRule(operators=frozenset(operators))

    def recovery_point_plans(self) -> Optional[list[SnapshotPlan]]:
        """The plans of the snapshots one recovery point is made of, as the policy plans them now (a sparse
        window's: each operator FULL once, COMPUTE before it), for what the store must be able to hold
        (``moe_ft/store/capacity.py``); ``None``: one snapshot of every operator FULL."""
        return None

    def retained_plans(self) -> Optional[list[SnapshotPlan]]:
        """The plans of the snapshots the node-local store holds at the least under the runtime's retention
        (``KeepTwoRecoverable``: the two newest recovery points, and the one being written), for the start's
        capacity check (``moe_ft/store/capacity.py``); ``None``: that many snapshots of every operator FULL.
        By default three recovery points' worth of :meth:`recovery_point_plans` (consecutive points do not
        share snapshots: a dense point, a sparse window)."""
        plans = self.recovery_point_plans()
        return None if plans is None else plans * SNAPSHOT_POINTS

    def retained_points(self) -> int:
        """How many newest store points (one per iteration that publishes) the runtime's retention keeps at
        the least: one per :meth:`retained_plans` (:data:`SNAPSHOT_POINTS` before the first plan), times the
        iterations between two checkpoints for policies that checkpoint every ``interval`` iterations and
        publish a point every iteration (they override it). A replica holder keeps that many points of its
        owner (``moe_ft/replication/receiver.py``), so that the replicas hold a complete recovery point as
        often as the owner's store does."""
        plans = self.retained_plans()
        return len(plans) if plans else SNAPSHOT_POINTS

    def retention_rule(self, operators: Iterable[OperatorId]) -> RecoveryRule:
        """The completeness rule garbage collection keeps recovery points by (MoEvement §3.2: one complete
        point kept while the next is in flight). Called after the first:meth:`plan` (and again after a
        recovery restored the policy's state)."""
        return self.recovery_rule(operators)

    def persist_plan(self, iteration: int, snapshot_plan: SnapshotPlan) -> Optional[SnapshotPlan]:
        """What of the snapshot after ``iteration`` goes to the durable tier; ``None`` (default): the whole
        recovery point the retention rule completes."""
        return None

    def token_loss_denominator(self, end: int, *, train_iters: int, tokens_per_iteration: float) -> float:
        """Routed tokens per MoE layer the lost-token metric is a fraction of (lossy policies)."""
        raise ValueError(f"policy {self.name!r} is exact: it loses no tokens, so it has no token-loss denominator")

    def after_recovery(self, iteration: int, token_loss: float) -> dict:
        """Called after a recovery that resumed after ``iteration`` lost ``token_loss`` (the metric's value);
        returns extra fields for the report. Default: nothing to adapt."""
        return {}

    def observe_iteration_time(self, t_iter_s: float) -> None:
        """The runtime reports the median time of recent trained iterations each time the ranks agree on a new
        value (every few iterations, ``IterationClock``; also after a restart, from that process's own iterations). Policies that derive a window or a budget from
        ``T_iter`` (MoEvement Alg. 1, MoEtion §4.2) use it from their next decision on. Default: unused."""

    def window_progress(self, iteration: int) -> Optional[str]:
        """``"i/W"``: where the snapshot after ``iteration`` lies in a multi-iteration recovery point (the
        FT log line); ``None`` when each point is one iteration."""
        return None

    def plan_bytes(self, plan: SnapshotPlan) -> dict[RankKey, int]:
        """Bytes each rank key copies for ``plan`` (a helper for engines, tests and the simulator)."""
        return bytes_per_rank(plan, self.info)


def validate_operators(operators: Sequence[OperatorInfo]) -> tuple[OperatorInfo, ...]:
    """Check the catalogue (no duplicates, sane sizes) and return it sorted by :class:`OperatorId`."""
    infos = sorted(operators, key=lambda i: i.op)
    if not infos:
        raise ValueError("a policy needs at least one operator; pass the model's OperatorInfo catalogue")
    for prev, cur in zip(infos, infos[1:]):
        if prev.op == cur.op:
            raise ValueError(f"operator {cur.op} is listed twice; each OperatorId must appear once")
    for info in infos:
        if info.bytes_compute < 0 or info.bytes_full < info.bytes_compute:
            raise ValueError(
                f"{info.op}: need 0 <= bytes_compute <= bytes_full, got {info.bytes_compute}, {info.bytes_full}"
            )
    return tuple(infos)


def make_plan(operators: Iterable[OperatorInfo], levels: Mapping[OperatorId, Level]) -> SnapshotPlan:
    """A read-only plan listing every operator explicitly (missing ones are ``NONE``), in OperatorId order."""
    return MappingProxyType({op: Level(levels.get(op, Level.NONE)) for op in sorted(i.op for i in operators)})


def rank_key(info: OperatorInfo) -> RankKey:
    return (info.pp_rank, info.ep_rank)


def bytes_per_rank(plan: SnapshotPlan, info: Mapping[OperatorId, OperatorInfo]) -> dict[RankKey, int]:
    """Bytes each rank key copies for ``plan``, charged where they are copied: an operator every rank of a
    stage holds (non-experts, or their shards with the distributed optimizer) is charged on each holder
    (``moe_ft.state.catalogue.copied_bytes``); a hand-built catalogue charges its one rank key."""

    return copied_bytes(plan, info)


def experts_by_layer(operators: Iterable[OperatorInfo]) -> dict[int, list[OperatorInfo]]:
    """Expert operators grouped by layer, each group sorted by expert index; layers in ascending order."""
    layers: dict[int, list[OperatorInfo]] = {}
    for info in sorted(operators, key=lambda i: i.op):
        if info.op.is_expert:
            layers.setdefault(info.op.layer, []).append(info)
    return dict(sorted(layers.items()))


def expert_scores(
    popularity: Optional["ExpertPopularity"], experts: Iterable[OperatorInfo], source: str
) -> dict[OperatorId, float]:
    """Counter ``source`` for each expert; all zeros without popularity (then ties → OperatorId order)."""
    if popularity is None:
        return {i.op: 0.0 for i in experts}
    rows = popularity.counter(source).tolist()  # one host read, not one tensor index per expert
    return {i.op: float(rows[popularity.layer_pos(i.op.layer)][i.op.expert]) for i in experts}


def never_saved(popularity: "ExpertPopularity", experts: Iterable[OperatorInfo]) -> set[OperatorId]:
    """The experts of ``experts`` without a FULL snapshot yet (``last_full_iteration`` < 0). Policies that rank
    experts by tokens since their last FULL snapshot save these first: ranked by tokens alone, an expert
    routed none is never saved, and lossy recovery, which restores every expert from its newest FULL entry,
    has no point until each has one (docs/policies.md, "MoEtion")."""
    rows = popularity.last_full_iteration.tolist()  # one host read
    return {i.op for i in experts if rows[popularity.layer_pos(i.op.layer)][i.op.expert] < 0}


def top_by_score(candidates: Sequence[OperatorInfo], scores: Mapping[OperatorId, float], k: int) -> list[OperatorInfo]:
    """The ``k`` candidates with the highest score, ties broken by OperatorId order."""
    return sorted(candidates, key=lambda i: (-scores[i.op], i.op))[: max(k, 0)]
