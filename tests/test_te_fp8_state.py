"""Transformer Engine's delayed-scaling FP8 state through a recovery, on the CPU stand-in of TE 2.9-2.11 in
``tests/_te_standin.py`` (TE cannot be installed here): ``fp8_meta``'s scaling state is created at a module's
first FP8 forward, and ``get_extra_state``/``set_extra_state`` are TE's checkpoint path.

A recovery builds moe-ft's operator registry on a rebuilt model before any forward. There the TE modules had
no scaling state yet, the stored entries had it, and the restore stopped ("does not match this model's
operator (unexpected [...fp8_meta...])"). ``ensure_te_scaling_state`` creates it through ``set_extra_state``
first; restoring into it and running the next step then equals the step the trained model runs, bit for bit.
Single process, no Megatron model."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from megatron.training.initialize import shutdown
from moe_ft.precision.quantized import quantized_state
from moe_ft.precision.te_fp8 import ensure_te_scaling_state
from moe_ft.snapshot.restore import copy_checked
from moe_ft.state.naming import operator_of
from moe_ft.state.operators import OperatorId
from moe_ft.state.registry import OperatorState
from tests import _te_standin as te

RECIPE = te.DelayedScaling(fp8_format="HYBRID", amax_history_len=4, amax_compute_algo="max")


@pytest.fixture(autouse=True)
def fresh_te_state():
    """Each test starts as a new process does (TE's own tests reset the same way)."""
    te.FP8GlobalStateManager.reset()
    yield
    te.FP8GlobalStateManager.reset()


def build(seed: int = 0) -> torch.nn.ModuleDict:
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.ModuleDict({"qkv": te.Linear(8, 8, gen), "experts": te.GroupedLinear(2, 8, 8, gen),
                                "attn": te.DotProductAttention()})


def step(model, it: int) -> torch.Tensor:
    """One iteration's FP8 work: the forward in an autocast region (its exit updates the forward scaling
    state), the backward's casts of output gradients, then the backward update."""
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 + it)) * (it + 1)
    with te.autocast(recipe=RECIPE):
        h = model["experts"](model["qkv"](x), [3, 5])
        out = model["attn"](h, h, h)
    model["qkv"].record_grad_output(out * 0.5)
    model["experts"].record_grad_output(out[3:] * 2.0, gemm_idx=1)
    te.FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
    return out


def scaling(model) -> dict[str, torch.Tensor]:
    return {name: t for name, (_, t) in quantized_state(model)[1].items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def new_attempt(model=None) -> dict[str, torch.Tensor]:
    """The rebuilt model's scaling tensors after ``ensure_te_scaling_state``, as the registry sees them."""
    model = build() if model is None else model
    created = ensure_te_scaling_state([model], RECIPE, lambda: te.autocast(recipe=RECIPE))
    assert created == 3
    return model, scaling(model)


def test_restore_into_a_model_that_has_not_run_a_forward_continues_bitwise():
    trained = build()
    for it in range(3):
        step(trained, it)
    snapshot = {name: t.clone() for name, t in scaling(trained).items()}  # what a snapshot stores
    assert len(snapshot) == 3 * 4  # scale and amax history, forward and backward, of each module
    assert snapshot["qkv.fp8_meta.scaling_fwd.amax_history"].abs().sum() > 0  # a history worth restoring
    te_checkpoints = {name: m.get_extra_state() for name, m in trained.items()}
    for name, m in trained.items():  # the registry's views hold exactly what TE's own checkpoint holds
        saved = te.pickle.loads(te_checkpoints[name].numpy().tobytes())
        for key in ("fwd", "bwd"):
            assert torch.equal(saved[f"scale_{key}"], snapshot[f"{name}.fp8_meta.scaling_{key}.scale"])
            assert torch.equal(saved[f"amax_history_{key}"], snapshot[f"{name}.fp8_meta.scaling_{key}.amax_history"])
    out_ref = step(trained, 3)
    state_ref = {name: t.clone() for name, t in scaling(trained).items()}

    te.FP8GlobalStateManager.reset()  # the next attempt (a restarted process, or shutdown() in this one)
    rebuilt = build()
    assert scaling(rebuilt) == {}  # TE creates it at the first FP8 forward only
    with pytest.raises(ValueError, match=r"does not match this model's operator .*unexpected \['attn.fp8_meta"):
        copy_checked(OperatorState(op=OperatorId.dense(0)), {}, snapshot, what="entry", fix="restore into the same layout")
    rebuilt, live = new_attempt(rebuilt)
    assert {n: (t.shape, t.dtype) for n, t in live.items()} == {n: (t.shape, t.dtype) for n, t in snapshot.items()}
    copy_checked(OperatorState(op=OperatorId.dense(0), compute=live), live, snapshot, what="entry",
                 fix="restore into the same layout")
    out = step(rebuilt, 3)
    assert torch.equal(bits(out), bits(out_ref))
    after = scaling(rebuilt)
    assert after.keys() == state_ref.keys()
    for name, t in after.items():
        assert t is live[name]  # TE's first forward kept the tensors the registry holds
        assert torch.equal(bits(t), bits(state_ref[name])), name

    te.FP8GlobalStateManager.reset()  # TE's own checkpoint load into a rebuilt model: the same step
    loaded = build()
    for name, m in loaded.items():
        m.set_extra_state(te_checkpoints[name])
    assert torch.equal(bits(step(loaded, 3)), bits(out_ref))


def test_created_state_is_what_the_first_forward_creates():
    """A module given its state before any forward computes as one whose first forward creates it (nothing
    restored into it): same outputs, same scaling state, same number of quantizers, over several steps."""
    plain = build()
    outs = [step(plain, it) for it in range(3)]
    te.FP8GlobalStateManager.reset()  # another process: TE's global lists are per process
    created, live = new_attempt()
    assert {n: t.numel() for n, t in live.items() if n.endswith("scaling_fwd.scale")} == {
        "qkv.fp8_meta.scaling_fwd.scale": 3, "experts.fp8_meta.scaling_fwd.scale": 6,
        "attn.fp8_meta.scaling_fwd.scale": 9}
    for it in range(3):
        assert torch.equal(bits(step(created, it)), bits(outs[it]))
    assert scaling(created).keys() == scaling(plain).keys()
    for name, t in scaling(created).items():
        assert t is live[name] and torch.equal(bits(t), bits(scaling(plain)[name])), name
    assert all(len(p.quantizers[k]) == len(c.quantizers[k]) for p, c in zip(plain.values(), created.values())
               for k in ("scaling_fwd", "scaling_bwd"))
    assert ensure_te_scaling_state([created], RECIPE, lambda: te.autocast(recipe=RECIPE)) == 0  # has it


def test_nothing_created_without_te_delayed_scaling():
    emulation_like = torch.nn.Linear(4, 4)  # moe-ft's --fp8-emulation: Megatron's config has no fp8
    emulation_like.config = types.SimpleNamespace(fp8=None)
    assert ensure_te_scaling_state([emulation_like]) == 0

    class Unknown(te.TransformerEngineBaseModule):
        """A Transformer Engine module class moe-ft has no GEMM count for."""

    with pytest.raises(ValueError, match="odd: a Transformer Engine Unknown .* add its class to _NUM_GEMMS"):
        ensure_te_scaling_state([torch.nn.ModuleDict({"odd": Unknown()})], RECIPE, lambda: te.autocast(recipe=RECIPE))


def test_scaling_state_of_a_module_without_parameters_goes_to_the_operator_of_its_path():
    """TE's DotProductAttention keeps scaling state (used with FP8 attention) and has no parameter."""
    gpt = torch.nn.Module()
    gpt.decoder = torch.nn.Module()
    layer = torch.nn.Module()
    layer.layer_number = 2
    layer.self_attention = torch.nn.Module()
    layer.self_attention.core_attention = te.DotProductAttention()
    gpt.decoder.layers = torch.nn.ModuleList([layer])
    new_attempt_attn = ensure_te_scaling_state([gpt], RECIPE, lambda: te.autocast(recipe=RECIPE))
    assert new_attempt_attn == 1
    owners = {name: owner for name, (owner, _) in quantized_state(gpt)[1].items()}
    assert set(owners) == {f"decoder.layers.0.self_attention.core_attention.fp8_meta.scaling_{k}.{a}"
                           for k in ("fwd", "bwd") for a in ("scale", "amax_history")}
    assert {operator_of(owner, gpt) for owner in owners.values()} == {OperatorId.dense(1)}


def test_shutdown_forgets_te_global_fp8_state(monkeypatch):
    """An in-process attempt builds a new model: without the reset, TE's global lists kept the previous
    attempt's modules (under the key of a group it left) and grew longer than on a freshly started rank."""
    package = types.ModuleType("transformer_engine")
    pytorch = types.ModuleType("transformer_engine.pytorch")
    fp8 = types.ModuleType("transformer_engine.pytorch.fp8")
    fp8.FP8GlobalStateManager = te.FP8GlobalStateManager
    for name, module in (("transformer_engine", package), ("transformer_engine.pytorch", pytorch),
                         ("transformer_engine.pytorch.fp8", fp8)):
        monkeypatch.setitem(sys.modules, name, module)
    step(build(), 0)  # attempt 1
    assert [len(v) for v in te.FP8GlobalStateManager.global_amax_buffer.values()] == [3, 3]
    shutdown(failed=True)
    assert te.FP8GlobalStateManager.global_amax_buffer == {} and te.FP8GlobalStateManager.autocast_arguments == {}
    step(build(), 0)  # attempt 2: only its own modules, as on a restarted rank
    assert [len(v) for v in te.FP8GlobalStateManager.global_amax_buffer.values()] == [3, 3]
