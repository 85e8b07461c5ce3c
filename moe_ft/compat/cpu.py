"""Run the real Megatron-Core code paths on a CPU-only torch with the gloo backend.

Megatron-Core 0.16.1 assumes CUDA in a handful of places that are not about GPU math at all: it asks
``torch.cuda.current_device()`` for the device of every buffer, builds a few scalars with
``device="cuda"``, checks ``param.type() == "torch.cuda.FloatTensor"``, synchronises streams and forks the
CUDA RNG. On a CPU build each of those raises. This module makes "cuda" mean "the training device, which is
the CPU" for exactly those calls, so that Megatron's MoE layer, router, token dispatchers, pipeline
schedules, DDP, optimizers and dist_checkpointing run unmodified. The shims (each justified inline):

1. ``torch.cuda`` entry points Megatron calls unconditionally: ``current_device`` (returns the CPU
   device), ``set_device``, ``synchronize``, ``Stream``/``Event``/
   ``current_stream``/``default_stream``/``stream``/``set_stream`` (CPU kernels run synchronously on the
   calling thread, so an in-order stream object whose waits are no-ops is the exact CPU semantics).
2. :class:`CudaToCpuMode`, a ``TorchFunctionMode``: ``device="cuda"``/``"cuda:N"``/an int index/
   ``torch.device("cuda")`` become CPU, ``Tensor.cuda()`` is the identity, ``pin_memory`` is dropped (no
   accelerator to pin for), and ``Tensor.type()`` reports ``torch.cuda.*Tensor`` so Megatron's optimizer
   type checks (``distrib_optimizer.py``, ``optimizer.py``, ``clip_grads.py``) accept CPU parameters.
3. :class:`CpuRNGStatesTracker`: Megatron's CUDA RNG tracker (dropout and expert-parallel RNG streams) keeps
   CPU generator states instead, so ``model_parallel_cuda_manual_seed`` and ``get_cuda_rng_tracker().fork()``
   work and remain reproducible.
4. ``moe_utils.te_general_gemm`` is only defined when Transformer Engine imports, yet the router's gating
   function reads it unconditionally (a Megatron bug on every TE-less install): define it as ``None``.
5. The alltoall dispatcher turns split sizes into host lists only for CUDA tensors
   (``maybe_move_tensor_to_cpu``); on CPU they stay tensors, which gloo's ``all_to_all_single`` rejects.
   :func:`_split_sizes_to_host` converts them.
6. With tensor or expert-tensor parallelism the alltoall dispatcher gathers and reduce-scatters *uneven*
   token counts over the tensor-parallel group (``tensor_parallel.mappings._gather_along_first_dim`` /
   ``_reduce_scatter_along_first_dim`` with split sizes): NCCL takes lists of unequal tensors, gloo rejects
   them ("invalid tensor size") or has no list reduce-scatter. :func:`_patch_uneven_tp_collectives` does the
   uneven cases with what gloo has: a gather of copies padded to the largest split, and a reduce-scatter as
   an all-reduce of the whole tensor from which each rank keeps its split (the same sums; more bytes, which
   on one CPU host cost little). The even cases keep Megatron-Core's code.

Activation is explicit (:func:`activate`), idempotent, and refuses to run on a Megatron-Core version this
layer was not written for. Nothing happens at import time. When CUDA is available :func:`activate` does
nothing at all.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from dataclasses import dataclass, field

import torch
from megatron.core import package_info
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel import random as mp_random
from megatron.core.transformer.moe import moe_utils, token_dispatcher
from torch.overrides import TorchFunctionMode

SUPPORTED_MCORE_VERSIONS = ("0.16.1",)


@dataclass(kw_only=True)
class CpuLayerState:
    """What :func:`activate` did (for ``moe-ft env`` and tests)."""

    active: bool = False
    reason: str = "not activated"
    shims: list[str] = field(default_factory=list)
    mode: "CudaToCpuMode | None" = None


_STATE = CpuLayerState()
_CPU = torch.device("cpu")
_LOCK = threading.Lock()


def state() -> CpuLayerState:
    return _STATE


# ----------------------------------------------------------------------------------------------
# Shim 1: torch.cuda entry points.
class CpuStream:
    """An in-order stream on the CPU. CPU kernels complete before the Python call returns, so every
    wait/synchronise is already satisfied; the object only has to answer Megatron's calls."""

    def __init__(self, device=None, priority: int = 0, **_):
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None):
        event = event if event is not None else CpuEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class CpuEvent:
    """A CUDA event on the CPU: recorded work is already complete. ``elapsed_time`` measures wall time
    between two recorded events (what Megatron's timers use it for)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._time: float | None = None

    def record(self, stream=None) -> None:
        self._time = time.perf_counter()

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: "CpuEvent") -> float:
        if self._time is None or end._time is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        return (end._time - self._time) * 1000.0


_DEFAULT_STREAM = CpuStream()


def _patch_torch_cuda() -> list[str]:
    cuda = torch.cuda
    patches = {
        # The CPU device itself, not an ordinal: Megatron mostly writes ``device=current_device()``, and
        # a real device object also works inside autograd backward, where torch-function modes are off.
        "current_device": lambda: _CPU,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "Stream": CpuStream,
        "Event": CpuEvent,
        "current_stream": lambda device=None: _DEFAULT_STREAM,
        "default_stream": lambda device=None: _DEFAULT_STREAM,
        "stream": lambda stream=None: contextlib.nullcontext(stream),
        "set_stream": lambda stream: None,
    }
    for name, value in patches.items():
        setattr(cuda, name, value)
    return [f"torch.cuda.{name}" for name in patches]


# ----------------------------------------------------------------------------------------------
# Shim 2: cuda devices -> cpu inside torch calls.
def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA ordinal in torch factory functions (Megatron passes current_device()).
    return isinstance(device, int) and not isinstance(device, bool)


_TENSOR_TYPE_TO_CUDA = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device arguments to the CPU for every torch call made while the mode is on the stack."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory or func is torch.Tensor.is_pinned:
            return args[0] if func is torch.Tensor.pin_memory else False
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _TENSOR_TYPE_TO_CUDA.get(name, name)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]) and not isinstance(
            args[1], torch.Tensor
        ):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------------------------
# Shim 3: RNG tracker on CPU generator states.
def _make_tracker_class():
    class CpuRNGStatesTracker(mp_random.CudaRNGStatesTracker):
        """Megatron's RNG tracker with the CPU default generator standing in for the CUDA generator.

        On a GPU, dropout draws from the CUDA generator and the tracker swaps its state; on the CPU dropout
        draws from the CPU default generator, so that is the state to swap."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig = self.states_[orig_name]
                torch.set_rng_state(orig)
                self._current_state_name = orig_name

    return CpuRNGStatesTracker


def _install_rng_tracker() -> str:
    tracker_cls = _make_tracker_class()
    original = mp_random.initialize_rng_tracker

    @functools.wraps(original)
    def initialize_rng_tracker(*args, force_reset: bool = False, **kwargs):
        if force_reset or not mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED:
            mp_random._CUDA_RNG_STATE_TRACKER = tracker_cls()
            mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    mp_random.initialize_rng_tracker = initialize_rng_tracker
    initialize_rng_tracker(force_reset=True)
    return "tensor_parallel.random.CpuRNGStatesTracker"


# ----------------------------------------------------------------------------------------------
# Shims 4 and 5: MoE utilities.
def define_te_general_gemm() -> bool:
    """Define ``moe_utils.te_general_gemm = None`` when Transformer Engine did not (any device: the router's
    gating reads the name even when it does not use TE). Returns whether it was missing."""

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


def _patch_moe_utils() -> list[str]:
    done = ["moe_utils.te_general_gemm=None"] if define_te_general_gemm() else []

    original = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def _split_sizes_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    for module in (moe_utils, token_dispatcher):
        if hasattr(module, "maybe_move_tensor_to_cpu"):
            module.maybe_move_tensor_to_cpu = _split_sizes_to_host
    done.append("moe_utils.maybe_move_tensor_to_cpu")
    return done


def _patch_uneven_tp_collectives() -> list[str]:
    original_gather = mappings._gather_along_first_dim
    original_reduce_scatter = mappings._reduce_scatter_along_first_dim

    @functools.wraps(original_gather)
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or len(set(output_split_sizes)) == 1:
            return original_gather(input_, group, output_split_sizes, use_global_buffer)
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, output_split_sizes)], dim=0)

    @functools.wraps(original_reduce_scatter)
    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original_reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.clone(memory_format=torch.contiguous_format)  # all_reduce works in place
        torch.distributed.all_reduce(total, group=group)
        return torch.split(total, input_split_sizes, dim=0)[group.rank()]

    mappings._gather_along_first_dim = gather
    mappings._reduce_scatter_along_first_dim = reduce_scatter
    return ["mappings._gather_along_first_dim(uneven)", "mappings._reduce_scatter_along_first_dim(uneven)"]


def _check_version() -> str:
    version = package_info.__version__
    if version not in SUPPORTED_MCORE_VERSIONS:
        raise RuntimeError(
            f"moe_ft.compat.cpu was written for megatron-core {', '.join(SUPPORTED_MCORE_VERSIONS)} "
            f"but {version} is installed; install the pinned version (pip install megatron-core=="
            f"{SUPPORTED_MCORE_VERSIONS[-1]}) or run on a machine with CUDA"
        )
    return version


def activate(force: bool = False) -> CpuLayerState:
    """Make Megatron-Core runnable on this CPU-only process. No-op when CUDA is available (unless
    ``force``, for tests). Must run before Megatron builds models or process groups; idempotent.
    The device mode is pushed on the calling thread's torch-function stack (the training thread)."""
    with _LOCK:
        if _STATE.active:
            return _STATE
        if torch.cuda.is_available() and not force:
            _STATE.reason = "CUDA available: CPU layer not needed"
            return _STATE
        _check_version()
        shims = _patch_torch_cuda()
        shims.append(_install_rng_tracker())
        shims.extend(_patch_moe_utils())
        shims.extend(_patch_uneven_tp_collectives())
        mode = CudaToCpuMode()
        mode.__enter__()
        shims.append("CudaToCpuMode")
        _STATE.active = True
        _STATE.reason = "no CUDA: Megatron-Core runs on CPU with gloo"
        _STATE.shims = shims
        _STATE.mode = mode
        return _STATE
