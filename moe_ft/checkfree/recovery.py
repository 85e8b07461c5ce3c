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
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_ft import comm
from moe_ft.checkfree.average import Weights, rebuild_layers, stage_layers
from moe_ft.state.operators import Level

GRAD_SQ = "checkfree.grad_sq"
"""Snapshot metadata tensor: this rank's squared gradient norm of the iteration (CheckFree's ``w``)."""

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


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
    from moe_ft.store import MissingEntryError

    try:
        value = store.load_meta(iteration).tensors.get(GRAD_SQ)
    except MissingEntryError:
        return math.nan
    return float(value.reshape(-1)[0]) if value is not None else math.nan


def _send(payload, dst: int) -> None:
    dist.send_object_list([payload], dst=dst, group=comm.coordination_group())


def _recv(src: int):
    box = [None]
    dist.recv_object_list(box, src=src, group=comm.coordination_group())
    return box[0]


@dataclass
class Rebuilt:
    """What the lost rank received and did."""

    start: int
    end: int
    metas: dict
    weights: Weights
    sources: tuple[int, int]


def exchange_and_rebuild(*, rank: int, rebuilt: dict[int, tuple[int, int]], pp_rank_of: dict[int, int],
                         store, registry, point, lossy: bool, state) -> Rebuilt | None:
    """Collective over the ranks named in ``rebuilt`` (lost rank -> (previous, next)): neighbours send,
    lost ranks receive and rebuild their layers. ``point``: this rank's agreed point (``None`` on a lost
    rank). Returns what a lost rank did, ``None`` elsewhere."""
    mine = None
    for lost in sorted(rebuilt, key=lambda r: (pp_rank_of[r], r)):
        prev, nxt = rebuilt[lost]
        if rank in (prev, nxt):
            it = point.end if lossy else point.start
            payload = {"layers": layers_as_loaded(store, registry, point, lossy=lossy),
                       "grad_sq": recorded_grad_sq(store, it)}
            if rank == prev:
                payload.update(start=point.start, end=point.end,
                               metas={t: store.load_meta(t) for t in range(point.start, point.end + 1)
                                      if not lossy or t == point.end})
            _send(payload, lost)
        if rank == lost:
            before, after = _recv(prev), _recv(nxt)
            weights = rebuild_own_layers(state, before["layers"], after["layers"], before["grad_sq"], after["grad_sq"])
            mine = Rebuilt(before["start"], before["end"], before["metas"], weights, (prev, nxt))
    return mine


def rebuild_own_layers(state, prev_layers, next_layers, grad_sq_prev: float, grad_sq_next: float) -> Weights:
    """Alg. 1 line 3 into this rank's live layers; fresh Adam state for them; masters reloaded."""
    from moe_ft.state.optimizer_views import main_states

    if len(state.model) != 1:
        raise ValueError("CheckFree rebuilds one model chunk per rank; virtual pipeline stages are not supported")
    target = stage_layers(state.model[0])
    weights = rebuild_layers(target, prev_layers, next_layers, grad_sq_prev=grad_sq_prev, grad_sq_next=grad_sq_next)
    rebuilt = {id(t) for layer in target for t in layer.values()}
    with torch.no_grad():
        for param_id, (_, main) in main_states(state.optimizer).items():
            if param_id in rebuilt:
                for value in main.state.values():
                    value.zero_()
    state.optimizer.reload_model_params()
    return weights


class RebuiltStageStore:
    """The recovery store of a rebuilt stage's rank: one point ``[start, end]`` with every operator FULL at
    ``start``; loading an entry returns the live (rebuilt) tensors, metadata is the previous stage's."""

    def __init__(self, registry, rebuilt: Rebuilt) -> None:
        self.registry, self.rebuilt = registry, rebuilt

    def newest_recoverable(self, rule, *, at_or_before=None, verify=False):
        from moe_ft.store.rules import RecoveryPoint

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
        try:
            return self.rebuilt.metas[iteration]
        except KeyError:
            raise KeyError(f"CheckFree: no metadata of iteration {iteration} from the previous stage (it sent "
                           f"{sorted(self.rebuilt.metas)})") from None


def boost_rebuilt_stage(state, first_iteration: int, config=None):
    """CheckFree Alg. 1 line 4 on the rebuilt stage's rank: every parameter group of its optimizer (the rank
    holds only that stage), from ``first_iteration`` on (``lr_boost.py``: for the rest of training by
    default). Returns the :class:`LrBoost`."""
    from moe_ft.checkfree.lr_boost import LrBoost, LrBoostConfig

    boost = LrBoost(state.optimizer, state.scheduler, config or LrBoostConfig())
    boost.start(first_iteration)
    return boost
