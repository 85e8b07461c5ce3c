"""A stable digest of the full training state, to compare two runs bitwise.

Covers, per rank: model parameters (by name), their FP8 compute state where a weight has one (FP8 data,
scales, amax histories: ``moe_ft.precision.quantized``), the optimizer's master weights and state
(``exp_avg``, ``exp_avg_sq``, ``step``: by optimizer, group and position, which is deterministic for a given
layout), the fp16 loss scaler (scale, growth and hysteresis trackers), the LR/WD scheduler state and the RNG
states (torch CPU/CUDA and Megatron's tracker). The global digest
hashes the per-rank digests in rank order, so it is equal for two runs exactly when every rank's state is
bitwise equal (for the same parallel layout).
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import get_cuda_rng_tracker

from moe_ft import comm
from moe_ft.precision.quantized import quantized_tensors
from moe_ft.precision.scaler import grad_scaler_tensors
from moe_ft.state.naming import is_spare_expert
from moe_ft.state.optimizer_views import main_states


def _optimizers(optimizer):
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def local_state_tensors(model_chunks, optimizer, scheduler=None, include_rng: bool = True) -> dict[str, torch.Tensor]:
    """Name → tensor for everything that makes up this rank's training state. The spare expert slots of an
    elastic layer (``--ft-rebalance-interval``: MLPs serving no expert) hold no training state: left out,
    with their optimizer entries."""

    out: dict[str, torch.Tensor] = {}
    spare: set[int] = set()
    for chunk_idx, chunk in enumerate(model_chunks):
        module = getattr(chunk, "module", chunk)
        for name, param in module.named_parameters():
            if is_spare_expert(name, module):
                spare.add(id(param))
                continue
            out[f"model{chunk_idx}.{name}"] = param.detach()
        for name, tensor in quantized_tensors(module).items():
            out[f"model{chunk_idx}.{name}"] = tensor.detach()
    if spare:
        spare |= {id(main.master) for pid, (_, main) in main_states(optimizer).items()
                  if pid in spare and main.master is not None}
    for opt_idx, opt in enumerate(_optimizers(optimizer)):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group_idx, group in enumerate(inner.param_groups):
            for param_idx, param in enumerate(group["params"]):
                if id(param) in spare:
                    continue
                prefix = f"optim{opt_idx}.g{group_idx}.p{param_idx}"
                out[f"{prefix}.master"] = param.detach()
                for key, value in inner.state.get(param, {}).items():
                    if torch.is_tensor(value):
                        out[f"{prefix}.{key}"] = value.detach()
                    else:
                        out[f"{prefix}.{key}"] = torch.tensor(float(value), dtype=torch.float64)
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is not None:
            out[f"optim{opt_idx}.loss_scale"] = scaler.scale.detach().reshape(-1).cpu()
    out.update(grad_scaler_tensors(optimizer))
    if scheduler is not None:
        sched = json.dumps(scheduler.state_dict(), sort_keys=True, default=str)
        out["scheduler"] = torch.frombuffer(bytearray(sched.encode()), dtype=torch.uint8)
    if include_rng:
        out["rng.torch"] = torch.get_rng_state()
        for name, value in sorted(get_cuda_rng_tracker().get_states().items()):
            out[f"rng.tracker.{name}"] = value.detach().cpu() if torch.is_tensor(value) else torch.tensor([])
        if torch.cuda.is_available():
            out["rng.cuda"] = torch.cuda.get_rng_state()
    return out


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes, in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def global_digest(model_chunks, optimizer, scheduler=None, include_rng: bool = True) -> str:
    """Collective over all ranks (host path, ``moe_ft.comm``): digest of every rank's state, in rank order."""

    local = tensor_digest(local_state_tensors(model_chunks, optimizer, scheduler, include_rng))
    if not dist.is_initialized():
        return hashlib.sha256(local.encode()).hexdigest()
    gathered = comm.all_gather_object(local)
    return hashlib.sha256("".join(str(d) for d in gathered).encode()).hexdigest()
