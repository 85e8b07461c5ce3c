"""The inverse of capture: load an operator's stored entry back into the live model/optimizer tensors.

``restore_operator(store, registry, iteration, op, level)`` reads the verified entry and copies every
tensor into the registry's views (compute weights; with FULL also the fp32 masters and the optimizer
state — with aliased fp32 masters restoring the compute weight restores the master). FP8 compute weights
are copied as FP8 bytes into the live FP8 tensors (same dtype on both sides: nothing is widened or
re-quantized), then the operator's ``after_restore`` hooks drop caches derived from them. The registry must
describe the same model layout and optimizer as when the entry was written (same parallel sizes).
``restore_meta`` returns the metadata entry (grad norm, loss scale, scheduler, RNG, popularity, policy).
"""

from __future__ import annotations

import torch

from moe_ft.state import shards
from moe_ft.state.naming import plan_free_name
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store.codec import dtype_name


@torch.no_grad()
def restore_operator(store, registry, iteration: int, op: OperatorId, level: Level) -> int:
    """Copy entry ``(iteration, op, level)`` into the live tensors; returns the bytes restored."""
    state = registry[op]
    return copy_checked(state, state.tensors(Level(level)), store.load(iteration, op, Level(level)),
                        what=f"entry {op} {Level(level).name} @ {iteration}", fix="restore into the same layout")


def copy_checked(state, live: dict, stored: dict, *, what: str, fix: str) -> int:
    """Copy ``stored`` into the operator's ``live`` tensors (same names, shapes and dtypes, else a
    ``ValueError`` naming ``what`` and the ``fix``), then run the operator's ``after_restore`` hooks;
    returns the bytes copied. Names are compared without the local expert index (``plan_free_name``): an
    expert of the elastic layer may sit in another MLP slot than when it was written (a rebuilt model, an
    in-run rebalance), and an operator holds one expert, so the names stay unique."""
    live = {plan_free_name(n): t for n, t in live.items()}
    stored = {plan_free_name(n): t for n, t in stored.items()}
    if set(stored) != set(live):
        missing, extra = sorted(set(live) - set(stored)), sorted(set(stored) - set(live))
        raise ValueError(f"{what} does not match this model's operator (missing {missing[:3]}, unexpected "
                         f"{extra[:3]}); {fix}")
    total = 0
    for name, dst in live.items():
        src = stored[name]
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise ValueError(f"{state.op}/{name}: stored {src.dtype}{tuple(src.shape)} vs live {dst.dtype}{tuple(dst.shape)}")
        dst.copy_(src)
        total += dst.nbytes
    for hook in getattr(state, "after_restore", ()):
        hook()
    return total


def entry_misfit(registry, entry) -> str | None:
    """Why the stored entry described by ``entry`` (a manifest's ``EntryRecord``: tensor names, dtypes and
    shapes; no byte read) cannot be restored into this rank's operator -- :func:`copy_checked` would refuse
    it -- or ``None``. The metadata entry and an operator this rank does not hold are not checked here."""
    if entry.op is None or entry.op not in registry:
        return None
    live = {plan_free_name(n): t for n, t in registry[entry.op].tensors(Level(entry.level)).items()}
    stored = {plan_free_name(t.name): t for t in entry.tensors}
    if set(stored) != set(live):
        missing, extra = sorted(set(live) - set(stored)), sorted(set(stored) - set(live))
        return f"{entry.op}: this model's tensors {missing[:2]} are not stored, the stored {extra[:2]} are not this model's"
    for name, dst in live.items():
        src = stored[name]
        if tuple(src.shape) != tuple(dst.shape) or src.dtype != dtype_name(dst.dtype):
            return f"{entry.op}/{name}: stored {src.dtype}{list(src.shape)}, this model's {dtype_name(dst.dtype)}{list(dst.shape)}"
    return None


@torch.no_grad()
def assemble_into(state, sources: list[dict], *, what: str) -> int:
    """Write the operator's FULL tensors from one or more stored copies written on another layout: whole
    tensors from the first copy that has them, each distributed-optimizer shard from the pieces of the copies'
    shards that overlap it (``moe_ft/state/shards.py``), names compared without the local expert index;
    then the ``after_restore`` hooks. Returns the bytes written."""
    live = {plan_free_name(n): t for n, t in state.tensors(Level.FULL).items()}
    total = shards.assemble(live, [{plan_free_name(n): t for n, t in src.items()} for src in sources], what=what)
    for hook in getattr(state, "after_restore", ()):
        hook()
    return total


def restore_meta(store, iteration: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(meta, tensors)`` of iteration ``iteration``'s metadata entry (see ``moe_ft/snapshot/meta.py``)."""
    entry = store.load_meta(iteration)
    return entry.meta, entry.tensors
