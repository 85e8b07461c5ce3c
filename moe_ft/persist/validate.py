"""Round-trip checks of a recovery point.

* :func:`validate_experts` — every expert of every MoE layer (all EP shards, i.e. all ranks' parts
  together), and every non-expert operator asked for, is restorable from the point: FULL somewhere in it.
* :func:`refuse_mixed_iterations` — the entries actually loaded come from the iterations the point says
  (``RecoveryPoint.full_at``); a dense point must be one iteration. Mixing would restore masters and Adam
  moments of different optimizer steps (a torn step), so loading refuses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping

from moe_ft.persist.durable import DurableTier
from moe_ft.state.operators import OperatorId
from moe_ft.store import StoreError
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


def validate_durable(job_dir, *, num_layers: int, num_experts: int) -> tuple[int | None, list[str]]:
    """Round-trip check of the newest complete point of a durable tier: ``(end, problems)``; ``end`` is
    ``None`` without a complete point or a durable tier (the problem says which)."""
    try:
        checked = validate_durable_points(job_dir, num_layers=num_layers, num_experts=num_experts)
    except ValueError as e:
        return None, [str(e)]
    return checked[0] if checked else (None, [f"{job_dir}: no complete durable point"])


def validate_durable_points(job_dir, *, num_layers: int, num_experts: int) -> list[tuple[int, list[str]]]:
    """Round-trip check of the complete points of a durable tier (``<persist_dir>/moe_ft/<job>``), newest
    first, as a recovery takes them: every entry each rank's part needs is present and passes its checksum,
    the parts form one point, and every expert of every layer is FULL in it. Returns ``[(end, problems)]`` down
    to the first valid point (empty problems), or every point when none is; ``[]`` without a complete point.
    Read-only: nothing is created or changed (a rank directory that is missing is a problem of the point). A
    ``ValueError`` names a directory that is no durable tier."""

    job_dir = Path(job_dir)
    if not (job_dir / "complete").is_dir():
        raise ValueError(f"{job_dir}: no complete/ directory; not a durable tier (<persist_dir>/moe_ft/<job>)")
    # the newest point's own world size: rank directories of an earlier, larger world may outlive it
    any_world = DurableTier(job_dir.parent.parent, job_dir.name, 1)
    ends = any_world.recorded_points()
    if not ends:
        return []
    newest = any_world.complete(ends[-1])
    tier = any_world.of_world(newest.world_size or len(newest.parts))
    out = []
    for end in reversed(tier.complete_points()):
        point = tier.complete(end)
        problems = _point_problems(tier, point, num_layers=num_layers, num_experts=num_experts)
        out.append((end, problems))
        if not problems:
            break
    return out


def _point_problems(tier: DurableTier, point, *, num_layers: int, num_experts: int) -> list[str]:
    problems = validate_experts(point.parts, num_layers=num_layers, num_experts=num_experts)
    for rank, part in sorted(point.parts.items()):
        try:  # read-only: a rank directory that is missing is a finding, never created
            store = tier.reader(rank)
        except StoreError:
            problems.append(f"rank {rank} holds no part of point {point.end} ({tier.directory / f'rank{rank}'} is "
                            "missing or not a store)")
            continue
        catalog = store.verify(part.iterations)
        problems += [f"rank {rank}: iteration {p.iteration} {p.what}: {p.reason}" for p in catalog.problems]
        for ref in part.entries:
            held = catalog.point(ref.iteration)
            entry = None if held is None else (held.meta if ref.op is None else held.entries.get(ref.op))
            if entry is None or (ref.op is not None and entry.level != ref.level):
                what = "metadata" if ref.op is None else f"{ref.op}@{ref.level.name if ref.level else 'any level'}"
                problems.append(f"rank {rank}: {what} of iteration {ref.iteration} missing or corrupt")
    return problems
