"""Selective expert checkpointing (MoEtion §4.1-4.3, Algorithm 1).

Every iteration all non-expert operators are FULL (§4.1) and a budget-limited set of experts is FULL; the
remaining experts are NONE (lossy; the recovery code reports MLT, MoEtion eq. 6, and boosts the capacity
of stale experts, §6).

Budgets (§4.2) are bytes per iteration *per device*: ``B_local = BW_host × T_iter`` bounds what one GPU
copies to host memory (the FULL operators of this plan), ``B_remote = BW_net × T_iter`` what it sends to
its replication peers (:meth:`SelectivePolicy.remote_plan`). For each rank key (see ``base.py``) the
non-expert FULL bytes are charged first; the rest buys ``S_total = floor(B / C_expert)`` experts, with
``C_expert`` the largest FULL size among that rank's experts, so the budget is never exceeded. ``S_total``
is split over the rank's MoE layers in proportion to their token risk ``R[l]`` (sum of tokens since last
FULL of the layer's experts), floors first, then largest remainders (Alg. 1 line 5 "adjust so that the
sum is S_total"), capped at the layer's expert count; each layer saves its top ``S[l]`` experts by tokens
since last FULL snapshot (§4.3), ties by OperatorId.

**Experts never saved go first (not in the paper).** Ranked by tokens since their last FULL snapshot alone,
an expert routed no tokens is never saved, nor is one routed few for as long as the popular experts regain
more tokens in an iteration than it gathers in all iterations so far. Lossy recovery restores every expert
from its newest FULL entry (§6), so until each has one no point is recoverable: a failure finds nothing to
recover from, and the store, which keeps every point until one is recoverable, grows until the tmpfs is
full (``tests/test_retention_buffers.py``; docs/policies.md, "MoEtion"). So an expert without a FULL
entry (``ExpertPopularity.last_full_iteration`` < 0: a fresh job, or one resumed from a checkpoint with a new
store) is saved before any chosen by token risk, from the same ``S_total`` (the riskiest of each layer, layer
after layer, as the paper's split would share them when every layer's risk is alike): the first
recovery point exists after ``ceil(n / S_total)`` iterations for a rank's ``n`` experts, whatever the
routing. After that the paper's ranking decides; the store then holds at most ``n + 3`` points (one per
expert's newest FULL entry, the two newest points and the one being written).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from moe_ft.policy.base import (
    RankKey,
    SnapshotPolicy,
    bytes_per_rank,
    expert_scores,
    experts_by_layer,
    make_plan,
    never_saved,
    rank_key,
    top_by_score,
)
from moe_ft.policy.window import flags_copy_bandwidth
from moe_ft.state.operators import Level, OperatorId, OperatorInfo, SnapshotPlan
from moe_ft.store.rules import NewestFullRule


@dataclass(kw_only=True)
class SelectiveConfig:
    local_budget: int
    """``B_local`` in bytes per iteration per device: host-link bandwidth × iteration time (§4.2)."""
    remote_budget: int
    """``B_remote`` in bytes per iteration per device: network bandwidth × iteration time (§4.2)."""
    remote_includes_non_expert: bool = True
    """Charge non-expert FULL bytes to the remote budget too. Set False when data parallelism already
    replicates the non-expert state (MoEtion §5.1) and replication skips it."""
    local_bandwidth: Optional[float] = None
    """When set (bytes/s), ``local_budget`` follows ``local_bandwidth × T_iter`` as the runtime measures
    ``T_iter`` (:meth:`SelectivePolicy.observe_iteration_time`); ``None``: the budget is fixed."""
    remote_bandwidth: Optional[float] = None
    """The same for ``remote_budget``."""

    def __post_init__(self) -> None:
        if self.local_budget < 0 or self.remote_budget < 0:
            raise ValueError("SelectiveConfig budgets are byte counts and must be >= 0")
        for bw in (self.local_bandwidth, self.remote_bandwidth):
            if bw is not None and bw <= 0:
                raise ValueError("SelectiveConfig bandwidths must be positive bytes/s (or None for fixed budgets)")

    @staticmethod
    def from_bandwidth(*, host_bytes_per_s: float, net_bytes_per_s: float, t_iter_s: float,
                       **kwargs) -> "SelectiveConfig":
        """``B = bandwidth × T_iter`` for both budgets (MoEtion §4.2)."""
        if min(host_bytes_per_s, net_bytes_per_s, t_iter_s) <= 0:
            raise ValueError("bandwidths and iteration time must be positive")
        return SelectiveConfig(local_budget=int(host_bytes_per_s * t_iter_s),
                               remote_budget=int(net_bytes_per_s * t_iter_s), **kwargs)


def _experts_within(experts: Sequence[OperatorInfo], budget: int) -> int:
    """``S_total = floor(B / C_expert)`` (MoEtion §4.2): how many of ``experts`` a budget of ``budget`` bytes
    buys, ``C_expert`` the largest FULL size among them (every expert when they have no bytes)."""
    cost = max((i.bytes_full for i in experts), default=0)
    return max(budget, 0) // cost if cost > 0 else len(experts)


def allocate_proportional(total: int, risks: Sequence[float], caps: Sequence[int]) -> list[int]:
    """``S[i] = floor(R[i] / sum(R) × total)`` then the leftover one by one by largest remainder (ties:
    lower index), never above ``caps[i]`` (MoEtion Alg. 1, COMPUTES). With zero total risk the shares are
    equal. Returns a list summing to ``min(total, sum(caps))``."""
    n = len(risks)
    total = min(max(total, 0), sum(caps))
    risk_sum = float(sum(risks))
    ideal = [(r / risk_sum) * total if risk_sum > 0 else total / n for r in risks]
    alloc = [min(int(x), c) for x, c in zip(ideal, caps)]
    while sum(alloc) < total:
        free = [i for i in range(n) if alloc[i] < caps[i]]
        best = max(free, key=lambda i: (ideal[i] - alloc[i], -i))
        alloc[best] += 1
    return alloc


class SelectivePolicy(SnapshotPolicy):
    """MoEtion selective expert checkpointing; see the module docstring. Stateless: the token risk comes
    from ``popularity.since_full`` (the engine calls ``mark_full`` after each snapshot)."""

    name = "selective"
    lossy = True
    token_loss_metric = "MLT"
    token_loss_layers = "sum"  # MoEtion eq. 6: Σ over the MoE layers
    reads_popularity = True
    recomputes_optimizer_on_peer = True  # --ft-optimizer-recompute: MoEtion §5.2 stable periods

    @classmethod
    def config_from_flags(cls, flags, t_iter_s: float, *, replication=None) -> "SelectiveConfig":
        """MoEtion §4.2: ``B_local = --ft-snapshot-bandwidth × T_iter`` unless given. ``B_remote`` unless given:
        :func:`~moe_ft.policy.window.snapshot_copy_bandwidth` × ``T_iter``, which is ``B_local`` unless replicas with a known
        ``--ft-replication-bandwidth`` bound it (that bandwidth over ``--ft-replicas``: the sender spends it on
        every peer); with ``B_local`` given and ``B_remote`` not, ``B_remote = B_local``."""
        local = flags.selective_local_budget or int(flags.snapshot_bandwidth * t_iter_s)
        derived = None if flags.selective_local_budget else flags.snapshot_bandwidth
        remote_derived = None
        if derived is not None and not flags.selective_remote_budget:
            remote_derived = flags_copy_bandwidth(derived, replication)
        remote = flags.selective_remote_budget or (int(remote_derived * t_iter_s) if remote_derived else local)
        return SelectiveConfig(local_budget=local, remote_budget=remote, local_bandwidth=derived,
                               remote_bandwidth=remote_derived)

    def observe_iteration_time(self, t_iter_s: float) -> None:
        """Budgets derived from a bandwidth follow the measured ``T_iter`` (MoEtion §4.2: ``B = BW × T_iter``),
        never below the non-expert bytes MoEtion saves every iteration and one expert (a budget that buys no
        expert never saves one: no point would be recoverable)."""
        if self.config.local_bandwidth is not None:
            self.config.local_budget = int(self.config.local_bandwidth * t_iter_s)
        if self.config.remote_bandwidth is not None:
            self.config.remote_budget = int(self.config.remote_bandwidth * t_iter_s)
        self._floor_derived_budgets()

    def _floor_derived_budgets(self) -> None:
        """Raise the budgets derived from a bandwidth to the least the policy can work with: every rank's
        non-expert state and one expert (remote: the non-expert state when it is replicated); budgets given as
        bytes are left as given (the constructor refuses one too small)."""
        floor = max(self._least_budget.values(), default=0)
        if self.config.local_bandwidth is not None:
            self.config.local_budget = max(self.config.local_budget, floor)
        if self.config.remote_bandwidth is not None:
            remote_floor = floor if self.config.remote_includes_non_expert else 0
            self.config.remote_budget = max(self.config.remote_budget, remote_floor)

    def recovery_rule(self, operators, *, store=None, start_iteration: int = 0):
        """Each operator's newest FULL entry (MoEtion §6: stale experts are restored from older snapshots)."""
        return NewestFullRule(operators=frozenset(operators))

    def token_loss_denominator(self, end: int, *, train_iters: int, tokens_per_iteration: float) -> float:
        """MLT (MoEtion §6) is a fraction of the tokens routed so far: iterations ``0 … end``."""
        return float((end + 1) * tokens_per_iteration)

    def __init__(self, config: SelectiveConfig, operators: Sequence[OperatorInfo]) -> None:
        super().__init__(operators)
        self.config = config
        non_experts = make_plan(self.operators, {i.op: Level.FULL for i in self.operators if not i.op.is_expert})
        # charged where copied: every rank holding a non-expert copies it (or its shard)
        self._non_expert_bytes: dict[RankKey, int] = dict(bytes_per_rank(non_experts, self.info))
        self._experts: dict[RankKey, dict[int, list[OperatorInfo]]] = {}
        for key in self._non_expert_bytes:
            self._experts[key] = experts_by_layer(i for i in self.operators if rank_key(i) == key)
        # the least budget of each rank: its non-expert state and one expert (none when it holds no expert)
        self._least_budget: dict[RankKey, int] = {
            key: nbytes + max((i.bytes_full for exps in self._experts[key].values() for i in exps), default=0)
            for key, nbytes in self._non_expert_bytes.items()}
        # budgets derived from a bandwidth are floored as at every measured T_iter (observe_iteration_time):
        # the estimate of T_iter the policy is built with must not refuse what the first measurement allows
        self._floor_derived_budgets()
        for key, nbytes in sorted(self._non_expert_bytes.items()):
            if nbytes > config.local_budget:
                raise ValueError(
                    f"local_budget of {config.local_budget} bytes is below the {nbytes} bytes of non-expert "
                    f"FULL state on rank (pp={key[0]}, ep={key[1]}); MoEtion saves non-experts every "
                    "iteration, so raise the budget (bandwidth × iteration time) or use the sparse policy"
                )
            if config.local_budget < self._least_budget[key]:
                raise ValueError(
                    f"local_budget of {config.local_budget} bytes buys no expert on rank (pp={key[0]}, "
                    f"ep={key[1]}) after its {nbytes} bytes of non-expert FULL state (an expert costs "
                    f"{self._least_budget[key] - nbytes} bytes): no expert would ever be saved and no point "
                    "would be recoverable; raise the budget (--ft-selective-local-budget, or the bandwidth "
                    "x iteration time) or use the sparse policy"
                )
            if config.remote_includes_non_expert and nbytes > config.remote_budget:
                raise ValueError(
                    f"remote_budget of {config.remote_budget} bytes is below the {nbytes} bytes of non-expert "
                    f"FULL state on rank (pp={key[0]}, ep={key[1]}); raise it (--ft-selective-remote-budget, or "
                    "--ft-replication-bandwidth / --ft-replicas x iteration time), or set "
                    "remote_includes_non_expert=False when data parallelism already replicates that state"
                )

    def _select(self, budget: int, popularity, candidates: Optional[set[OperatorId]],
                charge_non_expert: bool) -> list[OperatorId]:
        if popularity is None:
            raise ValueError("the selective policy ranks experts by tokens since their last FULL snapshot; "
                             "pass the ExpertPopularity counters to plan()/remote_plan()")
        chosen: list[OperatorId] = []
        # the counters read to the host once for every rank's experts, not once per rank and layer
        every = [i for layers in self._experts.values() for exps in layers.values() for i in exps]
        scores = expert_scores(popularity, every, "since_full")
        unsaved = never_saved(popularity, every)
        for key, layers in sorted(self._experts.items()):
            layers = {l: [i for i in exps if candidates is None or i.op in candidates]
                      for l, exps in layers.items()}
            layers = {l: exps for l, exps in layers.items() if exps}
            if not layers:
                continue
            avail = budget - (self._non_expert_bytes[key] if charge_non_expert else 0)
            s_total = _experts_within([i for exps in layers.values() for i in exps], avail)
            # experts never saved first (module docstring): each layer's riskiest, layer after layer
            ranked = {l: sorted((i.op for i in exps if i.op in unsaved), key=lambda op: (-scores[op], op))
                      for l, exps in layers.items()}
            due = {op for _, _, op in sorted((n, l, op) for l, ops in ranked.items()
                                             for n, op in enumerate(ops))[:s_total]}
            chosen.extend(due)
            layers = {l: [i for i in exps if i.op not in due] for l, exps in layers.items()}
            risks = [sum(scores[i.op] for i in exps) for exps in layers.values()]
            alloc = allocate_proportional(s_total - len(due), risks, [len(e) for e in layers.values()])
            for exps, s in zip(layers.values(), alloc):
                chosen.extend(i.op for i in top_by_score(exps, scores, s))
        return sorted(chosen)

    def retained_plans(self) -> list[SnapshotPlan]:
        """The snapshots the store holds at the least (``moe_ft/store/capacity.py``): the two newest recovery
        points by :class:`NewestFullRule` reach back to every expert's newest FULL entry, which a rank saving
        ``S_total`` of its ``n`` experts per iteration reaches in ceil(n / S_total) iterations when the tokens
        spread evenly (an expert with fewer waits longer: a lower bound), plus one iteration more and the one
        being written; each with the non-expert operators FULL and ``S_total`` experts of each rank."""
        per_key = []
        for key, layers in sorted(self._experts.items()):
            experts = [i for exps in layers.values() for i in exps]
            avail = self.config.local_budget - self._non_expert_bytes[key]
            per_key.append((experts, min(len(experts), _experts_within(experts, avail))))
        cycle = max((-(-len(experts) // s) for experts, s in per_key if s > 0), default=1)
        dense = {i.op: Level.FULL for i in self.operators if not i.op.is_expert}
        plans = []
        for c in range(cycle + 2):
            levels = dict(dense)
            for experts, s in per_key:
                levels.update({experts[(c * s + j) % len(experts)].op: Level.FULL for j in range(s)})
            plans.append(make_plan(self.operators, levels))
        return plans

    def selected_experts(self, iteration: int, popularity=None) -> list[OperatorId]:
        """Experts FULL in the local snapshot after ``iteration`` (SELECTEXPERTS(B_local))."""
        return self._select(self.config.local_budget, popularity, None, True)

    def plan(self, iteration: int, popularity=None) -> SnapshotPlan:
        levels = {i.op: Level.FULL for i in self.operators if not i.op.is_expert}
        levels.update({op: Level.FULL for op in self.selected_experts(iteration, popularity)})
        return make_plan(self.operators, levels)

    def remote_plan(self, iteration: int, snapshot_plan: Mapping[OperatorId, Level], popularity=None) -> SnapshotPlan:
        """What to replicate to remote peers: SELECTEXPERTS(B_remote) restricted to the experts FULL in the
        local ``snapshot_plan`` (one cannot replicate what was not snapshotted), plus the non-experts unless
        ``remote_includes_non_expert`` is False. Pass the same popularity as to :meth:`plan`."""
        full = {op for op, lvl in snapshot_plan.items() if lvl == Level.FULL}
        charge = self.config.remote_includes_non_expert
        levels = {op: Level.FULL for op in full if not op.is_expert and charge}
        levels.update({op: Level.FULL for op in self._select(self.config.remote_budget, popularity, full, charge)})
        return make_plan(self.operators, levels)
