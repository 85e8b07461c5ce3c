"""The optimizer's per-group state: everything in ``optimizer.param_groups`` but the parameters.

The state registry captures the per-parameter tensors of ``optimizer.state`` (Adam's moments, torch's
per-parameter ``step``). Some optimizers keep part of their state in the parameter groups instead:
Transformer Engine's and Apex's ``FusedAdam`` count the step there (``group["step"]``), and Adam's bias
correction reads it, so a recovery that restored only the per-parameter tensors would resume with the
wrong correction, silently, even in bf16. The groups also hold the hyper-parameters (``lr``, ``betas``,
``eps``, ``weight_decay``, Megatron's ``wd_mult``/``lr_mult``/``max_lr``/``min_lr``) and any key an
optimizer adds.

:func:`capture_param_groups` records every key but ``params``: numbers, strings, booleans, ``None`` and
tuples or lists of them in the metadata's JSON part, tensors (a ``capturable`` optimizer's step) among its
tensors. :func:`restore_param_groups` puts them back. Megatron-Core's ``ChainedOptimizer`` exposes the
groups of all its optimizers (dense, expert) as one list, in a fixed order; the record is that list.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch

META_KEY = "param_groups"
TENSOR_PREFIX = "param_group."

log = logging.getLogger("moe_ft.state")


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, (tuple, list)) and all(_plain(v) for v in value)


def capture_param_groups(optimizer) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """``(groups, tensors)``: per group, its plain values (JSON; tuples become lists) and its tensors
    (``param_group.<index>.<key>``, copied to the host). A value of another type (an object an optimizer
    keeps in a group) is not state this module can restore: it raises, naming the key."""
    groups, tensors = [], {}
    for index, group in enumerate(optimizer.param_groups):
        plain = {}
        for key, value in group.items():
            if key == "params":
                continue
            if torch.is_tensor(value):
                tensors[f"{TENSOR_PREFIX}{index}.{key}"] = value.detach().cpu().clone()
            elif _plain(value):
                plain[key] = list(value) if isinstance(value, tuple) else value
            else:
                raise TypeError(f"optimizer parameter group {index} holds {key!r} of type {type(value).__name__}; "
                                "only numbers, strings, tensors and tuples of numbers can be snapshotted")
        groups.append(plain)
    return groups, tensors


def _same_kind(old: Any, new: Any) -> Any:
    """``new`` in the form of ``old`` (a tuple stays a tuple: JSON turned it into a list)."""
    return tuple(new) if isinstance(old, tuple) else new


def restore_param_groups(optimizer, groups: list[dict[str, Any]] | None, tensors: Mapping[str, torch.Tensor]) -> bool:
    """Put the recorded group state back (metadata written before groups were recorded: ``groups`` ``None``,
    nothing changes). A tensor value is copied into the group's tensor when it has one of the same shape
    (its device kept), else set. Returns whether the record matched this optimizer's groups.

    Another layout (an elastic re-placement: this rank's groups are not the recording rank's) has another
    number of groups; then a key whose recorded values all agree (a step every group counts alike, the
    betas of the flags) is set in every group, and a key whose values differ keeps this optimizer's value,
    with a warning naming it."""
    if groups is None:
        return False
    live = list(optimizer.param_groups)
    per_group = [dict(g, **{k[len(f"{TENSOR_PREFIX}{i}."):]: v for k, v in tensors.items()
                            if k.startswith(f"{TENSOR_PREFIX}{i}.")}) for i, g in enumerate(groups)]
    if len(per_group) == len(live):
        for group, recorded in zip(live, per_group):
            for key, value in recorded.items():
                _set(group, key, value)
        return True
    keys = {k for g in per_group for k in g}
    uniform, differing = {}, []
    for key in sorted(keys):
        values = [g.get(key) for g in per_group]
        if all(key in g for g in per_group) and all(_equal(values[0], v) for v in values[1:]):
            uniform[key] = values[0]
        else:
            differing.append(key)
    for group in live:
        for key, value in uniform.items():
            _set(group, key, value)
    if differing:
        log.warning("the snapshot records %d optimizer parameter groups, this rank has %d; keys whose recorded "
                    "values differ between groups keep this rank's values: %s", len(per_group), len(live),
                    ", ".join(differing))
    return False


def _equal(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and bool(torch.equal(a, b))
    return a == b


def _set(group: dict, key: str, value: Any) -> None:
    old = group.get(key)
    if torch.is_tensor(value):
        if torch.is_tensor(old) and old.shape == value.shape:
            old.copy_(value)
        else:
            group[key] = value.clone()
    else:
        group[key] = _same_kind(old, value)
