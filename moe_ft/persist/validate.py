"""Round-trip checks of a recovery point (issue 5 part 4).

* :func:`validate_experts` — every expert of every MoE layer (all EP shards, i.e. all ranks' parts
  together), and every non-expert operator asked for, is restorable from the point: FULL somewhere in it.
* :func:`refuse_mixed_iterations` — the entries actually loaded come from the iterations the point says
  (``RecoveryPoint.full_at``); a dense point must be one iteration. Mixing would restore masters and Adam
  moments of different optimizer steps (a torn step), so loading refuses.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from moe_ft.state.operators import OperatorId
from moe_ft.store.rules import RecoveryPoint


def validate_experts(parts: Mapping[int, RecoveryPoint], *, num_layers: Iterable[int] | int, num_experts: int,
                     other_operators: Iterable[OperatorId] = ()) -> list[str]:
    """Problems (empty = valid) of the point made of each rank's ``parts[rank]``. ``num_layers``: the MoE
    layers (a count or the layer indices)."""
    layers = range(num_layers) if isinstance(num_layers, int) else list(num_layers)
    held: dict[OperatorId, set[int]] = {}
    ends = {p.end for p in parts.values()}
    problems = [] if len(ends) <= 1 else [f"ranks end at different iterations {sorted(ends)}: not one point"]
    for rank, part in parts.items():
        for op, it in part.full_at.items():
            held.setdefault(op, set()).add(it)
    wanted = [OperatorId.expert_op(layer, e) for layer in layers for e in range(num_experts)] + list(other_operators)
    for op in wanted:
        if op not in held:
            problems.append(f"{op}: no FULL entry in the point (no rank holds it)")
        elif len(held[op]) > 1:
            problems.append(f"{op}: FULL at different iterations {sorted(held[op])} on different ranks")
    return problems


def refuse_mixed_iterations(point: RecoveryPoint, loaded: Mapping[OperatorId, int], *, dense: bool = False) -> None:
    """Raise ``ValueError`` unless each operator was loaded from ``point.full_at[op]`` (and, for a dense
    point, every one from ``point.end``)."""
    bad = {str(op): it for op, it in loaded.items() if point.full_at.get(op) != it}
    if dense:
        bad.update({str(op): it for op, it in loaded.items() if it != point.end})
    if bad:
        raise ValueError(f"refusing to load a torn recovery point ending at {point.end}: entries from the wrong "
                         f"iteration {bad} (expected {{op: {point.full_at}}}); recover from one consistent point")
