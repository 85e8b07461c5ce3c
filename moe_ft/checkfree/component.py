"""CheckFree+ in a run (CheckFree §4.3): the runtime components ``--ft-checkfree-plus`` builds
(``config.CheckFreeConfig.build_components``; the runtime calls them like every other component,
``moe_ft/runtime/components.py``).

* :class:`PartnerSwapComponent` attaches :class:`moe_ft.checkfree.swap_pp.PartnerSwap` to Megatron's
  schedule hooks once the training state is built (after the loop set ``no_sync_func`` and
  ``finalize_model_grads_func``, which the swap wraps), so that every training schedule — replays and
  re-executed iterations included — runs the odd micro-batches with the partners' layers. It prints which
  micro-batches ran swapped after the first iteration and at the end of training.
* :class:`CopiesComponent` sends the embedding (stage 0) to stage 1 and the final norm + output layer
  (stage L-1) to stage L-2 after every optimizer step; the holder keeps them in its node-local directory,
  versioned by iteration (``copies.CopyStore``), and prunes the versions older than any recovery point its
  own store still holds (recovery agrees on a point every survivor has, so it is in the holder's store too).
  The copies travel on the host path (``docs/communication.md``): point-to-point pickles of host tensors on
  the coordination gloo group, embedding before output layer on every rank, so no send waits on a cycle.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state as ps

from moe_ft import comm
from moe_ft.checkfree.copies import COPIED, CopyStore, copied_tensors, copy_holders
from moe_ft.checkfree.lr_boost import GROUP_LR, capture_group_lr
from moe_ft.checkfree.swap import check_one_chunk
from moe_ft.checkfree.swap_pp import PartnerSwap
from moe_ft.runtime.components import Component


def _pipeline() -> tuple[int, list[int]]:
    """(this rank's pipeline stage, the global ranks of its pipeline group in stage order)."""

    ranks = list(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()))
    return ranks.index(dist.get_rank()), ranks


class PartnerSwapComponent(Component):
    """The swap partners trade layer weights for the odd micro-batches (``swap_pp.py``)."""

    def __init__(self, state) -> None:
        self.stage, pp_ranks = _pipeline()
        self.swap = PartnerSwap(state.model, pp_rank=self.stage, pp_ranks=pp_ranks).attach(state.config)
        self.iterations_swapped = 0
        self.swapped_sets: set[tuple[int, ...]] = set()

    def after_iteration(self, iteration: int) -> None:
        if self.swap.partner is None:
            return
        swapped = tuple(self.swap.last_swapped)
        if swapped:
            self.iterations_swapped += 1
            if not self.swapped_sets:
                print(f"moe-ft checkfree+ rank {dist.get_rank()} (stage {self.stage}): iteration {iteration} ran "
                      f"micro-batches {list(swapped)} with the layers of rank {self.swap.partner} (its swap "
                      "partner)", flush=True)
            self.swapped_sets.add(swapped)

    def close(self) -> None:
        if self.swap.partner is not None:
            print(f"moe-ft checkfree+ rank {dist.get_rank()} (stage {self.stage}): {self.iterations_swapped} "
                  f"iterations swapped micro-batches {sorted(map(list, self.swapped_sets))} with rank "
                  f"{self.swap.partner}", flush=True)


class CopiesComponent(Component):
    """Copies of the embedding / output layer on the neighbouring stage (``copies.py``)."""

    def __init__(self, model_chunks, directory: str) -> None:
        check_one_chunk(len(model_chunks))  # refused at parsing (CheckFreeConfig.check_args); built directly too
        self.stage, self.pp_ranks = _pipeline()
        holders = copy_holders(len(self.pp_ranks))
        self.owned = {kind: self.pp_ranks[holder] for kind, (owner, holder) in holders.items() if owner == self.stage}
        self.held = {kind: self.pp_ranks[owner] for kind, (owner, holder) in holders.items() if holder == self.stage}
        self.tensors = {kind: copied_tensors(model_chunks[0], kind) for kind in self.owned}
        for kind, tensors in self.tensors.items():
            if not tensors:
                raise ValueError(f"pipeline stage {self.stage} should hold the {kind} but its model has none of it")
        self.store = CopyStore(directory) if self.held else None
        self.bytes_sent = 0

    def after_snapshot(self, iteration, plan, session, replaying) -> None:
        for kind in COPIED:  # one order on every rank: no cycle of blocking sends
            if kind in self.owned:
                payload = {name: t.detach().cpu() for name, t in self.tensors[kind].items()}
                comm.send_object(payload, self.owned[kind])
                self.bytes_sent += sum(t.numel() * t.element_size() for t in payload.values())
            if kind in self.held:
                self.store.refresh(kind, iteration, comm.recv_object(self.held[kind]))
        if self.store is not None:
            points = session.store.points() if session is not None else []
            self.store.prune(keep_from=min(points) if points else iteration)

    def after_recovery(self, report, session) -> None:
        if self.store is not None:  # copies of the abandoned timeline must not be taken for the new one
            self.store.discard_after(report.recovery_point["resume"] - 1)


class GroupLrRecord(Component):
    """Saves every parameter group's own ``max_lr`` / ``min_lr`` with each snapshot (``checkfree.group_lr``),
    so that the 1.1x boost of a rebuilt stage (CheckFree Alg. 1 line 4) survives a later restart: recovery
    puts them back where it restores the LR schedule (``lr_boost.restore_group_lr``), before it replays, so
    the replayed iterations run at the learning rates they first ran at."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer

    def snapshot_tensors(self) -> dict:
        return {GROUP_LR: capture_group_lr(self.optimizer)}
