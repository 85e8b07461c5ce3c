"""CheckFree inside a recovery (CheckFree Alg. 1 with pipeline parallelism): the lost stage's rank gets its
two neighbours' layers and last squared gradient norms, averages them into its own layers, and then takes
part in the recovery machine like every other rank through :class:`RebuiltStageStore`.

Called by the recovery planner (``moe_ft/recovery/planner.py``) when every copy of a stage's state is gone
(``plan.path == "checkfree"``), after the surviving ranks agreed on their recovery point ``[start, end]``:

1. each neighbour reads its layers *as its recovery will load them at ``start``* from its own store (the
   FULL entry where the operator is FULL at ``start``, else its COMPUTE entry of ``start``; a lossy
   policy's newest FULL entry) and its squared gradient norm recorded with the snapshot of that iteration
   (``checkfree.grad_sq``, ``moe_ft/runtime/components.py`` ``CheckFreeNorms``); the previous stage adds
   its metadata entries of ``start … end`` (schedule, RNG, popularity, recorded grad norms: what the
   machine rewinds), which the lost rank has none of;
2. the transfers are point-to-point pickles of host tensors on the coordination gloo group (host path,
   ``docs/communication.md``), in (stage, rank) order so that no send waits on another;
3. the lost rank writes the weighted average into its live layers (``average.rebuild_layers``), zeroes
   their Adam state (the authors' code builds a fresh optimizer for the rebuilt stage) and reloads the
   optimizer's fp32 masters;
4. the machine then runs on every rank: on the lost rank over :class:`RebuiltStageStore`, whose one point
   is ``[start, end]`` with every operator FULL at ``start`` (so they all train through the replay) and
   whose entries are the live rebuilt tensors; routing is not compared with the recorded one (the rebuilt
   stage routes differently, by construction);
5. afterwards the lost rank's learning rate is raised 1.1x (``lr_boost.py``) for the rest of training.

CheckFree+ (``--ft-checkfree-plus``, §4.3): a lost stage that has a swap partner (stages 0, 1, L-2, L-1) is
rebuilt as a copy of that partner's layers (the partner trained on standing in for it; the authors' code
does the same, ``docs/checkfree.md``), so the first and the last stage can be rebuilt too. The partner is
also the holder of the lost stage's embedding (stage 0) or final norm + output layer (stage L-1) copies
(``copies.py``): it sends the copy of the iteration the lost stage is rebuilt at (``start``; a lossy
policy's ``end``), restored bitwise. A missing or corrupt copy is found before anything is overwritten:
every rank learns it (one gather) and the plan falls to start over with the reason
(:class:`RebuildImpossible`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from moe_ft import comm
from moe_ft.checkfree.average import Weights, align_layers, rebuild_layers, stage_layers
from moe_ft.checkfree.copies import copied_tensors, copies_owned_by, restore_tensors
from moe_ft.checkfree.lr_boost import GROUP_LR, LrBoost, LrBoostConfig
from moe_ft.checkfree.swap import swap_partner
from moe_ft.state.operators import Level
from moe_ft.state.optimizer_views import main_states
from moe_ft.store import MissingEntryError
from moe_ft.store.rules import RecoveryPoint

GRAD_SQ = "checkfree.grad_sq"
"""Snapshot metadata tensor: this rank's squared gradient norm of the iteration (CheckFree's ``w``)."""

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class RebuildImpossible(RuntimeError):
    """Raised on every rank by :func:`exchange_and_rebuild` when a lost stage cannot be rebuilt after all
    (a copy of its embedding / output layer is missing or corrupt); nothing was overwritten."""


def rebuild_sources(inventories, *, plus: bool) -> tuple[dict[int, tuple[int, ...]], str]:
    """For the ranks without a memory point (``RankInventory.memory_end < 0``): ``{lost rank: sources}``
    if every one of them can be rebuilt, else ``({}, why not)``. ``sources``: ``(previous, next)`` for the
    weighted average of an intermediate stage (§4.2), ``(partner,)`` for a copy of the swap partner under
    CheckFree+ (``plus``, §4.3; the partner also holds the embedding / output copy)."""

    by_rank = {inv.rank: inv for inv in inventories}
    out: dict[int, tuple[int, ...]] = {}
    for r in sorted(inv.rank for inv in inventories if inv.memory_end < 0):
        inv = by_rank[r]
        stages, stage = len(inv.pp_ranks), inv.pp_rank
        partner = swap_partner(stage, stages) if plus and stages >= 4 else None
        if partner is not None:
            src = inv.pp_ranks[partner]
            if by_rank[src].memory_end < 0:
                return {}, (f"rank {r} (stage {stage}) and its CheckFree+ swap partner (stage {partner}) lost their "
                            "state together (CheckFree §3: no two consecutive stages)")
            out[r] = (src,)
            continue
        if not 0 < stage < stages - 1:
            return {}, (f"rank {r} is pipeline stage {stage} of {stages}: CheckFree rebuilds intermediate stages "
                        "only (the first/last stage has one neighbour; CheckFree+ rebuilds it from its swap partner "
                        "and the embedding/output copies: --ft-checkfree-plus)")
        prev, nxt = inv.pp_ranks[stage - 1], inv.pp_ranks[stage + 1]
        if by_rank[prev].memory_end < 0 or by_rank[nxt].memory_end < 0:
            return {}, (f"rank {r} (stage {stage}) and a neighbouring stage lost their state together: "
                        "CheckFree needs both neighbours (CheckFree §3: no two consecutive stages)")
        out[r] = (prev, nxt)
    return out, ""


@dataclass
class Wildcard:
    """A lost rank's proposal while the survivors agree on a point: any ``end`` they agree on."""

    end: int


def layers_as_loaded(store, registry, point, *, lossy: bool) -> list[dict[str, torch.Tensor]]:
    """This rank's transformer layers (by position in the stage, names inside the layer) as its recovery
    will load them at ``point.start`` (see the module docstring)."""
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for op in registry:
        if op.kind not in ("dense", "gate", "expert"):
            continue
        full = point.full_at[op]
        iteration, level = (full, Level.FULL) if lossy or full == point.start else (point.start, Level.COMPUTE)
        loaded = store.load(iteration, op, level)
        for name in registry[op].compute:
            m = _LAYER.match(name)
            if m is None or name not in loaded:
                raise ValueError(f"CheckFree: operator {op} holds {name!r}, which is not a transformer-layer tensor "
                                 "in the store (FP8 or grouped expert weights are not supported by the rebuild)")
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = loaded[name].detach().cpu().clone()
    return [layers[k] for k in sorted(layers)]


def recorded_grad_sq(store, iteration: int) -> float:
    """The squared gradient norm recorded with ``iteration``'s snapshot (NaN if absent: the uniform
    average is used then, ``average.averaging_weights``)."""

    try:
        value = store.load_meta(iteration).tensors.get(GRAD_SQ)
    except MissingEntryError:
        return math.nan
    return float(value.reshape(-1)[0]) if value is not None else math.nan


def _send(payload, dst: int) -> None:
    comm.send_object(payload, dst)


def _recv(src: int):
    return comm.recv_object(src)


@dataclass
class Rebuilt:
    """What the lost rank received and did."""

    start: int
    end: int
    metas: dict
    weights: Weights
    sources: tuple[int, ...]


def read_copies(copies, *, lost_stage: int, num_stages: int, iteration: int, rank: int) -> dict:
    """The lost stage's embedding / output copies of ``iteration`` from this holder's ``copies``
    (:class:`CopyStore`): ``{"copies": {kind: tensors}}``, or ``{"missing": why}``."""
    kinds = copies_owned_by(lost_stage, num_stages)
    if not kinds:
        return {"copies": {}}
    if copies is None:
        return {"missing": f"rank {rank} keeps no copies of the {'/'.join(kinds)} (run with --ft-checkfree-plus)"}
    out = {}
    for kind in kinds:
        try:
            out[kind] = copies.load(kind, iteration)
        except (KeyError, RuntimeError, ValueError) as e:  # missing (KeyError), corrupt (CorruptEntryError)
            why = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            return {"missing": f"the {kind} copy of iteration {iteration} on rank {rank} is unusable: {why}"}
    return {"copies": out}


def exchange_and_rebuild(*, rank: int, rebuilt: dict[int, tuple[int, ...]], pp_rank_of: dict[int, int],
                         store, registry, point, lossy: bool, state, copies=None) -> Rebuilt | None:
    """Collective over every rank (the lost ranks in ``rebuilt``: lost rank -> its sources): sources send,
    lost ranks receive; then every rank learns whether a needed copy is missing (:class:`RebuildImpossible`
    on every rank, nothing overwritten), else the lost ranks rebuild. ``point``: this rank's agreed point
    (``None`` on a lost rank); ``copies``: this rank's :class:`CopyStore` (CheckFree+ holders). Returns what
    a lost rank did, ``None`` elsewhere."""

    received = None
    for lost in sorted(rebuilt, key=lambda r: (pp_rank_of[r], r)):
        sources = tuple(rebuilt[lost])
        if rank in sources:
            it = point.end if lossy else point.start
            payload = {"layers": layers_as_loaded(store, registry, point, lossy=lossy),
                       "grad_sq": recorded_grad_sq(store, it)}
            if rank == sources[0]:
                payload.update(start=point.start, end=point.end, iteration=it,
                               metas={t: store.load_meta(t) for t in range(point.start, point.end + 1)
                                      if not lossy or t == point.end})
            if len(sources) == 1:  # the swap partner holds the lost stage's embedding / output copies
                num_stages = 1 + max(pp_rank_of.values())
                payload.update(read_copies(copies, lost_stage=pp_rank_of[lost], num_stages=num_stages,
                                           iteration=it, rank=rank))
            _send(payload, lost)
        if rank == lost:
            received = [_recv(src) for src in sources]
    missing = [m for m in comm.all_gather_object(received[0].get("missing") if received else None) if m]
    if missing:
        raise RebuildImpossible("; ".join(missing))
    if received is None:
        return None
    first = received[0]
    if len(received) == 1:
        weights = copy_partner_stage(state, first["layers"], first["copies"], partner_stage=pp_rank_of[rebuilt[rank][0]],
                                     iteration=first["iteration"])
    else:
        before, after = received
        weights = rebuild_own_layers(state, before["layers"], after["layers"], before["grad_sq"], after["grad_sq"])
    return Rebuilt(first["start"], first["end"], first["metas"], weights, tuple(rebuilt[rank]))


def copy_partner_stage(state, partner_layers, copies: dict, *, partner_stage: int, iteration: int) -> Weights:
    """CheckFree+ (§4.3) into this rank's live stage: its layers become its swap partner's, the embedding /
    output layer are restored bitwise from the partner's copies of ``iteration``; fresh Adam state for all
    of them; masters reloaded. Returns the weights for the report (1 / 0: a copy)."""
    if len(state.model) != 1:
        raise ValueError("CheckFree+ rebuilds one model chunk per rank; virtual pipeline stages are not supported")
    target = stage_layers(state.model[0])
    if len(partner_layers) != len(target):
        raise ValueError(f"CheckFree+: the swap partner holds {len(partner_layers)} layers, the lost stage "
                         f"{len(target)}; swapped stages must hold the same layers")
    rebuilt = [t for layer in target for t in layer.values()]
    with torch.no_grad():
        for k, (live, src) in enumerate(zip(target, (partner_layers[j] for j in align_layers(len(target), len(partner_layers))))):
            restore_tensors(f"layer {k} of the swap partner", src, live)
    for kind, stored in copies.items():
        live = copied_tensors(state.model[0], kind)
        restore_tensors(f"{kind} copy of iteration {iteration}", stored, live)
        rebuilt += list(live.values())
    fresh_optimizer_state(state, rebuilt)
    restored = f"; {' and '.join(sorted(copies))} restored from the copy of iteration {iteration}" if copies else ""
    return Weights(1.0, 0.0, f"copy of swap partner stage {partner_stage} (CheckFree+){restored}")


def fresh_optimizer_state(state, tensors) -> None:
    """Zero the Adam state of ``tensors`` (a rebuilt stage starts a fresh optimizer, as the authors' code)
    and reload the optimizer's fp32 masters from the (rebuilt) model weights."""

    ids = {id(t) for t in tensors}
    with torch.no_grad():
        for param_id, (_, main) in main_states(state.optimizer).items():
            if param_id in ids:
                for value in main.state.values():
                    value.zero_()
    state.optimizer.reload_model_params()


def rebuild_own_layers(state, prev_layers, next_layers, grad_sq_prev: float, grad_sq_next: float) -> Weights:
    """Alg. 1 line 3 into this rank's live layers; fresh Adam state for them; masters reloaded."""
    if len(state.model) != 1:
        raise ValueError("CheckFree rebuilds one model chunk per rank; virtual pipeline stages are not supported")
    target = stage_layers(state.model[0])
    weights = rebuild_layers(target, prev_layers, next_layers, grad_sq_prev=grad_sq_prev, grad_sq_next=grad_sq_next)
    fresh_optimizer_state(state, [t for layer in target for t in layer.values()])
    return weights


class RebuiltStageStore:
    """The recovery store of a rebuilt stage's rank: one point ``[start, end]`` with every operator FULL at
    ``start``; loading an entry returns the live (rebuilt) tensors, metadata is the previous stage's."""

    def __init__(self, registry, rebuilt: Rebuilt) -> None:
        self.registry, self.rebuilt = registry, rebuilt

    def newest_recoverable(self, rule, *, at_or_before=None, verify=False):
        r = self.rebuilt
        if at_or_before is not None and at_or_before < r.end:
            return None
        return RecoveryPoint(start=r.start, end=r.end, full_at={op: r.start for op in self.registry}, entries=())

    def points(self) -> list[int]:
        """The iterations whose metadata the previous stage sent (the policy reads its windows there)."""
        return sorted(self.rebuilt.metas)

    def load(self, iteration: int, op, level) -> dict[str, torch.Tensor]:
        return {name: t.detach().clone() for name, t in self.registry[op].tensors(Level(level)).items()}

    def load_meta(self, iteration: int):
        """The previous stage's metadata of ``iteration`` without its parameter groups' learning rates (the
        rebuilt stage keeps its own groups; the boost comes after the replay)."""

        try:
            meta = self.rebuilt.metas[iteration]
            if GROUP_LR in meta.tensors:
                meta = type(meta)(meta.meta, {k: v for k, v in meta.tensors.items() if k != GROUP_LR})
            return meta
        except KeyError:
            raise KeyError(f"CheckFree: no metadata of iteration {iteration} from the previous stage (it sent "
                           f"{sorted(self.rebuilt.metas)})") from None


def boost_rebuilt_stage(state, first_iteration: int, config=None):
    """CheckFree Alg. 1 line 4 on the rebuilt stage's rank: every parameter group of its optimizer (the rank
    holds only that stage), from ``first_iteration`` on (``lr_boost.py``: for the rest of training by
    default). Returns the :class:`LrBoost`."""

    boost = LrBoost(state.optimizer, state.scheduler, config or LrBoostConfig())
    boost.start(first_iteration)
    return boost
