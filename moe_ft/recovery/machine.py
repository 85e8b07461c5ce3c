"""Recovery as an explicit state machine (MoEvement §3.3 sparse-to-dense conversion).

The state lives on a :class:`RecoveryState` passed in (like Megatron's ``RerunState``); the machine
(:class:`Recovery`) holds only what it was built with. ``Recovery.advance(state)`` performs one
transition; ``run(state)`` advances until ``DONE``::
    AGREE ──(no point anywhere)──► FALLBACK ──► DONE        (keep the --load checkpoint / initial state)
      │
      ▼
    LOAD  window start s: operators FULL at s → FULL (active); the others → COMPUTE of s (frozen)
      │
      ▼
    REPLAY t = s+1 … e (one transition per iteration):
            activate operators whose FULL is at t-1 (load FULL); frozen ones get COMPUTE of t-1;
            RNG, LR schedule and popularity ← metadata of t-1; run iteration t with exactly its batches
            through the step function the loop handed in, with a :class:`RecordedStepOptimizer`
            (recorded global grad norm, frozen operators not updated); check routing against the
            recorded per-expert token counts and routing digest of t (:func:`check_routing`)
      │
      ▼
    FINALIZE  operators FULL at e → FULL; RNG, LR schedule, popularity, policy ← metadata of e
      │
      ▼
    DONE  training resumes at e+1 (the loop re-executes the lost iterations e+1 … with their batches)

Dense(k) recovery is the same machine with ``s = e`` (no replay); lossy recovery (``pec``/``selective``)
loads each operator's newest FULL entry (``lossy=True``) and never replays.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, cast

import torch

from moe_ft.checkfree.lr_boost import restore_group_lr
from moe_ft.recovery.agreement import agree_on_point
from moe_ft.recovery.context import RecoveryContext
from moe_ft.recovery.optim import RecordedStepOptimizer, main_params_by_model_param
from moe_ft.snapshot.meta import restore_step_meta
from moe_ft.snapshot.restore import restore_meta, restore_operator
from moe_ft.state.operators import Level

if TYPE_CHECKING:
    from moe_ft.popularity import ExpertPopularity
    from moe_ft.state.operators import OperatorId
    from moe_ft.store import RecoveryPoint

__all__ = ["Phase", "Recovery", "MachineConfig", "RecoveryContext", "RecoveryState", "check_routing",
           "restore_step_state"]

log = logging.getLogger("moe_ft.recovery")


class Phase(enum.Enum):
    AGREE = "agree"
    LOAD = "load"
    REPLAY = "replay"
    FINALIZE = "finalize"
    FALLBACK = "fallback"
    DONE = "done"


@dataclass(kw_only=True)
class MachineConfig:
    """Knobs of the recovery mechanism."""

    verify: bool = True
    """Checksum every entry a candidate point needs before agreeing on it (corrupt entries are skipped)."""
    use_recorded_grad_norm: bool = True
    """Clip replayed iterations with the recorded global grad norm (off only to demonstrate the pitfall)."""
    check_routing: bool = True
    """Compare each replayed iteration's per-expert token counts and this rank's routing digest (top-k
    experts of every token, ``moe_ft.popularity.routing_digest``) with the recorded ones (raise on a
    mismatch: the replay diverged)."""
    lossy: bool = False
    """Restore each operator's newest FULL entry and do not replay (``pec``, ``selective``)."""


@dataclass(kw_only=True)
class RecoveryState:
    """Everything a recovery knows and has done so far (the report is built from it)."""

    phase: Phase = Phase.AGREE
    fallback_iteration: int = 0
    """Where training resumes if no in-memory point exists (the ``--load`` iteration, or 0)."""
    point: RecoveryPoint | None = None
    """The agreed point (``None`` until ``AGREE``, and after it when no rank has one)."""
    proposals: list[int] = field(default_factory=list)
    """The ``end`` iterations proposed while agreeing (``-1``: some rank had none)."""
    next_replay: int = -1
    """The iteration the next ``REPLAY`` transition runs."""
    replayed: list[int] = field(default_factory=list)
    active: set[OperatorId] = field(default_factory=set)
    """Operators whose FULL state is loaded (they train during replay); the others are frozen."""
    resume_iteration: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    bytes_loaded: int = 0
    routing_checked: int = 0
    skipped: list[str] = field(default_factory=list)
    """Store entries this rank found corrupt and skipped while agreeing (the store's warnings)."""
    message: str = ""


def check_routing(popularity: ExpertPopularity, recorded: Mapping[str, torch.Tensor], iteration: int) -> None:
    """Raise ``RuntimeError`` if the routing of the replayed ``iteration`` differs from the recorded one:
    the world-summed per-expert token counts (``popularity.last_counts``) or this rank's digest of the
    routing decisions (``popularity.routing_digest``, per MoE layer; absent in snapshots taken before it
    existed). ``recorded``: the metadata tensors of ``iteration``'s snapshot."""
    counts = recorded["popularity.last_counts"].to(torch.float64)
    if not torch.equal(popularity.last_counts, counts):
        raise RuntimeError(f"replay diverged at iteration {iteration}: the per-expert token counts differ from "
                           "the recorded ones (routing was not reproduced)")
    digest = recorded.get("popularity.routing_digest")
    if digest is not None and not torch.equal(popularity.routing_digest, digest.to(torch.int64)):
        layers = [popularity.moe_layers[i] for i in
                  (popularity.routing_digest != digest.to(torch.int64)).nonzero().flatten().tolist()]
        raise RuntimeError(f"replay diverged at iteration {iteration}: the routing decisions (top-k experts per "
                           f"token) of MoE layer(s) {layers} differ from the recorded ones although the per-expert "
                           "token counts match (routing was not reproduced: check the batches, RNG and router "
                           "state the replay restores)")


class _StoreWarnings(logging.Handler):
    """Collects the store's warnings (a corrupt entry skipped, with the reason) while agreeing."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []
        self._logger = logging.getLogger("moe_ft.store")

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> "_StoreWarnings":
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self._logger.removeHandler(self)


class Recovery:
    """The machine: what it was built with (``config``, ``ctx``) and a cache of metadata entries; every
    bit of progress is on the :class:`RecoveryState` passed to :meth:`advance`, so a state left by a
    failed transition can be advanced again, by this machine or a new one over the same context."""

    def __init__(self, config: MachineConfig, ctx: RecoveryContext) -> None:
        self.config, self.ctx = config, ctx
        self._mains: dict[int, list[torch.Tensor]] = main_params_by_model_param(ctx.train_state.optimizer)
        self._meta_cache: dict[int, tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}

    def run(self, state: RecoveryState) -> RecoveryState:
        while state.phase is not Phase.DONE:
            self.advance(state)
        return state

    def advance(self, state: RecoveryState) -> None:
        start = time.perf_counter()
        phase = state.phase
        getattr(self, f"_{phase.value}")(state)
        state.seconds[phase.value] = state.seconds.get(phase.value, 0.0) + time.perf_counter() - start

    # ----------------------------------------------------------------------------------- transitions
    def _agree(self, s: RecoveryState) -> None:
        find = lambda bound: self.ctx.store.newest_recoverable(self.ctx.rule, at_or_before=bound,  # noqa: E731
                                                               verify=self.config.verify)
        with _StoreWarnings() as skipped:
            point, s.proposals = agree_on_point(find, self.ctx.group)
        s.point = cast("RecoveryPoint | None", point)  # what `find` returned (agreement is type-agnostic)
        s.skipped.extend(skipped.messages)
        s.phase = Phase.LOAD if s.point is not None else Phase.FALLBACK

    def _fallback(self, s: RecoveryState) -> None:
        s.resume_iteration = s.fallback_iteration
        s.message = (f"no recovery point in every rank's node-local store; resuming from the persisted "
                     f"checkpoint at iteration {s.fallback_iteration}" if s.fallback_iteration else
                     "no recovery point in every rank's node-local store and no --load checkpoint; "
                     "restarting from the initial state (iteration 0)")
        s.phase = Phase.DONE

    def _load(self, s: RecoveryState) -> None:
        p = _agreed(s)
        with torch.no_grad():
            for op in self.ctx.registry:
                f = p.full_at[op]
                if self.config.lossy or f == p.start:
                    s.bytes_loaded += restore_operator(self.ctx.store, self.ctx.registry, f, op, Level.FULL)
                    s.active.add(op)
                else:
                    s.bytes_loaded += restore_operator(self.ctx.store, self.ctx.registry, p.start, op, Level.COMPUTE)
        s.next_replay = p.start + 1
        s.phase = Phase.REPLAY if (p.end > p.start and not self.config.lossy) else Phase.FINALIZE

    def _replay(self, s: RecoveryState) -> None:
        p, t = _agreed(s), s.next_replay
        self.ctx.fault_check(t, "recovery")
        frozen: list[OperatorId] = []
        with torch.no_grad():
            for op in self.ctx.registry:
                f = p.full_at[op]
                if op in s.active:
                    continue
                if f == t - 1:  # its FULL snapshot comes due: it becomes active
                    s.bytes_loaded += restore_operator(self.ctx.store, self.ctx.registry, f, op, Level.FULL)
                    s.active.add(op)
                else:  # still frozen: the weights it had when iteration t originally ran
                    if t - 1 != p.start:
                        s.bytes_loaded += restore_operator(self.ctx.store, self.ctx.registry, t - 1, op, Level.COMPUTE)
                    frozen.append(op)
        prev_meta, prev_tensors = self._meta(t - 1)
        self._restore_step_state(prev_meta, prev_tensors, policy=False)
        meta, tensors = self._meta(t)
        frozen_mains = [m for op in frozen for param in self.ctx.registry[op].compute.values()
                        for m in self._mains.get(id(param), [])]
        optimizer = RecordedStepOptimizer(self.ctx.train_state.optimizer, grad_norm=meta["grad_norm"],
                                          found_inf=meta["found_inf"], frozen_mains=frozen_mains,
                                          use_recorded_norm=self.config.use_recorded_grad_norm)
        self.ctx.step_fn(t, optimizer)
        if self.ctx.popularity is not None:
            self.ctx.popularity.end_iteration(t)
            if self.config.check_routing and "popularity.last_counts" in tensors:
                check_routing(self.ctx.popularity, tensors, t)
                s.routing_checked += 1
        s.replayed.append(t)
        s.next_replay = t + 1
        if s.next_replay > p.end:
            s.phase = Phase.FINALIZE

    def _finalize(self, s: RecoveryState) -> None:
        p = _agreed(s)
        with torch.no_grad():
            for op in self.ctx.registry:
                if op not in s.active:
                    s.bytes_loaded += restore_operator(self.ctx.store, self.ctx.registry, p.full_at[op], op, Level.FULL)
                    s.active.add(op)
        meta, tensors = self._meta(p.end)
        self._restore_step_state(meta, tensors, policy=True)
        s.resume_iteration = p.end + 1
        s.phase = Phase.DONE
        self._meta_cache.clear()

    # -------------------------------------------------------------------------------------- helpers
    def _meta(self, iteration: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        if iteration not in self._meta_cache:
            self._meta_cache[iteration] = restore_meta(self.ctx.store, iteration)
        return self._meta_cache[iteration]

    def _restore_step_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor], *,
                            policy: bool) -> None:
        """RNG, LR/WD schedule position and popularity counters as after the metadata's iteration."""
        restore_step_state(meta, tensors, train_state=self.ctx.train_state, popularity=self.ctx.popularity,
                           policy=self.ctx.policy if policy else None)


def restore_step_state(meta: dict[str, Any], tensors: dict[str, torch.Tensor], *, train_state, popularity=None,
                       policy=None) -> None:
    """The state outside the operators as after the metadata's iteration: RNG, loss scaler, LR/WD schedule
    position, popularity counters (``popularity``: ``None`` leaves them) and the policy's state (``policy``:
    ``None`` leaves it). Used by the machine and by survivors loading their point (``recovery/localized.py``)."""
    restore_step_meta(meta, tensors, optimizer=train_state.optimizer)
    scheduler = train_state.scheduler
    scheduler.num_steps = 0  # load_state_dict *adds* the stored step count
    scheduler.load_state_dict(meta["scheduler"])

    restore_group_lr(tensors, train_state.optimizer, scheduler)
    if popularity is not None and "popularity" in meta:
        pop = dict(meta["popularity"])
        pop.update({k[len("popularity."):]: v for k, v in tensors.items() if k.startswith("popularity.")})
        popularity.load_state_dict(pop)
    if policy is not None and meta.get("policy") is not None:
        policy.load_state_dict(meta["policy"])


def _agreed(s: RecoveryState) -> RecoveryPoint:
    assert s.point is not None, f"phase {s.phase.name} needs the agreed point (set by AGREE)"
    return s.point
