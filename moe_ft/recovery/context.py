"""What the recovery machine (``moe_ft/recovery/machine.py``) acts on: :class:`RecoveryContext` and the
interfaces of its parts.

The parts are typed structurally (``typing.Protocol``) by the few members the machine and
``moe_ft/snapshot/restore.py`` use, so that recovery depends on neither the training loop (the loop
hands recovery its step function) nor a particular store: a:class:`moe_ft.store.SnapshotStore`, a
wrapper bounding its points, or a durable tier's store all fit :class:`RecoveryStore`; the
:class:`moe_ft.state.registry.OperatorRegistry` fits :class:`RecoveryRegistry`; the loop's ``TrainState``
fits :class:`TrainStateLike`. Popularity counters and the snapshot policy are the concrete foundation
classes (imported for annotations only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Protocol, Sequence

if TYPE_CHECKING:
    import torch
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from torch.distributed import ProcessGroup

    from moe_ft.policy.base import SnapshotPolicy
    from moe_ft.popularity import ExpertPopularity
    from moe_ft.recovery.optim import RecordedStepOptimizer
    from moe_ft.state.operators import Level, OperatorId
    from moe_ft.store import MetaEntry, RecoveryPoint, RecoveryRule


class RecoveryStore(Protocol):
    """The reading side of a snapshot store that recovery needs (``SnapshotStore`` has it)."""

    def newest_recoverable(self, rule: RecoveryRule, *, at_or_before: int | None = None,
                           verify: bool = False) -> RecoveryPoint | None:
        """The newest point ``rule`` accepts ending at or before ``at_or_before``; with ``verify`` every
        entry it needs is checksummed first (a corrupt one is skipped with a warning)."""
        ...

    def load(self, iteration: int, op: OperatorId, level: Level) -> dict[str, torch.Tensor]:
        """The verified tensors of entry (``iteration``, ``op``, ``level``)."""
        ...

    def load_meta(self, iteration: int) -> MetaEntry:
        """The verified metadata entry of ``iteration`` (grad norm, scheduler, RNG, popularity, policy)."""
        ...


class OperatorTensors(Protocol):
    """One operator's live tensors on this rank (``moe_ft.state.registry.OperatorState``)."""

    @property
    def compute(self) -> Mapping[str, torch.Tensor]:
        """Compute weights, by name (views of the model parameters and buffers)."""
        ...

    def tensors(self, level: Level) -> Mapping[str, torch.Tensor]:
        """The views a snapshot at ``level`` holds; restoring copies into them."""
        ...


class RecoveryRegistry(Protocol):
    """This rank's operators (``moe_ft.state.registry.OperatorRegistry``): iterating gives the
    :class:`OperatorId` s the rank must restore, indexing gives their live tensors."""

    def __iter__(self) -> Iterator[OperatorId]: ...

    def __getitem__(self, op: OperatorId) -> OperatorTensors: ...


class TrainStateLike(Protocol):
    """The training loop's state (``megatron.training.model.TrainState``), typed without importing the
    loop: the model chunks the step function trains, the Megatron optimizer whose steps replay wraps
    (:class:`moe_ft.recovery.optim.RecordedStepOptimizer`), and the LR/WD scheduler recovery rewinds."""

    @property
    def model(self) -> Sequence[torch.nn.Module]: ...

    @property
    def optimizer(self) -> MegatronOptimizer: ...

    @property
    def scheduler(self) -> OptimizerParamScheduler: ...


StepFn = Callable[[int, "RecordedStepOptimizer"], object]
"""``step_fn(iteration, optimizer)`` runs training iteration ``iteration`` with ``optimizer`` in place of
the real one; its return value is ignored."""

FaultCheck = Callable[[int, str], None]
"""``fault_check(iteration, phase)``: failure drills raise or kill the process here."""


def _no_fault(iteration: int, phase: str) -> None:
    return None


@dataclass(kw_only=True)
class RecoveryContext:
    """What the machine acts on (built by the runtime; recovery never imports the training loop)."""

    store: RecoveryStore
    """Where the recovery points are (this rank's node-local store, or a durable tier's)."""
    registry: RecoveryRegistry
    """This rank's operators: what is restored, and into which tensors."""
    rule: RecoveryRule
    """Which points are complete for the policy (``SparseWindowRule``, ``DenseRule``, ``NewestFullRule``)."""
    train_state: TrainStateLike
    """The loop's ``TrainState`` (model chunks, optimizer, scheduler)."""
    step_fn: StepFn
    """``step_fn(iteration, optimizer)`` runs one training iteration with ``optimizer`` in place of the
    real one (the loop's ``train_step``, handed over by the runtime)."""
    popularity: ExpertPopularity | None = None
    """Expert popularity counters: rewound with the metadata, and compared after each replayed iteration
    (``check_routing``); ``None``: neither."""
    policy: SnapshotPolicy | None = None
    """The snapshot policy whose state (e.g. the sparse windows) is restored at ``FINALIZE``; ``None``: none."""
    fault_check: FaultCheck = _no_fault
    """Called with ``(iteration, "recovery")`` before each replayed iteration (failure drills)."""
    group: ProcessGroup | None = None
    """Host group agreeing on the point (``None``: the coordination gloo group of ``moe_ft.comm``)."""
