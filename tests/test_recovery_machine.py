"""The recovery state machine (``moe_ft/recovery/machine.py``; MoEvement §3.3 sparse-to-dense
conversion) one transition at a time, in this process.

A real tiny Megatron MoE GPT (2 layers, 4 experts, single-rank gloo group, CPU layer) trains iterations
0 … 6 with the sparse policy (window 3: windows [0, 2], [3, 5], [6, 8]) snapshotting every iteration through
the real snapshot engine into an in-memory store; the job "fails" in iteration 7. The same run continues,
without snapshots, to iteration 8 as the fault-free reference; the full state (every operator's weights,
Adam moments and steps, LR schedule, RNG, popularity counters) is kept after every iteration.

Each test first scrambles the live state, as a restarted process would have it, then drives
``Recovery.advance`` with a recorded step function: it runs the real ``train_step`` with the optimizer the
machine hands it and records the iteration, the wrapper, the recorded grad norm and the frozen operators,
and checks the live weights against the reference before the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import pytest
import torch

from megatron.training.extensions import LoopExtension
from moe_ft.recovery.machine import MachineConfig, Phase, Recovery, RecoveryContext, RecoveryState
from moe_ft.recovery.optim import RecordedStepOptimizer
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import MemoryBackend, NewestFullRule, SnapshotStore, SparseWindowRule
from tests._ft_helpers import one_rank_megatron, tiny_model_flags

pytestmark = pytest.mark.timeout(60)  # ~8 s here (Megatron import and model build are most of it)

WINDOW = 3
SNAPSHOTTED = 7  # iterations 0..6 completed and were snapshotted; the job failed in iteration 7
ITERS = 9  # the fault-free reference runs 0..8
MODEL = tiny_model_flags(seq_length=16, global_batch_size=4, train_iters=ITERS, lr_warmup_iters=2)


@dataclass
class Reference:
    """The full state after one iteration of the fault-free run."""

    tensors: dict[tuple[OperatorId, str], torch.Tensor]
    scheduler: dict
    lr: list[float]
    rng: torch.Tensor
    popularity: dict
    grad_norm: float


@dataclass
class Job:
    args: object
    state: object
    data: object
    registry: object
    popularity: object
    policy: object
    store: SnapshotStore
    plans: dict[int, dict[OperatorId, Level]] = field(default_factory=dict)
    ref: dict[int, Reference] = field(default_factory=dict)


class _RouterSpec(LoopExtension):
    """Puts moe-ft's popularity-counting router into the layer spec (what the FT flags do in a real run)."""

    def customize_layer_spec(self, spec):
        from moe_ft.megatron_ext.router import install_router

        return install_router(spec)


class _SnapshotBeforeStep:
    """The loop's hook: the in-flight snapshot must be off the weights before the optimizer step."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def before_optimizer_step(self, iteration: int) -> None:
        self.engine.wait_copied()


def capture(job: Job, grad_norm: float) -> Reference:
    return Reference(
        tensors={(op, name): t.detach().clone() for op in job.registry
                 for name, t in job.registry[op].tensors(Level.FULL).items()},
        scheduler=job.state.scheduler.state_dict(), lr=[g["lr"] for g in job.state.optimizer.param_groups],
        rng=torch.get_rng_state(), popularity=job.popularity.state_dict(), grad_norm=grad_norm)


def scramble(job: Job, seed: int = 99) -> None:
    """What a restarted process holds instead of the lost state: other weights, moments, steps, LR
    position, RNG and fresh popularity counters."""
    from moe_ft.popularity import ExpertPopularity

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for op in job.registry:
            for t in job.registry[op].tensors(Level.FULL).values():
                t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    job.state.scheduler.step(increment=1000)
    torch.manual_seed(seed)
    job.popularity.load_state_dict(ExpertPopularity(job.popularity.config).state_dict())


def mismatches(job: Job, ref: Reference, ops=None) -> list[str]:
    """Names of live tensors that are not bitwise equal to the reference (``ops``: only these)."""
    return [f"{op}/{name}" for (op, name), want in ref.tensors.items() if ops is None or op in ops
            if not torch.equal(job.registry[op].tensors(Level.FULL)[name], want)]


def assert_step_state(job: Job, ref: Reference) -> None:
    """LR schedule, LR, RNG and popularity counters bitwise as in ``ref``."""
    assert job.state.scheduler.state_dict() == ref.scheduler
    assert [g["lr"] for g in job.state.optimizer.param_groups] == ref.lr
    assert torch.equal(torch.get_rng_state(), ref.rng)
    for key, want in ref.popularity.items():
        got = job.popularity.state_dict()[key]
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want, key


def full_at(job: Job, start: int, end: int) -> dict[OperatorId, int]:
    """Each operator's newest FULL snapshot in ``[start, end]``, from the plans the policy produced."""
    out: dict[OperatorId, int] = {}
    for t in range(start, end + 1):
        out.update({op: t for op, level in job.plans[t].items() if level == Level.FULL})
    return out


@pytest.fixture(scope="module")
def job(corpus):
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import set_seeds
    from megatron.training.model import build_train_state
    from megatron.training.pretrain import build_data
    from megatron.training.training import train_step
    from moe_ft.megatron_ext.router import attach_popularity
    from moe_ft.policy.sparse import SparseConfig, SparsePolicy
    from moe_ft.popularity import ExpertPopularity, PopularityConfig
    from moe_ft.snapshot import EngineConfig, SnapshotEngine
    from moe_ft.snapshot.meta import capture_step_meta
    from moe_ft.state.catalogue import merge_catalogue
    from moe_ft.state.optimizer_views import ensure_optimizer_state
    from moe_ft.state.registry import OperatorRegistry

    with one_rank_megatron():
        engine = None
        try:
            args = parse_args([*MODEL, "--data-path", corpus], world_size=1)
            args.extra["router"] = _RouterSpec()
            set_seeds(args.training.seed)
            state = build_train_state(args)
            popularity = ExpertPopularity(PopularityConfig(moe_layers=[0, 1], num_experts=4))
            assert attach_popularity(state.model, popularity) == 2
            ensure_optimizer_state(state.optimizer)  # the registry's views need Adam's state before step 0
            registry = OperatorRegistry.from_megatron(state.model, state.optimizer)
            policy = SparsePolicy(SparseConfig(window=WINDOW), merge_catalogue([registry.infos()], registry.ep_size))
            policy.plan(0, popularity)  # opens the first window at iteration 0
            store = SnapshotStore(MemoryBackend(name="failed job's store"))
            engine = SnapshotEngine(EngineConfig(), registry, store)
            j = Job(args=args, state=state, data=build_data(args), registry=registry, popularity=popularity,
                    policy=policy, store=store)
            hooks = _SnapshotBeforeStep(engine)
            for t in range(ITERS):
                result = train_step(state, j.data, t, args, hooks=hooks)
                popularity.end_iteration(t)
                j.ref[t] = capture(j, result.grad_norm)
                if t < SNAPSHOTTED:  # what the runtime does after each iteration (moe_ft/runtime.py on_step_end)
                    plan = policy.plan(t, popularity)
                    j.plans[t] = dict(plan)
                    meta, tensors = capture_step_meta(iteration=t, result=result, state=state,
                                                      global_batch_size=args.training.global_batch_size,
                                                      clip_grad=args.training.clip_grad, policy=policy,
                                                      popularity=popularity)
                    engine.submit(t, plan, meta, tensors)
                    popularity.mark_full(t, fulls(plan))
                if t == SNAPSHOTTED - 1:
                    engine.close()
                    engine = None
            assert store.points() == list(range(SNAPSHOTTED))
            yield j
        finally:
            if engine is not None:
                engine.close()


@dataclass
class StepRecord:
    iteration: int
    wrapper: type
    grad_norm: float
    frozen: set[OperatorId]
    weights_as_reference: list[str]
    """Tensors whose value before the step differed from the fault-free run's after ``iteration - 1``."""


class RecordedSteps:
    """The step function the loop hands recovery (``train_step`` with the optimizer the machine passes),
    recording what each call got and checking the live weights before it runs."""

    def __init__(self, job: Job) -> None:
        from megatron.training.training import train_step

        self.job, self._train_step, self.calls = job, train_step, []
        self._op_of = {id(t): op for op in job.registry for t in job.registry[op].compute.values()}

    def __call__(self, iteration: int, optimizer) -> object:
        j = self.job
        frozen = {self._op_of[id(m)] for m in getattr(optimizer, "frozen_mains", [])}
        active = [op for op in j.registry if op not in frozen]
        before = j.ref[iteration - 1]
        # every operator's compute weights are those iteration `iteration` originally started from; the
        # active ones also hold their optimizer state of then (the frozen ones' is not loaded yet)
        differ = [f"{op}/{n}" for op in j.registry for n, t in j.registry[op].compute.items()
                  if not torch.equal(t, before.tensors[(op, n)])] + mismatches(j, before, active)
        self.calls.append(StepRecord(iteration, type(optimizer), getattr(optimizer, "grad_norm", math.nan),
                                     frozen, differ))
        return self._train_step(replace(j.state, optimizer=optimizer), j.data, iteration, j.args)


class FaultAt:
    """``fault_check`` of a drill: raises once at (``iteration``, ``phase``); records every call."""

    def __init__(self, iteration: int | None = None, phase: str = "recovery") -> None:
        self.at, self.calls, self.fired = (iteration, phase), [], False

    def __call__(self, iteration: int, phase: str) -> None:
        self.calls.append((iteration, phase))
        if (iteration, phase) == self.at and not self.fired:
            self.fired = True
            raise RuntimeError(f"injected fault at iteration {iteration} ({phase})")


def machine(job: Job, *, store=None, rule=None, lossy: bool = False, fault=None):
    steps = RecordedSteps(job)
    ops = list(job.registry)
    ctx = RecoveryContext(store=job.store if store is None else store, registry=job.registry,
                          rule=rule or SparseWindowRule.aligned(ops, WINDOW), train_state=job.state, step_fn=steps,
                          popularity=job.popularity, policy=job.policy, fault_check=fault or FaultAt())
    return Recovery(MachineConfig(lossy=lossy), ctx), steps


def fulls(plan) -> list[OperatorId]:
    return [op for op, level in plan.items() if level == Level.FULL]


def resume_training(job: Job, resume: int) -> None:
    """What the runtime does after recovery (``moe_ft/recovery/driver.py``: the restored counters are those
    captured before ``mark_full`` of the point's end) and then per re-executed iteration, to the end."""
    from megatron.training.training import train_step

    job.popularity.mark_full(resume - 1, fulls(job.plans[resume - 1]))
    for t in range(resume, ITERS):
        train_step(job.state, job.data, t, job.args)
        job.popularity.end_iteration(t)
        if t in job.plans:
            job.popularity.mark_full(t, fulls(job.plans[t]))


def test_sparse_window_agree_load_replay_finalize_done(job):
    scramble(job)
    fault = FaultAt()
    m, steps = machine(job, fault=fault)
    s = RecoveryState()
    start, end = WINDOW, 2 * WINDOW - 1  # [3, 5]: the newest window complete before the failure in 7
    expected_full_at = full_at(job, start, end)
    assert len(set(expected_full_at.values())) == WINDOW, "every slice of the window holds some operator"
    activated_by = lambda t: {op for op, f in expected_full_at.items() if f <= t}  # noqa: E731

    m.advance(s)
    assert s.phase is Phase.LOAD and (s.point.start, s.point.end) == (start, end) and s.proposals == [end]
    assert s.point.full_at == expected_full_at and s.skipped == []

    m.advance(s)
    assert s.phase is Phase.REPLAY and s.next_replay == start + 1 and s.active == activated_by(start)
    assert mismatches(job, job.ref[start], s.active) == [] and steps.calls == []

    for t in range(start + 1, end + 1):
        m.advance(s)
        assert s.phase is (Phase.REPLAY if t < end else Phase.FINALIZE)
        assert s.replayed == list(range(start + 1, t + 1)) and s.next_replay == t + 1
        assert s.active == activated_by(t - 1)
        call = steps.calls[-1]
        assert (call.iteration, call.wrapper) == (t, RecordedStepOptimizer)
        assert call.frozen == set(job.registry) - activated_by(t - 1) != set()
        assert call.grad_norm == job.ref[t].grad_norm, "clipping uses the recorded global norm"
        assert call.weights_as_reference == []
        # after the step the active operators are exactly where the fault-free run was after `t`
        assert mismatches(job, job.ref[t], activated_by(t - 1)) == []

    m.advance(s)
    assert s.phase is Phase.DONE and s.resume_iteration == end + 1 and s.active == set(job.registry)
    assert mismatches(job, job.ref[end]) == []
    assert_step_state(job, job.ref[end])
    assert job.policy.state_dict()["current"]["start"] == start, "the policy as after iteration 5"
    assert [c.iteration for c in steps.calls] == [4, 5] and fault.calls == [(4, "recovery"), (5, "recovery")]
    assert s.routing_checked == 2 and s.bytes_loaded > 0 and s.message == ""
    assert set(s.seconds) == {"agree", "load", "replay", "finalize"}

    resume_training(job, s.resume_iteration)  # re-executes 6, 7 and goes on: the fault-free run's state
    assert mismatches(job, job.ref[ITERS - 1]) == []
    assert_step_state(job, job.ref[ITERS - 1])


@pytest.mark.parametrize("fallback", [0, 4])
def test_empty_store_falls_back(job, fallback):
    scramble(job, seed=fallback)
    before = capture(job, math.nan)
    m, steps = machine(job, store=SnapshotStore(MemoryBackend(name="empty")))
    s = RecoveryState(fallback_iteration=fallback)
    m.advance(s)
    assert s.phase is Phase.FALLBACK and s.point is None and s.proposals == [-1]
    m.advance(s)
    assert s.phase is Phase.DONE and s.resume_iteration == fallback and s.replayed == [] and s.active == set()
    want = (f"resuming from the persisted checkpoint at iteration {fallback}" if fallback else
            "restarting from the initial state (iteration 0)")
    assert want in s.message
    assert steps.calls == [] and s.bytes_loaded == 0
    assert mismatches(job, before) == [], "falling back leaves the model to the --load checkpoint"


def test_lossy_loads_newest_full_and_skips_replay(job):
    scramble(job)
    m, steps = machine(job, rule=NewestFullRule(operators=frozenset(job.registry)), lossy=True)
    s = RecoveryState()
    end = SNAPSHOTTED - 1
    expected_full_at = full_at(job, 0, end)
    m.advance(s)
    assert s.phase is Phase.LOAD and s.point.end == end and s.point.full_at == expected_full_at
    m.advance(s)
    assert s.phase is Phase.FINALIZE and s.active == set(job.registry)
    m.advance(s)
    assert s.phase is Phase.DONE and s.resume_iteration == end + 1 and s.replayed == [] and steps.calls == []
    for op, f in expected_full_at.items():  # each operator exactly as after its newest FULL snapshot
        assert mismatches(job, job.ref[f], {op}) == [], op
    stale = {op for op, f in expected_full_at.items() if f < end}
    assert stale and mismatches(job, job.ref[end], stale), "lossy: stale operators are not at `end`"
    assert_step_state(job, job.ref[end])


def test_fault_during_replay_is_resumable(job):
    scramble(job)
    fault = FaultAt(5)
    m, steps = machine(job, fault=fault)
    s = RecoveryState()
    with pytest.raises(RuntimeError, match="injected fault at iteration 5"):
        m.run(s)
    assert s.phase is Phase.REPLAY and s.next_replay == 5 and s.replayed == [4]
    assert [c.iteration for c in steps.calls] == [4]
    m.run(s)  # the same state, advanced again: the transition that failed is redone
    assert s.phase is Phase.DONE and s.replayed == [4, 5] and s.resume_iteration == 6
    assert [c.iteration for c in steps.calls] == [4, 5] and steps.calls[-1].weights_as_reference == []
    assert mismatches(job, job.ref[5]) == []
    assert_step_state(job, job.ref[5])


def test_fault_during_replay_then_restart_recovers_again(job):
    scramble(job)
    m, _ = machine(job, fault=FaultAt(5))
    with pytest.raises(RuntimeError, match="injected fault"):
        m.run(RecoveryState())
    scramble(job, seed=7)  # the process died: a new one starts from other state, over the same store
    m, steps = machine(job)
    s = m.run(RecoveryState())
    assert s.phase is Phase.DONE and s.replayed == [4, 5] and [c.iteration for c in steps.calls] == [4, 5]
    assert mismatches(job, job.ref[5]) == []
    assert_step_state(job, job.ref[5])


def test_an_infinite_recorded_norm_zeroes_the_gradients_as_megatrons_clipping_did(job):
    """Training without a loss scaler: finite gradients whose fp32 sum of squares overflows give a global norm
    of inf. Megatron clips by ``max_norm / (inf + 1e-6) = 0`` and steps with zero gradients; the replay clips by
    the recorded norm the same way (it skipped clipping for a norm that is not finite: the raw gradients)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    from moe_ft.recovery.optim import leaf_optimizers

    opt = job.state.optimizer
    before = capture(job, math.nan).tensors

    def start_step() -> None:  # the weights, moments and step counters as before, and huge finite gradients
        with torch.no_grad():
            for (op, name), t in before.items():
                job.registry[op].tensors(Level.FULL)[name].copy_(t)
            for model in job.state.model:
                for p in model.parameters():
                    p.main_grad.fill_(1.0e19)

    start_step()
    assert not opt.prepare_grads()
    for leaf in leaf_optimizers(opt):  # what Megatron's step does with the norm it computed
        assert leaf.config.clip_grad > 0.0
        clip_grad_by_total_norm_fp32(leaf.get_parameters(), max_norm=leaf.config.clip_grad, total_norm=math.inf)
    opt.step_with_ready_grads()
    megatron = capture(job, math.inf)
    assert mismatches(job, Reference(before, {}, [], torch.empty(0), {}, math.nan)) != []  # the step moved them
    start_step()
    RecordedStepOptimizer(opt, grad_norm=math.inf, found_inf=False, frozen_mains=[]).step()
    assert mismatches(job, megatron) == []
