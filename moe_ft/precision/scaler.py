"""The fp16 loss scaler as per-iteration state (``--fp16``: Megatron's ``DynamicGradScaler``).

Each iteration scales the loss by the current scale before backward, unscales the gradients, and updates
the scaler from the found-inf flag: on an overflow the hysteresis tracker counts down and, at zero, the
scale backs off; after ``--loss-scale-window`` clean iterations it grows. The scale decides which
iterations overflow (and are skipped) and the fp16 rounding of every gradient, so an exact replay must
start each iteration from the scaler state the original iteration saw: it is captured after every step
into the snapshot metadata (``moe_ft/snapshot/meta.py``) and restored with the rest of the step state.

State per Megatron optimizer (``ChainedOptimizer`` holds one per parameter set): ``scale`` (fp32 value),
``growth_tracker``, ``hysteresis_tracker`` (ints) — the scaler's own ``state_dict()``. A static scaler
(``--loss-scale``) and bf16/fp32 training have none (``None``).
"""

from __future__ import annotations

import torch

from moe_ft.state.optimizer_views import leaf_optimizers


def _leaves(optimizer) -> list:
    return list(leaf_optimizers(optimizer))


def _scaler(opt):
    scaler = getattr(opt, "grad_scaler", None)
    if scaler is None or not hasattr(scaler, "_growth_tracker"):  # none, or a ConstantGradScaler
        return None
    return scaler


def grad_scaler_state(optimizer) -> list[dict | None]:
    """JSON-able state of every leaf optimizer's dynamic grad scaler (``None`` where there is none)."""
    out: list[dict | None] = []
    for opt in _leaves(optimizer):
        scaler = _scaler(opt)
        if scaler is None:
            out.append(None)
            continue
        sd = scaler.state_dict()
        out.append({"scale": float(sd["scale"].reshape(-1)[0]), "growth_tracker": int(sd["growth_tracker"]),
                    "hysteresis_tracker": int(sd["hysteresis_tracker"])})
    return out


def load_grad_scaler_state(optimizer, states: list[dict | None]) -> None:
    """Inverse of :func:`grad_scaler_state` (through the scaler's ``load_state_dict``)."""
    leaves = _leaves(optimizer)
    if len(states) != len(leaves):
        raise ValueError(f"recorded grad-scaler state for {len(states)} optimizers, this run has {len(leaves)}: "
                         "restore into the same precision and parallel layout")
    for opt, st in zip(leaves, states):
        scaler = _scaler(opt)
        if (scaler is None) != (st is None):
            raise ValueError("the recorded run and this one differ in loss scaling (--fp16 dynamic scaler vs none "
                             "or --loss-scale); restore with the same precision flags")
        if scaler is None:
            continue
        assert st is not None  # checked above: both or neither
        scale = torch.tensor([st["scale"]], dtype=torch.float32, device=scaler.scale.device)
        scaler.load_state_dict({"scale": scale, "growth_tracker": int(st["growth_tracker"]),
                                "hysteresis_tracker": int(st["hysteresis_tracker"])})


def grad_scaler_tensors(optimizer) -> dict[str, torch.Tensor]:
    """``optim<i>.grad_scaler.<field>`` tensors of the dynamic scalers (for the training-state digest)."""
    out = {}
    for i, st in enumerate(grad_scaler_state(optimizer)):
        if st is None:
            continue
        out[f"optim{i}.grad_scaler.scale"] = torch.tensor([st["scale"]], dtype=torch.float32)
        out[f"optim{i}.grad_scaler.trackers"] = torch.tensor([st["growth_tracker"], st["hysteresis_tracker"]],
                                                             dtype=torch.int64)
    return out
