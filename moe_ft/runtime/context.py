"""What components are built from: the job's facts at the moment the runtime builds them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(kw_only=True)
class BuildContext:
    """Inputs every component's ``build()`` may read (``moe_ft/config.py``)."""

    state: Any
    """The loop's ``TrainState`` (model chunks, optimizer, scheduler, transformer config)."""
    args: Any
    """Megatron's parsed ``Args``."""
    rank: int
    world_size: int
    start_iteration: int
    """Where this run (re)started: the ``--load`` iteration or 0."""
    registry: Any
    """This rank's :class:`moe_ft.state.registry.OperatorRegistry`."""
    catalogue: Any
    """The global operator catalogue (every rank's :class:`OperatorInfo`; policies plan over it)."""
    popularity: Any
    """The job's :class:`moe_ft.popularity.ExpertPopularity` counters."""
    t_iter_s: float
    """Measured iteration time (policies derive windows and budgets from it)."""
    clock: Any = None
    """The runtime's :class:`IterationClock` (``t_iter_s``: the agreed, continuously measured ``T_iter``)."""
    store_fault_hook: Callable[[str, int, str], None] | None = None
    """Drills: called by the store around each publish (``before_commit`` / ``after_commit``)."""
