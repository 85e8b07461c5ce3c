"""Token loss of a lossy recovery (``pec``: MoC §3.1.2 eq. 7 PLT; ``selective``: MoEtion §4.1 MLT).

Restoring expert ``(l, e)`` from its newest FULL entry ``f < end`` loses the updates of the tokens routed
to it in iterations ``f+1 … end``: exactly ``since_full[l, e]`` of the popularity counters as recorded
with the snapshot of ``end`` (``mark_full(f)`` reset it after the snapshot of ``f``), or, when a durable
point restores it from its last persisted FULL, older than its last snapshot FULL (two-level PEC, MoC §5.1),
``since_persisted[l, e]``, or, for an older entry still (a newer snapshot dropped or damaged), ``hard``
minus ``hard`` at the entry's FULL mark (``ExpertPopularity.since_entry`` picks). An expert FULL at ``end`` loses
nothing. Per layer the loss is divided by the expert-token assignments ``T_l · TopK``:
PLT uses the whole training run (``train_iters`` iterations, MoC "throughout the training") and averages
over the MoE layers (eq. 7: ``1/N_moe Σ``); MLT uses the tokens processed up to the recovery point
(MoEtion's momentary loss) and sums over the MoE layers as eq. 6 writes it (``Σ_l``; the paper's "below
3 %" reads like a per-layer fraction, see ``docs/recovery.md``). The policy says which
(:attr:`SnapshotPolicy.token_loss_layers`).
"""

from __future__ import annotations

import torch

from moe_ft import comm


def gather_expert_full_at(full_at: dict, group=None) -> dict[tuple[int, int], int]:
    """``(layer, expert) → iteration of the restored FULL entry`` over all ranks (collective, host path:
    ``group`` a host group, default the coordination group)."""
    mine = {(op.layer, op.expert): int(it) for op, it in full_at.items() if op.is_expert}
    out: dict = {}
    for part in comm.all_gather_object(mine, group):
        for key, it in part.items():
            out[key] = min(out.get(key, it), it)
    return out


def token_loss(*, end: int, expert_full_at: dict[tuple[int, int], int], since_entry: torch.Tensor,
               moe_layers: list[int], metric: str, tokens_per_layer: torch.Tensor, over_layers: str = "mean") -> dict:
    """``since_entry``: ``[num_moe_layers, num_experts]`` tokens since the entry each expert is restored
    from, as recorded at ``end`` (``ExpertPopularity.since_entry``); ``tokens_per_layer``:
    ``[num_moe_layers]`` expert-token assignments of the denominator; ``over_layers``: how the per-layer
    fractions combine (``mean``: MoC eq. 7 PLT; ``sum``: MoEtion eq. 6 MLT). Returns the report's
    token-loss dict."""
    if over_layers not in ("mean", "sum"):
        raise ValueError(f"over_layers must be 'mean' or 'sum', got {over_layers!r}")
    lost = torch.zeros_like(since_entry, dtype=torch.float64)
    for (layer, expert), f in expert_full_at.items():
        if f < end:
            lost[moe_layers.index(layer), expert] = since_entry[moe_layers.index(layer), expert]
    per_layer = lost.sum(dim=1) / tokens_per_layer.to(torch.float64)
    value = per_layer.mean() if over_layers == "mean" else per_layer.sum()
    return {"tokens": float(lost.sum()), "metric": metric, "value": float(value),
            "per_layer": [float(x) for x in per_layer], "per_expert": lost.tolist()}
