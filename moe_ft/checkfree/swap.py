"""CheckFree+ out-of-order pipelining (CheckFree §4.3): half of the micro-batches run the first two and the
last two stages in swapped order, so that stage 1 learns to stand in for stage 0 and stage L-2 for stage
L-1 (and then a lost first/last stage is rebuilt by copying its swap partner).

Stage order of one micro-batch over the *transformer* stages ``0 … L-1`` (the embedding always runs first
and the output layer last: the paper swaps "excluding the (de)embedding layers")::
    normal:   0, 1, 2, …, L-3, L-2, L-1
    swapped:  1, 0, 2, …, L-3, L-1, L-2

Which micro-batches swap: the odd ones (1, 3, 5, …) of every iteration, as in the authors' code
(``mbid % 2 == 1``); ``floor(M / 2)`` of ``M``: exactly half for even ``M``. Deterministic, no RNG, so a
replayed iteration runs the same orders. ``L >= 4`` is required: with 3 stages the two pairs overlap and
with 2 they are the same pair (swapping it twice is no swap).

Where it is applied. On one rank holding several stages' layers (pipeline parallelism 1, or the
convergence study's emulated stages) the seam is the ``forward_step_func`` handed to
``get_forward_backward_func()``: :class:`SwapForwardStep` wraps it, counts the micro-batches of the
iteration and, for a swapped one, runs the chunk's transformer layers in the swapped block order (the
``decoder.layers`` ``ModuleList`` is permuted for the duration of that forward call only; autograd records
the order actually run, so backward needs nothing). Why Megatron-Core 0.16.1's pipeline schedules cannot
route a micro-batch through ranks in another order, and what we do with pipeline parallelism instead, is
in ``docs/checkfree.md``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch


def check_num_stages(num_stages: int) -> None:
    if num_stages < 4:
        raise ValueError(f"CheckFree+ swaps the first two and the last two stages: it needs >= 4 pipeline stages "
                         f"(got {num_stages}; with fewer the two pairs overlap). Use plain CheckFree, which "
                         "recovers intermediate stages only")


def check_one_chunk(num_chunks: int) -> None:
    """CheckFree+ swaps a rank's whole stage and copies its embedding / output layer: one model chunk per
    pipeline rank (virtual pipeline stages would interleave other stages' layers into it)."""
    if num_chunks != 1:
        raise ValueError(f"CheckFree+ swaps and copies one model chunk per pipeline rank, got {num_chunks} (virtual "
                         "pipeline stages): drop --num-layers-per-virtual-pipeline-stage / "
                         "--virtual-pipeline-model-parallel-size")


def is_swapped(microbatch_idx: int) -> bool:
    """Whether micro-batch ``microbatch_idx`` (0-based within its iteration) runs out of order."""
    if microbatch_idx < 0:
        raise ValueError(f"micro-batch index must be >= 0, got {microbatch_idx}")
    return microbatch_idx % 2 == 1


def swapped_microbatches(num_microbatches: int) -> list[int]:
    """The micro-batches of an iteration that run out of order: ``[1, 3, 5, …]``."""
    if num_microbatches < 1:
        raise ValueError(f"an iteration has at least one micro-batch, got {num_microbatches}")
    return [m for m in range(num_microbatches) if is_swapped(m)]


def stage_order(num_stages: int, swapped: bool) -> tuple[int, ...]:
    """The order the transformer stages run in (module docstring)."""
    check_num_stages(num_stages)
    order = list(range(num_stages))
    if swapped:
        order[0], order[1] = order[1], order[0]
        order[-2], order[-1] = order[-1], order[-2]
    return tuple(order)


def microbatch_orders(num_stages: int, num_microbatches: int) -> list[tuple[int, ...]]:
    """Stage order of every micro-batch of one iteration."""
    return [stage_order(num_stages, is_swapped(m)) for m in range(num_microbatches)]


def swap_partner(stage: int, num_stages: int) -> int | None:
    """The stage that stands in for ``stage`` on swapped micro-batches (``None``: not swapped)."""
    check_num_stages(num_stages)
    return {0: 1, 1: 0, num_stages - 2: num_stages - 1, num_stages - 1: num_stages - 2}.get(stage)


def layer_order(num_stages: int, layers_per_stage: int, swapped: bool) -> list[int]:
    """Order of a chunk's layer positions when it holds ``num_stages`` consecutive blocks of
    ``layers_per_stage`` layers (one rank emulating several stages)."""
    return [s * layers_per_stage + k for s in stage_order(num_stages, swapped) for k in range(layers_per_stage)]


@contextmanager
def layers_in_order(gpt: torch.nn.Module, order: list[int]) -> Iterator[None]:
    """Run ``gpt``'s (unwrapped or DDP-wrapped ``GPTModel``) transformer layers in ``order`` inside the
    block; the original order is back afterwards, also on an exception."""
    model: Any = getattr(gpt, "module", gpt)
    layers = model.decoder.layers
    original = list(layers)
    if sorted(order) != list(range(len(original))):
        raise ValueError(f"layer order {order} is not a permutation of the chunk's {len(original)} layers")
    try:
        for position, idx in enumerate(order):
            layers[position] = original[idx]
        yield
    finally:
        for position, module in enumerate(original):
            layers[position] = module


class SwapForwardStep:
    """A ``forward_step_func`` for ``get_forward_backward_func()`` that runs the odd micro-batches of every
    iteration with the first two and last two stage blocks swapped (one rank holding all stages).

    Call :meth:`new_iteration` before each schedule call (the schedule calls the function once per
    micro-batch, in micro-batch order)."""

    def __init__(self, forward_step_func: Callable, *, num_stages: int, layers_per_stage: int) -> None:
        check_num_stages(num_stages)
        self.forward_step_func, self.num_stages, self.layers_per_stage = forward_step_func, num_stages, layers_per_stage
        self.microbatch_idx = 0
        self.orders_run: list[tuple[int, ...]] = []
        """Stage order of every micro-batch since the last :meth:`new_iteration` (tests, logs)."""

    def new_iteration(self) -> None:
        self.microbatch_idx = 0
        self.orders_run = []

    def __call__(self, data_iterator, model, *args, **kwargs):
        swapped = is_swapped(self.microbatch_idx)
        self.microbatch_idx += 1
        self.orders_run.append(stage_order(self.num_stages, swapped))
        n = len(getattr(model, "module", model).decoder.layers)
        if n != self.num_stages * self.layers_per_stage:
            raise ValueError(f"the chunk holds {n} layers, not {self.num_stages} stages x {self.layers_per_stage}")
        if not swapped:
            return self.forward_step_func(data_iterator, model, *args, **kwargs)
        with layers_in_order(model, layer_order(self.num_stages, self.layers_per_stage, True)):
            return self.forward_step_func(data_iterator, model, *args, **kwargs)
