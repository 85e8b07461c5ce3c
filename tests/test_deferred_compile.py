"""Megatron-Core's ``torch.compile``'d fusions (megatron/training/deferred_compile.py): imported without Inductor,
compiled with the same arguments at their first call where a GPU is, run as written on a CPU."""

from __future__ import annotations

import subprocess
import sys

import torch

from megatron.training.deferred_compile import Deferred, deferring
from tests._ft_helpers import ROOT


def test_a_deferred_function_is_compiled_once_at_its_first_call_with_its_arguments():
    built = []

    def fake_compile(fn, **kwargs):
        built.append((type(fn).__name__ if isinstance(fn, torch.nn.Module) else fn.__name__, kwargs))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    compile = deferring(fake_compile)

    @compile(mode="max-autotune", dynamic=False)
    def scale(x, by=2):
        return x * by

    class Router:
        factor = 3

        @compile
        def apply(self, x):
            return x + self.factor

    assert isinstance(scale, Deferred) and scale.__name__ == "scale" and built == []
    assert scale(4, by=3) == ("compiled", 12) and scale(1) == ("compiled", 2)
    assert Router().apply(1) == ("compiled", 4)
    assert built == [("scale", {"mode": "max-autotune", "dynamic": False}), ("apply", {})]  # once each
    compile(torch.nn.Linear(2, 2))
    assert built[-1] == ("Linear", {})  # a module goes to the compile function at once
    eager = deferring(fake_compile, eager_without_cuda=True)(lambda x: x + 1)
    assert eager(1) == 2 and eager.compiled is eager.__wrapped__ and len(built) == 3  # no CUDA here: as written


_FRESH = r"""
import sys
import torch
real, available, asked = torch.compile, torch.cuda.is_available, []
torch.cuda.is_available = lambda: asked.append(1) or available()
import moe_ft.drills.defer_compile  # what the preloading fork server imports: it must ask CUDA nothing
assert torch.compile is real and not asked, asked
torch.cuda.is_available = available
from megatron.training.deferred_compile import import_megatron_core
assert not import_megatron_core()  # done
from megatron.core import jit
from megatron.core.transformer.moe.router import TopKRouter
assert getattr(jit.jit_fuser, "deferring", False), jit.jit_fuser
f = jit.jit_fuser(lambda x: x * 2)
assert f(torch.ones(2)).tolist() == [2.0, 2.0] and f.compiled is not None
assert "torch._inductor.compile_fx" not in sys.modules  # nothing imported Inductor's compiler
print("ok", torch.cuda.is_available())
"""


def test_megatron_core_imports_without_inductor_and_its_fusions_run_as_written_on_cpu():
    done = subprocess.run([sys.executable, "-c", _FRESH], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["ok", "False"], done.stderr[-3000:]
