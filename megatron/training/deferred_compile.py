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
are fusions for GPU kernels. Whether there is a GPU is asked at that first call, not at import: a launcher that
imports the training stack once and forks its workers (``moe_ft/drills/prelaunch.py``) must not ask CUDA
anything before it forks. ``jit_fuser`` keeps the decorator, so functions Megatron-Core decorates later (its
experts' activation, at model build) are treated the same. An ``nn.Module`` passed to it goes to the compile
function at once.

Call :func:`import_megatron_core` before the first import of ``megatron.core`` (the entry script does, right
after :func:`megatron.training.quiet.hold`, and so does the preloading fork server); once Megatron-Core is
imported it does nothing.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import Any

import torch


class Deferred:
    """``compile_fn(fn, **kwargs)`` built at the first call and called from then on (a method when it is a class
    attribute, like the function it wraps); with ``eager_without_cuda``, ``fn`` itself where that first call
    finds no CUDA device."""

    def __init__(self, fn: Callable, compile_fn: Callable, kwargs: dict[str, Any],
                 eager_without_cuda: bool = False) -> None:
        functools.update_wrapper(self, fn)
        self._fn, self._compile_fn, self._kwargs = fn, compile_fn, kwargs
        self._eager_without_cuda = eager_without_cuda
        self.compiled: Callable | None = None

    def __call__(self, *args, **kwargs):
        compiled = self.compiled
        if compiled is None:  # two threads may both build it: the same function, one of them kept
            compiled = self.compiled = self._build()
        return compiled(*args, **kwargs)

    def _build(self) -> Callable:
        if self._eager_without_cuda:
            if not torch.cuda.is_available():  # asked here, in the process that runs it (not a launcher that
                return self._fn  # forks workers: there the question would keep them from using CUDA)
        return self._compile_fn(self._fn, **self._kwargs)

    def __get__(self, obj, objtype=None):
        return self if obj is None else types.MethodType(self, obj)


def deferring(compile_fn: Callable, eager_without_cuda: bool = False) -> Callable:
    """A stand-in for ``compile_fn`` (``torch.compile``) that defers compiling functions to their first call
    (:class:`Deferred`)."""

    def compile(model=None, **kwargs):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: compile(fn, **kwargs)
        if isinstance(model, torch.nn.Module):
            return compile_fn(model, **kwargs)
        return Deferred(model, compile_fn, kwargs, eager_without_cuda)

    compile.deferring = True  # type: ignore[attr-defined]
    return compile


def import_megatron_core() -> bool:
    """Import ``megatron.core`` with its ``torch.compile`` decorations deferred (module docstring). Returns
    whether it did (``False``: Megatron-Core was imported before, nothing changed)."""
    if "megatron.core" in sys.modules:
        return False
    real = torch.compile
    torch.compile = deferring(real, eager_without_cuda=True)  # type: ignore[assignment]
    try:
        # megatron.core imported while torch.compile is replaced (jit_fuser keeps the deferring decorator):
        # the point of this function, start-up time
        import megatron.core.jit  # noqa: F401
    finally:
        torch.compile = real  # type: ignore[assignment]
    return True
