"""Survivor points: a rank that did not fail publishes its exact state before it exits
(MoEvement §3.4: only the failed stage rolls back).

When a peer dies, the healthy ranks learn it one of two ways: a collective raises (gloo closes the
connection to the dead peer), or torchrun's agent sends SIGTERM and waits ``shutdown_timeout`` (30 s)
before SIGKILL (`measured on the development machines`). Either way the rank holds, in memory, the state
after its last *completed* iteration ``t``. It writes that state into its node-local store as one dense,
checksummed point (every operator FULL plus the metadata of ``t``: RNG, LR schedule, loss scaler,
popularity, policy — exactly what a snapshot's metadata holds, ``moe_ft/snapshot/meta.py``), published by
one rename at the end, then exits non-zero. After the restart it loads that point and does not replay
(``moe_ft/recovery/driver.py``, localized scope).

What "completed" means, and why it is exact:

* iteration ``t`` is completed once its optimizer and scheduler steps are done *and* the runtime has
  captured its metadata (``on_step_end``: RNG, scheduler, popularity as of the end of ``t``).
  :meth:`SurvivorGuard.completed` records that capture;
* from the moment the optimizer of ``t+1`` starts to update (:meth:`SurvivorGuard.begin_update`, called
  by :meth:`SurvivorGuard.watch_optimizer`'s seam on the optimizer's ``step_with_ready_grads``: Megatron's
  ``step()`` first unscales, all-reduces the grad norm and clips — gradients only — then calls it, and
  every weight, master and moment changes inside it) to that capture of ``t+1`` the state is being moved
  from ``t`` to ``t+1``: the *critical section*. A SIGTERM arriving inside it is deferred to its end (then
  the state is ``t+1``'s); an exception raised inside it (a collective of the update, or of the end of the
  iteration, failed) leaves a state that belongs to neither iteration: the rank publishes nothing and is
  treated as failed. A peer lost while the survivors wait in the grad-norm all-reduce leaves them outside
  it, with the state of ``t``;
* the runtime holds a deferred SIGTERM a little longer, until the training loop printed the iteration's
  log line (``completed(hold=True)``, released by ``StepHooks.after_log``): a completed iteration never
  loses its loss line (the elastic drill compares loss curves line by line);
* outside the critical section the forward/backward of ``t+1`` has only touched gradients, activations,
  the RNG and the open popularity counters, none of which the point takes from the live state: RNG and
  counters come from the captured metadata of ``t``, and so do the routers' expert biases (Megatron moves
  them in ``finalize_model_grads``, before the optimizer step).

A rank that cannot finish the dump before SIGKILL leaves only an unpublished staging directory, which no
reader ever sees (``moe_ft/store``: atomic rename), so it counts as failed. So does one whose dump is
older than the job's newest completed iteration (``moe_ft/localized/scope.py``).

Under ``moe-ft launch`` a survivor keeps its process, so it does not dump: it *holds* the point in memory
(:meth:`SurvivorGuard.hold`, a :class:`HeldPoint`: references to the failed attempt's tensors, moved to the
host, no copy on CPU) and the next attempt's recovery loads it from there, reading no file. The point is
written to the node store (:meth:`HeldPoint.spill`) only when the process is about to leave anyway (a full
restart, a stop) or the job was reshaped (the new layout's ranks read the old ranks' points from the store).
Recovery reads either kind from ``survivor_points.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch

from moe_ft.localized.survivor_points import HeldPoint, PublishResult, survivor_store, write_point
from moe_ft.state.operators import Level, OperatorId

log = logging.getLogger("moe_ft.localized")

class SurvivorStop(BaseException):
    """Raised on the training thread when the job is being stopped (SIGTERM) outside a critical section.
    A ``BaseException`` so that ``except Exception`` blocks in libraries do not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signal.Signals(signum).name}")
        self.signum = signum


class Regroup(SurvivorStop):
    """Raised on every rank at the end of the same iteration when the launcher regroups the job (a node
    joins, ``moe-ft launch``): the process leaves the attempt holding that iteration's state and stays."""

    def __init__(self, iteration: int) -> None:
        BaseException.__init__(self, f"the job regroups after iteration {iteration} (a node joins)")
        self.signum = 0


@dataclass
class Completed:
    """The newest completed iteration and the metadata the runtime captured at its end."""

    iteration: int
    meta: dict
    tensors: dict[str, torch.Tensor]


def _expert_bias_override(op: OperatorId, name: str, meta_tensors: Mapping[str, torch.Tensor]):
    """A router's expert bias as of the completed iteration (the live buffer may already be moved by
    ``finalize_model_grads`` of the next one)."""
    if op.kind == "gate" and name.endswith("expert_bias"):
        return meta_tensors.get(f"expert_bias.L{op.layer}")
    return None


class SurvivorGuard:
    """This rank's survivor bookkeeping (state on the object, nothing module-global but the installed
    signal handler). The runtime calls :meth:`begin_update` / :meth:`completed` every iteration; the entry
    script runs training under :func:`run_guarded`, which publishes on a stop."""

    def __init__(self, *, store_root: str, job_id: str, rank: int, registry_fn: Callable[[], object],
                 fault_check: Callable[[int, str], None] | None = None, deadline_s: float = 25.0) -> None:
        self.store_root, self.job_id, self.rank = store_root, job_id, rank
        self.registry_fn = registry_fn
        """Returns the operator registry (``None`` before the runtime built it: nothing to publish)."""
        self.fault_check = fault_check
        """Drills: called as ``(iteration, "survivor")`` after half of the entries are written."""
        self.deadline_s = deadline_s
        self.drain: Callable[[], None] | None = None
        """Called before the state is kept (the runtime's components finish their queued background work:
        the upstream log of the completed iterations must be published before the process goes)."""
        """Seconds after the stop beyond which the dump gives up unpublished (``--ft-survivor-deadline``;
        torch elastic sends SIGKILL its shutdown timeout, 30 s by default, after SIGTERM)."""
        self.last: Completed | None = None
        self.adopted: int | None = None
        """The iteration whose survivor point the live state was loaded from (:meth:`adopt`), until the next
        completed iteration."""
        self.updating: int | None = None
        """The iteration whose optimizer step is in progress (the critical section), else ``None``."""
        self.held: HeldPoint | None = None
        """What :meth:`hold` kept after this attempt failed."""
        self.carried: HeldPoint | None = None
        """The point this process held when its previous attempt failed (recovery loads it from memory)."""
        self.pending_signal: int | None = None
        self.stopped_at: float | None = None
        self.holding = False
        """After :meth:`completed` with ``hold=True``: a SIGTERM still waits for :meth:`release` (the
        iteration's log line is printed first, so a completed iteration never loses it)."""

    # ------------------------------------------------------------------------ per-iteration bookkeeping
    def begin_update(self, iteration: int | None = None) -> None:
        """The live state starts to change (the optimizer's update): the critical section starts.
        ``iteration``: the one being updated (default: the one after the newest completed)."""
        self.updating = iteration if iteration is not None else (self.last.iteration + 1 if self.last else -1)

    def watch_optimizer(self, optimizer) -> None:
        """Start the critical section where ``optimizer`` starts to update: a seam on this instance's
        ``step_with_ready_grads`` (Megatron's ``step()`` of every optimizer class, chained ones included,
        calls it once after the grad-norm all-reduce and the clipping, and changes no state before)."""
        inner = optimizer.step_with_ready_grads

        def step_with_ready_grads(*args, **kwargs):
            self.begin_update()
            return inner(*args, **kwargs)

        optimizer.step_with_ready_grads = step_with_ready_grads

    def completed(self, iteration: int, meta: dict, tensors: Mapping[str, torch.Tensor], *,
                  hold: bool = False) -> None:
        """The metadata of ``iteration`` is captured: ``iteration`` is completed, the critical section ends.
        A SIGTERM deferred during it takes effect now, or with ``hold`` at :meth:`release` (the training loop
        calls it once the iteration is logged)."""
        self.last = Completed(iteration, meta, dict(tensors))
        self.adopted = None
        self.updating = None
        self.holding = hold
        if not hold:
            self.release()

    def release(self) -> None:
        """End a hold (:meth:`completed`): a deferred SIGTERM takes effect now."""
        self.holding = False
        if self.pending_signal is not None:
            signum, self.pending_signal = self.pending_signal, None
            raise SurvivorStop(signum)

    def adopt(self, iteration: int, meta: dict, tensors: Mapping[str, torch.Tensor]) -> None:
        """The live state was just loaded from a survivor point of ``iteration``: it is that iteration's
        completed state again (a stop during the rest of the recovery publishes it once more)."""
        self.last = Completed(iteration, dict(meta), dict(tensors))
        self.adopted = iteration
        self.updating = None
        self.holding = False

    def forget(self) -> None:
        """The live state no longer matches :attr:`last` (a recovery is rewriting it)."""
        self.last = None
        self.adopted = None

    # ------------------------------------------------------------------------------------- stopping
    def on_signal(self, signum: int, frame=None) -> None:
        """SIGTERM handler (main thread): stop now, or at the end of the critical section."""
        if self.stopped_at is None:
            self.stopped_at = time.monotonic()
        if self.updating is not None or self.holding:
            self.pending_signal = signum
            return
        raise SurvivorStop(signum)

    def _drain(self) -> None:
        if self.drain is None:
            return
        try:
            self.drain()
        except Exception as e:  # noqa: BLE001 - the point is still worth keeping; say what was lost
            print(f"moe-ft survivor: rank {self.rank}: finishing background work before the dump failed: "
                  f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def _state_to_keep(self, why: str) -> tuple[Mapping, Completed] | PublishResult:
        """``(registry, newest completed iteration)``, or why there is no state to keep (nothing completed,
        or torn by the optimizer step)."""
        registry = self.registry_fn()
        if self.last is None or registry is None:
            return PublishResult(None, f"no completed iteration since this process (re)started or a recovery "
                                       f"rewrote its state ({why})")
        if self.updating is not None:
            return PublishResult(None, f"stopped inside the optimizer step of iteration {self.updating} "
                                       f"({why}): the state is torn between two iterations")
        return registry, self.last

    def publish(self, why: str) -> PublishResult:
        """Dump the state of the newest completed iteration as this rank's survivor point (dense, every
        entry checksummed, one rename at the end). Publishes nothing inside the critical section, before
        the first completed iteration, or past the deadline."""
        start = time.monotonic()
        if self.stopped_at is None:
            self.stopped_at = start
        self._drain()
        kept = self._state_to_keep(why)
        if isinstance(kept, PublishResult):
            return kept
        registry, done = kept
        store = survivor_store(self.store_root, self.job_id, self.rank)
        if self.adopted == done.iteration and done.iteration in store.points():
            # loaded from that very point: it already holds this state
            return PublishResult(done.iteration, f"{why} (its point of iteration {done.iteration} is "
                                                 "already published)", 0, time.monotonic() - start)
        written = write_point(store, done.iteration, _point_tensors(registry, done, self.fault_check),
                               _survivor_meta(done, self.rank, why), done.tensors,
                               out_of_time=lambda: time.monotonic() - self.stopped_at > self.deadline_s)
        if written is None:
            return PublishResult(None, f"the dump did not finish within {self.deadline_s:.0f} s of the "
                                       "stop (nothing published)")
        return PublishResult(done.iteration, why, written, time.monotonic() - start)

    def hold(self, why: str) -> PublishResult:
        """Keep the state of the newest completed iteration in memory (:attr:`held`) instead of dumping it:
        the process stays for the next attempt (``moe-ft launch``). Same conditions as :meth:`publish`; the
        tensors move to the host (a no-op on CPU: the failed attempt's own tensors, which nothing changes
        any more), so the next attempt's model can take the device memory."""
        start = time.monotonic()
        self.held = None
        self._drain()
        kept = self._state_to_keep(why)
        if isinstance(kept, PublishResult):
            return kept
        registry, done = kept
        with torch.no_grad():
            entries = {op: {k: t.detach().to("cpu") for k, t in tensors.items()}
                       for op, tensors in _point_tensors(registry, done, self.fault_check)}
            tensors = {k: v.detach().to("cpu") for k, v in done.tensors.items()}
        nbytes = sum(t.nbytes for ts in entries.values() for t in ts.values())
        self.held = HeldPoint(done.iteration, self.rank, entries, _survivor_meta(done, self.rank, why), tensors,
                              self.store_root, self.job_id, nbytes)
        return PublishResult(done.iteration, why, nbytes, time.monotonic() - start)


def _point_tensors(registry, done: Completed, fault_check: Callable[[int, str], None] | None):
    """``(op, {name: live tensor})`` of every operator FULL as of ``done`` (the routers' expert biases from
    its captured metadata); ``fault_check(iteration, "survivor")`` half-way (drills)."""
    ops = sorted(registry, key=str)
    for i, op in enumerate(ops):
        if i == len(ops) // 2 and fault_check is not None:
            fault_check(done.iteration, "survivor")
        tensors = {}
        for name, live in registry[op].tensors(Level.FULL).items():
            src = _expert_bias_override(op, name, done.tensors)
            tensors[name] = live if src is None else src
        yield op, tensors


def _survivor_meta(done: Completed, rank: int, why: str) -> dict:
    return dict(done.meta, survivor={"rank": rank, "iteration": done.iteration, "why": why,
                                     "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))})


class AttemptStop:
    """The SIGTERM handler of a process that may run several attempts (``moe-ft launch``), installed once
    around all of them. :func:`run_guarded` takes SIGTERM over during an attempt and puts this one back when
    the attempt ends, so no moment between two attempts (closing the failed one, waiting for the next,
    parsing the flags again, building the next runtime) is left to the default action, which ended the
    process (exit -15) without writing the state it held. Raises :class:`SurvivorStop` on the main thread,
    except inside :meth:`deferred`, which runs to its end first."""

    def __init__(self) -> None:
        self._deferring = False
        self._pending: int | None = None

    def __call__(self, signum, frame) -> None:
        if self._deferring:
            self._pending = signum
            return
        raise SurvivorStop(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[AttemptStop]:
        previous = signal.signal(signal.SIGTERM, self)
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A stop asked for inside the block raises once the block is done (closing a failed attempt: its
        threads write in the node store, as the spill that follows a stop does)."""
        self._deferring, self._pending = True, None
        try:
            yield
        finally:
            self._deferring = False
        if self._pending is not None:
            raise SurvivorStop(self._pending)


def run_guarded(train: Callable[[], object], guard_of: Callable[[], SurvivorGuard | None],
                on_failure: Callable[[BaseException], None] | None = None, *, hold: bool = False) -> int:
    """Run ``train()`` with SIGTERM handled by the guard ``guard_of()`` returns (main thread; the runtime
    builds it once the process group exists); on a stop or an exception publish the survivor point and
    return exit code 1 (torchrun restarts the job); 0 when training finished. Without a guard yet, a
    SIGTERM stops the rank at once and nothing is published. ``on_failure(exc)`` is called with the stop
    or the exception after the survivor point was published (``moe-ft launch``: may this process go on).
    ``hold``: keep the point in memory instead (:meth:`SurvivorGuard.hold`; the caller spills it if the
    process leaves after all)."""

    def on_signal(signum, frame):
        guard = guard_of()
        if guard is None:
            raise SurvivorStop(signum)
        guard.on_signal(signum, frame)

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        train()
        return 0
    except (Exception, SurvivorStop) as exc:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not tear the dump
        guard = guard_of()
        why = str(exc) if isinstance(exc, SurvivorStop) else f"{type(exc).__name__}: {exc}"[:300]
        try:
            if guard is None:
                result = PublishResult(None, "no survivor guard")
            else:
                result = (guard.hold if hold else guard.publish)(why)
        except Exception as dump_exc:  # the rank counts as failed; say why
            result = PublishResult(None, f"the dump failed: {type(dump_exc).__name__}: {dump_exc}")
        rank = guard.rank if guard is not None else os.environ.get("RANK", "?")
        if result.iteration is not None:
            verb = "holds its state in memory" if hold else "published its state"
            msg = (f"moe-ft survivor: rank {rank} {verb} at iteration {result.iteration} "
                   f"({result.nbytes / 1e6:.1f} MB in {result.seconds:.2f} s) after: {why}")
        else:
            msg = f"moe-ft survivor: rank {rank} published nothing: {result.reason}"
        print(msg, file=sys.stderr, flush=True)
        if not isinstance(exc, SurvivorStop):
            traceback.print_exception(exc, file=sys.stderr)
        if on_failure is not None:
            on_failure(exc)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
