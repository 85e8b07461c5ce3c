"""Transformer Engine's delayed-scaling state on a model that has not run a forward yet.

A TE module (``TransformerEngineBaseModule``) creates its ``fp8_meta["scaling_fwd"|"scaling_bwd"]`` — the
scale and amax history :func:`moe_ft.precision.quantized.module_scaling_state` captures — only inside its
first FP8 forward (``prepare_forward`` → ``init_fp8_metadata`` → ``init_fp8_meta_tensors``; TE 2.9–2.11,
``transformer_engine/pytorch/module/base.py``), or when ``set_extra_state`` loads a checkpoint's
``_extra_state`` into it (the path Megatron-Core's dist-checkpointing takes for a freshly built model).
moe-ft builds its operator registry on a freshly built model before any forward whenever it recovers (a
restarted rank, every rank of an in-process ``moe-ft launch`` attempt, an elastic reshape): the registry
would list no FP8 scaling tensors there while the stored entries hold them, and every restore would stop at
"does not match this model's operator (unexpected [...fp8_meta...])".

:func:`ensure_te_scaling_state` gives every such module its scaling state before the registry is built,
through TE's own load path: ``set_extra_state`` with a state in TE's checkpoint format (the pickled byte
tensor ``get_extra_state`` returns; Megatron-Core builds the same dictionaries when it merges a grouped
linear's per-expert extra states) holding what TE's first forward would allocate — scales of one,
amax histories of zeros (``DelayedScalingRecipeState.__init__``), for the recipe the run's forward uses
(Megatron-Core's ``get_fp8_recipe``) and the number of GEMMs the module's forward passes to
``prepare_forward`` — inside the FP8 context that forward runs in (Megatron-Core's ``get_fp8_context``, as
the forward: TE's ``Linear.set_meta_tensor`` adjusts its quantizers to the recipe of the context), with
autograd off (leaving TE's autocast then updates no scaling state). TE's first forward keeps these tensors
(``set_meta_tensor`` returns early for a delayed-scaling state that exists), so the registry's views are the
tensors TE reads and updates, and its operator layout is the same whether or not a forward has run. A
restore copies the stored values into them.

Snapshots still read the live tensors, not ``get_extra_state``: that one synchronizes the device and pickles
on every call, and for delayed scaling it holds exactly the scale and amax history of both directions that
the registry views already capture (``tests/test_te_fp8_state.py`` checks the two agree).
"""

from __future__ import annotations

import pickle
from typing import Callable, ContextManager, Iterable

import torch
from megatron.core.fp8_utils import get_fp8_context, get_fp8_recipe

from moe_ft.precision.quantized import module_scaling_state

_NUM_GEMMS = {"Linear": 1, "LayerNormLinear": 1, "LayerNormMLP": 2, "DotProductAttention": 3}
"""The ``num_gemms`` each TE module's forward passes to ``prepare_forward`` (TE 2.9–2.11: ``module/linear.py``
and ``module/layernorm_linear.py`` the default 1, ``module/layernorm_mlp.py`` 2,
``attention/dot_product_attention/dot_product_attention.py`` 3, which its own ``set_meta_tensor`` allocates
whatever it is given); ``GroupedLinear`` passes its ``num_gemms`` attribute (:func:`te_num_gemms`)."""


def is_te_module(module) -> bool:
    """A TE ``TransformerEngineBaseModule``, recognised by its attributes (TE is never imported here)."""
    return isinstance(getattr(module, "fp8_meta", None), dict) and callable(getattr(module, "set_extra_state", None)) \
        and callable(getattr(module, "init_fp8_meta_tensors", None))


def te_num_gemms(module) -> int | None:
    """How many GEMMs ``module``'s forward declares to TE (each gets 3 forward and 2 backward scaling
    slots), from the first TE class in its MRO that this module knows; ``None`` for an unknown one."""
    for cls in type(module).__mro__:
        if cls.__name__ == "GroupedLinear":
            return int(module.num_gemms)
        if cls.__name__ in _NUM_GEMMS:
            return _NUM_GEMMS[cls.__name__]
    return None


def _fp8_config(model_chunks: list):
    """The Megatron config of ``model_chunks`` when it trains in FP8, else ``None``."""
    for chunk in model_chunks:
        config = getattr(getattr(chunk, "module", chunk), "config", None)
        if config is not None and getattr(config, "fp8", None):
            return config
    return None


def encode_extra_state(state: dict) -> torch.Tensor:
    """``state`` in the format of TE's ``get_extra_state``: its pickle as a uint8 tensor."""
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def ensure_te_scaling_state(model_chunks: Iterable, recipe=None,
                            fp8_context: Callable[[], ContextManager] | None = None) -> int:
    """Give every TE module of ``model_chunks`` that has no delayed-scaling state yet the state its first FP8
    forward would create (see the module docstring). ``recipe`` and ``fp8_context``: the run's FP8 recipe and
    the context its forward runs in (default: Megatron-Core's ``get_fp8_recipe``/``get_fp8_context`` of the
    model's config). Nothing happens without a delayed-scaling recipe: the current-scaling and block-scaled
    recipes keep no scale or amax history (``PrecisionConfig.fp8_state``). Returns the number of modules
    given a state. Raises ``ValueError`` for a TE module class whose GEMM count is not known here."""
    model_chunks = list(model_chunks)
    if recipe is None:
        config = _fp8_config(model_chunks)
        if config is None:
            return 0
        recipe, fp8_context = get_fp8_recipe(config), lambda: get_fp8_context(config)
    if recipe is None or not recipe.delayed():
        return 0
    assert fp8_context is not None, "a recipe given without the FP8 context of the forward"
    todo = [(name, module) for chunk in model_chunks for name, module in getattr(chunk, "module", chunk).named_modules()
            if is_te_module(module) and not module_scaling_state(module)]
    if not todo:
        return 0
    length = recipe.amax_history_len
    with torch.no_grad(), fp8_context():
        for name, module in todo:
            n = te_num_gemms(module)
            if n is None:
                raise ValueError(f"{name}: a Transformer Engine {type(module).__name__} without FP8 scaling state yet, "
                                 "and moe-ft does not know how many GEMMs its forward quantizes; add its class to "
                                 "_NUM_GEMMS in moe_ft/precision/te_fp8.py")
            module.set_extra_state(encode_extra_state({
                "recipe": recipe, "scale_fwd": torch.ones(3 * n), "amax_history_fwd": torch.zeros(length, 3 * n),
                "scale_bwd": torch.ones(2 * n), "amax_history_bwd": torch.zeros(length, 2 * n),
                "extra_fp8_variables": {"num_gemms": n}}))
    return len(todo)
