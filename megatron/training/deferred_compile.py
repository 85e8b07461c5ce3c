"""Megatron-Core's ``torch.compile``'d fusion functions: wrapped at their first call on a GPU, run as written on
a CPU.

``megatron.core.jit`` sets ``jit_fuser = torch.compile`` (torch >= 2.2), and about twenty functions of
Megatron-Core are decorated with it as their modules are imported (bias-activation fusions, the router's expert
bias update, the flexible dispatcher's preprocessing, ...). Decorating already costs: ``torch.compile`` imports
TorchDynamo and Inductor to look up its default backend. And the router calls its ``_apply_expert_bias`` in every
forward, expert bias or not, so a CPU run has TorchDynamo trace it and Inductor's compiler entry imported
(``torch._inductor.compile_fx``), for a function that does nothing there. Measured on the 2-core host: a rank of
a 4-iteration tiny run spends 5.1-6.5 s of CPU with this module against 6.1-8.4 s without it (three alternating
pairs; the losses bitwise equal), in every rank of every start, restarts included.

:func:`import_megatron_core` imports Megatron-Core with ``torch.compile`` replaced, for that import only, by
:func:`deferring`, whose decorator returns a :class:`Deferred` function. With CUDA the function is handed to
``torch.compile``, with the same arguments, at its first call: what runs is what ``torch.compile`` builds, only
the wrapping moves. Without CUDA it runs as written (what Megatron-Core's own ``disable_jit_fuser`` gives): these
are fusions for GPU kernels. ``jit_fuser`` keeps the decorator, so functions Megatron-Core decorates later (its
experts' activation, at model build) are treated the same. An ``nn.Module`` passed to it goes to the compile
function at once.

Call :func:`import_megatron_core` before the first import of ``megatron.core`` (the entry script does, right
after :func:`megatron.training.quiet.hold`); once Megatron-Core is imported it does nothing.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import Any


class Deferred:
    """``compile_fn(fn, **kwargs)`` built at the first call and called from then on (a method when it is a class
    attribute, like the function it wraps)."""

    def __init__(self, fn: Callable, compile_fn: Callable, kwargs: dict[str, Any]) -> None:
        functools.update_wrapper(self, fn)
        self._fn, self._compile_fn, self._kwargs = fn, compile_fn, kwargs
        self.compiled: Callable | None = None

    def __call__(self, *args, **kwargs):
        compiled = self.compiled
        if compiled is None:  # two threads may both build it: the same function, one of them kept
            compiled = self.compiled = self._compile_fn(self._fn, **self._kwargs)
        return compiled(*args, **kwargs)

    def __get__(self, obj, objtype=None):
        return self if obj is None else types.MethodType(self, obj)


def deferring(compile_fn: Callable) -> Callable:
    """A stand-in for ``compile_fn`` (``torch.compile``) that defers compiling functions to their first call."""

    def compile(model=None, **kwargs):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: compile(fn, **kwargs)
        import torch

        if isinstance(model, torch.nn.Module):
            return compile_fn(model, **kwargs)
        return Deferred(model, compile_fn, kwargs)

    compile.deferring = True  # type: ignore[attr-defined]
    return compile


def _eager(fn: Callable, **kwargs) -> Callable:
    """Without a GPU: the function itself, as Megatron-Core's ``disable_jit_fuser`` makes it."""
    return fn


def import_megatron_core() -> bool:
    """Import ``megatron.core`` with its ``torch.compile`` decorations deferred (module docstring). Returns
    whether it did (``False``: Megatron-Core was imported before, nothing changed)."""
    if "megatron.core" in sys.modules:
        return False
    import torch

    real = torch.compile
    torch.compile = deferring(real if torch.cuda.is_available() else _eager)  # type: ignore[assignment]
    try:
        import megatron.core.jit  # noqa: F401  (imports megatron.core; jit_fuser keeps the deferring decorator)
    finally:
        torch.compile = real  # type: ignore[assignment]
    return True
