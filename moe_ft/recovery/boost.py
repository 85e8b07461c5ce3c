"""MoEtion §6 capacity boost, driven by the runtime (``--ft-capacity-boost``).

After a lossy recovery (``pec``, ``selective``) every expert restored from a FULL entry older than the
recovery point lost the updates of the tokens routed to it since that entry: the report's
``token_loss["per_expert"]`` (``moe_ft/recovery/lossy.py``, the same world-summed ``since_full``
counters the PLT/MLT accounting uses). Those experts get ``1 + boost`` times the base capacity factor
(``--moe-expert-capacity-factor``) until they have kept that many tokens beyond the base capacity; then
the boost of each ends on its own. The mechanism (per-expert capacity, paying the deficit off) is
:class:`moe_ft.megatron_ext.router.CapacityBoost` inside the router subclass; this module builds it,
starts it from a recovery report and keeps the report's ``capacity_boost`` section up to date.

Snapshots and restores: the boost state (``deficit``, ``owed``, ``made_up_at``) travels in every
snapshot's metadata as ``capacity_boost.*`` tensors. A later recovery to point ``end`` first restores the
state as it was after ``end`` (the deficit not yet made up by then; iterations after ``end`` are
re-executed and pay it off again), then adds the tokens the new recovery lost. A restart without an
in-memory point (``--load`` checkpoint or the initial state) starts with no deficit: Megatron checkpoints
do not carry it.
"""

from __future__ import annotations

import torch

from moe_ft import comm
from moe_ft.megatron_ext.router import CapacityBoost, CapacityBoostConfig, attach_capacity_boost
from moe_ft.store import MissingEntryError

PREFIX = "capacity_boost."


def build_capacity_boost(boost: float, state, popularity) -> CapacityBoost | None:
    """The boost for ``--ft-capacity-boost boost`` attached to every router of ``state.model`` (the routers
    take over Megatron's token dropping from the first iteration on, with equal factors until a recovery
    starts the boost), or ``None`` when ``boost`` is 0. ``state``: the loop's ``TrainState``."""
    if not boost:
        return None
    factor = state.config.moe_expert_capacity_factor
    if factor is None:
        raise ValueError("--ft-capacity-boost needs token dropping: set --moe-expert-capacity-factor")
    cb = CapacityBoost(CapacityBoostConfig(capacity_factor=float(factor), boost=boost),
                       moe_layers=popularity.moe_layers, num_experts=popularity.num_experts,
                       all_reduce=comm.all_reduce_world)  # host counters: the coordination gloo group
    if attach_capacity_boost(state.model, cb) == 0:
        raise RuntimeError("no PopularityRouter in the model to carry the capacity boost")
    return cb


def snapshot_tensors(cb: CapacityBoost) -> dict[str, torch.Tensor]:
    """The boost state as snapshot metadata tensors."""
    return {PREFIX + k: v for k, v in cb.state_dict().items()}


def start_after_recovery(cb: CapacityBoost, report, store) -> dict:
    """Restore the boost state of the recovery point (from ``store``'s metadata of its ``end``), add the
    tokens this recovery lost per expert (``report.token_loss["per_expert"]``), and return the report's
    ``capacity_boost`` section. Same result on every rank (the inputs are world-summed)."""

    rp = report.recovery_point
    note = ""
    if rp.get("source") in ("memory", "durable"):
        try:
            tensors = store.load_meta(rp["end"]).tensors
        except MissingEntryError:
            tensors = {}
        state = {k[len(PREFIX):]: v for k, v in tensors.items() if k.startswith(PREFIX)}
        if state:
            cb.load_state_dict(state)
        else:
            note = f"no boost state in the metadata of iteration {rp['end']}: earlier deficits (if any) dropped"
    carried = cb.deficit.clone()
    per_expert = report.token_loss.get("per_expert")
    lost = torch.tensor(per_expert, dtype=torch.float64) if per_expert else torch.zeros_like(cb.deficit)
    cb.start(lost)
    experts = []
    for row, expert in (cb.deficit > 0).nonzero().tolist():
        experts.append({"layer": cb.moe_layers[row], "expert": expert, "lost": float(lost[row, expert]),
                        "carried": float(carried[row, expert]), "tokens": float(cb.deficit[row, expert]),
                        "made_up_at": None})
    section = {"boost": cb.config.boost, "capacity_factor": cb.config.capacity_factor,
               "started_at": rp["resume"], "experts": experts,
               "tokens_to_make_up": float(cb.deficit.sum()), "ended_at": None if experts else rp["resume"] - 1}
    if note:
        section["note"] = note
    return section


def record_made_up(section: dict, made_up: list[tuple[int, int]], iteration: int, active: bool) -> bool:
    """Note in the report's ``capacity_boost`` section the iteration at which each of ``made_up``
    ``(layer, expert)`` pairs made its tokens up, and ``ended_at`` once no expert is boosted. Returns
    whether the section changed."""
    changed = False
    for entry in section.get("experts", []):
        if (entry["layer"], entry["expert"]) in made_up and entry["made_up_at"] is None:
            entry["made_up_at"] = iteration
            changed = True
    if changed and not active and section.get("ended_at") is None:
        section["ended_at"] = iteration
    return changed
