"""Layer norms for ``--sequence-parallel`` with Megatron-Core's local layers and no Apex (every CPU run).

Megatron-Core's torch fallback (``WrappedTorchNorm``) refuses sequence parallelism, although a layer norm is
computed per token and a sequence shard changes nothing in it. What sequence parallelism asks of a norm is
that its weight and bias gradients, each computed from one shard of the sequence, are summed over the
tensor-parallel ranks: Megatron-Core's ``finalize_model_grads`` does that for every parameter marked
``sequence_parallel`` (Apex's ``FusedLayerNorm`` and TE's norms mark theirs). :class:`SequenceParallelTorchNorm`
is torch's ``LayerNorm``/``RMSNorm`` with that mark; :func:`with_sequence_parallel_norms` puts it in the layer
spec and as the block's final norm.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer import transformer_block
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class SequenceParallelTorchNorm:
    """Megatron-Core's norm signature (``config, hidden_size, eps``) building torch's norm with its parameters
    marked ``sequence_parallel`` (their gradients are summed over the tensor-parallel group). A class whose
    ``__new__`` returns the norm, as ``WrappedTorchNorm`` is: a layer spec instantiates a class."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused) -> torch.nn.Module:  # type: ignore[misc]
        if config.normalization not in NORMS:
            raise ValueError(f"--sequence-parallel without Apex or Transformer Engine supports {sorted(NORMS)}, "
                             f"not {config.normalization}")
        norm = NORMS[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm


def with_sequence_parallel_norms(layer: ModuleSpec, config, vp_stage: int | None) -> TransformerBlockSubmodules:
    """The block spec of this rank's layers: ``layer``'s torch norms replaced by :class:`SequenceParallelTorchNorm`,
    and the block's final norm too when it is torch's (Megatron-Core picks that one at import, from what is
    installed). Norms of Apex or TE are kept: they support sequence parallelism."""
    fields = {f.name: getattr(layer.submodules, f.name) for f in dataclasses.fields(layer.submodules)}
    swapped = {name: SequenceParallelTorchNorm for name, module in fields.items() if module is WrappedTorchNorm}
    layer = dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, **swapped))
    final = transformer_block.LayerNormImpl
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=SequenceParallelTorchNorm if final is WrappedTorchNorm else final)
