"""Survivor points (``moe_ft/localized/survivor.py``): a stopped rank publishes the exact state of
its last completed iteration, atomically, and never a state torn by the optimizer step.

The registry here is a dict of real :class:`OperatorState` objects over plain tensors (what the survivor
code reads is exactly ``registry[op].tensors(Level.FULL)``); the store is the real node-local store."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from moe_ft.localized.survivor import SurvivorGuard, SurvivorStop, run_guarded
from moe_ft.localized.survivor_points import load_survivor_point, newest_survivor_point, survivor_store
from moe_ft.state.operators import Level, OperatorId
from moe_ft.state.registry import OperatorState


def make_registry(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    reg = {}
    for op in (OperatorId.expert_op(0, 0), OperatorId.expert_op(0, 1), OperatorId.gate(0), OperatorId.embedding()):
        names = ["weight"] + (["router.expert_bias"] if op.kind == "gate" else [])
        reg[op] = OperatorState(op=op, compute={n: torch.randn(4, 3, generator=g) for n in names},
                                master={"master.weight": torch.randn(4, 3, generator=g)},  # a buffer has none
                                optim={"exp_avg.weight": torch.randn(4, 3, generator=g)})
    return reg


def snapshot_of(reg) -> dict:
    return {(op, n): t.clone() for op, st in reg.items() for n, t in st.tensors(Level.FULL).items()}


def step(reg, value: float) -> None:
    """What an optimizer step does: every weight, master and moment moves."""
    for st in reg.values():
        for t in st.tensors(Level.FULL).values():
            t.add_(value)


def guard_for(tmp_path, reg, **kw) -> SurvivorGuard:
    return SurvivorGuard(store_root=str(tmp_path), job_id="job", rank=3, registry_fn=lambda: reg, **kw)


META = {"iteration": 0, "grad_norm": 1.5, "scheduler": {"num_steps": 8}}


def test_publish_is_the_completed_state_bitwise(tmp_path):
    reg = make_registry(0)
    guard = guard_for(tmp_path, reg)
    guard.begin_update(4)
    step(reg, 0.25)
    bias = reg[OperatorId.gate(0)].compute["router.expert_bias"]
    guard.completed(4, dict(META, iteration=4), {"rng.torch_cpu": torch.get_rng_state(),
                                                 "expert_bias.L0": bias.clone()})
    expected = snapshot_of(reg)
    bias.add_(7.0)  # finalize_model_grads of iteration 5 moves the bias before the optimizer step
    result = guard.publish("peer died")
    assert result.iteration == 4 and result.nbytes > 0
    store = survivor_store(str(tmp_path), "job", 3)
    assert store.backend.directory == tmp_path / "job" / "survivor" / "rank3"
    assert newest_survivor_point(store, list(reg)) == (4, "")
    target = make_registry(1)  # a fresh process: different live values
    load_survivor_point(store, target, 4)
    got = snapshot_of(target)
    assert got.keys() == expected.keys()
    for key, t in expected.items():
        assert torch.equal(got[key], t), key  # the bias is iteration 4's, not the moved one
    meta = store.load_meta(4)
    assert meta.meta["grad_norm"] == 1.5 and meta.meta["survivor"]["rank"] == 3
    assert meta.meta["survivor"]["why"] == "peer died"


def test_nothing_published_inside_the_optimizer_step_or_before_any_iteration(tmp_path):
    reg = make_registry(0)
    guard = guard_for(tmp_path, reg)
    assert guard.publish("x").iteration is None  # nothing completed since start
    guard.completed(2, META, {})
    guard.begin_update(3)
    result = guard.publish("gloo raised in the grad-norm all-reduce")
    assert result.iteration is None and "inside the optimizer step of iteration 3" in result.reason
    store = survivor_store(str(tmp_path), "job", 3)
    assert store.points() == [] and store.staging() == []
    assert newest_survivor_point(store, list(reg))[0] == -1


def test_sigterm_inside_the_step_is_deferred_to_its_end(tmp_path):
    reg = make_registry(0)
    guard = guard_for(tmp_path, reg)

    def train():
        guard.completed(0, META, {})
        guard.begin_update(1)
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun stops the job in the middle of the update
        step(reg, 1.0)
        guard.completed(1, dict(META, iteration=1), {})  # the stop takes effect here
        raise AssertionError("not reached: the deferred stop raises at the end of the critical section")

    assert run_guarded(train, lambda: guard) == 1
    store = survivor_store(str(tmp_path), "job", 3)
    assert store.points() == [1]
    target = make_registry(5)
    load_survivor_point(store, target, 1)
    assert all(torch.equal(a, b) for a, b in zip(snapshot_of(target).values(), snapshot_of(reg).values()))


def test_sigterm_outside_the_step_stops_at_once_with_the_previous_iteration(tmp_path):
    reg = make_registry(0)
    guard = guard_for(tmp_path, reg)
    reached = []

    def train():
        guard.completed(6, dict(META, iteration=6), {})
        expected.update(snapshot_of(reg))
        os.kill(os.getpid(), signal.SIGTERM)  # during forward/backward of iteration 7
        reached.append("after")

    expected: dict = {}
    assert run_guarded(train, lambda: guard) == 1
    assert reached == []
    store = survivor_store(str(tmp_path), "job", 3)
    assert newest_survivor_point(store, list(reg)) == (6, "")
    assert signal.getsignal(signal.SIGTERM) is not guard.on_signal  # handler restored


def test_exception_publishes_and_a_newer_dump_replaces_the_older(tmp_path):
    reg = make_registry(0)
    guard = guard_for(tmp_path, reg)

    def fail_at(it):
        def train():
            guard.completed(it, dict(META, iteration=it), {})
            raise RuntimeError("Connection closed by peer [gloo]")
        return train

    assert run_guarded(fail_at(3), lambda: guard) == 1
    assert run_guarded(fail_at(8), lambda: guard) == 1
    assert survivor_store(str(tmp_path), "job", 3).points() == [8]


def test_dump_killed_midway_publishes_nothing(tmp_path):
    """A rank SIGKILLed during its dump (torchrun's grace ran out) leaves only an unpublished staging dir."""
    reg = make_registry(0)

    def die(iteration, phase):
        assert phase == "survivor"
        os.kill(os.getpid(), signal.SIGKILL)

    guard = guard_for(tmp_path, reg, fault_check=die)
    guard.completed(5, META, {})
    pid = os.fork()
    if pid == 0:  # child: dies inside publish
        try:
            guard.publish("peer died")
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    store = survivor_store(str(tmp_path), "job", 3)
    assert store.points() == [] and len(store.staging()) == 1
    it, why = newest_survivor_point(store, list(reg))
    assert it == -1 and "did not finish" in why


def test_corrupt_survivor_point_is_not_usable(tmp_path):
    from moe_ft.drills.faults import corrupt_point

    reg = make_registry(0)
    guard = guard_for(tmp_path, reg)
    guard.completed(2, META, {})
    assert guard.publish("x").iteration == 2
    store = survivor_store(str(tmp_path), "job", 3)
    corrupt_point((store.backend, 2))
    it, why = newest_survivor_point(store, list(reg))
    assert it == -1 and "corrupt" in why


def test_deadline_gives_up_unpublished(tmp_path):
    reg = make_registry(0)
    guard = guard_for(tmp_path, reg, deadline_s=0.0)
    guard.completed(2, META, {})
    guard.stopped_at = 0.0  # the stop happened long ago
    result = guard.publish("x")
    assert result.iteration is None and "did not finish within" in result.reason
    store = survivor_store(str(tmp_path), "job", 3)
    assert store.points() == [] and store.staging() == []


def test_stop_exception_is_not_swallowed_by_except_exception():
    with pytest.raises(SurvivorStop):
        try:
            raise SurvivorStop(signal.SIGTERM)
        except Exception:  # noqa: BLE001 - what library code does
            pytest.fail("SurvivorStop must pass through `except Exception`")


class _MegatronLikeOptimizer:
    """The shape of Megatron's ``step()`` (every optimizer class): gradients only until it calls
    ``self.step_with_ready_grads()``, where weights and moments change."""

    def __init__(self, reg, guard):
        self.reg, self.guard, self.seen = reg, guard, []

    def step(self):
        self.seen.append(("grad-norm all-reduce", self.guard.updating))
        return self.step_with_ready_grads()

    def step_with_ready_grads(self):
        self.seen.append(("update", self.guard.updating))
        step(self.reg, 1.0)
        return True


def test_critical_section_starts_where_the_optimizer_updates(tmp_path):
    reg = make_registry(0)
    guard = guard_for(tmp_path, reg)
    opt = _MegatronLikeOptimizer(reg, guard)
    guard.watch_optimizer(opt)
    guard.completed(6, META, {})
    assert opt.step() is True
    assert opt.seen == [("grad-norm all-reduce", None), ("update", 7)]
    assert guard.publish("x").iteration is None  # between the update and the capture of 7
    guard.completed(7, META, {})
    assert guard.updating is None and guard.publish("x").iteration == 7


def test_a_held_stop_waits_for_the_log_line(tmp_path):
    """The runtime holds a SIGTERM after the step until the loop printed the iteration (``after_log``)."""
    reg = make_registry(0)
    guard = guard_for(tmp_path, reg)
    logged = []

    def train():
        guard.completed(4, dict(META, iteration=4), {}, hold=True)
        os.kill(os.getpid(), signal.SIGTERM)  # arrives before the loss line of iteration 4 is printed
        logged.append(4)
        guard.release()  # StepHooks.after_log
        raise AssertionError("not reached: the held stop takes effect at the release")

    assert run_guarded(train, lambda: guard) == 1
    assert logged == [4]
    assert survivor_store(str(tmp_path), "job", 3).points() == [4]


def test_the_previous_point_stays_until_the_new_one_is_published(tmp_path):
    """A dump that dies half-way leaves the rank's previous survivor point in place; a published dump
    replaces it; a state loaded from a point is not dumped again over it."""
    reg = make_registry(0)
    died = []

    def die_once(iteration, phase):
        if not died:
            died.append(iteration)
            raise RuntimeError("killed during the dump")

    guard = guard_for(tmp_path, reg)
    guard.completed(3, dict(META, iteration=3), {})
    assert guard.publish("first stop").iteration == 3
    store = survivor_store(str(tmp_path), "job", 3)
    at_3 = snapshot_of(reg)
    step(reg, 1.0)
    guard = guard_for(tmp_path, reg, fault_check=die_once)
    guard.completed(5, dict(META, iteration=5), {})
    with pytest.raises(RuntimeError, match="killed during the dump"):
        guard.publish("second stop")
    assert store.points() == [3] and newest_survivor_point(store, list(reg)) == (3, "")
    target = make_registry(1)
    load_survivor_point(store, target, 3)
    assert all(torch.equal(snapshot_of(target)[k], t) for k, t in at_3.items())
    assert guard.publish("second stop, again").iteration == 5  # published: the old point goes
    assert store.points() == [5]
    guard.adopt(5, dict(META, iteration=5), {})  # a loader took its state from that point
    again = guard.publish("stopped during the rest of the recovery")
    assert again.iteration == 5 and again.nbytes == 0 and store.points() == [5]


def test_dump_deadline_follows_the_launchers_grace_or_the_flag(monkeypatch):
    from moe_ft.recovery.config import RecoverConfig

    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert RecoverConfig().survivor_deadline_s() == 25.0  # torch elastic's 30 s grace, minus 5 s
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120")
    assert RecoverConfig().survivor_deadline_s() == 115.0
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "3")
    assert RecoverConfig().survivor_deadline_s() == 1.0
    assert RecoverConfig(survivor_deadline=7.5).survivor_deadline_s() == 7.5
    with pytest.raises(ValueError, match="--ft-survivor-deadline must be >= 0"):
        RecoverConfig(survivor_deadline=-1)


def test_held_point_is_the_completed_state_and_reads_no_file(tmp_path):
    """``moe-ft launch``: a survivor keeps its process, so it holds the point in memory (no copy on CPU) and
    the next attempt's model loads it from there; nothing is written until it spills (the process leaves)."""
    reg = make_registry(0)
    guard = guard_for(tmp_path, reg)
    guard.begin_update(4)
    step(reg, 0.25)
    bias = reg[OperatorId.gate(0)].compute["router.expert_bias"]
    guard.completed(4, dict(META, iteration=4), {"expert_bias.L0": bias.clone()})
    expected = snapshot_of(reg)
    bias.add_(7.0)  # moved by the next iteration's finalize_model_grads: the held bias is iteration 4's
    result = guard.hold("peer died")
    held = guard.held
    assert result.iteration == 4 and held is not None and held.rank == 3 and result.nbytes == held.nbytes > 0
    assert not (tmp_path / "job").exists()  # nothing on disk
    weight = reg[OperatorId.embedding()].compute["weight"]
    assert held.entries[OperatorId.embedding()]["weight"].data_ptr() == weight.data_ptr()  # no copy on CPU
    assert held.newest(list(reg)) == (4, "")
    assert held.newest(list(reg)[:2])[0] == -1  # a re-planned model's operators: not this point
    target = make_registry(1)
    for st in target.values():  # live parameters are leaves that require grad
        st.compute["weight"].requires_grad_(True)
    assert held.load(target, 4) > 0
    got = snapshot_of(target)
    for key, t in expected.items():
        assert torch.equal(got[key], t), key
    meta, tensors = held.meta(4)
    assert meta["survivor"]["why"] == "peer died" and torch.equal(tensors["expert_bias.L0"], expected[
        (OperatorId.gate(0), "router.expert_bias")])
    with pytest.raises(RuntimeError, match="holds no survivor point of iteration 3"):
        held.load(target, 3)

    spilled = held.spill()  # the process leaves after all: the node store gets the same point
    store = survivor_store(str(tmp_path), "job", 3)
    assert spilled.iteration == 4 and newest_survivor_point(store, list(reg)) == (4, "")
    fresh = make_registry(2)
    load_survivor_point(store, fresh, 4)
    assert all(torch.equal(snapshot_of(fresh)[k], t) for k, t in expected.items())
    held.discard()
    assert held.newest(list(reg))[0] == -1 and held.spill().iteration is None


def test_nothing_is_held_inside_the_update_or_before_the_first_completed_iteration(tmp_path):
    reg = make_registry(0)
    guard = guard_for(tmp_path, reg)
    assert guard.hold("x").iteration is None and guard.held is None
    guard.completed(2, dict(META, iteration=2), {})
    guard.begin_update()
    result = guard.hold("gloo raised in the optimizer step")
    assert result.iteration is None and "torn" in result.reason and guard.held is None


def test_run_guarded_holds_instead_of_publishing(tmp_path):
    reg = make_registry(0)
    guard = guard_for(tmp_path, reg)
    guard.completed(5, dict(META, iteration=5), {})

    def train():
        raise RuntimeError("Connection closed by peer")

    assert run_guarded(train, lambda: guard, hold=True) == 1
    assert guard.held is not None and guard.held.iteration == 5 and not (tmp_path / "job").exists()


@pytest.mark.parametrize("hold", [False, True])
def test_run_guarded_without_a_guard_says_so(capsys, hold):
    """A failure before the runtime built its guard (forming the process groups): exit code 1 and one line
    saying there was no guard, whether the caller holds or publishes."""

    def train():
        raise RuntimeError("Connection closed by peer")

    assert run_guarded(train, lambda: None, hold=hold) == 1
    err = capsys.readouterr().err
    assert "published nothing: no survivor guard" in err and "AttributeError" not in err
