"""The learning-rate boost of a rebuilt stage (CheckFree §4.2, Algorithm 1 line 4: ``lambda <- 1.1 lambda``).

Applied at Megatron's seam: ``OptimizerParamScheduler.get_lr`` reads the peak and floor of each parameter
group from the group's own ``max_lr`` / ``min_lr`` keys (Megatron's per-group override,
``megatron/core/optimizer/__init__.py`` sets them for every group), so the boost multiplies those two
keys of the rebuilt stage's groups by the factor and lets the scheduler do the rest: warm-up, decay and
``load_state_dict`` (recovery rewinds the schedule) all produce ``factor x`` the unboosted value for those
groups (exactly ``factor * lr`` for a constant schedule; within float rounding otherwise, since
``min + c (max - min)`` is evaluated on the scaled operands). During a warm-up from ``init_lr > 0`` only
the target is scaled (``init_lr`` is one scalar of the scheduler, not a group key).

Which groups: with pipeline parallelism a stage's rank holds only that stage's parameters, so the rebuilt
stage is every group of the rebuilt rank's optimizer (:meth:`LrBoost.start` with ``groups=None``).
Megatron groups parameters by (weight decay, lr multiplier, expert-parallel), not by layer: on a first or
last stage rebuilt by CheckFree+, the embedding / output layer (restored exactly from their copies) share
groups with the rebuilt layers and are boosted with them.

How long (the paper does not say; ``docs/checkfree.md``): the authors' code builds a fresh optimizer for
the rebuilt stage with ``1.1 x`` the base learning rate, i.e. the boost lasts until the end of training
(or the stage's next rebuild, which does not compound). That is ``iterations=0`` here, the default;
``iterations=N`` ends the boost after N iterations (the groups get their own ``max_lr``/``min_lr`` back).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

GROUP_LR = "checkfree.group_lr"
"""Snapshot metadata tensor ``[num_groups, 2]`` float64: every parameter group's own ``(max_lr, min_lr)``,
so that a boost outlives a later restart (:func:`restore_group_lr`)."""


@dataclass(kw_only=True)
class LrBoostConfig:
    factor: float = 1.1
    """Learning-rate multiplier of the rebuilt stage (CheckFree Alg. 1 line 4)."""
    iterations: int = 0
    """Iterations the boost lasts, counted from the first iteration trained after the rebuild; 0 = until
    the end of training (the authors' code)."""

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"the CheckFree learning-rate factor must be positive, got {self.factor}")
        if self.iterations < 0:
            raise ValueError(f"the CheckFree boost length must be >= 0 iterations (0 = until the end), got "
                             f"{self.iterations}")


@dataclass
class LrBoost:
    """Boosts the peak/floor learning rate of some parameter groups of one optimizer; the scheduler
    (Megatron's ``OptimizerParamScheduler``) turns them into per-iteration learning rates."""

    optimizer: Any
    """Anything with ``param_groups`` (a Megatron optimizer, a ``ChainedOptimizer``, a torch optimizer)."""
    scheduler: Any
    """The ``OptimizerParamScheduler`` driving ``optimizer`` (``get_lr(group)``, ``max_lr``, ``min_lr``)."""
    config: LrBoostConfig = field(default_factory=LrBoostConfig)
    base: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Boosted group index -> its own ``(max_lr, min_lr)`` before the boost."""
    first_iteration: int | None = None
    """The first iteration trained with the boost (``None``: no boost active)."""

    @property
    def active(self) -> bool:
        return self.first_iteration is not None

    def _groups(self) -> list[dict]:
        return list(self.optimizer.param_groups)

    def start(self, first_iteration: int, groups: Sequence[int] | None = None) -> None:
        """Boost ``groups`` (indices into ``param_groups``; ``None`` = all: the rebuilt stage's rank) from
        iteration ``first_iteration`` on. Boosting a boosted group again restarts its count; it does not
        compound (the factor applies to the group's own unboosted values)."""
        all_groups = self._groups()
        indices = range(len(all_groups)) if groups is None else groups
        for i in indices:
            if not 0 <= i < len(all_groups):
                raise ValueError(f"parameter group {i} does not exist (the optimizer has {len(all_groups)})")
            group = all_groups[i]
            if i not in self.base:
                self.base[i] = (group.get("max_lr", self.scheduler.max_lr), group.get("min_lr", self.scheduler.min_lr))
            peak, floor = self.base[i]
            group["max_lr"], group["min_lr"] = peak * self.config.factor, floor * self.config.factor
        self.first_iteration = first_iteration
        self._refresh()

    def end_iteration(self, iteration: int) -> bool:
        """Call after iteration ``iteration``'s optimizer and scheduler steps; ends the boost once it has
        lasted ``config.iterations`` iterations. Returns whether it ended now."""
        if self.first_iteration is None or not self.config.iterations:  # not active
            return False
        if iteration + 1 - self.first_iteration < self.config.iterations:
            return False
        self.stop()
        return True

    def stop(self) -> None:
        """Give the boosted groups their own ``max_lr``/``min_lr`` back."""
        groups = self._groups()
        for i, (peak, floor) in self.base.items():
            groups[i]["max_lr"], groups[i]["min_lr"] = peak, floor
        self.base.clear()
        self.first_iteration = None
        self._refresh()

    def _refresh(self) -> None:
        # the learning rate of the next optimizer step: the scheduler sets it only at its next step()
        for group in self._groups():
            group["lr"] = self.scheduler.get_lr(group)


# ------------------------------------------------------------------------ persistence across restarts
def capture_group_lr(optimizer) -> torch.Tensor:
    """``[num_groups, 2]`` float64 (exact for Python floats): each group's ``max_lr`` / ``min_lr`` (NaN where
    the group has no own value). Saved with every snapshot (``component.GroupLrRecord``)."""
    nan = float("nan")
    return torch.tensor([[g.get("max_lr", nan), g.get("min_lr", nan)] for g in optimizer.param_groups],
                        dtype=torch.float64).reshape(-1, 2)


def restore_group_lr(tensors: Mapping[str, torch.Tensor], optimizer, scheduler) -> bool:
    """Put the recorded per-group ``max_lr`` / ``min_lr`` back (a boosted stage stays boosted after a later
    restart rebuilt its parameter groups from the flags) and set each group's next ``lr`` from the scheduler.
    Called where recovery restores the LR schedule (``recovery/machine.py`` ``restore_step_state``, after the
    scheduler's ``load_state_dict``). Returns whether the metadata held a record."""
    recorded = tensors.get(GROUP_LR)
    if recorded is None:
        return False
    groups = list(optimizer.param_groups)
    if tuple(recorded.shape) != (len(groups), 2):  # another layout (elastic re-placement): not this optimizer's
        logging.getLogger("moe_ft.checkfree").warning(
            "%s: the snapshot records %s learning rates, this rank's optimizer has %d parameter groups; the "
            "groups keep the learning rates of the flags", GROUP_LR, tuple(recorded.shape), len(groups))
        return False
    for group, (peak, floor) in zip(groups, recorded.tolist()):
        if peak == peak:  # not NaN: the group had its own value when it was recorded
            group["max_lr"], group["min_lr"] = peak, floor
        group["lr"] = scheduler.get_lr(group)
    return True
