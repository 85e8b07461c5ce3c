"""A CPU stand-in for Transformer Engine's delayed-scaling FP8 state, so that moe-ft's handling of it is tested
without CUDA (TE cannot be installed here). It follows TE 2.9-2.11 -- the range megatron-core 0.16.1 is built
with, whose code of the parts mimicked here is identical -- cited by the lines of v2.11:

* ``transformer_engine/pytorch/module/base.py``, ``TransformerEngineBaseModule``: ``__init__`` (604-632: an
  ``fp8_meta`` without scaling state), ``set_meta_tensor`` (706-741), ``init_fp8_meta_tensors`` (767-772),
  ``get_extra_state`` (806-865: a pickled uint8 tensor, empty before the first FP8 forward),
  ``set_extra_state`` (867-923: takes the recipe and ``num_gemms`` from the state, creates the scaling state,
  copies the tensors in), ``init_fp8_metadata`` (971-1026), ``prepare_forward`` (1028-1079);
* ``transformer_engine/pytorch/quantization.py``: ``FP8GlobalStateManager`` (234-611: ``reset``,
  ``add_fp8_tensors_to_global_buffer``, ``reduce_and_update_fp8_tensors`` on its unfused path,
  ``get_unique_autocast_key``, ``autocast_enter``/``autocast_exit``), ``autocast`` (800-862), the amax and
  scale update (865-963), ``DelayedScalingRecipeState`` (1049-1096: scales of one, histories of zeros,
  quantizers holding views of them);
* what each forward passes to ``prepare_forward``: ``Linear`` the default ``num_gemms`` 1
  (``module/linear.py`` 1400), ``GroupedLinear`` ``self.num_gemms`` (``module/grouped_linear.py`` 790), and
  ``DotProductAttention`` 3 with its own ``set_meta_tensor`` that allocates 3 GEMMs' slots whatever it is
  given (``attention/dot_product_attention/dot_product_attention.py`` 750-797, 1003-1008).

Left out: CUDA (tensors on the CPU, no synchronize), FP8 parameters, activation recompute, CUDA graphs, the
fused update kernel (its unfused reference path is here, as with ``NVTE_UNFUSED_FP8_UPDATE=1``), the DPA
recipe switches (``NVTE_DPA_FP8_RECIPE``), and the amax all-reduce (one process). The FP8 cast is torch's
``float8_e4m3fn``/``float8_e5m2`` after saturation.
"""

from __future__ import annotations

import contextlib
import pickle
from dataclasses import dataclass

import torch

FP8_MAX = {"E4M3": (448.0, 448.0), "HYBRID": (448.0, 57344.0)}  # (forward, backward)


@dataclass
class DelayedScaling:
    """``transformer_engine.common.recipe.DelayedScaling`` (the fields the state depends on)."""

    fp8_format: str = "HYBRID"
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0
    fp8_dpa: bool = False

    def delayed(self) -> bool:
        return True


class Float8Quantizer:
    """Scale and amax are views of the recipe state's tensors: a cast records the amax in the history's
    newest row and quantizes with the scale."""

    def __init__(self, scale: torch.Tensor, amax: torch.Tensor, fp8_max: float) -> None:
        self.scale, self.amax, self.fp8_max = scale, amax, fp8_max
        self.dtype = torch.float8_e4m3fn if fp8_max == 448.0 else torch.float8_e5m2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.amax.copy_(torch.maximum(self.amax, x.detach().abs().amax().reshape(1)))
        data = (x * self.scale).clamp(-self.fp8_max, self.fp8_max).to(self.dtype)
        return data.to(x.dtype) * (1.0 / self.scale)


class DelayedScalingRecipeState:
    def __init__(self, recipe: DelayedScaling, *, mode: str, num_quantizers: int) -> None:
        self.recipe, self.mode, self.num_quantizers = recipe, mode, num_quantizers
        self.scale = torch.ones(num_quantizers, dtype=torch.float32)
        self.amax_history = torch.zeros(recipe.amax_history_len, num_quantizers, dtype=torch.float32)

    def make_quantizers(self) -> list:
        fp8_max = FP8_MAX[self.recipe.fp8_format][self.mode != "forward"]
        return [Float8Quantizer(self.scale[i], self.amax_history[0][i].reshape((1,)), fp8_max)
                for i in range(self.num_quantizers)]


class FP8GlobalStateManager:
    FP8_ENABLED = False
    FP8_RECIPE: DelayedScaling | None = None
    FP8_DISTRIBUTED_GROUP = None
    AUTOCAST_DEPTH = 0
    global_amax_buffer: dict = {}
    global_amax_history_buffer: dict = {}
    global_scale_buffer: dict = {}
    autocast_arguments: dict = {}

    @classmethod
    def reset(cls) -> None:
        cls.FP8_ENABLED, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP, cls.AUTOCAST_DEPTH = False, None, None, 0
        cls.global_amax_buffer, cls.global_amax_history_buffer, cls.global_scale_buffer = {}, {}, {}
        cls.autocast_arguments = {}

    @classmethod
    def get_fp8_recipe(cls) -> DelayedScaling:
        return cls.FP8_RECIPE if cls.FP8_RECIPE is not None else DelayedScaling()

    @classmethod
    def get_unique_autocast_key(cls, recipe, group) -> str:
        return f"{str(recipe)}:{hash(group)}"

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta: dict) -> None:
        if "buffer_index_and_autocast_key" in fp8_meta:  # once per module: the tensors never move
            return
        fp8_meta["buffer_index_and_autocast_key"] = []
        for forward, meta_key in ((True, "scaling_fwd"), (False, "scaling_bwd")):
            key = f"{'forward' if forward else 'backward'}_" + cls.get_unique_autocast_key(fp8_meta["recipe"],
                                                                                          fp8_meta["fp8_group"])
            state = fp8_meta[meta_key]
            cls.global_amax_buffer.setdefault(key, []).append(state.amax_history[0])
            cls.global_amax_history_buffer.setdefault(key, []).append(state.amax_history)
            cls.global_scale_buffer.setdefault(key, []).append(state.scale)
            fp8_meta["buffer_index_and_autocast_key"] += [len(cls.global_amax_buffer[key]) - 1, key]

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        for buffer_key, amax_buffer in cls.global_amax_buffer.items():
            fwd, autocast_key = buffer_key.split("_", 1)
            if (fwd == "forward") != forward or not amax_buffer:
                continue
            recipe, _group = cls.autocast_arguments[autocast_key]
            contiguous_amax = torch.cat(amax_buffer)  # (all-reduced over the group here)
            torch._foreach_copy_(amax_buffer, list(contiguous_amax.split([x.numel() for x in amax_buffer])))
            fp8_max = FP8_MAX[recipe.fp8_format][not forward]
            for history, scale in zip(cls.global_amax_history_buffer[buffer_key], cls.global_scale_buffer[buffer_key]):
                amax = history.max(dim=0).values if recipe.amax_compute_algo == "max" else history[0].clone()
                if history.shape[0] > 1:
                    history.copy_(torch.roll(history, -1, 0))
                history[0].fill_(0.0)
                sf = (fp8_max / amax) / (2 ** recipe.margin)
                sf = torch.where(amax > 0.0, sf, scale)
                sf = torch.where(torch.isfinite(amax), sf, scale)
                scale.copy_(torch.where(torch.isinf(sf), torch.full_like(sf, torch.finfo(torch.float32).max), sf))

    @classmethod
    def autocast_enter(cls, enabled: bool, recipe: DelayedScaling, group) -> None:
        cls.autocast_arguments[cls.get_unique_autocast_key(recipe, group)] = (recipe, group)
        cls.FP8_ENABLED, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP = enabled, recipe, group
        cls.AUTOCAST_DEPTH += 1

    @classmethod
    def autocast_exit(cls, enabled: bool) -> None:
        cls.AUTOCAST_DEPTH -= 1
        if enabled and cls.AUTOCAST_DEPTH == 0 and torch.is_grad_enabled():
            cls.reduce_and_update_fp8_tensors(forward=True)


@contextlib.contextmanager
def autocast(enabled: bool = True, recipe: DelayedScaling | None = None, amax_reduction_group=None):
    recipe = DelayedScaling() if recipe is None else recipe
    saved = (FP8GlobalStateManager.FP8_ENABLED, FP8GlobalStateManager.FP8_RECIPE,
             FP8GlobalStateManager.FP8_DISTRIBUTED_GROUP)
    FP8GlobalStateManager.autocast_enter(enabled, recipe, amax_reduction_group)
    try:
        yield
    finally:
        (FP8GlobalStateManager.FP8_ENABLED, FP8GlobalStateManager.FP8_RECIPE,
         FP8GlobalStateManager.FP8_DISTRIBUTED_GROUP) = saved
        FP8GlobalStateManager.autocast_exit(enabled)


class TransformerEngineBaseModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fp8_initialized = False
        self.fp8 = False
        self.fp8_meta = {"fp8_checkpoint": False, "fp8_group": None}
        self.fp8_meta_tensors_initialized = False
        self.quantizers = {"scaling_fwd": {}, "scaling_bwd": {}}

    def set_meta_tensor(self, fwd: bool, recipe: DelayedScaling) -> None:
        key = "scaling_fwd" if fwd else "scaling_bwd"
        if self.fp8_meta_tensors_initialized and isinstance(self.fp8_meta[key], DelayedScalingRecipeState):
            return  # (TE adjusts the amax history's length to the recipe's here)
        num = self._num_gemms_for_state() * (3 if fwd else 2)
        state = DelayedScalingRecipeState(recipe, mode="forward" if fwd else "backward", num_quantizers=num)
        self.fp8_meta[key] = state
        self.quantizers[key] = state.make_quantizers()

    def _num_gemms_for_state(self) -> int:
        return self.fp8_meta["num_gemms"]

    def init_fp8_meta_tensors(self, recipe: DelayedScaling) -> None:
        self.set_meta_tensor(True, recipe)
        self.set_meta_tensor(False, recipe)
        self.fp8_meta_tensors_initialized = True

    def get_extra_state(self) -> torch.Tensor:
        if not (self.fp8_meta["fp8_checkpoint"] or self.fp8):
            return torch.empty(0, dtype=torch.uint8)
        state = {"recipe": self.fp8_meta["recipe"]}
        for key, meta_key in (("fwd", "scaling_fwd"), ("bwd", "scaling_bwd")):
            state[f"scale_{key}"] = self.fp8_meta[meta_key].scale.clone()
            state[f"amax_history_{key}"] = self.fp8_meta[meta_key].amax_history.clone()
        state["extra_fp8_variables"] = {k: v for k, v in self.fp8_meta.items() if k != "buffer_index_and_autocast_key"
                                        and isinstance(v, (bool, int, float, str, tuple, list))}
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        if state is None:
            return
        if not isinstance(state, torch.Tensor):
            raise RuntimeError("Unsupported checkpoint format.")
        if state.numel() == 0:
            return
        state = pickle.loads(state.detach().cpu().numpy().tobytes())
        self.fp8_meta.update(state["extra_fp8_variables"])
        self.fp8_meta["recipe"] = state["recipe"]
        self.init_fp8_meta_tensors(self.fp8_meta["recipe"])
        for key, meta_key in (("fwd", "scaling_fwd"), ("bwd", "scaling_bwd")):
            self.fp8_meta[meta_key].scale.copy_(state[f"scale_{key}"])
            self.fp8_meta[meta_key].amax_history.copy_(state[f"amax_history_{key}"])

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        self.fp8 = FP8GlobalStateManager.FP8_ENABLED
        self.fp8_meta["fp8_checkpoint"] = self.fp8
        if not self.fp8:
            self.fp8_initialized = False
            return
        if self.fp8_initialized and FP8GlobalStateManager.get_fp8_recipe() == self.fp8_meta["recipe"]:
            return
        self.fp8_meta["recipe"] = FP8GlobalStateManager.get_fp8_recipe()
        self.fp8_meta["num_gemms"] = num_gemms
        self.fp8_meta["fp8_group"] = FP8GlobalStateManager.FP8_DISTRIBUTED_GROUP
        self.init_fp8_meta_tensors(self.fp8_meta["recipe"])
        self.fp8_initialized = True

    @contextlib.contextmanager
    def prepare_forward(self, inp: torch.Tensor, num_gemms: int = 1):
        self.init_fp8_metadata(num_gemms=num_gemms)
        if self.fp8:
            FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(self.fp8_meta)
        yield inp

    def record_grad_output(self, grad: torch.Tensor, gemm_idx: int = 0) -> None:
        """What the backward's cast of the output gradient records (TE quantizes it with
        ``quantizers["scaling_bwd"][gemm]``); the last module's backward then calls
        ``FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)``."""
        self.quantizers["scaling_bwd"][gemm_idx](grad)


class Linear(TransformerEngineBaseModule):
    def __init__(self, in_features: int, out_features: int, generator: torch.Generator) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features, generator=generator))

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        with self.prepare_forward(inp) as inp:
            if not self.fp8:
                return inp @ self.weight.t()
            q = self.quantizers["scaling_fwd"]
            return q[0](inp) @ q[1](self.weight).t()  # input, weight (output: q[2], not cast here)


class GroupedLinear(TransformerEngineBaseModule):
    def __init__(self, num_gemms: int, in_features: int, out_features: int, generator: torch.Generator) -> None:
        super().__init__()
        self.num_gemms = num_gemms
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.randn(out_features, in_features,
                                                                                 generator=generator)))

    def forward(self, inp: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        with self.prepare_forward(inp, num_gemms=self.num_gemms) as inp:
            q, n, out = self.quantizers["scaling_fwd"], self.num_gemms, []
            for i, x in enumerate(inp.split(m_splits)):
                w = getattr(self, f"weight{i}")
                out.append(q[i](x) @ q[n + i](w).t() if self.fp8 else x @ w.t())  # inputs, then weights
            return torch.cat(out)


class DotProductAttention(TransformerEngineBaseModule):
    """No parameters; its scaling state (3 GEMMs' worth) is used only with ``fp8_dpa``."""

    def _num_gemms_for_state(self) -> int:
        return 3

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with self.prepare_forward(q, num_gemms=3) as q:
            if self.fp8 and self.fp8_meta["recipe"].fp8_dpa:
                quant = self.quantizers["scaling_fwd"]
                q, k, v = quant[0](q), quant[1](k), quant[2](v)
            return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
