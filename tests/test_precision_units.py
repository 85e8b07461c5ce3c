"""FP8 state through snapshots, bit for bit (MoEvement §5.7): the delayed-scaling reference, the
decomposition of quantized weights (moe-ft's emulation, a duck-typed Transformer Engine ``Float8Tensor`` and
``fp8_meta``) into the plain tensors the store writes, the store round trip and restore into the live
tensors, and the precision checks of the flags. Single process, no Megatron model."""

from __future__ import annotations

import pytest
import torch

from moe_ft.precision.config import PrecisionConfig
from moe_ft.precision.fp8 import DelayedScalingConfig, FP8WeightState, dequantize, next_scale, quantize
from moe_ft.precision.quantized import quantized_state, quantized_tensors, quantized_weight
from moe_ft.snapshot.restore import restore_operator
from moe_ft.state.operators import Level, OperatorId
from moe_ft.state.registry import OperatorState, _add_quantized
from moe_ft.store import MemoryBackend, SnapshotStore
from moe_ft.store.codec import write_entry


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone()


# ------------------------------------------------------------------------------ delayed scaling reference
def test_quantize_saturates_and_next_scale_follows_te_formula():
    x = torch.tensor([1000.0, -1000.0, 0.5, 0.0])
    q = quantize(x, torch.ones(1), torch.float8_e4m3fn)
    assert q.to(torch.float32).tolist() == [448.0, -448.0, 0.5, 0.0]  # saturated, not NaN
    cfg = DelayedScalingConfig(amax_history_len=3, amax_compute_algo="max", margin=1)
    scale = torch.tensor([7.0])
    assert next_scale(torch.tensor([2.0, 4.0, 1.0]), scale, cfg).item() == 448.0 / 4.0 / 2.0
    recent = DelayedScalingConfig(amax_history_len=3, amax_compute_algo="most_recent")
    assert next_scale(torch.tensor([2.0, 4.0, 1.0]), scale, recent).item() == 224.0
    assert next_scale(torch.zeros(3), scale, cfg).item() == 7.0  # no amax yet: keep the scale
    assert next_scale(torch.tensor([float("inf"), 1.0, 1.0]), scale, cfg).item() == 7.0


def test_weight_state_uses_delayed_scale_and_records_history():
    cfg = DelayedScalingConfig(amax_history_len=3, amax_compute_algo="max")
    st = FP8WeightState((4, 4), config=cfg)
    gen = torch.Generator().manual_seed(0)
    masters = [torch.randn(4, 4, generator=gen) * s for s in (0.1, 2.0, 0.5, 0.3)]
    views = st.tensors()
    for i, m in enumerate(masters):
        used = st.scale.clone()
        st.quantize_from(m)
        assert torch.equal(bits(st.data), bits(quantize(m, used, torch.float8_e4m3fn)))  # the *previous* scale
        assert st.scale_inv.item() == (1.0 / used).item()
        assert st.amax_history[0].item() == m.abs().max().item()  # newest first
        window_amax = torch.stack([x.abs().max() for x in masters[max(0, i - 2): i + 1]]).max()
        assert st.scale.item() == (448.0 / window_amax).item()  # max over the 3 newest amaxes
    assert all(v is t for v, t in zip(views.values(), st.tensors().values()))  # updated in place
    deq = st.dequantize(torch.float32)
    assert torch.equal(deq, dequantize(st.data, st.scale_inv, torch.float32))


def test_fp8_state_cannot_be_rederived_from_the_master():
    """Why snapshots must hold the FP8 state: the same master quantizes differently after another history."""
    cfg = DelayedScalingConfig(amax_history_len=4, amax_compute_algo="max")
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(8, 8, generator=gen)
    a, b = FP8WeightState((8, 8), config=cfg), FP8WeightState((8, 8), config=cfg)
    a.quantize_from(w * 30.0)  # a saw a large weight before
    b.quantize_from(w)
    a.quantize_from(w)
    b.quantize_from(w)
    assert not torch.equal(bits(a.data), bits(b.data)) and a.scale.item() != b.scale.item()


# ------------------------------------------------------------------------------ duck-typed Transformer Engine
class FakeQuantizer:
    def __init__(self) -> None:
        self.scale = torch.tensor([3.5])
        self.amax = torch.tensor([0.25])


class FakeFloat8Tensor(torch.Tensor):
    """The attributes of TE's ``Float8TensorStorage`` (``_data`` uint8, ``_scale_inv``, ``_fp8_dtype``,
    transpose cache, quantizer); its nominal dtype is bf16, as TE's."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor):
        self = torch.Tensor._make_subclass(cls, torch.empty(data.shape, dtype=torch.bfloat16))
        self._data, self._scale_inv, self._fp8_dtype = data, scale_inv, "DType.kFloat8E4M3"
        self._transpose, self._transpose_invalid = data.t().contiguous(), False
        self._quantizer = FakeQuantizer()
        return self

    def detach(self):  # as TE's: a detached tensor (nn.Parameter makes one) shares the FP8 data and scales
        out = FakeFloat8Tensor(self._data, self._scale_inv)
        out._transpose, out._quantizer = self._transpose, self._quantizer
        return out


class FakeTELinear(torch.nn.Module):
    def __init__(self, data, scale_inv) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(FakeFloat8Tensor(data, scale_inv), requires_grad=False)
        holder = type("FP8TensorMeta", (), {})
        self.fp8_meta = {"scaling_fwd": holder(), "scaling_bwd": holder(), "recipe": object()}
        for key, n in (("scaling_fwd", 3), ("scaling_bwd", 2)):
            self.fp8_meta[key].scale = torch.rand(n)
            self.fp8_meta[key].amax_history = torch.rand(5, n)


def model_with_fp8(fmt: str = "e4m3"):
    """An emulation FP8 weight (all 256 byte patterns in its data, NaN payloads included) next to a TE-like
    layer with a Float8Tensor weight and fp8_meta."""
    gen = torch.Generator().manual_seed(2)
    emu = torch.nn.Linear(16, 16, bias=False)
    st = FP8WeightState((16, 16), config=DelayedScalingConfig(fmt=fmt, amax_history_len=4))
    st.data.copy_(torch.arange(256, dtype=torch.uint8).reshape(16, 16).view(st.data.dtype))
    st.scale_inv.fill_(0.0123)
    st.scale.fill_(81.25)
    st.amax_history.copy_(torch.rand(4, generator=gen))
    emu.weight.fp8_state = st
    te = FakeTELinear(torch.randint(0, 256, (8, 16), dtype=torch.uint8, generator=gen), torch.tensor([0.5]))
    return torch.nn.ModuleDict({"emu": emu, "te": te}), st


def test_quantized_state_decomposes_into_the_live_tensors():
    model, st = model_with_fp8()
    weights, scaling = quantized_state(model)
    assert weights["emu.weight"].has_wide_copy and not weights["te.weight"].has_wide_copy
    assert weights["emu.weight"].tensors == st.tensors()
    te = model["te"].weight
    assert weights["te.weight"].data is te._data and weights["te.weight"].tensors["fp8_scale_inv"] is te._scale_inv
    assert set(weights["te.weight"].tensors) == {"fp8_data", "fp8_scale_inv", "fp8_quantizer_scale",
                                                 "fp8_quantizer_amax"}
    assert {n: owner for n, (owner, _) in scaling.items()} == {
        f"te.fp8_meta.{k}.{a}": "te.weight" for k in ("scaling_fwd", "scaling_bwd") for a in ("scale", "amax_history")}
    assert len(quantized_tensors(model)) == 4 + 4 + 4
    assert quantized_weight(torch.nn.Parameter(torch.zeros(2))) is None
    # what the next forward writes in place (delayed scaling's scale/amax): captured at submit by the engine
    assert weights["te.weight"].forward_mutated == {"fp8_quantizer_scale", "fp8_quantizer_amax"}
    assert weights["emu.weight"].forward_mutated == frozenset()  # re-quantized by the optimizer step only


def test_block_scaled_and_subclass_tensors_are_refused():
    class FakeMXFP8(torch.Tensor):
        pass

    mx = torch.Tensor._make_subclass(FakeMXFP8, torch.zeros(4, 4))
    mx._rowwise_data, mx._rowwise_scale_inv = torch.zeros(4, 4, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="block-scaled"):
        quantized_weight(mx)
    f8 = FakeFloat8Tensor(torch.zeros(4, 4, dtype=torch.uint8), torch.ones(1))
    with pytest.raises(ValueError, match="quantized FakeFloat8Tensor: writing it would dequantize it"):
        write_entry(lambda b: None, {"k": 1}, {"w": f8}, "crc32")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_state_round_trips_through_the_store_bitwise(fmt):
    """Emulation and TE state of one operator: snapshot (the store's codec), scribble over the live tensors,
    restore: every byte back (the e5m2 data holds NaN payloads, which a trip through fp32 would not keep),
    each stored as its own dtype (FP8, uint8, fp32: nothing wider), the TE transpose cache invalidated."""
    model, st = model_with_fp8(fmt)
    weights, scaling = quantized_state(model)
    op = OperatorId.expert_op(0, 0)
    state = OperatorState(op=op)
    _add_quantized(state, "emu.weight", model["emu"].weight, None, weights["emu.weight"])
    _add_quantized(state, "te.weight", model["te"].weight, None, weights["te.weight"])
    for name, (_, tensor) in scaling.items():
        state.compute[name] = tensor
    assert "emu.weight" in state.wide and "emu.weight" not in state.compute  # the wide weight: FULL only
    before = {n: (t.dtype, bits(t)) for n, t in state.tensors(Level.FULL).items()}
    store = SnapshotStore(MemoryBackend())
    points = {Level.COMPUTE: 3, Level.FULL: 4}
    for level, it in points.items():
        with store.begin(it) as point:
            point.put(op, level, {n: t.clone() for n, t in state.tensors(level).items()})
            point.put_meta({"iteration": it}, {})
            point.publish()
    stored = {rec.name: rec.dtype for rec in store.catalog().point(4).entries[op].tensors}
    fp8 = f"float8_{'e4m3fn' if fmt == 'e4m3' else 'e5m2'}"
    assert stored == {n: str(dt).removeprefix("torch.") for n, (dt, _) in before.items()}
    assert stored["emu.weight.fp8_data"] == fp8 and stored["te.weight.fp8_data"] == "uint8"
    assert {dt for n, dt in stored.items() if ".fp8" in n} <= {fp8, "uint8", "float32"}
    assert set(store.load(3, op, Level.COMPUTE)) == set(state.compute)
    model["te"].weight._transpose_invalid = False
    for level in (Level.COMPUTE, Level.FULL):
        for t in state.tensors(level).values():
            t.detach().view(torch.uint8).fill_(0x55) if t.element_size() == 1 else t.detach().fill_(-1.0)
        restore_operator(store, {op: state}, points[level], op, level)
        for name, t in state.tensors(level).items():
            assert t.dtype == before[name][0] and torch.equal(bits(t), before[name][1]), (level, name)
        assert model["te"].weight._transpose_invalid  # derived from the restored bytes: rebuilt on use
        model["te"].weight._transpose_invalid = False


# ------------------------------------------------------------------------------ precision configurations
class _Args:
    def __init__(self, fp8_emulation: bool = False, **model) -> None:
        from moe_ft.precision.emulation import FP8EmulationConfig

        base = dict(bf16=False, fp16=False, fp8_format=None, fp8_recipe="delayed")
        self.model = type("M", (), {**base, **model})()
        self.training = type("T", (), {"loss_scale": None})()
        self.extra = {"FP8EmulationConfig": FP8EmulationConfig(fp8_emulation=fp8_emulation)}


@pytest.mark.parametrize("model,compute,state", [
    ({}, "fp32", "none"),
    ({"bf16": True}, "bf16", "none"),
    ({"fp16": True}, "fp16", "none"),
    ({"fp8_format": "e4m3", "fp8_emulation": True}, "fp8", "amax history"),
    ({"bf16": True, "fp8_format": "hybrid", "fp8_recipe": "delayed"}, "fp8", "amax history"),
    # current scaling on bf16 parameters: no FP8 state outlives an iteration, nothing to capture
    ({"bf16": True, "fp8_format": "e4m3", "fp8_recipe": "tensorwise"}, "fp8", "none (current scaling"),
    ({"bf16": True, "fp8_format": "hybrid", "fp8_recipe": "mxfp8"}, "fp8", "none (current scaling"),
    ({"bf16": True, "fp8_format": "e4m3", "fp8_recipe": "blockwise"}, "fp8", "none (current scaling"),
])
def test_precision_config_and_its_fp8_state(model, compute, state):
    cfg = PrecisionConfig.from_args(_Args(**model))
    assert cfg.fp8_source == ("emulation" if model.get("fp8_emulation") else "transformer_engine" if
                              model.get("fp8_format") else "")
    assert cfg.compute == compute and cfg.master == "fp32"
    assert (cfg.loss_scaling == "dynamic") == bool(model.get("fp16"))
    assert cfg.fp8_state().startswith(state), cfg.fp8_state()


@pytest.mark.parametrize("flags,message", [
    (["--fp8-format", "e4m3"], "or --fp8-emulation to run FP8 weights without Transformer Engine"),
    (["--fp8-emulation"], "--fp8-emulation emulates --fp8-format"),
    (["--fp8-format", "e4m3", "--fp8-emulation", "--use-distributed-optimizer"], "drop --use-distributed-optimizer"),
    (["--fp8-format", "e4m3", "--fp8-emulation", "--moe-grouped-gemm"], "--moe-grouped-gemm"),  # either check
    (["--fp8-format", "e4m3", "--fp8-emulation", "--fp8-recipe", "tensorwise"], "delayed scaling only"),
    (["--fp16", "--min-loss-scale", "8", "--initial-loss-scale", "4"], "--min-loss-scale <= --initial-loss-scale"),
])
def test_precision_flags_are_validated(data_prefix, flags, message):
    from megatron.training.arguments import ArgumentError, parse_args
    from moe_ft.precision.emulation import FP8EmulationConfig

    with pytest.raises(ArgumentError, match=message.replace("-", r"\-").replace("(", r"\(")):
        parse_args(["--data-path", data_prefix, *flags], world_size=1,
                   extra_groups=[("FP8 emulation", FP8EmulationConfig)])


def test_fp8_emulation_and_fp16_pass_with_ft(data_prefix):
    from megatron.training.arguments import parse_args
    from moe_ft.config import FTConfig

    for flags in (["--fp8-format", "e4m3", "--fp8-emulation"], ["--fp16", "--loss-scale", "1024"]):
        from moe_ft.precision.emulation import FP8EmulationConfig

        args = parse_args(["--data-path", data_prefix, *flags, "--ft"], world_size=1,
                          extra_groups=[("FP8 emulation", FP8EmulationConfig), ("fault tolerance", FTConfig)])
        assert args.extra["FTConfig"].ft
        if "--fp16" in flags:  # the precision flags survive beside --ft
            assert args.model.fp16 and args.training.loss_scale == 1024
        else:
            assert args.extra["FP8EmulationConfig"].fp8_emulation
