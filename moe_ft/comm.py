"""The one communication rule (``docs/communication.md``): every collective that moe-ft and the training loop
issue goes through this module, on one of two paths.

* **Host path** — coordination between ranks (agreement on a recovery point, restart counts, inventories,
  catalogues, digests, reports): host tensors and pickled objects over the *coordination group*, a gloo group
  of all world ranks created once beside Megatron's groups (:func:`init_coordination`). Never on an NCCL
  group: NCCL rejects host tensors, and object collectives on NCCL copy through the GPU and synchronise it.
* **Device path** — collectives on Megatron's groups (pipeline, data, expert parallel): the tensor lives on
  the group's device (:func:`device_for`: the current CUDA device for an NCCL group, the CPU for gloo); a
  tensor found elsewhere is moved there and the result copied back, so a host tensor never meets NCCL.
  Implemented once in ``megatron/training/collectives.py`` (the training loop must not import ``moe_ft``)
  and re-exported here: :func:`all_reduce`, :func:`broadcast`, :func:`all_gather_into_tensor`.

``tests/test_comm_rule.py`` walks training, snapshot, recovery, replication and elastic paths under
:class:`moe_ft.testing.collective_checker.CollectiveChecker`, which fails when our code hands a tensor to a
collective on an accelerator group any other way.

Like Megatron's ``parallel_state``, the coordination group is process-wide state: it belongs to the default
process group it was created beside and is created again after that one is replaced.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# the device path lives beside the training loop (which must not import moe_ft); one implementation
from megatron.training.collectives import (  # noqa: F401
    all_gather_into_tensor,
    all_reduce,
    broadcast,
    device_for,
    group_backends,
    on_device,
    parse_backends,
    reduce_op,
)

log = logging.getLogger("moe_ft.comm")


class CollectivePatches:
    """Functions of ``torch.distributed`` replaced by wrappers, and put back (for the seams and checks that watch
    collectives). A wrapper replaces the function in ``torch.distributed.distributed_c10d``, where torch's own
    internal calls find it (e.g. ``P2POp``'s op check), and in ``torch.distributed`` where that exports the same
    object."""

    def __init__(self) -> None:
        self._originals: dict[str, tuple[Any, bool]] = {}

    def __bool__(self) -> bool:
        return bool(self._originals)

    def patch(self, name: str, wrapper) -> None:
        orig = getattr(c10d, name)
        on_dist = getattr(dist, name, None) is orig
        self._originals[name] = (orig, on_dist)
        setattr(c10d, name, wrapper)
        if on_dist:
            setattr(dist, name, wrapper)

    def restore(self) -> None:
        for name, (orig, on_dist) in self._originals.items():
            setattr(c10d, name, orig)
            if on_dist:
                setattr(dist, name, orig)
        self._originals.clear()


COORDINATION_DESC = "MOE_FT_COORDINATION_GLOO"


@dataclass
class _Coordination:
    world: Any
    """The default process group the coordination group was created beside (held: no address reuse)."""
    group: Any


_COORD: _Coordination | None = None


# ------------------------------------------------------------------------------------------- groups
def _default_group():
    return dist.distributed_c10d._get_default_group()


def _default_timeout() -> timedelta | None:
    """The default group's timeout (the coordination group gives up when the job's groups would)."""
    world = _default_group()
    for device in world._device_types:
        try:
            return world._get_backend(device).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return None


def init_coordination(timeout_s: float | None = None):
    """Create the coordination group (gloo, all world ranks) beside the default group and return it.

    Collective: ``dist.new_group`` must be called by every rank, in the same order relative to every other
    group creation. Call it at one fixed point on every rank — right after Megatron's groups exist, or at the
    start of ``FTRuntime.on_train_start``. Idempotent while the default group stays the same."""
    global _COORD
    if not dist.is_initialized():
        raise RuntimeError("moe_ft.comm.init_coordination: torch.distributed is not initialised; call it after "
                           "init_process_group (megatron.training.initialize.initialize_distributed)")
    world = _default_group()
    if _COORD is not None and _COORD.world is world:
        return _COORD.group
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else _default_timeout()
    group = dist.new_group(backend="gloo", timeout=timeout, group_desc=COORDINATION_DESC)
    _COORD = _Coordination(world=world, group=group)
    return group


def reset_coordination() -> None:
    """Forget the coordination group (its process groups are gone: ``moe-ft launch`` starts a new attempt in
    this process, whose :func:`init_coordination` builds a new one)."""
    global _COORD
    _COORD = None


def coordination_group():
    """The coordination group. Created on first use when :func:`init_coordination` was not called yet: safe,
    because every use is a collective over all world ranks, so every rank reaches its first use at the same
    point of its sequence of collectives."""
    if _COORD is not None and _COORD.world is _default_group():
        return _COORD.group
    return init_coordination()


def initialized_coordination_group():
    """The coordination group if it exists for the current default group, else ``None`` (never creates)."""
    if _COORD is not None and dist.is_initialized() and _COORD.world is _default_group():
        return _COORD.group
    return None


def new_host_group(ranks: Sequence[int] | None = None, *, timeout_s: float | None = None, desc: str = ""):
    """A dedicated gloo group for host traffic (e.g. replica transfers). Collective over the default group."""
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else _default_timeout()
    return dist.new_group(ranks=list(ranks) if ranks is not None else None, backend="gloo", timeout=timeout,
                          group_desc=desc or "MOE_FT_HOST_GLOO")


def is_host_group(group) -> bool:
    """Whether ``group`` takes host tensors (it has a CPU backend, i.e. gloo)."""
    return "cpu" in group_backends(group)


# ---------------------------------------------------------------------------------------- host path
def _host(group):
    if group is None:
        return coordination_group()
    if not is_host_group(group):
        raise ValueError(f"group {getattr(group, 'group_desc', group)!r} has no host (gloo) backend: host "
                         "collectives go over moe_ft.comm.coordination_group() or a moe_ft.comm.new_host_group")
    return group


def all_reduce_host(values, op="sum", group=None):
    """Reduce host values over every rank of ``group`` (default: the coordination group). ``values``: a CPU
    tensor (reduced in place and returned), a number (returns the reduced number) or a sequence of numbers
    (returns a list); integers stay exact (int64), anything else is float64."""
    if torch.is_tensor(values):
        if values.device.type != "cpu":
            raise ValueError(f"all_reduce_host takes host tensors, got one on {values.device}; device tensors "
                             "go through moe_ft.comm.all_reduce (the device path)")
        if dist.is_initialized():
            dist.all_reduce(values, op=reduce_op(op), group=_host(group))
        return values
    scalar = not isinstance(values, (list, tuple))
    items = [values] if scalar else list(values)
    exact = all(isinstance(v, (int, bool)) for v in items)
    t = torch.tensor([int(v) if exact else float(v) for v in items], dtype=torch.int64 if exact else torch.float64)
    all_reduce_host(t, op, group)
    out = t.tolist()
    return out[0] if scalar else out


def max_over_ranks(value: int, group=None) -> int:
    """The largest ``value`` of any rank (host path)."""
    return int(all_reduce_host(int(value), "max", group))


def min_over_ranks(value: int, group=None) -> int:
    """The smallest ``value`` of any rank (host path)."""
    return int(all_reduce_host(int(value), "min", group))


def all_gather_object(obj, group=None) -> list:
    """Every rank's ``obj`` in rank order (pickled, host path); ``[obj]`` when not distributed."""
    if not dist.is_initialized():
        return [obj]
    group = _host(group)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def broadcast_object(obj, src: int = 0, group=None):
    """Global rank ``src``'s ``obj`` on every rank (pickled, host path)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_host(group))
    return box[0]


def send_object(obj, dst: int, group=None) -> None:
    """Send ``obj`` (pickled; tensors go as host bytes, bit-exact) to global rank ``dst`` (host path, blocking:
    the receiver must call :func:`recv_object` with this rank in the same order)."""
    dist.send_object_list([obj], dst=dst, group=_host(group))


def recv_object(src: int, group=None):
    """The object global rank ``src`` sends with :func:`send_object` (host path, blocking)."""
    box = [None]
    dist.recv_object_list(box, src=src, group=_host(group))
    return box[0]


def barrier(group=None) -> None:
    """Wait for every rank of ``group`` (default: the coordination group)."""
    if dist.is_initialized():
        dist.barrier(group=_host(group))


def all_reduce_world(tensor: torch.Tensor, op="sum") -> torch.Tensor:
    """In-place reduction over every rank of the job without moving ``tensor``: a host tensor over the
    coordination group (host path), an accelerator tensor over the default group (device path). For counters
    that may live on either side (popularity, capacity-boost deficits)."""
    if tensor.device.type == "cpu":
        return all_reduce_host(tensor, op)
    return all_reduce(tensor, op, group=None)


__all__ = ["COORDINATION_DESC", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_reduce_host",
           "all_reduce_world", "barrier", "broadcast", "broadcast_object", "coordination_group", "device_for",
           "init_coordination", "initialized_coordination_group", "is_host_group", "max_over_ranks",
           "min_over_ranks", "new_host_group", "on_device", "parse_backends"]
