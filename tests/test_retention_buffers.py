"""Why the runtime keeps ``KeepTwoRecoverable`` rather than MoC-System's triple buffering (§5.2) in the
node-local store (``docs/store.md`` "Retention").

MoC's three buffers are the point being snapshotted, the newest published point (being persisted) and the
one before it (recovery). Each rank garbage-collects its own store after each of its publishes, and a
failure can catch the ranks one point apart: a rank killed with iteration ``e`` in flight has published
``e - 1`` while the others have published ``e``. The job then needs a recovery point common to all ranks,
i.e. the others must still be able to restore ``e - 1``. With PEC plans (K experts per layer FULL per
checkpoint) a lossy recovery to ``e - 1`` restores each operator from its newest FULL entry *at or before
``e - 1``*; for the experts saved again at ``e`` that entry is a point ``TripleBuffer`` has already deleted
(its floor keeps the FULL entries newest at ``e`` only). The agreement then finds no common point and the
job restarts from scratch, which is what the pec failure drill hit. ``KeepTwoRecoverable`` keeps the newest
two recovery points per rank by the policy's own rule: it holds every buffer triple buffering holds, plus
the older FULL entries that make ``e - 1`` restorable.

Pure store rules, one process: real ``PECPolicy`` plans, one ``SnapshotStore`` per rank on the in-memory
backend, the agreement loop of ``moe_ft/recovery/agreement.py`` (``agree_on_point``) run over the stores' answers.
"""

from __future__ import annotations

import pytest
import torch
from test_policy_common import make_catalog, make_popularity

from moe_ft.policy import PECConfig, PECPolicy, SelectiveConfig, SelectivePolicy
from moe_ft.state.operators import Level
from moe_ft.store import DenseRule, KeepTwoRecoverable, MemoryBackend, NewestFullRule, SnapshotStore, TripleBuffer

NUM_RANKS = 2  # EP = 2, one stage: each rank holds half the experts and every non-expert operator


def _run(retention_of, *, killed_at: int, policy: PECPolicy, catalog):
    """Train ``killed_at + 1`` iterations: every rank publishes the snapshot of each iteration (its own
    operators of the plan) and garbage-collects; rank 1 is killed while the snapshot of ``killed_at`` is in
    flight (written, never published)."""
    ops_of = [[i.op for i in catalog if not i.op.is_expert or i.ep_rank == r] for r in range(NUM_RANKS)]
    stores = [SnapshotStore(MemoryBackend(name=f"rank{r}"), retention=retention_of(ops_of[r]))
              for r in range(NUM_RANKS)]
    for t in range(killed_at + 1):
        plan = policy.plan(t)
        for rank, store in enumerate(stores):
            with store.begin(t) as point:
                for op in ops_of[rank]:
                    if plan[op] != Level.NONE:
                        point.put(op, plan[op], {"w": torch.full((4,), float(t))})
                point.put_meta({"iteration": t})
                if rank == 1 and t == killed_at:
                    break  # killed before publish: the point stays unpublished
                point.publish()
    return stores, ops_of


@pytest.fixture
def pec():
    catalog = make_catalog(2, 8, ep=NUM_RANKS)
    return PECPolicy(PECConfig(k_snapshot=1), catalog), catalog


@pytest.mark.parametrize("killed_at", [9, 12, 17])
def test_triple_buffer_loses_the_common_point_keep_two_recoverable_does_not(pec, killed_at):
    policy, catalog = pec
    rule_of = lambda ops: NewestFullRule(operators=frozenset(ops))  # noqa: E731  (pec's retention rule)

    # MoC §5.2 triple buffering, with the floor that keeps one complete lossy point per rank
    stores, ops_of = _run(lambda ops: TripleBuffer(floor=rule_of(ops)), killed_at=killed_at, policy=policy,
                          catalog=catalog)
    assert [s.points()[-1] for s in stores] == [killed_at, killed_at - 1]
    assert stores[0].newest_recoverable(rule_of(ops_of[0])).end == killed_at
    assert stores[1].newest_recoverable(rule_of(ops_of[1])).end == killed_at - 1
    # rank 0 can no longer restore killed_at - 1: the experts saved again at killed_at lost their previous
    # FULL entries to GC -> no common point, the job would start over
    assert stores[0].newest_recoverable(rule_of(ops_of[0]), at_or_before=killed_at - 1) is None
    assert _agree_per_rank(stores, ops_of, rule_of) is None

    # the runtime's retention: same plans, same kill
    stores, ops_of = _run(lambda ops: KeepTwoRecoverable(rule=rule_of(ops)), killed_at=killed_at, policy=policy,
                          catalog=catalog)
    assert _agree_per_rank(stores, ops_of, rule_of) == killed_at - 1
    for store, ops in zip(stores, ops_of):  # and each rank restores every operator it holds, verified
        point = store.newest_recoverable(rule_of(ops), at_or_before=killed_at - 1, verify=True)
        assert set(point.full_at) == set(ops)


def _agree_per_rank(stores, ops_of, rule_of):
    """The agreement with each rank's own rule (its operators)."""
    bound = None
    while True:
        points = [s.newest_recoverable(rule_of(ops), at_or_before=bound) for s, ops in zip(stores, ops_of)]
        ends = [p.end if p is not None else -1 for p in points]
        agreed = min(ends)
        if agreed < 0:
            return None
        if all(e == agreed for e in ends):
            return agreed
        bound = agreed


def test_keep_two_recoverable_holds_every_triple_buffer_point(pec):
    """At every step of a fault-free run, the runtime's retention keeps a superset of MoC's buffers (so
    persisting the newest point and recovering from the previous one work as in MoC) and only the FULL
    entries of one more recovery point besides."""
    policy, catalog = pec
    ops = [i.op for i in catalog if not i.op.is_expert or i.ep_rank == 0]
    rule = NewestFullRule(operators=frozenset(ops))
    keep_two = SnapshotStore(MemoryBackend(), retention=KeepTwoRecoverable(rule=rule))
    triple = SnapshotStore(MemoryBackend(), retention=TripleBuffer(floor=rule))
    extra = []
    for t in range(20):
        plan = policy.plan(t)
        for store in (keep_two, triple):
            with store.begin(t) as point:
                for op in ops:
                    if plan[op] != Level.NONE:
                        point.put(op, plan[op], {"w": torch.zeros(2)})
                point.put_meta({"iteration": t})
                point.publish()
        assert set(triple.points()) <= set(keep_two.points())
        extra.append(len(keep_two.points()) - len(triple.points()))
    # once a complete point exists, the previous recovery point costs exactly one more stored point here
    # (K = 1: the expert saved at the newest point has its previous FULL entry in one older point)
    assert extra[:8] == [0] * 8 and set(extra[8:]) == {1}, extra


def test_triple_buffer_is_fine_for_dense_points():
    """For dense points (every operator FULL at each iteration) the two buffers always include a point
    common to ranks one iteration apart: triple buffering's failure is specific to partial (PEC) points."""
    catalog = make_catalog(1, 4, ep=NUM_RANKS)
    ops_of = [[i.op for i in catalog if not i.op.is_expert or i.ep_rank == r] for r in range(NUM_RANKS)]
    stores = [SnapshotStore(MemoryBackend(), retention=TripleBuffer(floor=DenseRule(operators=frozenset(o))))
              for o in ops_of]
    for t in range(8):
        for rank, (store, ops) in enumerate(zip(stores, ops_of)):
            if rank == 1 and t == 7:
                continue  # killed with 7 in flight
            with store.begin(t) as point:
                for op in ops:
                    point.put(op, Level.FULL, {"w": torch.zeros(2)})
                point.put_meta({"iteration": t})
                point.publish()
    assert _agree_per_rank(stores, ops_of, lambda o: DenseRule(operators=frozenset(o))) == 6


def _most_held(policy, ops, iterations: int, popularity=None, tokens=None) -> int:
    """Entries the store of a fault-free run holds at most under the runtime's retention (``KeepTwoRecoverable``
    by the policy's ``NewestFullRule``), the point being written included; one entry per FULL operator.
    ``tokens``: each expert's tokens per iteration in every layer (default: 4 each)."""
    store = SnapshotStore(MemoryBackend(), retention=KeepTwoRecoverable(rule=NewestFullRule(operators=frozenset(ops))))
    held = []
    for t in range(iterations):
        if popularity is not None:  # even tokens: the selective policy's round robin
            for layer in popularity.moe_layers:
                popularity.record(layer, torch.tensor(tokens) if tokens is not None
                                  else torch.full((popularity.num_experts,), 4))
            popularity.end_iteration(t)
        plan = {op: lvl for op, lvl in policy.plan(t, popularity).items() if op in ops and lvl != Level.NONE}
        held.append(sum(len(store.catalog().point(it).entries) for it in store.points()) + len(plan))
        with store.begin(t) as point:
            for op, lvl in plan.items():
                point.put(op, lvl, {"w": torch.zeros(2)})
            point.put_meta({"iteration": t})
            point.publish()
        if popularity is not None:
            popularity.mark_full(t, [op for op in plan if op.is_expert])
    return max(held)


def _counted(policy, ops) -> int:
    return sum(op in ops and lvl == Level.FULL for plan in policy.retained_plans() for op, lvl in plan.items())


@pytest.mark.parametrize("experts, k, ep", [(8, 1, 2), (8, 3, 2), (6, 2, 1), (4, 4, 1)])
def test_what_pec_keeps_is_what_its_capacity_check_counts(experts, k, ep):
    """The start's capacity check counts pec's snapshots by ``PECPolicy.retained_plans`` (one cycle of the
    sequential selection and two more checkpoints): that is the most the store of a fault-free run holds at
    any time, the point being written included. Three dense points' worth (the check's former count) is
    less than that wherever the non-expert operators outweigh ``2K/N`` of the experts."""
    policy = PECPolicy(PECConfig(k_snapshot=k), make_catalog(2, experts, ep=ep))
    ops = {i.op for i in policy.operators if not i.op.is_expert or i.ep_rank == 0}  # rank 0's operators
    counted = _counted(policy, ops)
    assert _most_held(policy, ops, 4 * experts) == counted
    # the former count (three dense points): too small for K = 1 of 8 experts (70 entries held, 42 counted),
    # right for K = N (every checkpoint dense)
    if (experts, k) == (8, 1):
        assert counted > 3 * len(ops)
    if k == experts:
        assert counted == 3 * len(ops)


@pytest.mark.parametrize("experts, budget_experts", [(8, 1), (8, 3), (6, 6)])
def test_what_selective_keeps_with_even_tokens_is_what_its_capacity_check_counts(experts, budget_experts):
    """``SelectivePolicy.retained_plans``: ``S_total`` experts per iteration reach every expert in
    ceil(n / S_total) iterations when the tokens spread evenly, and the store holds that cycle, one iteration
    more and the one being written (a lower bound: an expert routed fewer tokens waits longer)."""
    catalog = make_catalog(2, experts)
    non_expert = sum(i.bytes_full for i in catalog if not i.op.is_expert)
    budget = non_expert + budget_experts * 300  # make_catalog's experts: 300 bytes FULL each
    policy = SelectivePolicy(SelectiveConfig(local_budget=budget, remote_budget=budget), catalog)
    ops = {i.op for i in catalog}
    counted = _counted(policy, ops)
    assert _most_held(policy, ops, 6 * experts, make_popularity(2, experts)) == counted
    assert counted == (-(-2 * experts // budget_experts) + 2) * (len(ops) - 2 * experts + budget_experts)


@pytest.mark.parametrize("experts, budget_experts", [(8, 1), (8, 3)])
def test_selective_with_an_expert_routed_nothing_keeps_a_bounded_store(experts, budget_experts):
    """An expert routed no tokens (and one routed few) is saved once, first, so that points become
    recoverable; the store then holds at most ``n + 3`` points (module docstring of
    ``moe_ft/policy/selective.py``). Ranked by tokens alone it was never saved: no point was ever
    recoverable and the store kept every point."""
    catalog = make_catalog(2, experts)
    non_expert = sum(i.bytes_full for i in catalog if not i.op.is_expert)
    budget = non_expert + budget_experts * 300
    policy = SelectivePolicy(SelectiveConfig(local_budget=budget, remote_budget=budget), catalog)
    ops = {i.op for i in catalog}
    size = len(ops) - 2 * experts + budget_experts  # entries per snapshot
    tokens = [2 ** (experts - 1 - e) for e in range(experts - 1)] + [0]  # skewed, and the last routed nothing
    held = _most_held(policy, ops, 12 * experts, make_popularity(2, experts), tokens)
    assert held <= (2 * experts + 3) * size
