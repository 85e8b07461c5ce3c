"""Token loss of lossy recoveries and the popularity counters they leave (``moe_ft/recovery/driver.py``
``account_token_loss``, ``moe_ft/recovery/lossy.py``; MoC-System §3.1.2 PLT, MoEtion §6 MLT).

No model: :class:`Run` drives the real policy and :class:`ExpertPopularity` through the runtime's sequence
per iteration (``moe_ft/runtime/hooks.py``: close the iteration, plan, capture the metadata, ``mark_full``)
with fixed per-expert token counts, and a recovery does what the machine's FINALIZE and the driver do:
policy and counters from the metadata of ``end``, each expert from its newest FULL entry at or before
``end``, then :func:`account_token_loss`. Every expected loss is counted by hand from the token counts.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe_ft.persist.component import Durable
from moe_ft.policy.pec import PECConfig, PECPolicy
from moe_ft.policy.selective import SelectivePolicy
from moe_ft.popularity import ExpertPopularity, PopularityConfig
from moe_ft.recovery.driver import account_token_loss
from moe_ft.recovery.inputs import RecoveryInputs
from moe_ft.state.operators import Level, OperatorId, OperatorInfo
from moe_ft.store.rules import RecoveryPoint

torch.set_num_threads(1)

TRAIN_ITERS = 100


def operators(num_experts: int, expert_bytes: int = 30, dense_bytes: int = 30) -> list[OperatorInfo]:
    return [OperatorInfo(op=OperatorId.dense(0), bytes_compute=dense_bytes // 3, bytes_full=dense_bytes)] + [
        OperatorInfo(op=OperatorId.expert_op(0, e), bytes_compute=expert_bytes // 3, bytes_full=expert_bytes)
        for e in range(num_experts)]


class Writer:
    """The durable tier's writer as :class:`Durable` drives it, every iteration due: it records the persist
    plans (copying the entries is ``tests/test_persist.py``'s)."""

    def __init__(self) -> None:
        self.plans: dict[int, dict[OperatorId, Level] | None] = {}

    def due(self, iteration: int) -> bool:
        return True

    def submit(self, iteration: int, persist_plan=None) -> None:
        self.plans[iteration] = None if persist_plan is None else dict(persist_plan)


class Run:
    """One MoE layer; every iteration routes ``tokens[e]`` tokens to expert ``e``. Beside the counters it
    keeps the truth: the iterations whose tokens each expert's live state and each FULL entry hold."""

    def __init__(self, policy, tokens: list[float]) -> None:
        self.policy, self.tokens = policy, torch.tensor(tokens, dtype=torch.float64)
        self.popularity = ExpertPopularity(PopularityConfig(moe_layers=[0], num_experts=len(tokens)))
        self.writer = Writer()
        self.durable = Durable(self.writer, None, rank=0, popularity=self.popularity)
        self.plans: dict[int, dict[OperatorId, Level]] = {}
        self.meta: dict[int, tuple[dict, dict]] = {}
        self.live: list[set[int]] = [set() for _ in tokens]
        self.entries: dict[int, dict[int, frozenset[int]]] = {}  # iteration -> expert -> its FULL entry

    def train(self, *iterations: int, dropped: tuple[int, ...] = ()) -> None:
        """``dropped``: iterations whose snapshot the store dropped after it was submitted (full): marked
        FULL like any other, but no entry of it exists."""
        for t in iterations:
            self.popularity.record(0, self.tokens)
            self.popularity.end_iteration(t)
            for seen in self.live:
                seen.add(t)
            plan = self.policy.plan(t, self.popularity)
            self.plans[t] = dict(plan)
            self.meta[t] = (self.policy.state_dict(), self.popularity.state_dict())  # before mark_full
            self.popularity.mark_full(t, [op for op, lvl in plan.items() if lvl == Level.FULL])
            self.entries[t] = {op.expert: frozenset(self.live[op.expert]) for op, lvl in plan.items()
                               if op.is_expert and lvl == Level.FULL}
            if t in dropped:
                self.plans[t] = {}
            self.durable.after_snapshot(t, plan, SimpleNamespace(policy=self.policy), False)

    def full_at(self, end: int, durable: bool = False) -> dict[OperatorId, int]:
        """Each operator's newest FULL entry at or before ``end`` (``NewestFullRule``) in the node-local
        store or (``durable``) the durable tier."""
        out: dict[OperatorId, int] = {}
        for t in sorted(t for t in self.plans if t <= end):
            plan = self.writer.plans.get(t) if durable else self.plans[t]
            out.update({op: t for op, lvl in (plan or {}).items() if lvl == Level.FULL})
        return out

    def recover(self, end: int, policy=None, durable: bool = False) -> tuple[dict, list[float]]:
        """Recover to ``end`` from the node-local store or (``durable``) the durable tier (``policy``: the
        restarted process's policy object, default this run's). Returns the report's token loss and the
        tokens each expert truly lost."""
        policy = self.policy if policy is None else policy
        policy_state, popularity_state = self.meta[end]
        policy.load_state_dict(policy_state)
        self.popularity.load_state_dict(popularity_state)
        point = RecoveryPoint(start=end, end=end, full_at=self.full_at(end, durable), entries=())
        truth = []
        for e, seen in enumerate(self.live):
            restored = self.entries[point.full_at[OperatorId.expert_op(0, e)]][e]
            truth.append(len(seen - restored) * float(self.tokens[e]))
            self.live[e] = set(restored)
        for t in [t for t in self.plans if t > end]:  # the abandoned timeline, in both tiers
            del self.plans[t], self.meta[t], self.entries[t]
            self.writer.plans.pop(t, None)
        self.policy = policy
        args = SimpleNamespace(training=SimpleNamespace(global_batch_size=int(self.tokens.sum()),
                                                        train_iters=TRAIN_ITERS),
                               model=SimpleNamespace(seq_length=1, moe_router_topk=1))
        inputs = RecoveryInputs(config=None, state=None, args=args, rank=0, world_size=1, start_iteration=0,
                                restart_count=1, step_fn=lambda t, opt: None, registry=None,
                                popularity=self.popularity, session=SimpleNamespace(policy=policy))
        return account_token_loss(inputs, point, durable=durable), truth


def test_second_recovery_does_not_report_the_first_ones_loss_again():
    """pec K=1 over 3 experts saves e0, e1, e2, e0, … A recovery to 4 restores e0 from 3 and e2 from 2
    (losing iteration 4 of e0, 3 and 4 of e2); training resumes at 5 (e2 saved) and fails again. The
    recovery to 5 restores e0 from 3 again: its live state had only iteration 5 since, the loss of 4 was
    reported by the first recovery. e1 (restored from its FULL at 4, not saved since) loses iteration 5."""
    run = Run(PECPolicy(PECConfig(k_snapshot=1, dynamic_k=False), operators(3)), tokens=[1.0, 10.0, 100.0])
    run.train(0, 1, 2, 3, 4)
    first, truth = run.recover(4)
    assert first["per_expert"] == [truth]
    assert first["per_expert"] == [[1.0, 0.0, 200.0]] and first["tokens"] == 201.0
    # the restored experts' counters are those of the entries they came from
    assert run.popularity.since_full.tolist() == [[0.0, 0.0, 0.0]]
    assert run.popularity.last_full_iteration.tolist() == [[3, 4, 2]]
    run.train(5)
    second, truth = run.recover(5)
    assert second["per_expert"] == [truth]
    assert second["per_expert"] == [[1.0, 10.0, 0.0]] and second["tokens"] == 11.0
    assert second["value"] == pytest.approx(11.0 / (TRAIN_ITERS * 111.0))


def test_a_snapshot_the_full_store_dropped_counts_the_tokens_since_the_entry_restored():
    """pec K=1 over 3 experts saves e0 at 0 and 3, e1 at 1 and 4, e2 at 2 and 5; the store was full at 3
    (the snapshot was marked FULL when submitted, then dropped). A recovery to 5 restores e0 from 0: it
    lost iterations 1-5, not only 4-5 (what counting since the dropped snapshot reported)."""
    run = Run(PECPolicy(PECConfig(k_snapshot=1, dynamic_k=False), operators(3)), tokens=[1.0, 10.0, 100.0])
    run.train(0, 1, 2, 3, 4, 5, dropped=(3,))
    loss, truth = run.recover(5)
    assert loss["per_expert"] == [truth] == [[5.0, 10.0, 0.0]]


def test_selective_marks_the_experts_saved_at_the_point_not_a_new_plan_of_it():
    """selective's budget is bandwidth x the measured iteration time (MoEtion §4.2): 1.25 s buys 5 of the 8
    experts after the non-expert state. The restarted process builds its policy before it has measured one
    (1 s: 2 experts), so a plan of the point made again misses 3 of the experts saved there. After the
    recovery every expert's counters are those of the entry it was restored from."""
    flags = SimpleNamespace(selective_local_budget=0, selective_remote_budget=0, snapshot_bandwidth=3600.0)
    ops = operators(8, expert_bytes=300, dense_bytes=3000)
    measured = SelectivePolicy(SelectivePolicy.config_from_flags(flags, 1.25), ops)
    measured.observe_iteration_time(1.25)
    run = Run(measured, tokens=[5.0, 1.0, 7.0, 2.0, 9.0, 3.0, 4.0, 6.0])
    run.train(0, 1, 2, 3, 4, 5)
    saved_at_5 = {op.expert for op, lvl in run.plans[5].items() if op.is_expert and lvl == Level.FULL}
    assert len(saved_at_5) == 5
    full_at = run.full_at(5)
    restarted = SelectivePolicy(SelectivePolicy.config_from_flags(flags, 1.0), ops)
    first, truth = run.recover(5, policy=restarted)
    assert first["per_expert"] == [truth]
    assert run.popularity.since_full.tolist() == [[0.0] * 8]
    assert run.popularity.last_full_iteration.tolist() == [[full_at[OperatorId.expert_op(0, e)] for e in range(8)]]
    # the next recovery loses iteration 6 of each expert not saved there, nothing more
    run.train(6)
    second, truth = run.recover(6, policy=restarted)
    assert second["per_expert"] == [truth]
    saved_at_6 = {op.expert for op, lvl in run.plans[6].items() if op.is_expert and lvl == Level.FULL}
    assert second["per_expert"] == [[0.0 if e in saved_at_6 else run.tokens[e].item() for e in range(8)]]


def two_level_pec() -> Run:
    """pec K_snapshot=2, K_persist=1 over 4 experts (MoC §5.1): each expert's newest persisted FULL can be
    older than its newest snapshot FULL."""
    return Run(PECPolicy(PECConfig(k_snapshot=2, k_persist=1, dynamic_k=False), operators(4)),
               tokens=[1.0, 10.0, 100.0, 1000.0])


def test_durable_point_of_two_level_pec_counts_from_the_persisted_full():
    """The durable point restores expert 1 from its FULL persisted at 2, though its snapshot FULL at 4 (lost
    with the node-local store) had reset its since_full: 30 tokens lost, not 10."""
    run = two_level_pec()
    run.train(*range(6))
    assert {op.expert: t for op, t in run.full_at(5).items() if op.is_expert} == {0: 4, 1: 4, 2: 5, 3: 5}
    assert {op.expert: t for op, t in run.full_at(5, durable=True).items() if op.is_expert} == \
        {0: 4, 1: 2, 2: 5, 3: 3}
    loss, truth = run.recover(5, durable=True)
    assert truth == [1.0, 30.0, 0.0, 2000.0]
    assert loss["per_expert"] == [truth] and loss["tokens"] == 2031.0
    assert run.popularity.since_full.tolist() == run.popularity.since_persisted.tolist() == [[0.0] * 4]
    assert run.popularity.last_full_iteration.tolist() == run.popularity.last_persisted_iteration.tolist() == \
        [[4, 2, 5, 3]]


def test_durable_recovery_after_a_memory_one_counts_the_saved_but_unpersisted_tokens_once():
    """A recovery from the node-local store first (each expert from its snapshot FULL), then, after two more
    iterations, one from the durable tier: an expert restored from a FULL persisted before the first point
    loses the tokens between that entry and its snapshot FULL (in its live state until now) and those since
    the resume, never the ones the first recovery reported."""
    run = two_level_pec()
    run.train(*range(6))
    first, truth = run.recover(5)
    assert first["per_expert"] == [truth] and truth == [1.0, 10.0, 0.0, 0.0]
    run.train(6, 7)
    second, truth = run.recover(7, durable=True)
    assert second["per_expert"] == [truth] and sum(truth) > 0
