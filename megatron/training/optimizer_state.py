"""Optimizer state that Megatron-Core's checkpoint loading needs but a fresh optimizer lacks.

A plain Megatron need, not a fault-tolerance one: ``load_checkpoint`` (``checkpointing.py``) and any
in-memory restore (``moe_ft`` recovery imports it from here) load Adam state into an optimizer that has
never stepped.
"""

from __future__ import annotations

from typing import Iterator

import torch


def leaf_optimizers(optimizer) -> Iterator:
    """The Megatron optimizers inside ``optimizer`` (a ``ChainedOptimizer`` or a single one)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        yield optimizer
        return
    for opt in chained:
        yield from leaf_optimizers(opt)


def ensure_optimizer_state(optimizer) -> None:
    """Give an optimizer that never stepped its state tensors (Adam ``exp_avg``/``exp_avg_sq``, and for
    torch's Adam/AdamW a per-parameter ``step`` 0), so that a checkpoint or snapshot can be loaded into
    them; no parameter is touched.

    Without Apex/TE, Megatron's ``DistributedOptimizer.state_dict()`` reads ``step`` from every param
    state and asserts there is one value, so loading into an optimizer that never stepped fails (a
    Megatron bug on TE-less installs); a dummy optimizer step instead would change the parameters.
    Transformer Engine's and Apex's ``FusedAdam`` count the step in the parameter group instead and keep
    no per-parameter ``step``: giving them one would make the state differ from the one they snapshot."""
    for opt in leaf_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        opt.init_state_fn(inner, opt.config)
        if not isinstance(inner, torch.optim.Adam):  # AdamW is a subclass
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param].setdefault("step", torch.tensor(0.0))
