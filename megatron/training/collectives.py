"""The device path of the communication rule (``docs/communication.md``): collectives on Megatron's groups
(pipeline, data, expert parallel) with the tensor on the group's device — the current CUDA device when the
group is NCCL, the CPU when it is gloo. A tensor found elsewhere is moved there and the result copied back,
so a host tensor never meets NCCL (NCCL rejects it: the loop's first log line failed that way with PP > 1).

The training loop uses this module directly (it does not depend on ``moe_ft``); ``moe_ft.comm`` re-exports
it beside the host path (the coordination gloo group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT}


def reduce_op(op) -> dist.ReduceOp:
    """``"sum" | "max" | "min" | "product"`` or a ``dist.ReduceOp``."""
    if isinstance(op, str):
        if op not in _OPS:
            raise ValueError(f"unknown reduce op {op!r}; use one of {sorted(_OPS)}")
        return _OPS[op]
    return op


def parse_backends(config: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` (``dist.get_backend_config``) → ``{"cpu": "gloo", "cuda": "nccl"}``; a bare
    backend name maps to its device (``"nccl"`` → ``{"cuda": "nccl"}``)."""
    if ":" not in config:
        return {"cpu" if config in ("gloo", "mpi") else "cuda": config}
    return dict(pair.split(":", 1) for pair in config.split(","))


def group_backends(group=None) -> dict[str, str]:
    """The device → backend map of ``group`` (``None``: the default group)."""
    return parse_backends(dist.get_backend_config(group))


def device_of(backends: dict[str, str], cuda_available: bool) -> str:
    """``"cuda"`` when the group's CUDA backend is an accelerator one (NCCL) and CUDA is there, else ``"cpu"``."""
    backend = backends.get("cuda")
    return "cuda" if backend is not None and backend != "gloo" and cuda_available else "cpu"


def device_for(group=None) -> torch.device:
    """The device a tensor must be on for a collective on ``group`` (``None``: the default group)."""
    if not dist.is_initialized():
        return torch.device("cpu")
    if device_of(group_backends(group), torch.cuda.is_available()) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def on_device(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device.type == device.type and (device.index is None or tensor.device.index == device.index)


def all_reduce(tensor: torch.Tensor, op="sum", group=None) -> torch.Tensor:
    """In-place all-reduce over ``group`` (``None``: the default group) on the group's device; a tensor
    elsewhere is reduced in a copy there and the result written back. Returns ``tensor``."""
    if not dist.is_initialized():
        return tensor
    device = device_for(group)
    if on_device(tensor, device):
        dist.all_reduce(tensor, op=reduce_op(op), group=group)
        return tensor
    moved = tensor.to(device)
    dist.all_reduce(moved, op=reduce_op(op), group=group)
    return tensor.copy_(moved)


def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """In-place broadcast from global rank ``src`` on the group's device (as :func:`all_reduce`)."""
    if not dist.is_initialized():
        return tensor
    device = device_for(group)
    if on_device(tensor, device):
        dist.broadcast(tensor, src=src, group=group)
        return tensor
    moved = tensor.to(device)
    dist.broadcast(moved, src=src, group=group)
    return tensor.copy_(moved)


def all_gather_into_tensor(output: torch.Tensor, tensor: torch.Tensor, group=None) -> torch.Tensor:
    """``output`` (flat, ``group size × tensor.numel()``) ← every rank's ``tensor`` in group-rank order, on the
    group's device (as :func:`all_reduce`). Returns ``output``."""
    if not dist.is_initialized():
        return output.copy_(tensor.reshape(output.shape))
    device = device_for(group)
    if on_device(output, device) and on_device(tensor, device):
        dist.all_gather_into_tensor(output, tensor, group=group)
        return output
    moved = output.to(device)
    dist.all_gather_into_tensor(moved, tensor.to(device), group=group)
    return output.copy_(moved)
