"""Compatibility shims that let the pinned Megatron-Core (0.16.1) run unmodified where it otherwise could
not: on a CPU-only torch (:mod:`moe_ft.compat.cpu`) and without the checkpoint writer's ``Manager`` server
process that a killed rank would leak (:mod:`moe_ft.compat.writer_queue`).

The training loop (``megatron/training``) does not import this package: the process that runs it
activates the shims first. ``pretrain_gpt_moe.py`` calls :func:`activate_all` right after parsing its
flags; a script that calls ``megatron.training.pretrain.pretrain`` or ``initialize_distributed`` itself
does the same. Nothing happens at import time.
"""

from __future__ import annotations

from moe_ft.compat import cpu, writer_queue


def activate_all():
    """Activate every shim a Megatron training process needs, in the order they are needed; idempotent.

    1. The CPU layer (:func:`moe_ft.compat.cpu.activate`, a no-op when CUDA is available): before Megatron
       builds process groups, RNG trackers or models. Its device mode is pushed on the calling thread,
       so call this from the thread that trains (the main thread).
    2. ``moe_utils.te_general_gemm`` defined (as ``None``) when Transformer Engine is absent, on any device:
       Megatron-Core 0.16.1's router gating reads it unconditionally (a TE-less GPU run died with
       ``NameError`` at the first router call; found on the H100).
    3. The checkpoint writer's results queue (:func:`moe_ft.compat.writer_queue.install`): before the
       first ``dist_checkpointing.save`` (``--save``, durable Megatron checkpoints).

    Returns the CPU layer's state (:class:`moe_ft.compat.cpu.CpuLayerState`). Raises ``RuntimeError``
    on a Megatron-Core version the shims were not written for."""

    state = cpu.activate()
    cpu.define_te_general_gemm()
    writer_queue.install()
    return state
